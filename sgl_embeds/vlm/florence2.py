"""The vision half of a Florence-2 checkpoint (served whole: its BART by the plugin), its task
prompts and its answers' parsing. ``Florence2Encoder(checkpoint)`` (also ``load_encoder``): an
image's rows as transformers 5.19's ``get_image_features(...).pooler_output`` (DaViT tower and
projector); a prompt is the rows, then ``<s>`` + the task's prompt + ``</s>`` (``prompt_segments``),
the task's prompt and the answer's parsing the checkpoint's processor's (``task_prompt``,
``parse_answer``; ask with ``skip_special_tokens=False``). docs/vision-encoders.md.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Sequence

import torch
from PIL import Image
from safetensors import safe_open
from transformers import AutoConfig, AutoProcessor
from transformers.models.florence2.modeling_florence2 import Florence2MultiModalProjector, Florence2VisionBackbone

from sgl_embeds.vision import note_dtype, to_pixel_box, vision_dtype
from sgl_embeds.vlm.tower import place_vision_half
from sgl_embeds_protocol import segments as seg

FAMILY = "florence2"
# the weights of the vision half, as transformers 5 (and the florence-community checkpoints) name them
TOWER_PREFIX, PROJECTOR_PREFIX = "model.vision_tower.", "model.multi_modal_projector."


class Florence2Encoder:
    """``image -> [rows, d_model]`` rows of a Florence-2 checkpoint (module docstring).
    ``device``: cuda when available; ``dtype``: what the tower computes in (rows come back float32)."""

    family = FAMILY

    def __init__(self, checkpoint: str | Path, device: str | torch.device | None = None,
                 dtype: str | torch.dtype | None = None):
        checkpoint = Path(checkpoint)
        self.dtype = vision_dtype(dtype)
        self.config = AutoConfig.from_pretrained(checkpoint)
        if self.config.model_type != FAMILY:
            raise ValueError(f"{checkpoint} is a {self.config.model_type!r} checkpoint, not Florence-2's")
        self.processor = AutoProcessor.from_pretrained(checkpoint)
        weights, digest = _vision_weights(checkpoint)
        self.tower = Florence2VisionBackbone(self.config.vision_config)
        self.projector = Florence2MultiModalProjector(self.config)
        self.device = place_vision_half(self.tower, self.projector, weights, f"{checkpoint}: ", device, self.dtype)
        digest.update(self.processor.image_processor.to_json_string().encode())
        note_dtype(digest, self.dtype)
        self.identity = f"{FAMILY}-{digest.hexdigest()[:16]}"  # for encoder caches

    @property
    def span_width(self) -> int:
        return self.config.text_config.d_model

    @property
    def rows_per_image(self) -> int:
        return self.processor.num_image_tokens

    def rows_for(self, width: int, height: int) -> int:
        """How many rows an image of this size becomes: ``rows_per_image``, whatever its size."""
        return self.rows_per_image

    @property
    def mean_color(self) -> tuple[int, int, int]:
        """The RGB colour that normalizes to (nearly) zero: what masked-out pixels become."""
        return tuple(int(round(m * 255)) for m in self.processor.image_processor.image_mean)

    def pixel_values(self, image: Image.Image) -> torch.Tensor:
        (pixels,) = self.processor.image_processor(images=[image], return_tensors="pt")["pixel_values"]
        return pixels

    @torch.no_grad()
    def features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """``[batch, rows, d_model]`` rows of ``[batch, 3, size, size]`` pixels."""
        out = self.tower(pixel_values.to(self.device, self.dtype))
        return self.projector(out.last_hidden_state)

    def __call__(self, image: Image.Image) -> torch.Tensor:
        return self.features(self.pixel_values(image).unsqueeze(0))[0].float().cpu()

    # -- prompts and answers

    def task_prompt(self, task: str, text_input: str | None = None) -> str:
        """The prompt the checkpoint's processor makes of ``task`` (``"<OD>"``, ``"<CAPTION>"``;
        a task that reads an input takes ``text_input``: a phrase, or a region as ``loc_box``)."""
        without, with_input = self.processor.task_prompts_without_inputs, self.processor.task_prompts_with_input
        if task in without:
            if text_input:
                raise ValueError(f"{task} takes no input, got {text_input!r}")
            return without[task]
        if task in with_input:
            if not text_input:
                raise ValueError(f"{task} reads an input (a phrase or a region's <loc_N> tokens)")
            return with_input[task].format(input=text_input)
        raise ValueError(f"unknown Florence-2 task {task!r}: one of {sorted([*without, *with_input])}")

    def prompt_segments(self, rows: torch.Tensor, task: str, text_input: str | None = None) -> seg.Prompt:
        """The image's rows, then ``<s>`` + the task's prompt + ``</s>`` (the encoder's input)."""
        tokenizer = self.processor.tokenizer
        text = f"{tokenizer.bos_token}{self.task_prompt(task, text_input)}{tokenizer.eos_token}"
        prompt = seg.Prompt()
        prompt.append(seg.Span(rows))
        prompt.append(seg.Text(text))
        return prompt

    def parse_answer(self, text: str, task: str, image_size: tuple[int, int]) -> dict[str, Any]:
        """The checkpoint's post-processor on a decoded answer (with its special tokens):
        ``{task: ...}``, boxes in the pixels of an image of ``image_size`` (width, height)."""
        return self.processor.post_process_generation(text=text, task=task, image_size=image_size)

    def region_input(self, box: Sequence[float], width: int, height: int) -> str:
        """A region of a ``width`` x ``height`` image as a task's input (``<REGION_TO_DESCRIPTION>``):
        four ``<loc_N>`` tokens, the box quantized as the checkpoint's post-processor quantizes."""
        pixels = torch.tensor([to_pixel_box(box, width, height)], dtype=torch.float32)
        bins = self.processor.post_processor.quantize(pixels, (width, height))[0].tolist()
        return "".join(f"<loc_{b}>" for b in bins)


def _vision_weights(checkpoint: Path) -> tuple[dict[str, torch.Tensor], "hashlib._Hash"]:
    """The tower's and projector's weights (as ``tower.*`` and ``projector.*``) of the
    checkpoint's safetensors files, and a digest of them for the encoder's identity."""
    files = sorted(checkpoint.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{checkpoint} has no .safetensors weights")
    weights, digest = {}, hashlib.sha256()
    for file in files:
        with safe_open(str(file), "pt") as f:
            for key in sorted(f.keys()):
                for prefix, ours in ((TOWER_PREFIX, "tower."), (PROJECTOR_PREFIX, "projector.")):
                    if key.startswith(prefix):
                        tensor = f.get_tensor(key)
                        weights[ours + key[len(prefix):]] = tensor
                        digest.update(key.encode())
                        digest.update(tensor.contiguous().view(torch.uint8).numpy().tobytes())
    if not any(k.startswith("tower.") for k in weights):
        raise ValueError(f"{checkpoint} has no {TOWER_PREFIX}* weights: a Florence-2 checkpoint in "
                         "transformers' layout (florence-community/*) is needed, not the remote-code one")
    return weights, digest
