"""``connect(url, vision=...)``: an ``EmbedsEndpoint`` whose vision half fits the served model.

It reads what the server serves (``/sgl_embeds/info``'s ``"model"``), loads that vision half or
takes the one given, and refuses before any request one whose rows the server would refuse or
misread (``fit_error``: family, span width, grid). The endpoint's chat template is the model's own
(``vlm.model_chat_template``; docs/vision-encoders.md, "Chat turns instead of a rendered text").
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

from PIL import Image

from sgl_embeds.backend import EmbedsEndpoint
from sgl_embeds.vision import encode_region
from sgl_embeds.vlm import load_encoder
from sgl_embeds.vlm.prompt import model_chat_template
from sgl_embeds_protocol.family import ENCODER_DECODER, family_of
from sgl_embeds_protocol.info import ServedModel

# A small grey image: what an encoder that does not state its fit is run on once, to see it
PROBE_IMAGE_SIZE = (64, 64)


def connect(url: str, vision: str | Path | Any | None = None, **endpoint_options: Any) -> EmbedsEndpoint:
    """An ``EmbedsEndpoint`` for ``url`` with the vision encoder of the served family: ``vision``
    None loads the server's own vision half (``load_encoder`` of the folder the server names;
    none for a text LLM); a folder is loaded with ``load_encoder``; anything else is taken as a
    ``VisionEncoder``. ``ValueError`` when it does not fit the server. ``endpoint_options`` go to
    ``EmbedsEndpoint`` (``device`` picks where the encoder runs, ``dtype`` what it computes in:
    ``load_encoder``'s). With a folder (or None), the
    endpoint's chat template is the model's own, read from that folder; with a ``VisionEncoder``
    object, SGLang's (``chat_template_name``)."""
    device, dtype = endpoint_options.pop("device", None), endpoint_options.pop("dtype", None)
    backend = EmbedsEndpoint(url, **endpoint_options)
    served = backend.server_info.model
    if vision is None:
        vision = _served_vision_dir(url, served)
    folder = vision if isinstance(vision, (str, Path)) else None
    if folder is not None:
        vision = load_encoder(folder, device=device, dtype=dtype)
    elif dtype is not None and vision is not None:
        raise ValueError("dtype is what a vision half connect loads computes in; the encoder given "
                         "computes in its own")
    if vision is not None:
        problem = fit_error(vision, served, backend.span_width)
        if problem:
            raise ValueError(f"the vision encoder does not fit the model at {url}: {problem}")
    backend.vision_encoder = vision
    if folder is not None and "chat_template_name" not in endpoint_options and _has_chat(served):
        try:
            backend.chat_template = model_chat_template(folder, vision.image_token,
                                                        getattr(vision, "image_text", None),
                                                        getattr(vision, "bos_token", None))
        except (FileNotFoundError, ValueError) as e:  # the prompt can still be rendered by hand
            warnings.warn(f"{e}; sgl.user / sgl.assistant keep SGLang's chat template "
                          f"{backend.chat_template.name!r}", stacklevel=2)
    return backend


def _has_chat(served: ServedModel) -> bool:
    """Whether the served family is prompted by chat turns: a prefix LM (PaliGemma) and an
    encoder-decoder (Florence-2) have no chat template, their processors lay the prompt out
    (``vlm.paligemma.prompt_text``, ``vlm.florence2.Florence2Encoder.prompt_segments``)."""
    family = family_of(served.family)
    return family is None or not (family.prefix_lm or family.served_as == ENCODER_DECODER)


def _served_vision_dir(url: str, served: ServedModel) -> str | None:
    """The folder of the served model's vision half here: the one the server names, or where it
    names a hub id (a server launched with ``--model-path org/name``), its snapshot in the local
    Hugging Face cache."""
    path = served.vision_dir
    if path is None or Path(path).is_dir():
        return path
    from sgl_embeds.serve import ServeError, checkpoint_folder  # (the CLI's imports: only here)

    try:
        found = checkpoint_folder(path, download=False)
    except ServeError:
        found = None
    if found is not None and found.is_dir():
        return str(found)
    raise ValueError(f"{url} serves {_describe(served)} whose vision half is at {path} on the "
                     "server's machine, not here (nor in the local Hugging Face cache): pass "
                     "vision=<a copy of that folder>")


def fit_error(encoder: Any, served: ServedModel, span_width: int) -> str | None:
    """Why ``encoder``'s rows do not fit the served model (see the module docstring), naming what
    would fit; None when they do. An encoder that does not state its ``family`` and
    ``span_width`` (ours do) is run once on a small image to read its width and grid."""
    family = getattr(encoder, "family", None)
    width = getattr(encoder, "span_width", None)
    if width is None:
        rows = encode_region(Image.new("RGB", PROBE_IMAGE_SIZE, (128, 128, 128)), None, encoder)
        width, grid = rows.rows.shape[1], rows.grid is not None
    else:
        grid = getattr(encoder, "merge_size", None) is not None
    fits = _what_fits(served, span_width)
    if family is not None and served.family is not None and family != served.family:
        return f"it is the vision half of a {family} model, the server serves {_describe(served)}; {fits}"
    if width != span_width:
        return f"its rows are [n, {width}], the server's spans are [n, {span_width}]; {fits}"
    if grid != served.grid:
        have = "carry an image grid (image_grid_thw)" if grid else "carry no image grid"
        want = "needs one (M-RoPE)" if served.grid else "takes none"
        return f"its rows {have}, the server {want}; {fits}"
    merge = getattr(encoder, "merge_size", None)
    if served.grid and merge is not None and merge != served.merge_size:
        return f"its merge size is {merge}, the server's {served.merge_size}; {fits}"
    return None


def _describe(served: ServedModel) -> str:
    if served.family is None:
        return "a text LLM"
    return f"a {served.family} model ({served.served_as})"


def _what_fits(served: ServedModel, span_width: int) -> str:
    if served.vision_dir is None:
        return (f"what fits: an encoder of [n, {span_width}] rows without a grid, e.g. "
                "OpenClipEncoder with the LLM's projector")
    return (f"what fits: connect(url) (the server's own vision half), or "
            f"vision={served.vision_dir!r}")
