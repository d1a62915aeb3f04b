"""A Gemma 4 checkpoint's two halves and its prompt rule (docs/vision-encoders.md, section 9).

``llm_config`` / ``llm_keys``: the LLM half (E2B / E4B), SGLang's ``Gemma4ForCausalLM``.
``write_vision_half``: tower (``Gemma4VisionModel``) and ``embed_vision`` weights, settings, image
processor, chat template. ``Gemma4Encoder``: an image's rows, bit-equal to HF's
``get_image_features(...).pooler_output`` for that image alone (as many rows as its size gives:
``rows_for``), unscaled. ``prompt_text`` / ``prompt_segments``: each image token becomes
``<boi>``, the rows, ``<eoi>``, as ``Gemma4Processor`` writes it. Video and audio are refused."""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import torch
from PIL import Image
from safetensors.torch import save_file
from transformers import AutoConfig, AutoImageProcessor, AutoModel, AutoProcessor, Gemma4TextConfig
from transformers.image_processing_backends import TorchvisionBackend
from transformers.models.gemma4.image_processing_gemma4 import (
    Gemma4ImageProcessor, get_aspect_ratio_preserving_size,
)
from transformers.models.gemma4.image_processing_pil_gemma4 import Gemma4ImageProcessorPil
from transformers.models.gemma4.modeling_gemma4 import Gemma4MultimodalEmbedder

from sgl_embeds.vlm.files import (
    CONFIG_NAME, GEMMA4_FORMAT as FORMAT, WEIGHTS_NAME, Tensors, chat_template_of, weight_index,
)
from sgl_embeds.vlm.pixels import BACKENDS
from sgl_embeds.vision import note_dtype, vision_dtype
from sgl_embeds.vlm.tower import ImageTextOfSettings, place_vision_half, read_vision_dir
from sgl_embeds_protocol import segments as seg
from sgl_embeds_protocol.family import ImageText

FAMILY = "gemma4"
TOWER = "gemma4_vision"  # the only tower type a Gemma 4 checkpoint has
IMAGE_PROCESSORS = (Gemma4ImageProcessor, Gemma4ImageProcessorPil)  # torchvision, PIL backends
# checkpoint key prefixes (transformers 5 saves the modules' names) -> the vision folder's
PARTS = {"model.vision_tower.": "tower.", "model.embed_vision.": "projector."}
LLM_PART = "model.language_model."  # -> the LLM half's "model."
# text_config.use_bidirectional_attention of 26B / 31B: each image one block on the sliding layers
VISION_BLOCKS = "vision"
# what neither half takes: the audio tower and its embedder (audio is refused in a prompt)
LEFT_OUT = ("model.audio_tower.", "model.embed_audio.")
# what this encoder does not take, by the checkpoint's placeholder token: why
NOT_DONE = {"video": "Gemma 4 videos (frames with timestamps, each its own block of rows) are "
                     "not supported yet: send frames as images",
            "audio": "Gemma 4 audio (its conformer tower and embed_audio) is not supported yet"}


@dataclass(frozen=True)
class Gemma4Vision:
    """Everything ``Gemma4Encoder`` needs but the weights and the image processor's settings
    (``sgl_embeds_vision.json``)."""

    vision_config: dict  # the Gemma 4 tower's config, as transformers saves it
    llm_hidden_size: int  # the projector's output width: the rows' width
    bos_token: str  # the server writes it (the first text's special token): not in the text
    boi_token: str  # written before an image's rows
    image_token: str  # where a prompt puts an image, and the processor's placeholder of one row
    image_token_id: int
    eoi_token: str  # written after an image's rows
    video_token: str  # refused in a prompt (NOT_DONE)
    audio_token: str  # refused in a prompt (NOT_DONE)
    # each image one bidirectional block (26B / 31B; on the LLM's sliding layers only, which the
    # split's family file tells the server); False: images causal (E2B / E4B)
    image_block: bool = False

    def __post_init__(self) -> None:
        tower = self.vision_config.get("model_type")
        if tower != TOWER:
            raise ValueError(f"vision_config.model_type is {tower!r}: a Gemma 4 checkpoint's "
                             f"tower is {TOWER!r}")

    @property
    def image_text(self) -> ImageText:
        """How ``Gemma4Processor`` writes an image: each image token becomes ``<boi>``, the
        image's rows, ``<eoi>``."""
        return ImageText(self.image_token, self.boi_token, self.eoi_token)

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, **asdict(self)}, indent=2)

    @classmethod
    def from_json(cls, text: str) -> Gemma4Vision:
        d = json.loads(text)
        if d.pop("format", None) != FORMAT:
            raise ValueError(f"not an sgl_embeds Gemma 4 vision config (expected format {FORMAT!r})")
        return cls(**d)


def check_image_processor(processor: object, vision_config: dict) -> None:
    """Gemma 4's image processor (either backend), resizing, with the tower's patch and pooling
    sizes (the rows a processor counts are the rows the tower gives)."""
    if not isinstance(processor, IMAGE_PROCESSORS):
        names = [c.__name__ for c in IMAGE_PROCESSORS]
        raise ValueError(f"the image processor is a {type(processor).__name__}: a Gemma 4 "
                         f"checkpoint needs one of {names}")
    if not processor.do_resize:
        raise ValueError("the image processor has do_resize=False: Gemma 4's tower takes each "
                         "image resized to whole pooling cells; set it to true")
    for name in ("patch_size", "pooling_kernel_size"):
        if getattr(processor, name) != vision_config[name]:
            raise ValueError(f"the image processor's {name} {getattr(processor, name)} differs "
                             f"from the tower's {vision_config[name]}")


def write_vision_half(src: str | Path, vision_dir: str | Path) -> Gemma4Vision:
    """Write the vision half of the Gemma 4 checkpoint ``src`` (safetensors, as transformers 5
    saves it) to ``vision_dir``: weights, settings, image processor, chat template. The audio
    tower and the language model stay behind."""
    src, vision_dir = Path(src), Path(vision_dir)
    config = AutoConfig.from_pretrained(src)
    if config.model_type != "gemma4":
        raise ValueError(f"{src}/config.json: model_type is {config.model_type!r}, not 'gemma4'")
    if config.vision_config is None:
        raise ValueError(f"{src}/config.json has no vision_config: the checkpoint has no vision "
                         "tower")
    processor = AutoProcessor.from_pretrained(src)
    vision_config = config.vision_config.to_dict()
    check_image_processor(processor.image_processor, vision_config)
    tok = processor.tokenizer
    settings = Gemma4Vision(
        vision_config=vision_config, llm_hidden_size=config.text_config.hidden_size,
        bos_token=tok.bos_token, boi_token=tok.boi_token, image_token=tok.image_token,
        image_token_id=config.image_token_id, eoi_token=tok.eoi_token,
        video_token=processor.video_token, audio_token=processor.audio_token,
        image_block=config.text_config.use_bidirectional_attention == VISION_BLOCKS)
    pairs = [("image_token_id", tok.image_token_id, config.image_token_id),
             ("boi_token_id", tok.convert_tokens_to_ids(tok.boi_token), config.boi_token_id),
             ("eoi_token_id", tok.convert_tokens_to_ids(tok.eoi_token), config.eoi_token_id)]
    for name, theirs, ours in pairs:
        if theirs != ours:
            raise ValueError(f"the processor's {name} {theirs!r} differs from the model config's "
                             f"{ours!r}")
    weights = weight_index(src)
    tensors = Tensors(weights)
    state = {new + key[len(old):]: tensors[key].contiguous()
             for key in weights for old, new in PARTS.items() if key.startswith(old)}
    for part in PARTS.values():
        if not any(k.startswith(part) for k in state):
            raise ValueError(f"{src}: no {part[:-1]} weights (keys {list(PARTS)})")
    vision_dir.mkdir(parents=True, exist_ok=True)
    save_file(state, str(vision_dir / WEIGHTS_NAME), metadata={"format": "pt"})
    (vision_dir / CONFIG_NAME).write_text(settings.to_json())
    processor.image_processor.save_pretrained(vision_dir)  # preprocessor_config.json
    template = chat_template_of(src)
    if template:
        (vision_dir / "chat_template.jinja").write_text(template)
    return settings


def llm_config(text_config: Gemma4TextConfig) -> Gemma4TextConfig:
    """``text_config`` as the config of the LLM half, a ``Gemma4ForCausalLM`` (``model_type``
    ``gemma4_text``) that computes what HF's ``Gemma4ForConditionalGeneration`` computes on the
    image rows: as it is, ``final_logit_softcapping`` included (transformers 5.19's Gemma 4 VLM
    caps its logits, unlike Gemma 3's), ``use_bidirectional_attention="vision"`` (26B / 31B) too
    (the family file then says so). Refused: any other bidirectional attention."""
    both_ways = text_config.use_bidirectional_attention
    if both_ways not in (None, VISION_BLOCKS):
        raise ValueError(f"text_config.use_bidirectional_attention is {both_ways!r}: a Gemma 4 "
                         f"VLM's text model attends causally or with {VISION_BLOCKS!r}")
    config = copy.deepcopy(text_config)
    config.architectures = ["Gemma4ForCausalLM"]
    return config


def llm_keys(weights: dict[str, Path]) -> dict[str, str]:
    """The LLM half's tensor names -> the checkpoint's keys (``model.language_model.X`` ->
    ``model.X``); a key of no known part is refused by name."""
    keys = {}
    for key in weights:
        if key.startswith(LLM_PART):
            keys["model." + key[len(LLM_PART):]] = key
        elif key == "lm_head.weight":
            keys[key] = key
        elif not key.startswith((*PARTS, *LEFT_OUT)):
            raise ValueError(f"checkpoint key {key!r} belongs to no known part of a "
                             "Gemma4ForConditionalGeneration model")
    if "model.embed_tokens.weight" not in keys:
        raise ValueError(f"missing language-model weight {LLM_PART}embed_tokens.weight")
    return keys


def prompt_text(text: str, vision: Gemma4Vision, images: int | None = None) -> str:
    """``text`` (a rendered chat, or any text with an image token where each image goes) as
    ``Gemma4Processor`` expands it, with one image token where each image's rows go (for
    ``image_prompt(..., vision.image_token)``): ``<boi><image><eoi>``; the rows' count is the
    span's. ``images``: the count the text must hold. A leading bos is dropped: the server writes
    it (as HF's chat-template path tokenizes a rendered chat without special tokens)."""
    for what in ("video", "audio"):
        if getattr(vision, f"{what}_token") in text:
            raise ValueError(f"the prompt holds {getattr(vision, f'{what}_token')!r}: "
                             f"{NOT_DONE[what]}")
    found = text.count(vision.image_token)
    if images is not None and found != images:
        raise ValueError(f"the prompt has {found} {vision.image_token!r} tokens but {images} "
                         "images were given")
    if vision.boi_token in text or vision.eoi_token in text:
        raise ValueError(f"the prompt already holds {vision.boi_token!r} or {vision.eoi_token!r}: "
                         f"write each image as one {vision.image_token!r}")
    return vision.image_text.expand(text.removeprefix(vision.bos_token), vision.image_token)


def prompt_segments(rows: Sequence[torch.Tensor], text: str, vision: Gemma4Vision) -> seg.Prompt:
    """The segments of a Gemma 4 prompt: the text of ``prompt_text`` with each image's rows, in
    order, as a span between ``"...<boi>"`` and ``"<eoi>..."``. The spans are plain (causal)
    spans as E2B / E4B attend images, or bidirectional ones where ``vision.image_block`` (26B /
    31B: the server attends them so on the sliding layers only)."""
    for i, r in enumerate(rows):
        if r.dim() != 2 or r.shape[1] != vision.llm_hidden_size:
            raise ValueError(f"image {i}: rows of shape {list(r.shape)}, a Gemma 4 image is "
                             f"[n, {vision.llm_hidden_size}]")
    pieces = prompt_text(text, vision, len(rows)).split(vision.image_token)
    out = seg.Prompt()
    for piece, r in zip(pieces, rows):
        out.append(seg.Text(piece))
        out.append(seg.Span(r, bidirectional=vision.image_block))
    out.append(seg.Text(pieces[-1]))
    return out


class Gemma4Encoder(ImageTextOfSettings):
    """``image -> [rows_for(image.size), llm_hidden]`` rows, as HF's Gemma 4 computes them.

    ``backend``: the image processor's transformers backend, ``"torchvision"`` or ``"pil"``
    (default: what ``AutoImageProcessor.from_pretrained`` picks); ``device``: cuda when available.
    """

    family = FAMILY

    def __init__(self, vision_dir: str | Path, backend: str | None = None,
                 device: str | torch.device | None = None, dtype: str | torch.dtype | None = None):
        self.dtype = vision_dtype(dtype)
        if backend is not None and backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
        text, weights, digest = read_vision_dir(vision_dir)
        self.config = Gemma4Vision.from_json(text)
        self.processor = AutoImageProcessor.from_pretrained(
            vision_dir, **({} if backend is None else {"backend": backend}))
        check_image_processor(self.processor, self.config.vision_config)
        self.backend = "torchvision" if isinstance(self.processor, TorchvisionBackend) else "pil"
        vision = AutoConfig.for_model(**self.config.vision_config)
        self.tower = AutoModel.from_config(vision)
        # HF's own projector, given only the field it reads of the text model (its width)
        text_config = Gemma4TextConfig(hidden_size=self.config.llm_hidden_size)
        self.projector = Gemma4MultimodalEmbedder(vision, text_config)
        self.device = place_vision_half(self.tower, self.projector, weights, f"{vision_dir}: ", device,
                                        self.dtype)
        digest.update(f"{self.backend}\n{self.processor.to_json_string()}".encode())
        note_dtype(digest, self.dtype)
        self.identity = f"{self.family}-{digest.hexdigest()[:16]}"  # for encoder caches

    @property
    def span_width(self) -> int:
        return self.config.llm_hidden_size

    @property
    def image_block(self) -> bool:
        """Whether each image's rows are one bidirectional block (``lang.image_block``)."""
        return self.config.image_block

    @property
    def image_token(self) -> str:
        """Where ``prompt_text`` puts each image's rows (``image_prompt``'s token)."""
        return self.config.image_token

    @property
    def mean_color(self) -> tuple[int, int, int]:
        """The RGB colour the tower maps to zero (its patch embedder takes ``2 * (x - 0.5)`` of
        the processor's [0, 1] pixels): what masked-out pixels become."""
        return (128, 128, 128)

    def rows_for(self, width: int, height: int) -> int:
        """How many rows an image of this size becomes (``Gemma4Processor``'s count)."""
        p, k = self.processor.patch_size, self.processor.pooling_kernel_size
        h, w = get_aspect_ratio_preserving_size(
            height=height, width=width, patch_size=p,
            max_patches=self.processor.max_soft_tokens * k * k, pooling_kernel_size=k)
        return (h // p) * (w // p) // (k * k)

    def pixel_inputs(self, image: Image.Image) -> dict[str, torch.Tensor]:
        """``pixel_values`` ``[1, max_patches, 3 * patch**2]`` and ``image_position_ids``
        ``[1, max_patches, 2]`` (padding patches at -1): what the checkpoint's image processor
        gives for ``image``."""
        if not isinstance(image, Image.Image):
            kind = _not_done_kind(image)
            why = NOT_DONE[kind] if kind else "give a PIL image"
            raise ValueError(f"a Gemma 4 image must be a PIL.Image.Image, got "
                             f"{type(image).__name__}: {why}")
        out = self.processor(images=[image], return_tensors="pt")
        return {"pixel_values": out["pixel_values"], "image_position_ids": out["image_position_ids"]}

    @torch.no_grad()
    def __call__(self, image: Image.Image) -> torch.Tensor:
        inputs = self.pixel_inputs(image)
        hidden = self.tower(pixel_values=inputs["pixel_values"].to(self.device, self.dtype),
                            pixel_position_ids=inputs["image_position_ids"].to(self.device))
        return self.projector(hidden.last_hidden_state).float().cpu()

    def prompt_text(self, text: str, images: int | None = None) -> str:
        """``prompt_text`` with this checkpoint's tokens."""
        return prompt_text(text, self.config, images)

    def prompt_segments(self, rows: Sequence[torch.Tensor], text: str) -> seg.Prompt:
        """``prompt_segments`` with this checkpoint's tokens."""
        return prompt_segments(rows, text, self.config)


def _not_done_kind(value: object) -> str | None:
    """``"video"`` for frames (a list of images, a 4-D array) or a video file's path, ``"audio"``
    for a waveform (a 1-D or 2-D array) or an audio file's path; else None."""
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], Image.Image):
        return "video"
    ndim = getattr(value, "ndim", None)
    if ndim == 4:
        return "video"
    if ndim in (1, 2):
        return "audio"
    suffix = Path(value).suffix.lower() if isinstance(value, (str, Path)) else ""
    if suffix in (".mp4", ".mov", ".avi", ".mkv", ".webm"):
        return "video"
    if suffix in (".wav", ".mp3", ".flac", ".ogg", ".m4a"):
        return "audio"
    return None
