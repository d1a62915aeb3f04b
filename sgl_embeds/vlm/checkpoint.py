"""Split an HF LLaVA, PaliGemma, Gemma 3 or Gemma 4 checkpoint (safetensors, both key layouts)
into an LLM that SGLang serves and a vision half that we run: ``split(SRC, DST)`` writes
``DST/llm/`` (a causal LM whose weights stay in the checkpoint's files, linked; the family file)
and ``DST/vision/`` (tower and projector weights, settings, chat template); ``load_split_llm``
loads the LLM half with transformers. What cannot be carried over exactly is a ``ValueError``
naming the key or field; ``.bin`` weights are refused, never unpickled (docs/vision-encoders.md).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from huggingface_hub.errors import StrictDataclassError
from safetensors.torch import save_file
from transformers import AutoConfig, AutoImageProcessor, AutoModelForCausalLM, AutoTokenizer
from transformers.image_processing_backends import TorchvisionBackend
from transformers.utils import logging as hf_logging
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

from sgl_embeds.vlm import gemma3, gemma4, paligemma
from sgl_embeds.vlm.anyres import checkpoint_settings
from sgl_embeds.vlm.files import Tensors, chat_template_of, weight_index
from sgl_embeds.vlm.pixels import ImageProcessing
from sgl_embeds.vlm.tower import (
    CONFIG_NAME, WEIGHTS_NAME, TowerGeometry, VisionConfig, clip_to_open_clip,
)
from sgl_embeds_protocol.family import (
    EMBEDDER, FAMILY_FILE, FAMILIES, LINEAR, MLP, POOLED, SPLIT, Family, family_file, family_of,
)
from sgl_embeds_protocol.split_weights import weight_names, write_weight_names

# what ``split`` writes, as a version: ``serve`` keys its split cache by it too, so a split of an
# older layout is made again rather than served without what it lacks (2: FAMILY_FILE's image_text;
# 3: the LLM's weights linked, not copied)
SPLIT_VERSION = 3
_LLM_FILES = ("generation_config.json",)


def split(src: str | Path, dst: str | Path, log: Callable[[str], None] = print) -> tuple[Path, Path]:
    """Write ``dst/llm`` and ``dst/vision`` from the LLaVA / PaliGemma / Gemma 3 / Gemma 4
    checkpoint ``src``; returns both paths. The LLM's weights stay in ``src``'s files (linked)."""
    src, dst = Path(src), Path(dst)
    raw = _read_json(src / "config.json")
    model_type = raw.get("model_type")
    family = family_of(model_type)
    if family is None or family.served_as != SPLIT:
        video = " (a video model: videos are not supported)" if "video" in str(model_type) else ""
        splittable = [f for f in FAMILIES if f.served_as == SPLIT]
        raise ValueError(f"{src}/config.json: model_type is {model_type!r}{video}; only "
                         f"{', '.join(repr(f.name) for f in splittable)} checkpoints "
                         f"({', '.join(f.hf_class for f in splittable)}) can be split")
    if family.projector == EMBEDDER:  # Gemma 4: its own key layout and vision half
        return _split_gemma4(src, dst, family, log)
    vision_type = raw.get("vision_config", {}).get("model_type")
    if family.projector == MLP and family.tiling is None and vision_type != "clip_vision_model":
        raise ValueError(f"vision_config.model_type is {vision_type!r}: only CLIP vision towers "
                         "(clip_vision_model) map onto open_clip")
    try:
        config = AutoConfig.from_pretrained(src)
    except StrictDataclassError as e:  # a value transformers itself refuses, e.g. a strategy
        raise ValueError(f"{src}/config.json: {e}") from None
    text_config = config.text_config
    if family.projector == LINEAR:  # PaliGemma: a plain Gemma / Gemma2 of its text config
        text_config = paligemma.llm_config(text_config)
    elif family.projector == POOLED:  # Gemma 3: a Gemma3ForCausalLM of its text config
        text_config = gemma3.llm_config(text_config)
    arch = _causal_lm_architecture(text_config)
    log(f"[split] {src}: {family.hf_class} with a {vision_type} tower and a {arch} language model")

    weights = weight_index(src)
    parts = _partition(weights, family)
    if family.projector == LINEAR:  # PaliGemma: transformers' SigLIP tower, one linear layer
        vision, image_processor = paligemma.checkpoint_settings(src, config, parts.projector)
    elif family.projector == POOLED:  # Gemma 3: transformers' SigLIP tower and projector
        vision, image_processor = gemma3.checkpoint_settings(src, config, parts.projector)
    elif family.tiling is None:  # LLaVA-1.5: an open_clip tower, one square image
        vision = _vision_config(src, config, parts.projector)
        image_processor = None
    else:
        vision, image_processor = checkpoint_settings(
            src, config, _projector_bias(config, parts.projector))
    log(f"[split] {len(parts.llm)} language-model tensors, {len(parts.tower)} tower, "
        f"{len(parts.projector)} projector")

    llm_dir, vision_dir = dst / "llm", dst / "vision"
    for d in (llm_dir, vision_dir):
        d.mkdir(parents=True, exist_ok=True)
    tensors = Tensors(weights)
    llm_keys = _untied(parts.llm, tensors, text_config)
    _write_llm(src, text_config, arch, weights, llm_keys, llm_dir, log)
    tower = {k: tensors[full] for k, full in parts.tower.items()}
    if family.tiling is None and family.projector == MLP:
        tower = clip_to_open_clip(tower, vision.tower.layers)
    state = {f"tower.{k}": v.contiguous() for k, v in tower.items()}
    state.update({f"projector.{k}": tensors[full].contiguous() for k, full in parts.projector.items()})
    if parts.newline is not None:
        state["image_newline"] = tensors[parts.newline].contiguous()
    save_file(state, str(vision_dir / WEIGHTS_NAME), metadata={"format": "pt"})
    (vision_dir / CONFIG_NAME).write_text(vision.to_json())
    template = chat_template_of(src)
    if template:
        (vision_dir / "chat_template.jinja").write_text(template)
    image_text = vision.image_text if family.image_block else None  # the chat route's image parts
    (llm_dir / FAMILY_FILE).write_text(family_file(family.name, "../vision", vision.image_token, image_text))
    if family.projector != MLP:  # PaliGemma, Gemma 3: one square image
        image_processor.save_pretrained(vision_dir)  # preprocessor_config.json
        size = vision.vision_config["image_size"]
        log(f"[split] vision: {vision_type} tower, {size}x{size} px, {vision.rows_per_image} "
            f"rows per image -> {vision_dir}")
    elif image_processor is None:
        log(f"[split] vision: open_clip tower ({vision.tower.layers} blocks, width "
            f"{vision.tower.width}), feature layers {list(vision.feature_layers)}, "
            f"{vision.rows_per_image} rows per image -> {vision_dir}")
    else:
        image_processor.save_pretrained(vision_dir)  # preprocessor_config.json
        tiling = vision.tiling
        height, width = max(tiling.pinpoints, key=lambda p: p[0] * p[1])
        log(f"[split] vision: {vision_type} tower, {len(tiling.pinpoints)} pinpoints of "
            f"{tiling.tile} px tiles, {tiling.grid}x{tiling.grid} rows per tile; an image of "
            f"one tile costs {tiling.rows_for(tiling.tile, tiling.tile)} rows, one of "
            f"{width}x{height} {tiling.rows_for(width, height)} -> {vision_dir}")
    return llm_dir, vision_dir


def _split_gemma4(src: Path, dst: Path, family: Family, log: Callable[[str], None]) -> tuple[Path, Path]:
    """``split`` of a ``Gemma4ForConditionalGeneration`` checkpoint: the LLM half a
    ``Gemma4ForCausalLM`` of its text config (``gemma4.llm_config``), the vision half
    ``gemma4.write_vision_half``'s."""
    config = AutoConfig.from_pretrained(src)
    text_config = gemma4.llm_config(config.text_config)
    arch = _causal_lm_architecture(text_config)
    weights = weight_index(src)
    tensors = Tensors(weights)
    llm_keys = _untied(gemma4.llm_keys(weights), tensors, text_config)
    log(f"[split] {src}: {family.hf_class}: a {arch} language model, {len(llm_keys)} tensors")
    llm_dir, vision_dir = dst / "llm", dst / "vision"
    llm_dir.mkdir(parents=True, exist_ok=True)
    _write_llm(src, text_config, arch, weights, llm_keys, llm_dir, log)
    vision = gemma4.write_vision_half(src, vision_dir)
    (llm_dir / FAMILY_FILE).write_text(family_file(
        family.name, "../vision", vision.image_token, vision.image_text,
        sliding_blocks=vision.image_block))
    log(f"[split] vision: {vision.vision_config['model_type']} tower, up to "
        f"{AutoImageProcessor.from_pretrained(vision_dir).max_soft_tokens} rows per image -> "
        f"{vision_dir}")
    return llm_dir, vision_dir


def _read_json(path: Path) -> dict:
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: is {path.parent} a saved HF checkpoint?")
    return json.loads(path.read_text())


def _causal_lm_architecture(text_config) -> str:
    arch = (getattr(text_config, "architectures", None) or [None])[0]
    arch = arch or MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(text_config.model_type)
    if arch is None:
        raise ValueError(f"text_config.model_type {text_config.model_type!r} has no causal-LM "
                         "class in transformers")
    if not sglang_serves(arch):
        raise ValueError(f"text_config: SGLang has no model class {arch!r}, so it cannot serve "
                         "this language model")
    return arch


def sglang_serves(arch: str) -> bool:
    """Whether SGLang's model folder defines ``arch`` (read as text: importing every model is slow)."""
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        return True  # a client-only machine: the server will say so when it loads the model
    models = Path(list(spec.submodule_search_locations)[0]) / "srt" / "models"
    needle = f"class {arch}("
    return any(needle in p.read_text(errors="replace") for p in models.glob("*.py"))


@dataclass(frozen=True)
class Parts:
    """The checkpoint's keys by part: each map goes from the name the part uses to the key."""

    llm: dict[str, str]
    tower: dict[str, str]
    projector: dict[str, str]
    newline: str | None  # the key of image_newline (any-resolution families only)


def _partition(weights: dict[str, Path], family: Family) -> Parts:
    llm, tower, projector, newline = {}, {}, {}, None
    for key in weights:
        name = key[len("model."):] if key.startswith("model.") and not key.startswith("model.model.") else key
        if name.startswith("language_model.model."):
            llm["model." + name[len("language_model.model."):]] = key
        elif name.startswith("language_model.lm_head."):
            llm[name[len("language_model."):]] = key
        elif name.startswith("language_model."):
            llm["model." + name[len("language_model."):]] = key
        elif key.startswith("lm_head."):
            llm[key] = key
        elif name.startswith("vision_tower."):
            rest = name[len("vision_tower."):]
            tower[rest[len("vision_model."):] if rest.startswith("vision_model.") else rest] = key
        elif name.startswith("multi_modal_projector."):
            projector[name[len("multi_modal_projector."):]] = key
        elif name == "image_newline" and family.tiling is not None:
            newline = key
        else:
            raise ValueError(f"checkpoint key {key!r} belongs to no known part of a "
                             f"{family.hf_class} model")
    if not projector:
        raise ValueError("missing projector: the checkpoint has no multi_modal_projector.* weights")
    if not tower:
        raise ValueError("missing vision tower: the checkpoint has no vision_tower.* weights")
    if family.tiling is not None and newline is None:
        raise ValueError(f"missing image_newline: a {family.hf_class} checkpoint needs the row "
                         "that closes each row of tile features")
    return Parts(llm, tower, projector, newline)


def _projector_bias(config, projector_keys: dict[str, str]) -> bool:
    """Whether the projector (LLaVA's ``linear_1 -> act -> linear_2``, checked) has biases."""
    known = {f"linear_{i}.{p}" for i in (1, 2) for p in ("weight", "bias")}
    unknown = sorted(set(projector_keys) - known)
    declared = getattr(config, "projector_type", None) or getattr(config, "mm_projector_type", None)
    if unknown or (declared not in (None, "mlp2x_gelu")):
        named = ["multi_modal_projector." + k for k in unknown] or sorted(projector_keys)
        raise ValueError(f"unknown projector type (projector_type={declared!r}, keys {named}): "
                         "only LLaVA's linear_1 -> act -> linear_2 is supported")
    for key in ("linear_1.weight", "linear_2.weight"):
        if key not in projector_keys:
            raise ValueError(f"missing projector weight multi_modal_projector.{key}")
    return "linear_1.bias" in projector_keys


def _vision_config(src: Path, config, projector_keys: dict[str, str]) -> VisionConfig:
    bias = _projector_bias(config, projector_keys)
    v = config.vision_config
    layers = config.vision_feature_layer
    geometry = TowerGeometry(
        image_size=v.image_size, patch_size=v.patch_size, width=v.hidden_size,
        layers=v.num_hidden_layers, heads=v.num_attention_heads, mlp_width=v.intermediate_size,
        act=v.hidden_act, layer_norm_eps=v.layer_norm_eps,
    )
    processing, image_token, rows_by_processor = _image_processing(src)
    vision = VisionConfig(
        tower=geometry, feature_layers=tuple([layers] if isinstance(layers, int) else layers),
        select_strategy=config.vision_feature_select_strategy, projector_act=config.projector_hidden_act,
        projector_bias=bias, llm_hidden_size=config.text_config.hidden_size, processing=processing,
        image_token=image_token, image_token_id=config.image_token_id,
    )
    if rows_by_processor is not None and rows_by_processor != vision.rows_per_image:
        raise ValueError(f"the processor expands {image_token!r} into {rows_by_processor} tokens "
                         f"but the tower gives {vision.rows_per_image} rows (check "
                         "num_additional_image_tokens and patch_size)")
    if processing.crop_size != (v.image_size, v.image_size):
        raise ValueError(f"image processor crop_size {processing.crop_size} differs from the tower's "
                         f"image_size {v.image_size}")
    return vision


def _image_processing(src: Path) -> tuple[ImageProcessing, str, int | None]:
    """The checkpoint's image processing, its image token, and the rows its processor expands it to."""
    processor = AutoImageProcessor.from_pretrained(src)
    if getattr(processor, "do_pad", False):
        raise ValueError("image processor do_pad=True (pad to square) is not supported")
    backend = "torchvision" if isinstance(processor, TorchvisionBackend) else "pil"
    processing = ImageProcessing.from_hf(processor, backend)
    settings = {}
    for name in ("processor_config.json", "preprocessor_config.json"):
        if (src / name).exists():
            settings = {**_read_json(src / name), **settings}
    image_token = settings.get("image_token", "<image>")
    rows = None
    if settings.get("patch_size"):
        h, w = processing.crop_size
        rows = ((h // settings["patch_size"]) * (w // settings["patch_size"])
                + settings.get("num_additional_image_tokens", 0))
        if settings.get("vision_feature_select_strategy") == "default":
            rows -= 1
    return processing, image_token, rows


def _untied(llm_keys: dict[str, str], tensors: Tensors, text_config) -> dict[str, str]:
    """``llm_keys`` less ``lm_head.weight`` where the LLM ties it to ``embed_tokens``: a stored
    copy must equal the embeddings (SGLang's tied models never read it)."""
    if not text_config.tie_word_embeddings or "lm_head.weight" not in llm_keys:
        return llm_keys
    embed = llm_keys.get("model.embed_tokens.weight")
    if embed is None:
        raise ValueError("missing language-model weight model.embed_tokens.weight (lm_head is tied "
                         "to it)")
    if not torch.equal(tensors[llm_keys["lm_head.weight"]], tensors[embed]):
        raise ValueError(f"checkpoint key {llm_keys['lm_head.weight']!r} differs from {embed!r} but "
                         "text_config.tie_word_embeddings is True: which one the LLM uses is unclear")
    return {k: v for k, v in llm_keys.items() if k != "lm_head.weight"}


def _write_llm(src: Path, text, arch: str, weights: dict[str, Path], llm_keys: dict[str, str],
               out: Path, log: Callable[[str], None]) -> None:
    """``out``: the LLM's config, tokenizer and generation config, and its weights where they
    are: the checkpoint's files that hold them, linked (hard links; symbolic ones across file
    systems), and the name of each in them (``split_weights.WEIGHTS_FILE``)."""
    text.architectures = [arch]
    text.save_pretrained(out)
    files = sorted({weights[key] for key in llm_keys.values()})
    if len({f.name for f in files}) != len(files):
        raise ValueError(f"{src}: two weight files of the language model share a name ({[str(f) for f in files]})")
    for f in files:
        _link(f.resolve(), out / f.name)
    write_weight_names(out, llm_keys)
    tokenizer = AutoTokenizer.from_pretrained(src)
    if not tokenizer.chat_template:
        tokenizer.chat_template = chat_template_of(src)
    tokenizer.save_pretrained(out)
    for name in _LLM_FILES:
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    log(f"[split] llm: {arch}, {len(llm_keys)} tensors read in place from {len(files)} file(s) -> {out}")


def _link(target: Path, link: Path) -> None:
    """``link`` to ``target``: a hard link, which keeps the bytes the split was made of if the
    checkpoint's file is replaced; a symbolic one where the two are on different file systems."""
    try:
        os.link(target, link)
    except OSError:
        os.symlink(target, link)


def load_split_llm(llm_dir: str | Path, **kwargs: Any) -> Any:
    """The split LLM in ``llm_dir`` as transformers' causal LM (``AutoModelForCausalLM``;
    ``kwargs`` go to ``from_pretrained``), its weights read where ``split`` left them; a folder
    with the LLM's own weights loads as it is. Any tensor of the LLM left unloaded is an error."""
    names = weight_names(llm_dir)
    if names is None:
        return AutoModelForCausalLM.from_pretrained(llm_dir, **kwargs)
    mapping = {f"^{re.escape(key)}$": name for key, name in names.items()}
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its report lists every vision tensor the files also hold
    try:
        model, loading = AutoModelForCausalLM.from_pretrained(
            llm_dir, key_mapping=mapping, output_loading_info=True, **kwargs)
    finally:
        hf_logging.set_verbosity(verbosity)
    if loading["missing_keys"]:
        raise ValueError(f"{llm_dir}: the language model's {sorted(loading['missing_keys'])[:3]} "
                         "are in none of its weight files")
    return model
