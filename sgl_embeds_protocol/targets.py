"""Every SGLang internal that sgl_embeds patches or relies on, in one place, with its guard.

``PATCHED`` (what the hook tables wrap: ``sgl_embeds_srt.plugin``'s, ``sgl_embeds_cpu.plugin``'s,
``sgl_embeds.hooks``'s; a test keeps them equal) and ``RELIED_ON`` (what we call, read or
subclass) give each dotted path a ``Guard``: its side, the words its source must mention, a
fingerprint of its source. ``check(side)`` raises ``ChangedSGLang`` naming each change; ``python
-m sgl_embeds_protocol.targets`` lists each target's state (docs/engine.md, "Every patched target").
"""

from __future__ import annotations

import ast
import functools
import hashlib
import importlib.metadata
import inspect
import pkgutil
import sys
import textwrap
from dataclasses import dataclass

SGLANG_VERSION = "0.5.23"


@dataclass(frozen=True)
class Guard:
    side: str  # "server" or "client": whose start-up checks it
    mentions: tuple[str, ...] = ()  # what its source must still say
    fingerprint: str | None = None  # of its normalised source; None: it has no source (a value)


def server(*mentions: str, fp: str | None = None) -> Guard:
    return Guard("server", mentions, fp)


def client(*mentions: str, fp: str | None = None) -> Guard:
    return Guard("client", mentions, fp)


_SB = "sglang.srt.managers.schedule_batch"
_TM = "sglang.srt.managers.tokenizer_manager.TokenizerManager"
_HTTP = "sglang.srt.entrypoints.http_server"
_ENGINE = "sglang.srt.entrypoints.engine.Engine"
_EXEC = "sglang.lang.interpreter.StreamExecutor"
_RE = "sglang.lang.backend.runtime_endpoint.RuntimeEndpoint"

# Scheduler process
REQ_INIT = f"{_SB}.Req.__init__"
REQ_NEXT_ROUND_INPUT = f"{_SB}.Req.init_next_round_input"
PREPARE_FOR_EXTEND = f"{_SB}.ScheduleBatch.prepare_for_extend"
SDPA_FORWARD_EXTEND = ("sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend"
                       "._run_sdpa_forward_extend")
HANDLE_GENERATE_REQUEST = "sglang.srt.managers.scheduler.Scheduler.handle_generate_request"
GET_EMBEDDING_AND_MASK = "sglang.srt.managers.mm_schedule.get_embedding_and_mask"
QWEN2_VISION_INIT = "sglang.srt.models.qwen2_vl.Qwen2VisionTransformer.__init__"
LOAD_MODEL = "sglang.srt.model_executor.model_runner.ModelRunner.load_model"
SPLIT_WEIGHTS = "sglang.srt.model_loader.loader.DefaultModelLoader._get_weights_iterator"
ADD_ONE_REQ = "sglang.srt.managers.schedule_policy.PrefillAdder.add_one_req"
ADD_CHUNKED_REQ = "sglang.srt.managers.schedule_policy.PrefillAdder.add_chunked_req"
FORWARD_BATCH_INIT = "sglang.srt.model_executor.forward_batch_info.ForwardBatch.init_new"
EAGER_LOAD_BATCH = "sglang.srt.model_executor.runner.eager_runner.EagerRunner.load_batch"
_TORCH_NATIVE = "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend"
TORCH_NATIVE_EXTEND = f"{_TORCH_NATIVE}.forward_extend"
TORCH_NATIVE_DECODE = f"{_TORCH_NATIVE}.forward_decode"
_TRITON = "sglang.srt.layers.attention.triton_backend.TritonAttnBackend"
TRITON_INIT_METADATA = f"{_TRITON}.init_forward_metadata"
TRITON_EXTEND_KERNEL = f"{_TRITON}._forward_extend_kernel"
_FLASHINFER = "sglang.srt.layers.attention.flashinfer_backend"
FLASHINFER_INIT_METADATA = f"{_FLASHINFER}.FlashInferAttnBackend.init_forward_metadata"
FLASHINFER_PLAN = f"{_FLASHINFER}.FlashInferIndicesUpdaterPrefill.call_begin_forward"
PREFILL_GRAPH_CAN_RUN = "sglang.srt.model_executor.runner.prefill_cuda_graph_runner.PrefillCudaGraphRunner.can_run_graph"
# a split Gemma 4's LLM half (model_runner.gemma4_*)
GEMMA4_TEXT_CONFIG = "sglang.srt.utils.hf_transformers.config.get_hf_text_config"
GEMMA4_BACKEND_CHECK = "sglang.srt.arg_groups.model_hook.handle_model_specific_adjustments"
GEMMA4_PER_LAYER_INPUTS = "sglang.srt.models.gemma4_causal.Gemma4TextModel.forward"
# an encoder-decoder of ours (Florence-2: florence2.py) declared as one (a list inside the function)
IS_ENCODER_DECODER_MODEL = "sglang.srt.configs.model_config.is_encoder_decoder_model"
# ... its class joins the registry where SGLang looks a model class up; its processor refuses raw images
GET_MODEL_ARCHITECTURE = "sglang.srt.model_loader.utils.get_model_architecture"
GET_MM_PROCESSOR_CLS = "sglang.srt.managers.multimodal_processor.get_mm_processor_cls"
GATED_RMSNORM_FORWARD = "sglang.kernels.ops.attention.fla.layernorm_gated.RMSNorm.forward"
GATE_SIGMOID_MUL = "sglang.kernels.ops.elementwise.elementwise._launch_fused_gate_sigmoid_mul"
# Server main process: the start method of its scheduler and detokenizer (sgl_embeds_cpu.children)
SET_ENVS_AND_CONFIG = "sglang.srt.entrypoints.engine._set_envs_and_config"
# Tokenizer-manager (HTTP) process
ADD_LOGPROB_TO_META_INFO = f"{_TM}.add_logprob_to_meta_info"
INIT_EMBEDS_TRANSPORT = f"{_TM}.init_positional_embeds_transport"
GENERATE_REQUEST = f"{_TM}.generate_request"
CREATE_TOKENIZED_OBJECT = f"{_TM}._create_tokenized_object"
LAUNCH_SERVER = f"{_HTTP}.launch_server"
ENGINE_GENERATE = f"{_ENGINE}.generate"
ENGINE_ASYNC_GENERATE = f"{_ENGINE}.async_generate"
# Frontend (client) process
EXECUTOR_INIT = f"{_EXEC}.__init__"
EXECUTE = f"{_EXEC}._execute"
FORK = f"{_EXEC}.fork"
STOCK_POST = "sglang.lang.backend.runtime_endpoint.http_request"

PATCHED: dict[str, Guard] = {
    # req_init rewrites the stock skip_radix_cache_insert expression minus its override clause
    REQ_INIT: server("skip_radix_cache_insert", "positional_embed_overrides is not None",
                     "FAKE_BOOTSTRAP_HOST", "self.vocab_size", fp="33b1eb0b2e8e9b4f"),
    REQ_NEXT_ROUND_INPUT: server("positional_embed_overrides", "token_ids_to_match", fp="0f11ffa7f806d0bc"),
    PREPARE_FOR_EXTEND: server("prefill_input_ids_cpu", "replace_positions", "positional_embed_overrides",
                               fp="8f197e98949bf72c"),
    SDPA_FORWARD_EXTEND: server("per_req_query_redudant", "extend_prefix_lens", fp="e1497a0a5e3bdaa7"),
    ADD_LOGPROB_TO_META_INFO: server('meta_info["input_token_logprobs"]', fp="e242ec6d21757507"),
    INIT_EMBEDS_TRANSPORT: server("self.positional_embeds_transport = PositionalEmbedsTransport", fp="2cda71e490f228df"),
    GENERATE_REQUEST: server(fp="302f82297e1fe5b7"),
    LAUNCH_SERVER: server(fp="5d31a0080f07c45c"),
    ENGINE_GENERATE: server("tokenizer_manager.generate_request", fp="be5f68cffd34d267"),
    ENGINE_ASYNC_GENERATE: server("tokenizer_manager.generate_request", fp="637a92600005087e"),
    # grid spans: items handed over as processed multimodal inputs (image_spans.py), their rows
    # moved in before the Req is built (scheduler.py), embedded item by item (model_runner.py)
    CREATE_TOKENIZED_OBJECT: server("mm_inputs=mm_inputs", "positional_embed_overrides", fp="a31975898450d2ab"),
    HANDLE_GENERATE_REQUEST: server("recv_req.mm_inputs", "_handle_generate_request", fp="b41817b2226eecbe"),
    GET_EMBEDDING_AND_MASK: server("_get_precomputed_embedding", "_get_chunked_prefill_embedding",
                                   "data_embedding_func", fp="c7a8f00f9d06b197"),
    # Qwen2-VL checkpoints written by transformers 5 name the channels in_channels; SGLang reads
    # in_chans (model_runner.qwen2_vision_init gives it the value)
    QWEN2_VISION_INIT: server("vision_config.in_chans", fp="ab85a3c8256d1db7"),
    # bidirectional blocks (blocks.py, block_attention.py): the rows of a Gemma's spans reach its
    # first layer unscaled; a chunk's end moves out of a block after the adder chose it (it sets
    # extend_end and new_chunked_req; add_chunked_req returns the request while it is chunked);
    # a forward batch takes its requests' blocks, and the eager runner's copy of it keeps them; the torch_native extend and decode, attended
    # again with the mask and the soft cap (they save the KV as these do)
    LOAD_MODEL: server("self.model", fp="b001b62d7fc3a116"),
    # a split LLM's weights read in place (loader.py): every (name, tensor) of the model's files
    # passes through here, under the source's prefix
    SPLIT_WEIGHTS: server("source.prefix + name", fp="51675bf475977cf4"),
    ADD_ONE_REQ: server("_select_prefill_admission", "add_one_req_ignore_eos", fp="ff9f32254e9b11e1"),
    ADD_CHUNKED_REQ: server("req.extend_end = req.prefix_len + new_len", "return req if truncated else None", fp="a2ff155ff7ef375f"),
    FORWARD_BATCH_INIT: server("batch.forward_mode", fp="d37cf9d33f2e0e1b"),
    EAGER_LOAD_BATCH: server("forward_batch_template=forward_batch", "return replace(forward_batch)", fp="aa0893a835eb23f0"),
    TORCH_NATIVE_EXTEND: server("KVWriteLoc(cache_loc, self.swa_out_cache_loc)", "_run_sdpa_forward_extend", fp="97118fc036df00e2"),
    TORCH_NATIVE_DECODE: server("KVWriteLoc(cache_loc, self.swa_out_cache_loc)", "_run_sdpa_forward_decode", fp="008a3d8cfe1fa5fd"),
    # the GPU backends' block masks (gpu_block_attention): Triton's metadata carries a mask its
    # extend kernel reads (argument 9, the causal flag 10: see the RELIED_ON forward_extend);
    # FlashInfer's paged-only plan (the is_multimodal switch) takes one per wrapper
    TRITON_INIT_METADATA: server("self.forward_metadata = ForwardMetadata(", "custom_mask", fp="d2b6cc77f0f5a461"),
    TRITON_EXTEND_KERNEL: server("self.extend_attention_fwd(*args, **kwargs)", fp="a84053c66ac6426b"),
    FLASHINFER_INIT_METADATA: server("if self.is_multimodal or self.enable_mis:", "use_ragged = False", fp="06b7597c8e8a3d2b"),
    FLASHINFER_PLAN: server("custom_mask = cross_attention_custom_mask", "use_custom_mask = custom_mask", fp="38d642b325dc307f"),
    PREFILL_GRAPH_CAN_RUN: server("can_replay_locally", fp="43cedd35cceab5e1"),
    # a split Gemma 4 (model_runner.gemma4_*): a gemma4_text config flattened before the loader
    # reads it; the torch_native backend let through the Gemma 4 assert; per-layer inputs of span
    # rows by the pad id, where the forward refuses ids and rows together
    GEMMA4_TEXT_CONFIG: server(fp="9fcc4b1401ec37e6"),
    GEMMA4_BACKEND_CHECK: server('"Gemma4ForCausalLM"', "Gemma4 only supports", fp="be63fbd027d4b35d"),
    GEMMA4_PER_LAYER_INPUTS: server("(input_ids is None) ^ (input_embeds is not None)",
                                    "self.get_per_layer_inputs(input_ids)",
                                    "self.project_per_layer_inputs(", fp="86d1558babe70025"),
    IS_ENCODER_DECODER_MODEL: server("WhisperForConditionalGeneration", fp="709315323a378c57"),
    GET_MODEL_ARCHITECTURE: server("ModelRegistry.is_arch_supported(arch)", fp="b8e0459aeee8587e"),
    GET_MM_PROCESSOR_CLS: server("PROCESSOR_MAPPING", fp="67866fc6492ff73b"),
    # Qwen3.5's Gated DeltaNet output norm: on a CPU without AMX (_use_cpu False) SGLang runs
    # its Triton kernel, which asks CUDA for the SM count; sgl_embeds_cpu.fused.rms_norm_gated computes it
    GATED_RMSNORM_FORWARD: server("_use_cpu", "fused_rmsnorm_gated_cpu", "layernorm_fn(",
                                  fp="e2927c7b3f0b4173"),
    # Qwen3.5-MoE's shared-expert gate (Qwen2MoeSparseMoeBlock.forward, use_fused_gate unless
    # AMX): a Triton launch, which finds no driver on CPU; sgl_embeds_cpu.fused.gate_sigmoid_mul computes it
    GATE_SIGMOID_MUL: server("_fused_gate_sigmoid_mul_add_kernel", "do_add", fp="c87c9d4e8809146c"),
    # SGLang sets spawn for its children here; on CPU, sgl_embeds_cpu.children.set_envs_and_config sets fork after it
    SET_ENVS_AND_CONFIG: server('mp.set_start_method("spawn", force=True)', fp="6bb7501499ef26fd"),
    EXECUTOR_INIT: client("self.images_ = []", fp="f0cffaf41e3c2329"),
    EXECUTE: client("SglImage", "Unknown type", fp="ae059cff582e1661"),
    FORK: client("images_", "text_", fp="062ebfc3617be817"),
    # every stock RuntimeEndpoint call posts its /generate body with this module function
    # (sender.post_stock_body wraps it: the inline resend of a refused handle)
    STOCK_POST: client("urllib.request.urlopen", "stream", fp="c1368192ee6d1920"),
}
DETOKENIZER_TITLE = "sglang::detokenizer"
RELIED_ON: dict[str, Guard] = {
    # -- start-up: how a refusal stops a launch (plugin.register raises SystemExit, which
    #    load_plugins' `except Exception` lets through) and where the plugin loads
    "sglang.srt.plugins.load_plugins": server("except Exception", "apply_hooks", fp="4af6a54c7fd56378"),
    "sglang.launch_server": server("load_plugins()"),  # its __main__ loads plugins first
    f"{_ENGINE}.__init__": server("load_plugins()", fp="6458fa9b0cefacef"),
    # the detokenizer is told by the title it takes before it loads plugins (in_detokenizer)
    "sglang.srt.managers.detokenizer_manager.run_detokenizer_process": server(
        f'setproctitle.setproctitle("{DETOKENIZER_TITLE}")\n    load_plugins()', fp="4d6d486d9199cf48"),
    # -- where the CPU kernels turn on (sgl_embeds_cpu.plugin.activate, a platform entry point):
    #    each SGLang process resolves its platform on importing sglang.srt.utils.common, before
    #    any module imports sgl_kernel, and resolving calls every platform plugin
    "sglang.srt.utils.common": server("from sglang.srt.platforms import current_platform"),
    "sglang.srt.platforms._resolve_platform": server("load_plugins_by_group(PLATFORM_PLUGINS_GROUP)",
                                                     "plugin_fn()", fp="8ca8abb3c0bf53dd"),
    # -- HTTP process: our middleware goes innermost in SGLang's app (starlette builds the
    #    stack from user_middleware at the first request, after launch_server's hook ran)
    f"{_HTTP}.app": server(),
    "starlette.applications.Starlette.build_middleware_stack": server("self.user_middleware", fp="d1af921e24bd9122"),
    f"{_HTTP}.serve_generate_request": server("tokenizer_manager.generate_request", fp="ff5196620cd3f804"),
    f"{_HTTP}.get_model_info": server(fp="6627f793a9926ca2"),  # its answer carries ours (deprecated upstream)
    f"{_HTTP}._global_state": server(),
    # the span budget reads the checkpoint's processor that SGLang loaded (ModelSpec.largest_image_rows)
    f"{_TM}.init_tokenizer_and_processor": server("self.processor = _processor", fp="8a9a8aa61c48619a"),
    # -- bidirectional blocks: a scheduler reads the served model's path (blocks.served_prefix_lm),
    #    and a layer's soft-capping method and sliding window (block_attention)
    "sglang.srt.runtime_context.get_server_args": server("_CONTEXT.server_args", fp="77acc44f31f26ac7"),
    "sglang.srt.layers.radix_attention.RadixAttention.__init__": server(
        "self.logit_capping_method = logit_capping_method", "self.sliding_window_size", fp="3db630e05a135fc8"),
    # Triton's extend hands its kernel the mask and causal flag at these places (TRITON_CAUSAL_ARG);
    # the kernel's causal flag ends each query tile's sweep at the tile (why a block runs without it)
    f"{_TRITON}.forward_extend": server("self._forward_extend_kernel(",
                                        "self.forward_metadata.custom_mask,\n            causal,",
                                        fp="960380cae26fa89f"),
    "sglang.kernels.ops.attention.extend_attention.extend_attention_fwd":
        server("custom_mask,\n    is_causal,", "IS_CAUSAL=is_causal", fp="5ca6696f1a74618f"),
    # FlashInfer's paged wrapper plans a mask of qo x kv rows per request, the kv its plan reads
    f"{_FLASHINFER}.FlashInferIndicesUpdaterPrefill.update_sliding_window":
        server("kv_start_idx = seq_lens - paged_kernel_lens", fp="819978987369c31c"),
    # multi-tokenizer mode: each HTTP worker imports the app by this path, which we point at ours
    f"{_HTTP}._setup_and_run_http_server": server("SGLANG_HTTP_SERVER_APP_PATH", fp="9922db5d86b86d38"),
    f"{_HTTP}._run_granian_server": server("SGLANG_HTTP_SERVER_APP_PATH", fp="caaae7a6bc63ec7c"),
    "sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat._process_messages":
        server("request.input_ids is not None", "prompt_ids=request.input_ids", fp="6d94294074348727"),
    "sglang.srt.entrypoints.openai.serving_completions.OpenAIServingCompletion._convert_to_internal_request":
        server('{"input_ids": prompt}', fp="4ac54ee0412da29d"),
    "sglang.srt.entrypoints.openai.serving_base.OpenAIServingBase.handle_request": server("raw_request", fp="740663c21757890e"),
    "sglang.srt.managers.io_struct.GenerateReqInput._get_positional_embed_overrides_item":
        server("positional_embed_overrides[i]", fp="77a77ce02a877a6a"),
    # -- the rows' trip (transport.py): our carrier subclasses PositionalEmbeds; the dispatch
    #    transport is called around every send; the scheduler reconstructs every request's
    #    overrides first thing, in the order they were sent, over pickle IPC
    "sglang.srt.managers.embed_types.PositionalEmbeds": server("positions", "embeds", "def reconstruct", fp="619cde061da071f9"),
    f"{_TM}._send_one_request": server("positional_embeds_transport.prepare_for_dispatch",
                                       "cancel_for_dispatch", fp="e09c548a8ef48914"),
    f"{_TM}._send_batch_request": server("positional_embeds_transport.prepare_for_dispatch",
                                         "cancel_for_dispatch", fp="27329ca9b657f184"),
    "sglang.srt.managers.scheduler.Scheduler.process_input_requests":
        server("positional_embed_overrides.reconstruct", fp="83237e517bbd89e0"),
    "sglang.srt.managers.io_struct.sock_send": server("send_pyobj", fp="392e732baf387df5"),
    "sglang.srt.environ.Envs.SGLANG_USE_PICKLE_IPC": server(),
    # -- a split Gemma 4: SGLang's own flattening of a Gemma 4 text config, which the loader
    #    calls only for VLM configs (model_runner.gemma4_text_config); the call it runs in
    "sglang.srt.utils.hf_transformers.config._apply_gemma4_attention_overrides":
        server("text_config.swa_head_dim = swa_head_dim", "text_config.per_layer_config = None", fp="dd7c2bfedf4f0ed9"),
    "sglang.srt.utils.hf_transformers.config.HfModelConfigParser.parse":
        server("text_config = get_hf_text_config(config=config)", "if not hasattr(config, key)", fp="35180a09c16b70c5"),
    "sglang.srt.arg_groups.model_override_base.model_config_of": server(fp="b45fd9c53f40bfa3"),
    #    the router's scale lives in its norm's weight, which the CPU norm applies only
    #    with_scale (model_runner.router_scaled)
    "sglang.srt.models.gemma4_causal.Gemma4Router.fuse_scale": server("self.norm.weight.data.copy_(fused)", fp="af044f11c469090c"),
    "sglang.srt.models.gemma4_causal.Gemma4Router.forward": server("self.norm(x)", fp="7f704a1a49ac090a"),
    "sglang.srt.layers.layernorm.Gemma4RMSNorm.forward_native": server("if self.with_scale:", fp="6ebf9d963cb055a2"),
    # -- scheduler: the placeholder masking of prepare_for_extend reaches the model because the
    #    prefill ids are copied to the device later, from the CPU tensor we mask
    "sglang.srt.managers.overlap_utils.resolve_forward_inputs": server("prefill_input_ids_cpu.to(", fp="83e7c38a781eed48"),
    f"{_SB}.FAKE_BOOTSTRAP_HOST": server(),
    f"{_SB}.Req.set_finish_with_abort": server("origin_input_ids", "FINISH_ABORT", fp="678e9683a985331a"),
    # the model runner scatters the override rows and casts them to the model's dtype: rows sent
    # in a dtype whose cast to it is exact reach it uncast (prompts.EXACT_CASTS)
    "sglang.srt.model_executor.model_runner.ModelRunner._extend_forward_kwargs":
        server("replace_embeds", "replace_positions", 'replace_embeds.to(kwargs["input_embeds"].dtype)',
               fp="0c1d0eb6ece06b1b"),
    # -- grid spans on M-RoPE VLMs (image_spans, scheduler, model_runner): our items adopt a 32-byte identity (no
    #    hash of the rows), padded ids and M-RoPE positions come from SGLang's own code, the
    #    scheduler takes our processed inputs as they are and pads with them, and the model
    #    embeds precomputed items through get_embedding_and_mask, whose per-item results it accepts
    f"{_SB}.MultimodalDataItem.set_identity": server("_compute_pad_values", fp="1d032d6c2ad5c6e7"),
    f"{_SB}.MultimodalDataItem.set_pad_value": server("if self.pad_value is not None", fp="331fd6bb5186ccb6"),
    f"{_SB}.MultimodalProcessorOutput.build_padded_input_ids": server("padding_sequence", fp="24cd07d7b16d5ed9"),
    f"{_SB}.MultimodalInputs.from_processor_output": server("mrope_positions", fp="07617cafbe8c7750"),
    "sglang.srt.layers.rotary_embedding.mrope_rope_index.get_rope_index":
        server("vision_start_token_id", "image_grid_thw", fp="f8a3c2533ae4ae29"),
    "sglang.srt.managers.scheduler.Scheduler._handle_generate_request":
        server("_get_multimodal_inputs", "_try_apply_padded_mm_input_ids", fp="e7fbfeba7ed0874e"),
    "sglang.srt.managers.scheduler.Scheduler._get_multimodal_inputs": server("MMInputsProcessError", fp="2d34dd5096cd9408"),
    "sglang.srt.managers.scheduler.Scheduler._try_apply_padded_mm_input_ids":
        server("padded_input_ids", fp="e5ad39f142f55075"),
    # our items keep precomputed_embeddings unset, so this returns None and the per-item path runs
    "sglang.srt.managers.mm_schedule._get_precomputed_embedding":
        server("precomputed_embeddings", fp="0d124c64a4cf82d7"),
    "sglang.srt.managers.mm_schedule._get_chunked_prefill_embedding":
        server("_batch_encode_per_image_misses", fp="f7ef04b1dfecef31"),
    "sglang.srt.layers.rotary_embedding.mrope.MRotaryEmbedding.get_rope_index":
        server("get_rope_index(", fp="35d707fc2ad2eb46"),
    "sglang.srt.managers.mm_schedule._batch_encode_per_image_misses":
        server("data_embedding_func(miss_items)", "isinstance(all_miss_embedding, list)", fp="f0a32a66f7c8f079"),
    # a Qwen3-VL span's width holds its deepstack rows: SGLang splits what our per-item embedding
    # returns at the LLM's hidden size and adds deepstack layer i after decoder layer i
    "sglang.srt.managers.mm_utils.embed_mm_inputs":
        server("get_embedding_and_mask(", "separate_deepstack_embeds", fp="e9aa8c6497e155ee"),
    "sglang.srt.managers.mm_utils.prepare_mm_inputs": server('kwargs["input_deepstack_embeds"]', fp="a49a4ac4c19e4679"),
    "sglang.srt.models.qwen2_5_vl.Qwen2_5_VLForConditionalGeneration.forward":
        server("general_mm_embed_routine", "mrope_positions", fp="a0968933ad7d0574"),
    "sglang.srt.models.qwen2_vl.Qwen2VLForConditionalGeneration.forward":
        server("general_mm_embed_routine", "mrope_positions", fp="bd9eea1c46592051"),
    "sglang.srt.models.qwen3_vl.Qwen3VLForConditionalGeneration.forward":
        server("general_mm_embed_routine", "use_deepstack=self.use_deepstack", "mrope_positions",
               fp="5f09a341cd8d270f"),
    "sglang.srt.models.qwen3_vl.Qwen3VLForConditionalGeneration.separate_deepstack_embeds":
        server("self.config.hidden_size", fp="1ac769f80d572e73"),
    "sglang.srt.models.qwen3_vl.Qwen3LLMModel.forward":
        server("input_deepstack_embeds[:, sep : sep + self.hidden_size]", fp="a55663ad95dd429f"),
    # -- an encoder-decoder (florence2.py, encoder_prompts.py): the model class goes in the
    #    registry the loader resolves from; the scheduler pads with the model's pad_input_ids
    #    (num_image_tokens: the encoder's length), strips the encoder ids and splits its slots off
    #    for the cross layers; torch_native attends cross layers over a request's first
    #    encoder_lens slots and self layers after them; the pool has the model's end_layer layers
    "sglang.srt.models.registry._ModelRegistry._try_load_model_cls": server("self.models[model_arch]", fp="08a421db8b581db8"),
    f"{_SB}.ScheduleBatch.prepare_encoder_info_extend":
        server("im.num_image_tokens", "encoder_out_cache_loc", "assert req.prefix_len == 0", fp="b44cc276ae1d82ad"),
    "sglang.srt.managers.mm_utils.duplicate_pad_mm_input_ids": server("pad_input_ids_func(input_ids, mm_inputs)", fp="b2634f6303b9c0dd"),
    f"{_TORCH_NATIVE}._run_sdpa_forward_decode": server("end_kv = encoder_lens[seq_idx]", fp="e2a7ac5dd455e78b"),
    "sglang.srt.model_executor.model_runner_components.layer_setup._resolve_pp_layer_range":
        server('getattr(model, "end_layer", model_num_layers)', fp="1fe45fd8e852e6e3"),
    # -- client: the sglang module gains sgl.embeds / sgl.region (ADDED_NAMES); a /generate body
    #    passes _add_images; select reads input logprobs; a refused request raises
    #    RuntimeError(<the server's JSON error>), which carries UnknownSpanHandle
    f"{_RE}._add_images": client('data["image_data"]', fp="2c2f12188242c3c1"),
    # ... and every one that posts a body writes it with _add_images, then posts it with the
    # module's http_request (STOCK_POST), then reads the response itself
    f"{_RE}.generate": client("self._add_images(s, data)", "http_request(", fp="fb5ea052af7bfd80"),
    f"{_RE}.generate_stream": client("self._add_images(s, data)", "http_request(", fp="1b19dad65a6b9e60"),
    f"{_RE}.commit_lazy_operations": client("self._add_images(s, data)", "http_request(", fp="6ab73da2a7386e66"),
    f"{_RE}.fill_image": client("self._add_images(s, data)", "http_request(", fp="a1556b4adaa0c6e8"),
    f"{_RE}._generate_http_request": client("self._add_images(s, data)", "http_request(", fp="ee6d0389ab2c231a"),
    f"{_RE}.select": client("_generate_http_request", "input_token_logprobs", fp="af9fc1f68cec5094"),
    # a binary body is posted over http.client (sender._post_bytes) and answered with this
    # wrapper, as http_request answers JSON: the stock calls read its json() and status_code
    "sglang.utils.HttpResponse": client("def json", "status_code", "self.resp.read()", fp="953bd588519c3327"),
    f"{_RE}._assert_success": client("raise RuntimeError(content)", fp="de80c54851f784db"),
    f"{_EXEC}._execute_fill": client("self.text_ += value", fp="382733fd5031b14c"),
    # vlm.checkpoint asks whether SGLang serves an architecture by reading this folder's sources
    "sglang.srt.models": client(),
}
# Names the client adds to SGLang's modules (the DSL); they must not exist there already.
ADDED_NAMES: dict[str, tuple[str, ...]] = {"sglang": ("embeds", "region")}
TARGETS: dict[str, Guard] = {**PATCHED, **RELIED_ON}


def in_detokenizer() -> bool:
    """Whether this process is a server's detokenizer, which runs none of the hooks: registering
    them there would import their modules and patch them for nothing (~2 s of CPU a launch)."""
    import setproctitle  # SGLang's dependency: only its processes ask

    return setproctitle.getproctitle() == DETOKENIZER_TITLE


class ChangedSGLang(RuntimeError):
    """The installed SGLang differs from what sgl_embeds' patches were written against."""


def installed_version() -> str:
    return importlib.metadata.version("sglang")


def fingerprint(obj: object) -> str:
    """A hash of ``obj``'s source as a syntax tree, without docstrings, comments or positions."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(obj)))
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(body, list) and body and isinstance(body[0], ast.Expr)
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return hashlib.sha256(ast.dump(tree, include_attributes=False).encode()).hexdigest()[:16]


def _resolve(target: str) -> object:
    obj = pkgutil.resolve_name(target)
    return inspect.unwrap(obj) if callable(obj) else obj  # our own hooks wrap some targets


def guard_problems(target: str, guard: Guard) -> list[str]:
    """What no longer holds for one target (empty: it is as recorded)."""
    try:
        obj = _resolve(target)
    except (ImportError, AttributeError) as e:
        return [f"{target}: cannot be resolved ({e})"]
    if not guard.mentions and guard.fingerprint is None:
        return []
    source = inspect.getsource(obj)
    problems = []
    lost = [m for m in guard.mentions if m not in source]
    if lost:
        problems.append(f"{target}: its source no longer mentions {lost}")
    if guard.fingerprint is not None and (found := fingerprint(obj)) != guard.fingerprint:
        problems.append(f"{target}: its source changed (fingerprint {found}, recorded {guard.fingerprint})")
    return problems


def _added_name_problems() -> list[str]:
    problems = []
    for module_name, names in ADDED_NAMES.items():
        module = pkgutil.resolve_name(module_name)
        for name in names:
            value = getattr(module, name, None)
            if value is not None and not getattr(value, "__module__", "").startswith("sgl_embeds"):
                problems.append(f"{module_name}.{name}: SGLang now defines it ({value!r}); the DSL would hide it")
    return problems


def problems(side: str | None = None) -> list[str]:
    """Every guard of ``side`` (None: both) that fails, one line each."""
    found = [p for target, guard in TARGETS.items() if side in (None, guard.side)
             for p in guard_problems(target, guard)]
    return found + (_added_name_problems() if side in (None, "client") else [])


@functools.cache
def check(side: str) -> None:
    """Raise ``ChangedSGLang`` unless every guard of ``side`` holds (once per process)."""
    found = problems(side)
    if found:
        raise ChangedSGLang(
            f"sgl_embeds was written against SGLang {SGLANG_VERSION}; the installed SGLang "
            f"{installed_version()} differs in {len(found)} internal(s) it patches or relies on:\n  "
            + "\n  ".join(found)
            + f"\nRefusing to run on them: install sglang=={SGLANG_VERSION}, or review each change and "
            "record its new guard in sgl_embeds_protocol/targets.py (`python -m sgl_embeds_protocol.targets`)."
        )


def main() -> int:
    """List each target's state and current fingerprint (to record after reviewing a change)."""
    status = 0
    for target, guard in TARGETS.items():
        found = guard_problems(target, guard)
        status |= bool(found)
        try:
            current = fingerprint(_resolve(target)) if guard.fingerprint is not None else "-"
        except (ImportError, AttributeError, TypeError, OSError):
            current = "?"
        print(f"{'CHANGED' if found else 'ok':8} {current:16} {target}")
        for line in found:
            print(f"         {line}")
    return status


if __name__ == "__main__":
    sys.exit(main())
