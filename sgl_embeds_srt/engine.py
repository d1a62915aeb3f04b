"""``sglang.Engine`` side: ``engine.generate(input_segments=..., input_embeds=...)``.

The hooks accept the span fields as keywords (wire encodings, or torch tensors in-process),
build the request with ``prompts.make_generate_req`` exactly as the HTTP route does, and hand it
to the engine's tokenizer manager. Calls without span fields go to the stock methods unchanged.
"""

from __future__ import annotations

from typing import Any, Callable

from sgl_embeds_srt import parse, prompts, token_ids

_RENAMED = {"prompt": "text"}


def _span_request(engine: Any, args: tuple, kwargs: dict) -> Any:
    if args:
        raise TypeError("with input_segments / input_embeds, pass every argument by keyword")
    body = {_RENAMED.get(k, k): v for k, v in kwargs.items() if v is not None}
    body.pop("data_parallel_rank", None)
    spec = prompts.ModelSpec.from_tokenizer_manager(engine.tokenizer_manager)
    return prompts.make_generate_req(body, spec)


def _check_stock_ids(engine: Any, kwargs: dict) -> None:
    """``input_ids`` given by keyword must be ids of the vocabulary (see ``token_ids.py``)."""
    if kwargs.get("input_ids") is not None:
        vocab_size = engine.tokenizer_manager.model_config.vocab_size
        token_ids.check_id_lists(kwargs["input_ids"], vocab_size, "input_ids")


def generate(original: Callable, self: Any, *args: Any, **kwargs: Any) -> Any:
    if not parse.has_span_fields(kwargs):
        _check_stock_ids(self, kwargs)
        return original(self, *args, **kwargs)
    obj = _span_request(self, args, kwargs)
    generator = self.tokenizer_manager.generate_request(obj, None)
    if not obj.stream:
        return self.loop.run_until_complete(generator.__anext__())

    def chunks():
        while True:
            try:
                yield self.loop.run_until_complete(generator.__anext__())
            except StopAsyncIteration:
                return

    return chunks()


async def async_generate(original: Callable, self: Any, *args: Any, **kwargs: Any) -> Any:
    if not parse.has_span_fields(kwargs):
        _check_stock_ids(self, kwargs)
        return await original(self, *args, **kwargs)
    obj = _span_request(self, args, kwargs)
    generator = self.tokenizer_manager.generate_request(obj, None)
    return generator if obj.stream else await generator.__anext__()
