"""A split LLM's weights, read in place: ``split`` links the checkpoint's safetensors files into
``llm/`` and writes ``WEIGHTS_FILE``, the key in those files of each tensor the LLM loads. The
server's weight loader (``sgl_embeds_srt.loader``) and ``vlm.load_split_llm`` read the files
through it; tensors it does not name (the vision half's, a tied ``lm_head``) are skipped.
"""

from __future__ import annotations

import json
import os
from typing import Iterable, Iterator, TypeVar

WEIGHTS_FILE = "sgl_embeds_weights.json"
WEIGHTS_FORMAT = "sgl_embeds.split_weights/1"

T = TypeVar("T")


def write_weight_names(folder: str | os.PathLike, names: dict[str, str]) -> None:
    """Write ``WEIGHTS_FILE`` in ``folder``; ``names``: the LLM's name of each tensor -> its key
    in the linked files."""
    record = {"format": WEIGHTS_FORMAT, "names": dict(sorted(names.items()))}
    with open(os.path.join(folder, WEIGHTS_FILE), "w") as f:
        json.dump(record, f, indent=1)


def weight_names(folder: str | os.PathLike) -> dict[str, str] | None:
    """The linked files' key -> the LLM's name, of each tensor the LLM in ``folder`` loads; None
    for a folder without ``WEIGHTS_FILE`` (its files carry the LLM's own names)."""
    path = os.path.join(folder, WEIGHTS_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        record = json.load(f)
    names = record.get("names") if isinstance(record, dict) else None
    if not isinstance(names, dict) or record.get("format") != WEIGHTS_FORMAT or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in names.items()):
        raise ValueError(f"{path}: not a {WEIGHTS_FORMAT} record (split the checkpoint again)")
    by_key = {key: name for name, key in names.items()}
    if len(by_key) != len(names):
        raise ValueError(f"{path}: two of the LLM's tensors read the same key")
    return by_key


def renamed(weights: Iterable[tuple[str, T]], by_key: dict[str, str], where: str) -> Iterator[tuple[str, T]]:
    """``weights`` (key, tensor) under the LLM's names (``by_key``, as ``weight_names`` gives it),
    what it does not name skipped; after the last, a ``ValueError`` naming a key never seen (a
    linked file gone: the LLM would keep its initial values there)."""
    unseen = set(by_key)
    for key, tensor in weights:
        name = by_key.get(key)
        if name is not None:
            unseen.discard(key)
            yield name, tensor
    if unseen:
        raise ValueError(f"{where}: {len(unseen)} of the LLM's tensors are in none of its weight files, "
                         f"e.g. {sorted(unseen)[0]!r} ({WEIGHTS_FILE}; split the checkpoint again)")
