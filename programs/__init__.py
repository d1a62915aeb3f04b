"""Ready ``@sgl.function`` programs for VLM developers, built on ``sgl.embeds`` / ``sgl.region``.

Each takes images (with a backend that has a ``vision_encoder``) or precomputed embeddings
(``[n, hidden]`` tensors from your vision tower + projector), and writes each image as the served
model's chat template does (``sgl_embeds.image_part``). Run them with
``program.run(..., backend=sgl_embeds.connect(url))``: ``connect`` gives the endpoint the model's
vision half and chat template, so the prompt is the one HF's processor writes. ``detect`` and
``segment`` are PaliGemma's own tasks, written in its prompt format (no chat turns); ``florence2``
holds Florence-2's tasks (``run_task``, ``detect_objects`` ...), on ``backend.run``.
"""

from programs.attributes import extract_attributes
from programs.classify import classify
from programs.compare import compare_images
from programs.detect import Detection, detect, parse_detections, run_detect
from programs.florence2 import TaskAnswer, describe_region, detect_objects, ground_phrases, read_text_with_regions, run_task
from programs.grounded_chat import grounded_chat
from programs.region_caption import caption_regions
from programs.segment import Segmentation, parse_segmentations, run_segment, segment
from programs.vqa import visual_qa

__all__ = ["visual_qa", "compare_images", "caption_regions", "grounded_chat", "extract_attributes",
           "classify", "detect", "run_detect", "parse_detections", "Detection", "segment",
           "run_segment", "parse_segmentations", "Segmentation", "run_task", "TaskAnswer", "detect_objects",
           "read_text_with_regions", "describe_region", "ground_phrases"]
