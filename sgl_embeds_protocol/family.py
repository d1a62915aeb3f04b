"""The VLM families sgl_embeds knows, one ``Family`` record each (``FAMILIES``), and what
``/sgl_embeds/info`` says of the served model under ``"model"`` (``served_model``).

Both sides read this module (``serve`` and the client's vision halves, the plugin's grid spans):
it imports nothing of either. A family's code lives in its own module (docs/architecture.md,
"Adding a family"); everything else asks the record.
"""

from __future__ import annotations

import functools
import json
import os
from dataclasses import asdict, dataclass
from typing import Any

from sgl_embeds_protocol.info import TEXT, ServedModel
from sgl_embeds_protocol.segments import SECONDS_PER_STEP, TIMESTAMPS

FAMILY_FILE = "sgl_embeds_family.json"

# How a family is served (``Family.served_as``)
SPLIT = "split"  # its LLM served as a causal LM; tower + projector on the client
NATIVE = "native"  # the whole checkpoint served by SGLang; its image rows at M-RoPE positions
# the checkpoint served whole as an encoder-decoder whose encoder reads the prompt (image rows from
# the client's tower + projector, then text); the decoder generates (sgl_embeds_srt/florence2.py)
ENCODER_DECODER = "encoder_decoder"
REFUSED = "refused"  # known, and refused by name (``Family.refused`` says why)

# A split family's projector (``Family.projector``)
MLP = "mlp"  # LLaVA's linear_1 -> act -> linear_2 over the tower's selected feature layers
LINEAR = "linear"  # PaliGemma's one linear layer over the tower's last hidden state
POOLED = "pooled"  # Gemma 3's average pooling to a fixed row count, RMS norm, one matrix
# Gemma 4's embed_vision over its pooling tower: rows of a count that depends on the image's
# size, RMS-normed without a gain, one matrix; the checkpoint's own layout (vlm/gemma4.py)
EMBEDDER = "embedder"


@dataclass(frozen=True)
class Family:
    """One VLM family: its HF ``model_type`` (``name``), how it is served, and what its spans
    need. Read by both sides; a field replaces a branch on family names."""

    name: str  # HF's model_type
    title: str  # as its model cards write it
    hf_class: str  # the transformers class of its checkpoints
    served_as: str  # SPLIT, NATIVE, ENCODER_DECODER or REFUSED
    refused: str | None = None  # why, when REFUSED
    # the any-resolution tiling of a split LLaVA: None (one square image), "anyres" (NeXT:
    # tiles unpadded, image_newline rows), "anyres_max" (OneVision: and down-scaled past N tiles)
    tiling: str | None = None
    mrope: bool = False  # its image rows stand at 3-D rotary positions: a span carries its grid
    clips: bool = False  # whether a span may be a clip (a video's frames, with a video grid)
    # the time a clip's span carries, as the family's processor and rope index read it: None
    # (steps 1 position apart), segments.SECONDS_PER_STEP or segments.TIMESTAMPS
    clip_time: str | None = None
    # the family whose vision half (tower, processor, M-RoPE layout) this one's is
    vision_of: str | None = None
    hybrid: bool = False  # an LLM of Gated DeltaNet and attention layers (SGLang's mamba state)
    # its LLM attends the whole prompt both ways (a prefix LM, PaliGemma): each request's prompt is
    # one bidirectional block; generated tokens attend causally
    prefix_lm: bool = False
    # each image's span is one bidirectional block (Gemma 3): its rows attend each other both
    # ways, the text around them causally; the client's image spans carry it
    image_block: bool = False
    projector: str | None = MLP  # a split family's: MLP, LINEAR, POOLED or EMBEDDER; None: not split

    def __post_init__(self) -> None:
        if self.served_as not in (SPLIT, NATIVE, ENCODER_DECODER, REFUSED):
            raise ValueError(f"{self.name}: served_as {self.served_as!r}")
        if (self.served_as == REFUSED) != (self.refused is not None):
            raise ValueError(f"{self.name}: a refused family says why, and only it")
        if self.clip_time not in (None, SECONDS_PER_STEP, TIMESTAMPS):
            raise ValueError(f"{self.name}: clip_time {self.clip_time!r}")
        if self.projector not in (MLP, LINEAR, POOLED, EMBEDDER, None):
            raise ValueError(f"{self.name}: projector {self.projector!r}")


_QWEN_VL = dict(mrope=True, clips=True)  # grid spans at M-RoPE positions, clips with their time

FAMILIES = (
    Family("llava", "LLaVA-1.5", "LlavaForConditionalGeneration", SPLIT),
    Family("llava_next", "LLaVA-NeXT", "LlavaNextForConditionalGeneration", SPLIT,
           tiling="anyres"),
    Family("llava_onevision", "LLaVA-OneVision", "LlavaOnevisionForConditionalGeneration", SPLIT,
           tiling="anyres_max"),
    Family("paligemma", "PaliGemma", "PaliGemmaForConditionalGeneration", SPLIT, prefix_lm=True,
           projector=LINEAR),
    Family("gemma3", "Gemma 3", "Gemma3ForConditionalGeneration", SPLIT, image_block=True,
           projector=POOLED),
    # E2B / E4B: images causal, per-layer inputs of image positions by the pad id (the plugin's
    # model_runner.gemma4_per_layer_inputs); 26B / 31B: each image one block on the sliding layers
    # only (the checkpoint's vision settings and family file say so: split_sliding_blocks)
    Family("gemma4", "Gemma 4", "Gemma4ForConditionalGeneration", SPLIT, projector=EMBEDDER),
    # its BART encoder attends the image rows and the task prompt both ways; the DaViT tower and
    # projector run on the client (sgl_embeds.vlm.florence2)
    Family("florence2", "Florence-2", "Florence2ForConditionalGeneration", ENCODER_DECODER, projector=None),
    Family("qwen2_vl", "Qwen2-VL", "Qwen2VLForConditionalGeneration", NATIVE, **_QWEN_VL),
    Family("qwen2_5_vl", "Qwen2.5-VL", "Qwen2_5_VLForConditionalGeneration", NATIVE, **_QWEN_VL,
           clip_time=SECONDS_PER_STEP),
    Family("qwen3_vl", "Qwen3-VL", "Qwen3VLForConditionalGeneration", NATIVE, **_QWEN_VL,
           clip_time=TIMESTAMPS),
    Family("qwen3_5", "Qwen3.5", "Qwen3_5ForConditionalGeneration", NATIVE, **_QWEN_VL,
           clip_time=TIMESTAMPS, vision_of="qwen3_vl", hybrid=True),
    Family("qwen3_5_moe", "Qwen3.5-MoE", "Qwen3_5MoeForConditionalGeneration", NATIVE, **_QWEN_VL,
           clip_time=TIMESTAMPS, vision_of="qwen3_vl", hybrid=True),
    Family("qwen3_vl_moe", "Qwen3-VL-MoE", "Qwen3VLMoeForConditionalGeneration", REFUSED,
           **_QWEN_VL, clip_time=TIMESTAMPS, vision_of="qwen3_vl",
           refused="Qwen3-VL-MoE's LLM adds exactly 3 deepstack layers whatever its config "
                   "says, and it has not run here"),
)
BY_NAME = {family.name: family for family in FAMILIES}


def family_of(model_type: str | None) -> Family | None:
    """The record of ``model_type``; None for a model that is no known VLM (a text LLM)."""
    return BY_NAME.get(model_type) if model_type else None


def names(served_as: str) -> tuple[str, ...]:
    """The model types served so (SPLIT, NATIVE) or refused (REFUSED), in the table's order."""
    return tuple(family.name for family in FAMILIES if family.served_as == served_as)


def served_titles() -> str:
    """The served families as a sentence, for errors that list them."""
    def titles(served_as: str) -> str:
        return " / ".join(family.title for family in FAMILIES if family.served_as == served_as)
    return (f"{titles(SPLIT)} ({SPLIT}), {titles(NATIVE)} ({NATIVE}), {titles(ENCODER_DECODER)} "
            f"({ENCODER_DECODER}), and text LLMs that SGLang serves")


@dataclass(frozen=True)
class ImageText:
    """How a split family's processor writes an image into a chat: the template writes
    ``written`` for an image part, and the processor puts ``before``, the image's rows, ``after``
    in its place (Gemma 3: ``<start_of_image>`` becomes ``"\\n\\n<start_of_image>"``, the rows,
    ``"<end_of_image>\\n\\n"``). The chat route renders an ``input_embeds`` part so."""

    written: str
    before: str
    after: str

    def expand(self, text: str, image: str) -> str:
        """``text`` with each ``written`` replaced by ``before + image + after``."""
        return text.replace(self.written, self.before + image + self.after)


def family_file(family: str, vision_dir: str, image_token: str,
                image_text: ImageText | None = None, sliding_blocks: bool = False) -> str:
    """The text of ``FAMILY_FILE`` for a split LLM; ``vision_dir``: relative to the LLM's folder;
    ``image_text``: where the chat route renders a span part as an image; ``sliding_blocks``: its
    blocks hold on its sliding-window layers only, inside the window (``split_sliding_blocks``)."""
    record = {"family": family, "vision_dir": vision_dir, "image_token": image_token}
    if image_text is not None:
        record["image_text"] = asdict(image_text)
    if sliding_blocks:
        record["sliding_blocks"] = True
    return json.dumps(record, indent=2)


def served_model(model_path: str | None, vision: Any, tokenizer: Any, model_type: str | None = None) -> ServedModel:
    """What ``/sgl_embeds/info`` says of the served model. ``vision``: the native VLM's
    ``image_spans.VisionSpec`` or None; a split LLM is known by its ``FAMILY_FILE``; an
    encoder-decoder by its ``model_type`` (its checkpoint is its vision half)."""
    path = os.path.abspath(model_path) if model_path and os.path.isdir(model_path) else None
    family = family_of(model_type)
    if family is not None and family.served_as == ENCODER_DECODER:
        return ServedModel(family.name, ENCODER_DECODER, path, grid=False, merge_size=None, vision_tokens={})
    if vision is not None:
        ids = [vision.image_token_id, vision.vision_start_token_id, vision.vision_end_token_id]
        image, start, end = tokenizer.convert_ids_to_tokens(ids) if tokenizer else (None,) * 3
        return ServedModel(vision.model_type, NATIVE, path, grid=True, merge_size=vision.merge_size,
                           vision_tokens={"image": image, "start": start, "end": end})
    split = _read_family_file(path)
    if split is not None:
        vision_dir = os.path.normpath(os.path.join(path, split["vision_dir"]))
        return ServedModel(split["family"], SPLIT, vision_dir, grid=False, merge_size=None,
                           vision_tokens={"image": split["image_token"]})
    return ServedModel(None, TEXT, None, grid=False, merge_size=None, vision_tokens={})


@functools.cache
def split_family(model_path: str | None) -> Family | None:
    """The family whose LLM half ``model_path`` is (its ``FAMILY_FILE``); None for any other
    model. Read once per path: a server's model does not change under it, and the tokenizer side
    asks on every request."""
    split = _read_family_file(model_path if model_path and os.path.isdir(model_path) else None)
    return family_of(split["family"]) if split is not None else None


@functools.cache
def split_image_text(model_path: str | None) -> ImageText | None:
    """How the chat template's image part is expanded for the split LLM ``model_path``
    (``ImageText``); None where its family has no such rule or the model is not a split."""
    split = _read_family_file(model_path if model_path and os.path.isdir(model_path) else None)
    image_text = split.get("image_text") if split is not None else None
    return ImageText(**image_text) if image_text is not None else None


@functools.cache
def split_sliding_blocks(model_path: str | None) -> bool:
    """Whether the split LLM ``model_path`` attends a block both ways on its sliding-window layers
    only, as window AND (causal OR block), and causally on its full layers (Gemma 4 26B / 31B:
    HF's ``create_masks_for_vision_model``); False for any other model."""
    split = _read_family_file(model_path if model_path and os.path.isdir(model_path) else None)
    return bool(split is not None and split.get("sliding_blocks"))


def _read_family_file(path: str | None) -> dict | None:
    file = os.path.join(path, FAMILY_FILE) if path else None
    if file is None or not os.path.exists(file):
        return None
    with open(file) as f:
        return json.load(f)
