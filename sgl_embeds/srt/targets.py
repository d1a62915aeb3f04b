"""Every SGLang internal that sgl_embeds patches or relies on, in one place, pinned to one version.

``HOOKS`` lists the patched targets (dotted path -> (hook type, our function)). ``RELIED_ON``
lists the internals we call or read, each with the names its source must still mention. A moved
or renamed target fails ``missing_targets()`` (and its test) with the exact path.
"""

from __future__ import annotations

import importlib.metadata
import inspect
import pkgutil

SGLANG_VERSION = "0.5.23"

_SB = "sglang.srt.managers.schedule_batch"
_HTTP = "sglang.srt.entrypoints.http_server"
_ENGINE = "sglang.srt.entrypoints.engine.Engine"

# target -> (hook type name, "module:function" of ours, names the target's source must mention)
HOOKS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    f"{_SB}.Req.__init__": ("AROUND", "scheduler:req_init", ("skip_radix_cache_insert", "positional_embed_overrides")),
    f"{_SB}.Req.init_next_round_input": ("AROUND", "scheduler:req_init_next_round_input", ("positional_embed_overrides", "token_ids_to_match")),
    f"{_SB}.ScheduleBatch.prepare_for_extend": ("AROUND", "scheduler:prepare_for_extend", ("prefill_input_ids_cpu", "replace_positions", "positional_embed_overrides")),
    "sglang.srt.managers.tokenizer_manager.TokenizerManager.add_logprob_to_meta_info": ("AROUND", "logprobs:add_logprob_to_meta_info", ('meta_info["input_token_logprobs"]',)),
    "sglang.srt.managers.tokenizer_manager.TokenizerManager.generate_request": ("AROUND", "openai:generate_request", ()),
    "sglang.srt.layers.attention.torch_native_backend.TorchNativeAttnBackend._run_sdpa_forward_extend": (
        "AROUND", "sgl_embeds.cpu.attention:sdpa_forward_extend", ("per_req_query_redudant", "extend_prefix_lens")),
    f"{_ENGINE}.generate": ("AROUND", "engine:generate", ("tokenizer_manager.generate_request",)),
    f"{_ENGINE}.async_generate": ("AROUND", "engine:async_generate", ("tokenizer_manager.generate_request",)),
}
# Hooks that only make sense in the process that serves HTTP.
HTTP_HOOKS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    f"{_HTTP}.launch_server": ("BEFORE", "http:before_launch_server", ()),
}
# Frontend (client-side) hooks, applied when ``sgl_embeds`` is imported.
_EXEC = "sglang.lang.interpreter.StreamExecutor"
LANG_HOOKS: dict[str, tuple[str, str, tuple[str, ...]]] = {
    f"{_EXEC}._execute": ("AROUND", "lang:execute", ("SglImage", "Unknown type")),
    f"{_EXEC}.fork": ("AROUND", "lang:fork", ("images_", "text_")),
}
RELIED_ON: dict[str, tuple[str, ...]] = {
    f"{_HTTP}.serve_generate_request": ("tokenizer_manager.generate_request",),
    "sglang.srt.entrypoints.openai.serving_chat.OpenAIServingChat._process_messages": ("request.input_ids is not None", "prompt_ids=request.input_ids"),
    "sglang.srt.entrypoints.openai.serving_completions.OpenAIServingCompletion._convert_to_internal_request": ('{"input_ids": prompt}',),
    f"{_HTTP}.app": (),
    f"{_HTTP}._global_state": (),
    "sglang.srt.managers.embed_types.PositionalEmbeds": ("positions", "embeds"),
    f"{_SB}.FAKE_BOOTSTRAP_HOST": (),
    "sglang.srt.model_executor.model_runner.ModelRunner._extend_forward_kwargs": ("replace_embeds", "replace_positions"),
    "sglang.srt.managers.io_struct.GenerateReqInput._get_positional_embed_overrides_item": ("positional_embed_overrides[i]",),
    "sglang.lang.backend.runtime_endpoint.RuntimeEndpoint._add_images": ('data["image_data"]',),
    "sglang.lang.backend.runtime_endpoint.RuntimeEndpoint.select": ("_generate_http_request", "input_token_logprobs"),
    "sglang.lang.interpreter.StreamExecutor._execute_fill": ("self.text_ += value",),
}
TARGETS = {**HOOKS, **HTTP_HOOKS, **LANG_HOOKS, **{k: ("", "", v) for k, v in RELIED_ON.items()}}


def installed_version() -> str:
    return importlib.metadata.version("sglang")


def missing_targets() -> list[str]:
    """Targets that do not resolve, or whose source no longer mentions what we rely on."""
    problems = []
    for target, (_, _, names) in TARGETS.items():
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
