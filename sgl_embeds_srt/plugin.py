"""The SGLang plugin entry point (group ``sglang.srt.plugins``): registers every engine hook.

SGLang calls ``register()`` in each of its processes (server, scheduler, detokenizer); the HTTP
hook is registered only in the main process, where the HTTP app lives. The table of hooks is
``hook_table``: target (see ``targets.py`` for the guard of each) -> (hook type, our function).
The CPU-only hooks are the opt-in CPU plugin's (``sgl_embeds_cpu.plugin.hook_table``); their
guards are checked here with every other server guard.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
from typing import Any, Callable

from sgl_embeds_protocol import targets

logger = logging.getLogger(__name__)


def hook_table(http: bool) -> dict[str, tuple[Any, Callable]]:
    """Our hooks of SGLang's engine; ``http`` adds the one of the process that serves HTTP.
    (Imported here, not at module level: the plugin loads before SGLang's modules are ready.)"""
    from sglang.srt.plugins.hook_registry import HookType

    from sgl_embeds_srt import (
        block_attention, blocks, engine, gpu_block_attention, image_spans, loader, logprobs, model_runner, openai, scheduler,
        transport,
    )

    table = {
        targets.REQ_INIT: (HookType.AROUND, scheduler.req_init),
        targets.REQ_NEXT_ROUND_INPUT: (HookType.AROUND, scheduler.req_init_next_round_input),
        targets.PREPARE_FOR_EXTEND: (HookType.AROUND, scheduler.prepare_for_extend),
        targets.ADD_LOGPROB_TO_META_INFO: (HookType.AROUND, logprobs.add_logprob_to_meta_info),
        targets.INIT_EMBEDS_TRANSPORT: (HookType.AROUND, transport.init_positional_embeds_transport),
        targets.GENERATE_REQUEST: (HookType.AROUND, openai.generate_request),
        targets.ENGINE_GENERATE: (HookType.AROUND, engine.generate),
        targets.ENGINE_ASYNC_GENERATE: (HookType.AROUND, engine.async_generate),
        targets.CREATE_TOKENIZED_OBJECT: (HookType.AROUND, image_spans.create_tokenized_object),
        targets.HANDLE_GENERATE_REQUEST: (HookType.AROUND, scheduler.handle_generate_request),
        targets.GET_EMBEDDING_AND_MASK: (HookType.AROUND, model_runner.get_embedding_and_mask),
        targets.QWEN2_VISION_INIT: (HookType.AROUND, model_runner.qwen2_vision_init),
        targets.LOAD_MODEL: (HookType.AROUND, model_runner.load_model),
        targets.IS_ENCODER_DECODER_MODEL: (HookType.AROUND, model_runner.is_encoder_decoder_model),
        targets.GET_MODEL_ARCHITECTURE: (HookType.AROUND, model_runner.get_model_architecture),
        targets.GET_MM_PROCESSOR_CLS: (HookType.AROUND, model_runner.get_mm_processor_cls),
        targets.SPLIT_WEIGHTS: (HookType.AROUND, loader.weights_iterator),
        targets.GEMMA4_TEXT_CONFIG: (HookType.AROUND, model_runner.gemma4_text_config),
        targets.GEMMA4_BACKEND_CHECK: (HookType.AROUND, model_runner.gemma4_backend_check),
        targets.GEMMA4_PER_LAYER_INPUTS: (HookType.AROUND, model_runner.gemma4_per_layer_inputs),
        targets.ADD_ONE_REQ: (HookType.AROUND, blocks.add_one_req),
        targets.ADD_CHUNKED_REQ: (HookType.AROUND, blocks.add_chunked_req),
        targets.FORWARD_BATCH_INIT: (HookType.AROUND, block_attention.forward_batch_init),
        targets.EAGER_LOAD_BATCH: (HookType.AROUND, block_attention.load_batch),
        targets.TORCH_NATIVE_EXTEND: (HookType.AROUND, block_attention.forward_extend),
        targets.TORCH_NATIVE_DECODE: (HookType.AROUND, block_attention.forward_decode),
        targets.TRITON_INIT_METADATA: (HookType.AROUND, gpu_block_attention.triton_init_forward_metadata),
        targets.TRITON_EXTEND_KERNEL: (HookType.AROUND, gpu_block_attention.triton_extend_kernel),
        targets.FLASHINFER_INIT_METADATA: (HookType.AROUND, gpu_block_attention.flashinfer_init_forward_metadata),
        targets.FLASHINFER_PLAN: (HookType.AROUND, gpu_block_attention.flashinfer_plan),
        targets.PREFILL_GRAPH_CAN_RUN: (HookType.AROUND, gpu_block_attention.prefill_graph_can_run),
    }
    if http:
        from sgl_embeds_srt import http as http_side

        table[targets.LAUNCH_SERVER] = (HookType.BEFORE, http_side.before_launch_server)
    return table


def register() -> None:
    """Register every hook; in the main process first check every server-side guard and refuse
    to start on a changed SGLang.

    SGLang's ``load_plugins`` logs an ``Exception`` from a plugin and carries on, and its hook
    registry logs a hook it could not apply and carries on: a server would then run half
    patched. ``SystemExit`` passes through both, so a refusal stops ``launch_server`` (exit 1
    with the message) and makes ``sglang.Engine(...)`` raise it. The scheduler and detokenizer
    processes are started by a main process that has checked the same installation (the check
    would cost them ~3 s of imports each); multi-tokenizer HTTP workers check again
    (``http/worker_app.py``)."""
    from sglang.srt.plugins.hook_registry import HookRegistry  # SGLang not ready at module import

    if targets.in_detokenizer():  # it runs none of our hooks
        return
    main_process = is_server_main_process()
    if main_process:
        check_guards()
    try:
        table = hook_table(http=main_process)
    except Exception as e:  # an installation that cannot import its hooks would serve unpatched
        raise SystemExit(f"sgl_embeds refuses to start: its hooks failed to load: {e!r}") from e
    for target, (kind, hook) in table.items():
        HookRegistry.register(target, hook, kind)


# The pid of the process of this lineage that loaded the plugin last, in the environment the
# processes it starts inherit
LOADED_BY_VAR = "SGLANG_EMBEDS_PLUGIN_LOADED_BY"


def is_server_main_process() -> bool:
    """Whether this process is a server's (or an Engine's) main process, where the guards are
    checked and the HTTP side goes, and not one SGLang started for it (scheduler, detokenizer, DP
    controller, multi-tokenizer HTTP worker): those are multiprocessing children of a process that
    loaded the plugin. Not just ``multiprocessing.parent_process() is None``: a server may itself
    run in a multiprocessing child (an orchestrator, a supervisor or a notebook helper starts
    ``launch_server`` that way), whose parent never loaded the plugin. (A multiprocessing child of
    a process that did load it, such as a notebook that ran an ``Engine``, counts as SGLang's: start
    such a server with ``subprocess`` instead.)"""
    parent = multiprocessing.parent_process()
    started_by_sglang = parent is not None and os.environ.get(LOADED_BY_VAR) == str(parent.pid)
    os.environ[LOADED_BY_VAR] = str(os.getpid())
    return not started_by_sglang


def check_guards() -> None:
    """``targets.check("server")``, as a ``SystemExit`` that SGLang's plugin loader lets through."""
    try:
        targets.check("server")
    except targets.ChangedSGLang as e:
        raise SystemExit(f"sgl_embeds refuses to start: {e}") from None
