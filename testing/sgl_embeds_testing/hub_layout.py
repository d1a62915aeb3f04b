"""Where each family's published checkpoints keep their chat template and processor settings, and
``publish_layout``: a checkpoint as transformers 5 saves it (``chat_template.jinja``, one nested
``processor_config.json``) rewritten into those files, so that the tests serve and read what users
download from the hub rather than what ``save_pretrained`` writes today.

The layouts are the file listings of the named repositories (no hub is reachable here); the
families published after transformers 5 changed its files (Qwen3.5, Gemma 4) keep the saved
layout."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# named here, not taken from ``sgl_embeds.vlm.files.TEMPLATE_FILES``: these are the hub's files, and
# what the code under test reads must not decide what the tests' checkpoints hold
JINJA, TEMPLATE_JSON, TOKENIZER_CONFIG = "chat_template.jinja", "chat_template.json", "tokenizer_config.json"
PROCESSOR, IMAGE_PROCESSOR, VIDEO_PROCESSOR = ("processor_config.json", "preprocessor_config.json",
                                               "video_preprocessor_config.json")


@dataclass(frozen=True)
class HubLayout:
    """The processor files of a family's published checkpoints: ``templates``, the files holding
    the chat template (none: the family has none); ``processor_config``, whether a flat
    ``processor_config.json`` holds the processor's own settings (the image processor's are in
    ``preprocessor_config.json`` either way); ``video_config``, whether the video processor's
    settings have their own file (else transformers reads them from the image processor's)."""

    repository: str
    templates: tuple[str, ...]
    processor_config: bool
    video_config: bool


QWEN_VL = dict(templates=(TEMPLATE_JSON, TOKENIZER_CONFIG), processor_config=False)
HUB_LAYOUTS = {
    "qwen2_vl": HubLayout("Qwen/Qwen2-VL-2B-Instruct", **QWEN_VL, video_config=False),
    "qwen2_5_vl": HubLayout("Qwen/Qwen2.5-VL-3B-Instruct", **QWEN_VL, video_config=False),
    "qwen3_vl": HubLayout("Qwen/Qwen3-VL-2B-Instruct", **QWEN_VL, video_config=True),
    "llava": HubLayout("llava-hf/llava-1.5-7b-hf", (TEMPLATE_JSON,), True, False),
    "llava_next": HubLayout("llava-hf/llava-v1.6-mistral-7b-hf", (TEMPLATE_JSON,), True, False),
    "llava_onevision": HubLayout("llava-hf/llava-onevision-qwen2-0.5b-ov-hf", (TEMPLATE_JSON,), True, False),
    "paligemma": HubLayout("google/paligemma-3b-pt-224", (), False, False),
    "gemma3": HubLayout("google/gemma-3-4b-it", (TEMPLATE_JSON, TOKENIZER_CONFIG), True, False),
}


def _read(path: Path) -> dict:
    return json.loads(path.read_text())


def _write(path: Path, settings: dict) -> None:
    path.write_text(json.dumps(settings, indent=2, sort_keys=True) + "\n")


def publish_layout(folder: Path, family: str) -> None:
    """Rewrite the processor files transformers 5 saved in ``folder`` as ``HUB_LAYOUTS[family]``
    lays them out (a family without one is left as saved)."""
    layout = HUB_LAYOUTS.get(family)
    if layout is None:
        return
    processor = _read(folder / PROCESSOR)
    image = processor.pop("image_processor")
    video = processor.pop("video_processor", None)
    owner = {"processor_class": processor["processor_class"]}
    _write(folder / IMAGE_PROCESSOR, {**image, **owner})
    (folder / VIDEO_PROCESSOR).unlink(missing_ok=True)
    if layout.video_config and video is not None:
        _write(folder / VIDEO_PROCESSOR, {**video, **owner})
    (folder / PROCESSOR).unlink()
    if layout.processor_config:
        _write(folder / PROCESSOR, processor)
    template = folder / JINJA
    if template.exists():
        text = template.read_text()
        template.unlink()
        for name in layout.templates:
            settings = _read(folder / name) if (folder / name).exists() else {}
            _write(folder / name, {**settings, "chat_template": text})


def layout_of(folder: Path) -> dict:
    """What ``folder``'s processor files are, in ``HubLayout``'s terms (for the tests that check it)."""
    templates = tuple(name for name in (JINJA, TEMPLATE_JSON, TOKENIZER_CONFIG)
                      if (folder / name).exists() and (name == JINJA or "chat_template" in _read(folder / name)))
    processor = _read(folder / PROCESSOR) if (folder / PROCESSOR).exists() else None
    return dict(templates=templates, processor_config=processor is not None,
                nested=processor is not None and "image_processor" in processor,
                image_config=(folder / IMAGE_PROCESSOR).exists(), video_config=(folder / VIDEO_PROCESSOR).exists())
