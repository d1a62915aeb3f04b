"""The files ``load_encoder`` picks an encoder by, named once for the encoders that read them:
a checkpoint's ``config.json`` (``model_type``) and what ``split`` writes in ``DST/vision``; and
the readers of a checkpoint's weights and chat template that ``split`` and the families share."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

CONFIG_NAME = "sgl_embeds_vision.json"  # the vision half's settings
WEIGHTS_NAME = "model.safetensors"  # tower, projector (and image_newline)
LLAVA_FORMAT = "sgl_embeds.llava_vision/1"  # LLaVA-1.5: tower.VisionConfig
ANYRES_FORMAT = "sgl_embeds.llava_anyres_vision/1"  # LLaVA-NeXT / OneVision: anyres.AnyresConfig
PALIGEMMA_FORMAT = "sgl_embeds.paligemma_vision/1"  # PaliGemma 1 and 2: paligemma.PaliGemmaVision
GEMMA3_FORMAT = "sgl_embeds.gemma3_vision/1"  # Gemma 3: gemma3.Gemma3Vision
GEMMA4_FORMAT = "sgl_embeds.gemma4_vision/1"  # Gemma 4: gemma4.Gemma4Vision


def model_type(path: str | Path) -> str | None:
    """The ``model_type`` of the HF checkpoint at ``path``; None where there is no config.json."""
    config = Path(path) / "config.json"
    return json.loads(config.read_text()).get("model_type") if config.exists() else None


def weight_index(src: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it."""
    index = src / "model.safetensors.index.json"
    if index.exists():
        return {k: src / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    single = src / "model.safetensors"
    if single.exists():
        with safe_open(str(single), "pt") as f:
            return {k: single for k in f.keys()}
    if any(src.glob("*.bin")):
        raise ValueError(f"{src} holds only .bin (pickle) weights: convert them to safetensors first "
                         "(sgl_embeds never unpickles a checkpoint)")
    raise FileNotFoundError(f"{src} has no model.safetensors or model.safetensors.index.json")


class Tensors:
    """Reads tensors by key, opening each safetensors file of the checkpoint once."""

    def __init__(self, weights: dict[str, Path]):
        self.weights = weights
        self._files: dict[Path, object] = {}

    def __getitem__(self, key: str) -> torch.Tensor:
        path = self.weights[key]
        if path not in self._files:
            self._files[path] = safe_open(str(path), "pt")
        return self._files[path].get_tensor(key)


# Where a checkpoint keeps its chat template, in the order transformers reads them: the
# processor's own file, its older JSON form, then the tokenizer's config (published Qwen-VL
# repositories carry the last two, no .jinja)
TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json", "tokenizer_config.json")


def chat_template_of(folder: str | Path) -> str | None:
    """The chat template of the checkpoint (or split vision) ``folder`` (``TEMPLATE_FILES``;
    of a tokenizer's named templates, the ``default``); None where it has none. ``split`` keeps
    it in the vision folder as ``chat_template.jinja``."""
    folder = Path(folder)
    if (folder / TEMPLATE_FILES[0]).exists():
        return (folder / TEMPLATE_FILES[0]).read_text()
    for name in TEMPLATE_FILES[1:]:
        template = json.loads((folder / name).read_text()).get("chat_template") if (folder / name).exists() else None
        if isinstance(template, list):  # [{"name": ..., "template": ...}, ...]
            template = next((t.get("template") for t in template if t.get("name") == "default"), None)
        if isinstance(template, str):
            return template
    return None
