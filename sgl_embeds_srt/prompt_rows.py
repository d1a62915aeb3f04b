"""A span prompt's rows, in the two roles they play outside the trip to the scheduler.

``PromptRows`` is the built prompt (HTTP process: ``prompts.build_ids`` makes it, one ``SpanRows``
per span, and an M-RoPE VLM's image items); ``SpanPromptRows`` is the scheduler's mark that every
override position holds a placeholder id, so the prefix may be cached. The third role, the rows
as they cross, is ``transport.CrossingRows``: it needs the scheduler's rows, which live there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from sglang.srt.managers.embed_types import PositionalEmbeds


@dataclass(frozen=True)
class SpanRows:
    """One span of a prompt's rows: the content key of its rows as sent (None: an in-process
    caller's rows that are never held), its row count, and, on the trip to the scheduler
    (``transport.CrossingRows``), whether its rows are in the message (False: the scheduler
    holds them)."""

    content_key: str | None
    n_rows: int
    sent: bool = True
    bidirectional: bool = False  # its rows attend each other both ways (blocks.py)


class PromptRows(PositionalEmbeds, array_like=True):
    """The span rows of one built prompt at their positions, spans back to back in prompt order,
    one ``SpanRows`` each."""

    spans: list[SpanRows] = []
    # the image items of an M-RoPE VLM's prompt (image_spans.py), which go to the scheduler as
    # SGLang's own multimodal inputs, never in the rows (transport.RowsTransport drops them)
    images: object = None

    @classmethod
    def from_spans(cls, rows_per_span: list[torch.Tensor], content_keys: list[str | None],
                   positions: list[int], bidirectional: list[bool] | None = None) -> PromptRows:
        """A prompt's spans (rows, content keys, whether each attends both ways) in prompt order."""
        # one span: its rows as they are (a held span's rows are not copied). Spans of several
        # dtypes occur on a float32 model only (prompts.EXACT_CASTS): torch.cat promotes to it
        embeds = rows_per_span[0] if len(rows_per_span) == 1 else torch.cat(rows_per_span)
        bidirectional = bidirectional or [False] * len(rows_per_span)
        spans = [SpanRows(key, rows.shape[0], bidirectional=both)
                 for rows, key, both in zip(rows_per_span, content_keys, bidirectional)]
        return cls(embeds, positions, spans=spans)


class SpanPromptRows(PositionalEmbeds, array_like=True):
    """Scheduler side: a request's overrides (ours or SGLang's own) once every position was
    checked to hold a placeholder id (``scheduler.req_init``). A new object: requests may share
    the overrides they arrived with, and only this request's ids were checked."""

    @classmethod
    def of(cls, overrides: PositionalEmbeds) -> SpanPromptRows:
        return cls(overrides.embeds, overrides.positions)
