"""The vision half of a PaliGemma checkpoint (PaliGemma 1 and 2) and its prompt rule.

``PaliGemmaEncoder(DST/vision)`` (also ``load_encoder``): an image's rows as transformers 5.19's
``get_image_features(...).pooler_output`` (SigLIP's image processor and tower, the last hidden
state, one linear layer; not divided by sqrt(hidden)). The prompt as ``PaliGemmaProcessor`` lays it
out: image rows first, then bos, the text, a newline (``prompt_text``, ``prompt_segments``), the bos
written out since the span comes first; the LLM attends it as one block (docs/vision-encoders.md).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Sequence

import torch
from transformers import AutoConfig, AutoProcessor
from transformers.models.siglip.image_processing_pil_siglip import SiglipImageProcessorPil
from transformers.models.siglip.image_processing_siglip import SiglipImageProcessor

from sgl_embeds.vlm.files import PALIGEMMA_FORMAT as FORMAT
from sgl_embeds.vlm.square import SquareImageEncoder
from sgl_embeds_protocol import segments as seg

FAMILY = "paligemma"
TOWER = "siglip_vision_model"  # the only tower type a PaliGemma checkpoint has
IMAGE_PROCESSORS = (SiglipImageProcessor, SiglipImageProcessorPil)  # torchvision, PIL backends
PROJECTOR_KEYS = ("linear.bias", "linear.weight")  # multi_modal_projector.*
# What PaliGemmaConfig writes into its text_config that a plain Gemma / Gemma2 LLM must not carry:
# use_bidirectional_attention=True would make transformers' GemmaForCausalLM attend bidirectionally
# where no mask is given; num_image_tokens is the processor's business
PREFIX_LM_FIELDS = ("use_bidirectional_attention", "num_image_tokens")


@dataclass(frozen=True)
class PaliGemmaVision:
    """Everything ``PaliGemmaEncoder`` needs but the weights and the image processor's settings
    (``sgl_embeds_vision.json``)."""

    vision_config: dict  # the SigLIP tower's config, as transformers saves it
    llm_hidden_size: int  # the projector's output width: the rows' width
    image_token: str
    image_token_id: int
    bos_token: str  # written after the image rows (``prompt_text``)
    rows_per_image: int  # (image_size / patch_size)^2: the processor's image_seq_length

    def __post_init__(self) -> None:
        tower = self.vision_config.get("model_type")
        if tower != TOWER:
            raise ValueError(f"vision_config.model_type is {tower!r}: a PaliGemma checkpoint's "
                             f"tower is {TOWER!r}")
        grid = self.vision_config["image_size"] // self.vision_config["patch_size"]
        if self.rows_per_image != grid * grid:
            raise ValueError(f"image_seq_length {self.rows_per_image} differs from the tower's "
                             f"(image_size / patch_size)^2 = {grid * grid}")

    def to_json(self) -> str:
        return json.dumps({"format": FORMAT, **asdict(self)}, indent=2)

    @classmethod
    def from_json(cls, text: str) -> PaliGemmaVision:
        d = json.loads(text)
        if d.pop("format", None) != FORMAT:
            raise ValueError(f"not an sgl_embeds PaliGemma vision config (expected format "
                             f"{FORMAT!r})")
        return cls(**d)


def check_image_processor(processor: object, image_size: int) -> None:
    """SigLIP's image processor (either backend), resizing to ``image_size`` square: the pixels
    the tower takes whatever the image's size."""
    if not isinstance(processor, IMAGE_PROCESSORS):
        names = [c.__name__ for c in IMAGE_PROCESSORS]
        raise ValueError(f"the image processor is a {type(processor).__name__}: a PaliGemma "
                         f"checkpoint needs one of {names}")
    size = dict(processor.size)
    if not processor.do_resize or size != {"height": image_size, "width": image_size}:
        raise ValueError(f"the image processor resizes to {size} (do_resize="
                         f"{processor.do_resize}): the tower takes {image_size}x{image_size}")


def checkpoint_settings(src: Path, config, projector_keys: dict[str, str]) -> tuple[PaliGemmaVision, object]:
    """The settings of the PaliGemma checkpoint ``src`` (``config``: its ``AutoConfig``;
    ``projector_keys``: its ``multi_modal_projector.*`` names) and its image processor, checked
    against each other (``split`` saves both to ``DST/vision``)."""
    unknown = sorted(set(projector_keys) - set(PROJECTOR_KEYS))
    missing = sorted(set(PROJECTOR_KEYS) - set(projector_keys))
    if unknown or missing:
        raise ValueError(f"unknown projector: multi_modal_projector keys {sorted(projector_keys)} "
                         f"(unexpected {unknown}, missing {missing}); PaliGemma's is one linear "
                         "layer with a bias")
    text, vision = config.text_config, config.vision_config
    if vision.model_type != TOWER:
        raise ValueError(f"vision_config.model_type is {vision.model_type!r}: a PaliGemma "
                         f"checkpoint's tower is {TOWER!r}")
    if vision.projection_dim != text.hidden_size:
        raise ValueError(f"vision_config.projection_dim {vision.projection_dim} differs from "
                         f"text_config.hidden_size {text.hidden_size}")
    processor = AutoProcessor.from_pretrained(src)
    check_image_processor(processor.image_processor, vision.image_size)
    settings = PaliGemmaVision(
        vision_config=vision.to_dict(), llm_hidden_size=text.hidden_size,
        image_token=processor.image_token, image_token_id=config.image_token_id,
        bos_token=processor.tokenizer.bos_token, rows_per_image=processor.image_seq_length)
    pairs = [("image_token_id", processor.image_token_id, settings.image_token_id),
             ("image_seq_length", processor.image_seq_length,
              getattr(text, "num_image_tokens", processor.image_seq_length))]
    for name, theirs, ours in pairs:
        if theirs != ours:
            raise ValueError(f"the processor's {name} {theirs!r} differs from the model config's "
                             f"{ours!r}")
    return settings, processor.image_processor


def llm_config(text_config):
    """``text_config`` as a plain Gemma / Gemma2 causal LM's config that computes what HF's
    ``PaliGemmaForConditionalGeneration`` computes: ``PREFIX_LM_FIELDS`` dropped, and a Gemma2's
    ``final_logit_softcapping`` off (transformers 5.19's PaliGemma applies ``lm_head`` alone;
    Gemma2ForCausalLM, HF's and SGLang's, would cap the logits), its activation under both names
    SGLang reads. Its embeddings must be tied
    (SGLang's gemma.py and gemma2.py always tie ``lm_head`` to ``embed_tokens``)."""
    if not text_config.tie_word_embeddings:
        raise ValueError("text_config.tie_word_embeddings is False: SGLang's Gemma models tie "
                         "lm_head to embed_tokens, so an untied lm_head would be ignored")
    fields = {k: v for k, v in text_config.to_dict().items() if k not in PREFIX_LM_FIELDS}
    if "final_logit_softcapping" in fields:
        fields["final_logit_softcapping"] = None
    if "hidden_activation" in fields and "hidden_act" not in fields:
        # SGLang's gemma2.py reads both names (as the hub's Gemma 2 configs write them); the
        # Gemma2Config of transformers 5 has only hidden_activation
        fields["hidden_act"] = fields["hidden_activation"]
    return AutoConfig.for_model(**fields)


def prompt_text(prompt: str, bos_token: str, images: int = 1, image_token: str = "<image>") -> str:
    """The text ``PaliGemmaProcessor`` builds for ``prompt`` before it expands each image token:
    ``image_token`` x ``images``, ``bos_token``, ``prompt``, a newline; a ``prompt`` that holds
    image tokens keeps them and gets the bos after the last one. For ``image_prompt``."""
    if image_token not in prompt:
        return f"{image_token * images}{bos_token}{prompt}\n"
    if prompt.count(image_token) != images:
        raise ValueError(f"the prompt has {prompt.count(image_token)} {image_token!r} tokens but "
                         f"{images} images were given")
    end = prompt.rfind(image_token) + len(image_token)
    return f"{prompt[:end]}{bos_token}{prompt[end:]}\n"


def prompt_segments(rows: Sequence[torch.Tensor], prompt: str, bos_token: str) -> seg.Prompt:
    """The segments of a PaliGemma prompt: each image's rows, then ``bos_token`` + ``prompt`` +
    a newline as one text segment (for ``encode_prompt``, ``/generate`` or the Engine)."""
    if not rows:
        raise ValueError("a PaliGemma prompt needs at least one image's rows")
    out = seg.Prompt()
    for r in rows:
        out.append(seg.Span(r))
    out.append(seg.Text(f"{bos_token}{prompt}\n"))
    return out


class PaliGemmaEncoder(SquareImageEncoder):
    """The vision half of a split PaliGemma checkpoint (module docstring; the constructor's
    arguments: ``square.SquareImageEncoder``)."""

    family = FAMILY
    settings = PaliGemmaVision
    check_processor = staticmethod(check_image_processor)

    def make_projector(self, vision) -> torch.nn.Module:
        return _Projector(vision.hidden_size, self.config.llm_hidden_size)

    @property
    def bos_token(self) -> str:
        return self.config.bos_token

    def prompt_text(self, prompt: str, images: int = 1) -> str:
        """``prompt_text`` with this checkpoint's bos and image tokens."""
        return prompt_text(prompt, self.bos_token, images, self.image_token)


class _Projector(torch.nn.Module):
    """PaliGemma's ``multi_modal_projector``: one linear layer, HF's weight names."""

    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.linear = torch.nn.Linear(width, hidden, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear(x)
