"""The vision half of a Gemma 3 checkpoint and its prompt rule.

``Gemma3Encoder(DST/vision)`` (also ``load_encoder``): an image's rows as transformers 5.19's
``get_image_features(...).pooler_output`` (SigLIP tower, average pooling to
``mm_tokens_per_image`` rows, RMS norm, projection; not scaled). The prompt as ``Gemma3Processor``
expands it: each ``<start_of_image>`` becomes ``"\\n\\n<start_of_image>"``, the rows as one
bidirectional span, ``"<end_of_image>\\n\\n"`` (docs/vision-encoders.md, section 8).
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import torch
from transformers import AutoConfig, AutoProcessor, Gemma3Config
from transformers.models.gemma3.image_processing_gemma3 import Gemma3ImageProcessor
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil
from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

from sgl_embeds.vlm.files import GEMMA3_FORMAT as FORMAT
from sgl_embeds.vlm.square import SquareImageEncoder
from sgl_embeds.vlm.tower import ImageTextOfSettings
from sgl_embeds_protocol import segments as seg
from sgl_embeds_protocol.family import ImageText

FAMILY = "gemma3"
TOWER = "siglip_vision_model"  # the only tower type a Gemma 3 checkpoint has
IMAGE_PROCESSORS = (Gemma3ImageProcessor, Gemma3ImageProcessorPil)  # torchvision, PIL backends
PROJECTOR_KEYS = ("mm_input_projection_weight", "mm_soft_emb_norm.weight")  # multi_modal_projector.*


@dataclass(frozen=True)
class Gemma3Vision:
    """Everything ``Gemma3Encoder`` needs but the weights and the image processor's settings
    (``sgl_embeds_vision.json``)."""

    vision_config: dict  # the SigLIP tower's config, as transformers saves it
    llm_hidden_size: int  # the projector's output width: the rows' width
    rows_per_image: int  # mm_tokens_per_image: the pooled rows, a square number
    bos_token: str  # the server writes it (the first text's special token): not in the text
    boi_token: str  # <start_of_image>: where a prompt puts an image, and the text before its rows
    image_token: str  # <image_soft_token>: the processor's placeholder of one row
    image_token_id: int
    eoi_token: str  # <end_of_image>: the text after an image's rows

    def __post_init__(self) -> None:
        tower = self.vision_config.get("model_type")
        if tower != TOWER:
            raise ValueError(f"vision_config.model_type is {tower!r}: a Gemma 3 checkpoint's "
                             f"tower is {TOWER!r}")
        patches = self.vision_config["image_size"] // self.vision_config["patch_size"]
        side = math.isqrt(self.rows_per_image)
        if side * side != self.rows_per_image or side == 0 or patches % side:
            raise ValueError(f"mm_tokens_per_image {self.rows_per_image} is not a square whose "
                             f"side divides the tower's {patches} patches a side")

    @property
    def image_text(self) -> ImageText:
        """How ``Gemma3Processor`` writes an image: each ``<start_of_image>`` becomes
        ``"\\n\\n<start_of_image>"``, the image's rows, ``"<end_of_image>\\n\\n"``."""
        return ImageText(self.boi_token, f"\n\n{self.boi_token}", f"{self.eoi_token}\n\n")

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, **asdict(self)}, indent=2)

    @classmethod
    def from_json(cls, text: str) -> Gemma3Vision:
        d = json.loads(text)
        if d.pop("format", None) != FORMAT:
            raise ValueError(f"not an sgl_embeds Gemma 3 vision config (expected format {FORMAT!r})")
        return cls(**d)


def check_image_processor(processor: object, image_size: int) -> None:
    """Gemma 3's image processor (either backend), resizing to ``image_size`` square, without
    pan-and-scan crops (each crop would be another image in the prompt)."""
    if not isinstance(processor, IMAGE_PROCESSORS):
        names = [c.__name__ for c in IMAGE_PROCESSORS]
        raise ValueError(f"the image processor is a {type(processor).__name__}: a Gemma 3 "
                         f"checkpoint needs one of {names}")
    size = {k: v for k, v in dict(processor.size).items() if v is not None}
    if not processor.do_resize or size != {"height": image_size, "width": image_size}:
        raise ValueError(f"the image processor resizes to {size} (do_resize="
                         f"{processor.do_resize}): the tower takes {image_size}x{image_size}")
    if processor.do_pan_and_scan:
        raise ValueError("the image processor has do_pan_and_scan=True: pan-and-scan crops are "
                         "not supported; set it to false in preprocessor_config.json")


def checkpoint_settings(src: Path, config, projector_keys: dict[str, str]) -> tuple[Gemma3Vision, object]:
    """The settings of the Gemma 3 checkpoint ``src`` (``config``: its ``AutoConfig``;
    ``projector_keys``: its ``multi_modal_projector.*`` names) and its image processor, checked
    against each other (``split`` saves both to ``DST/vision``)."""
    unknown = sorted(set(projector_keys) - set(PROJECTOR_KEYS))
    missing = sorted(set(PROJECTOR_KEYS) - set(projector_keys))
    if unknown or missing:
        raise ValueError(f"unknown projector: multi_modal_projector keys {sorted(projector_keys)} "
                         f"(unexpected {unknown}, missing {missing}); Gemma 3's is "
                         f"{list(PROJECTOR_KEYS)}")
    vision = config.vision_config
    if vision.model_type != TOWER:
        raise ValueError(f"vision_config.model_type is {vision.model_type!r}: a Gemma 3 "
                         f"checkpoint's tower is {TOWER!r}")
    processor = AutoProcessor.from_pretrained(src)
    check_image_processor(processor.image_processor, vision.image_size)
    tok = processor.tokenizer
    settings = Gemma3Vision(
        vision_config=vision.to_dict(), llm_hidden_size=config.text_config.hidden_size,
        rows_per_image=config.mm_tokens_per_image, bos_token=tok.bos_token,
        boi_token=tok.boi_token, image_token=tok.image_token, image_token_id=config.image_token_id,
        eoi_token=tok.eoi_token)
    pairs = [("image_seq_length", processor.image_seq_length, config.mm_tokens_per_image),
             ("image_token_id", tok.image_token_id, config.image_token_id),
             ("boi_token_id", tok.boi_token_id, config.boi_token_id),
             ("eoi_token_id", tok.convert_tokens_to_ids(tok.eoi_token), config.eoi_token_id)]
    for name, theirs, ours in pairs:
        if theirs != ours:
            raise ValueError(f"the processor's {name} {theirs!r} differs from the model config's "
                             f"{ours!r}")
    return settings, processor.image_processor


def llm_config(text_config):
    """``text_config`` (a ``Gemma3TextConfig``) as a ``Gemma3ForCausalLM``'s config that computes
    what HF's ``Gemma3ForConditionalGeneration`` computes: ``final_logit_softcapping`` off
    (transformers 5.19's VLM applies ``lm_head`` alone; HF's and SGLang's causal LM would cap).
    Refused: untied embeddings and attention soft-capping (SGLang's gemma3_causal.py always ties
    ``lm_head`` and never caps), and ``use_bidirectional_attention`` (EmbeddingGemma's: the whole
    prompt one block, and a halved sliding window)."""
    if not text_config.tie_word_embeddings:
        raise ValueError("text_config.tie_word_embeddings is False: SGLang's Gemma3ForCausalLM ties "
                         "lm_head to embed_tokens, so an untied lm_head would be ignored")
    if text_config.attn_logit_softcapping is not None:
        raise ValueError(f"text_config.attn_logit_softcapping is "
                         f"{text_config.attn_logit_softcapping}: SGLang's Gemma3ForCausalLM does "
                         "not cap attention logits")
    if text_config.use_bidirectional_attention:
        raise ValueError("text_config.use_bidirectional_attention is True: that is EmbeddingGemma's "
                         "attention, not a Gemma 3 VLM's")
    fields = text_config.to_dict()
    fields["final_logit_softcapping"] = None
    return AutoConfig.for_model(**fields)


def prompt_text(text: str, vision: Gemma3Vision, images: int | None = None) -> str:
    """``text`` (a rendered chat, or any text with a ``<start_of_image>`` where each image goes)
    as ``Gemma3Processor`` expands it, with one ``image_token`` where each image's rows go: for
    ``image_prompt(..., vision.image_token)``. A leading bos is dropped: the server writes it (the
    first text segment is tokenized with the tokenizer's special tokens), as HF's chat template
    path tokenizes a rendered chat without them. ``images``: the count the text must hold."""
    found = text.count(vision.boi_token)
    if images is not None and found != images:
        raise ValueError(f"the prompt has {found} {vision.boi_token!r} tokens but {images} images "
                         "were given")
    if vision.image_token in text or vision.eoi_token in text:
        raise ValueError(f"the prompt already holds {vision.image_token!r} or "
                         f"{vision.eoi_token!r}: write each image as one {vision.boi_token!r}")
    return vision.image_text.expand(text.removeprefix(vision.bos_token), vision.image_token)


def prompt_segments(rows: Sequence[torch.Tensor], text: str, vision: Gemma3Vision) -> seg.Prompt:
    """The segments of a Gemma 3 prompt (for ``encode_prompt``, ``/generate`` or the Engine): the
    text of ``prompt_text`` with each image's rows, in order, as a bidirectional span between
    ``"...\\n\\n<start_of_image>"`` and ``"<end_of_image>\\n\\n..."``."""
    pieces = prompt_text(text, vision, len(rows)).split(vision.image_token)
    for i, r in enumerate(rows):
        if r.dim() != 2 or r.shape[0] != vision.rows_per_image:
            raise ValueError(f"image {i}: rows of shape {list(r.shape)}, a Gemma 3 image is "
                             f"[{vision.rows_per_image}, {vision.llm_hidden_size}]")
    out = seg.Prompt()
    for piece, r in zip(pieces, rows):
        out.append(seg.Text(piece))
        out.append(seg.Span(r, bidirectional=True))
    out.append(seg.Text(pieces[-1]))
    return out


class Gemma3Encoder(SquareImageEncoder, ImageTextOfSettings):
    """The vision half of a split Gemma 3 checkpoint (module docstring; the constructor's
    arguments: ``square.SquareImageEncoder``)."""

    family = FAMILY
    settings = Gemma3Vision
    check_processor = staticmethod(check_image_processor)

    def make_projector(self, vision) -> torch.nn.Module:
        """HF's own projector module, given only the fields it reads (the text model's width)."""
        model_config = Gemma3Config(
            vision_config=self.config.vision_config, mm_tokens_per_image=self.config.rows_per_image,
            text_config={"hidden_size": self.config.llm_hidden_size, "num_attention_heads": 1})
        return Gemma3MultiModalProjector(model_config)

    def prompt_text(self, text: str, images: int | None = None) -> str:
        """``prompt_text`` with this checkpoint's tokens."""
        return prompt_text(text, self.config, images)

    def prompt_segments(self, rows: Sequence[torch.Tensor], text: str) -> seg.Prompt:
        """``prompt_segments`` with this checkpoint's tokens."""
        return prompt_segments(rows, text, self.config)
