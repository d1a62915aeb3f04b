"""The hand-off from the middleware to SGLang's own OpenAI routes: a ``StockRequest``.

The rewritten body goes to SGLang's route as JSON; its rows cannot, so they travel as the
``StockRequest`` being served: a context variable the middleware sets while that route runs
(``serving``; every task the route starts inherits it, a streamed answer's included) and that
``openai.generate_request`` reads (``being_served``). docs/architecture.md, step 8.
"""

from __future__ import annotations

import contextlib
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Iterator

from sgl_embeds_srt.prompt_rows import PromptRows


@dataclass(frozen=True)
class StockRequest:
    """A body that SGLang's own route serves: the rewritten body, and the prompt's rows to attach
    when that route calls ``generate_request`` (None: a stock body, passed on as JSON)."""

    body: dict
    prompt_rows: PromptRows | None


_SERVING: ContextVar[StockRequest | None] = ContextVar("sgl_embeds_stock_request", default=None)


@contextlib.contextmanager
def serving(stock: StockRequest) -> Iterator[None]:
    """While SGLang's own route serves ``stock`` (its whole call, in this task and the tasks it
    starts)."""
    token = _SERVING.set(stock)
    try:
        yield
    finally:
        _SERVING.reset(token)


def being_served() -> StockRequest | None:
    """The ``StockRequest`` SGLang's route is serving in this context (None outside one)."""
    return _SERVING.get()
