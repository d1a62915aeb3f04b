"""The model family a server serves, and how: what ``/sgl_embeds/info`` says under ``"model"``
so that a client loads the vision half that fits it (``sgl_embeds.connect``).

* A LLaVA-family checkpoint is split (``sgl_embeds.vlm.split``) and its LLM served: a plain causal
  LM to SGLang, which knows the family only from ``FAMILY_FILE``, written by the split beside the
  LLM's weights (the family, the vision half's folder relative to the LLM's, the image token).
* A Qwen-VL checkpoint is served natively (``image_spans.VisionSpec``): its family is its
  ``model_type``, its spans carry their image's grid, and its own folder holds the vision half.
* Any other model is a text LLM (family None): spans of its hidden size, no vision half.

Both sides import this module (the split writes the file, the plugin reads it): it imports nothing
of either.
"""

from __future__ import annotations

import json
import os
from typing import Any

FAMILY_FILE = "sgl_embeds_family.json"
SPLIT_FAMILIES = ("llava", "llava_next", "llava_onevision")


def family_file(family: str, vision_dir: str, image_token: str) -> str:
    """The text of ``FAMILY_FILE`` for a split LLM; ``vision_dir``: relative to the LLM's folder."""
    return json.dumps({"family": family, "vision_dir": vision_dir, "image_token": image_token},
                      indent=2)


def served_model(model_path: str | None, vision: Any, tokenizer: Any) -> dict:
    """What ``/sgl_embeds/info`` says of the served model: ``family``, ``served_as`` (``"split"``,
    ``"native"`` or ``"text"``), ``vision_dir`` (the vision half's folder, absolute, on the
    server's machine; None for a text LLM), ``grid`` (whether an image's span carries
    ``image_grid_thw``), ``merge_size`` and ``vision_tokens`` (what a prompt writes around an
    image: ``image``, and on Qwen-VL ``start`` / ``end``). ``vision``: the native VLM's
    ``VisionSpec`` or None."""
    path = os.path.abspath(model_path) if model_path and os.path.isdir(model_path) else None
    if vision is not None:
        ids = [vision.image_token_id, vision.vision_start_token_id, vision.vision_end_token_id]
        image, start, end = tokenizer.convert_ids_to_tokens(ids) if tokenizer else (None,) * 3
        return {"family": vision.model_type, "served_as": "native", "vision_dir": path,
                "grid": True, "merge_size": vision.merge_size,
                "vision_tokens": {"image": image, "start": start, "end": end}}
    split = _read_family_file(path)
    if split is not None:
        return {"family": split["family"], "served_as": "split",
                "vision_dir": os.path.normpath(os.path.join(path, split["vision_dir"])),
                "grid": False, "merge_size": None,
                "vision_tokens": {"image": split["image_token"]}}
    return {"family": None, "served_as": "text", "vision_dir": None, "grid": False,
            "merge_size": None, "vision_tokens": {}}


def _read_family_file(path: str | None) -> dict | None:
    file = os.path.join(path, FAMILY_FILE) if path else None
    if file is None or not os.path.exists(file):
        return None
    with open(file) as f:
        return json.load(f)
