"""Every SGLang internal that sgl_embeds patches or relies on, in one place, pinned to one version.

Each target is a dotted path with its *guard*: the names its source must still mention for our
hook or call to be right. ``PATCHED`` lists the hooked targets (the hook tables that attach our
functions are ``srt.plugin.hook_table`` for the engine and HTTP processes and
``lang.hook_table`` for the frontend; a test keeps both equal to ``PATCHED``); ``RELIED_ON`` the
internals we call or read. A moved or renamed target fails ``missing_targets()`` (and its test)
with the exact path.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import pkgutil

SGLANG_VERSION = "0.5.23"

_SB = "sglang.srt.managers.schedule_batch"
_TM = "sglang.srt.managers.tokenizer_manager.TokenizerManager"
_HTTP = "sglang.srt.entrypoints.http_server"
_ENGINE = "sglang.srt.entrypoints.engine.Engine"
_EXEC = "sglang.lang.interpreter.StreamExecutor"

# Scheduler process
REQ_INIT = f"{_SB}.Req.__init__"
REQ_NEXT_ROUND_INPUT = f"{_SB}.Req.init_next_round_input"
PREPARE_FOR_EXTEND = f"{_SB}.ScheduleBatch.prepare_for_extend"
SDPA_FORWARD_EXTEND = "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend._run_sdpa_forward_extend"
# Tokenizer-manager (HTTP) process
ADD_LOGPROB_TO_META_INFO = f"{_TM}.add_logprob_to_meta_info"
INIT_EMBEDS_TRANSPORT = f"{_TM}.init_positional_embeds_transport"
GENERATE_REQUEST = f"{_TM}.generate_request"
LAUNCH_SERVER = f"{_HTTP}.launch_server"
ENGINE_GENERATE = f"{_ENGINE}.generate"
ENGINE_ASYNC_GENERATE = f"{_ENGINE}.async_generate"
# Frontend (client) process
EXECUTE = f"{_EXEC}._execute"
FORK = f"{_EXEC}.fork"

PATCHED: dict[str, tuple[str, ...]] = {
    REQ_INIT: ("skip_radix_cache_insert", "positional_embed_overrides", "self.vocab_size"),
    REQ_NEXT_ROUND_INPUT: ("positional_embed_overrides", "token_ids_to_match"),
    PREPARE_FOR_EXTEND: ("prefill_input_ids_cpu", "replace_positions", "positional_embed_overrides"),
    SDPA_FORWARD_EXTEND: ("per_req_query_redudant", "extend_prefix_lens"),
    ADD_LOGPROB_TO_META_INFO: ('meta_info["input_token_logprobs"]',),
    INIT_EMBEDS_TRANSPORT: ("self.positional_embeds_transport = PositionalEmbedsTransport",),
    GENERATE_REQUEST: (),
    LAUNCH_SERVER: (),
    ENGINE_GENERATE: ("tokenizer_manager.generate_request",),
    ENGINE_ASYNC_GENERATE: ("tokenizer_manager.generate_request",),
    EXECUTE: ("SglImage", "Unknown type"),
    FORK: ("images_", "text_"),
}
RELIED_ON: dict[str, tuple[str, ...]] = {
    f"{_HTTP}.serve_generate_request": ("tokenizer_manager.generate_request",),
    "sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat._process_messages": ("request.input_ids is not None", "prompt_ids=request.input_ids"),
    "sglang.srt.entrypoints.openai.serving_completions.OpenAIServingCompletion._convert_to_internal_request": ('{"input_ids": prompt}',),
    "sglang.srt.entrypoints.openai.serving_base.OpenAIServingBase.handle_request": ("raw_request",),
    f"{_HTTP}.app": (),
    # multi-tokenizer mode: each HTTP worker imports the app by this path (http.before_launch_server)
    f"{_HTTP}._setup_and_run_http_server": ("SGLANG_HTTP_SERVER_APP_PATH",),
    f"{_HTTP}._run_granian_server": ("SGLANG_HTTP_SERVER_APP_PATH",),
    "sglang.srt.plugins.load_plugins": ("apply_hooks",),
    # the client finds the plugin's info here, through a gateway too (deprecated upstream, but
    # SGLang's own RuntimeEndpoint still calls it)
    f"{_HTTP}.get_model_info": (),
    f"{_HTTP}._global_state": (),
    "sglang.srt.managers.embed_types.PositionalEmbeds": ("positions", "embeds", "def reconstruct"),
    # transport.py: our wrapper of the dispatch transport is called around every send, and the
    # scheduler reconstructs every request's overrides first thing, in the order they were sent
    f"{_TM}._send_one_request": ("positional_embeds_transport.prepare_for_dispatch", "cancel_for_dispatch"),
    f"{_TM}._send_batch_request": ("positional_embeds_transport.prepare_for_dispatch", "cancel_for_dispatch"),
    "sglang.srt.managers.scheduler.Scheduler.process_input_requests": ("positional_embed_overrides.reconstruct",),
    "sglang.srt.managers.io_struct.sock_send": ("send_pyobj",),
    f"{_SB}.FAKE_BOOTSTRAP_HOST": (),
    f"{_SB}.Req.set_finish_with_abort": ("origin_input_ids", "FINISH_ABORT"),
    "sglang.srt.model_executor.model_runner.ModelRunner._extend_forward_kwargs": ("replace_embeds", "replace_positions"),
    "sglang.srt.managers.io_struct.GenerateReqInput._get_positional_embed_overrides_item": ("positional_embed_overrides[i]",),
    "sglang.lang.backend.runtime_endpoint.RuntimeEndpoint._add_images": ('data["image_data"]',),
    "sglang.lang.backend.runtime_endpoint.RuntimeEndpoint.select": ("_generate_http_request", "input_token_logprobs"),
    f"{_EXEC}._execute_fill": ("self.text_ += value",),
}
TARGETS: dict[str, tuple[str, ...]] = {**PATCHED, **RELIED_ON}


def installed_version() -> str:
    return importlib.metadata.version("sglang")


def missing_targets() -> list[str]:
    """Targets that do not resolve, or whose source no longer mentions what we rely on."""
    problems = []
    for target, names in TARGETS.items():
        try:
            obj = pkgutil.resolve_name(target)
        except (ImportError, AttributeError) as e:
            problems.append(f"{target}: cannot be resolved ({e})")
            continue
        if names:
            source = inspect.getsource(obj)
            lost = [n for n in names if n not in source]
            if lost:
                problems.append(f"{target}: source no longer mentions {lost}")
    return problems
