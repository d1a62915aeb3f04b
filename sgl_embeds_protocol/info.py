"""The plugin's info message (``GET /sgl_embeds/info``, and ``"sgl_embeds"`` in SGLang's
``/get_model_info``): typed records that the server writes (``http.own_routes.info``) and the
client reads (``EmbedsEndpoint.server_info``). Shared: it imports neither side.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

TEXT = "text"  # ServedModel.served_as of a text LLM (the families' ways: family.SPLIT, NATIVE, ...)


@dataclass(frozen=True)
class VisionInfo:
    """A natively served M-RoPE VLM: what a client needs to send its grid spans."""

    mrope: bool
    model_type: str
    served: bool  # False: a family refused by name (family.Family.refused)
    merge_size: int
    image_token_id: int
    video_token_id: int
    vision_start_token_id: int
    vision_end_token_id: int
    deepstack_layers: int
    span_width: int
    video_time: str | None  # the time a clip carries (family.Family.clip_time)
    largest_image_rows: int  # of the largest image the server's processor makes (0: it does not say)


@dataclass(frozen=True)
class ServedModel:
    """The served model's family and where its vision half lies (``sgl_embeds.connect``)."""

    family: str | None  # None: a text LLM
    served_as: str  # family.SPLIT, family.NATIVE, family.ENCODER_DECODER or TEXT
    vision_dir: str | None  # absolute, on the server's machine
    grid: bool  # an image's span carries image_grid_thw
    merge_size: int | None
    vision_tokens: dict[str, str | None]  # "image", and on Qwen-VL "start" / "end"


@dataclass(frozen=True)
class ServerInfo:
    """What a client needs to check spans before sending them."""

    hidden_size: int
    dtype: str
    vocab_size: int
    context_len: int
    max_span_bytes: int
    wire_dtypes: list[str]
    binary_body: str  # the content type of a binary body (binary_body.CONTENT_TYPE)
    key_scheme: str  # handles are content keys of this scheme (keys.KEY_SCHEME)
    sglang_version: str
    sgl_embeds_version: str
    span_store: dict[str, int]  # this HTTP process's (one per tokenizer worker)
    rows_to_scheduler: dict[str, Any] | None  # held spans' rows cross once (transport.stats)
    http_worker_pid: int
    vision: VisionInfo | None  # a natively served M-RoPE VLM; None otherwise
    span_width: int  # a span's row width: hidden_size, with deepstack rows on Qwen3-VL
    model: ServedModel

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, message: Any) -> ServerInfo:
        """The message as a server sent it; ``ValueError`` naming what a server of another
        sgl_embeds version left out (fields it added are ignored)."""
        info = _record(cls, message, "the server's info")
        vision = info["vision"] and VisionInfo(**_record(VisionInfo, info["vision"], "its vision"))
        model = ServedModel(**_record(ServedModel, info["model"], "its model"))
        return cls(**{**info, "vision": vision, "model": model})


def _record(cls: type, message: Any, what: str) -> dict:
    names = [f.name for f in fields(cls)]
    if not isinstance(message, dict):
        raise ValueError(f"{what} is not a JSON object")
    missing = [name for name in names if name not in message]
    if missing:
        raise ValueError(f"{what} lacks {', '.join(missing)}: the server runs another version of "
                         "sgl_embeds than this client; install the same on both")
    return {name: message[name] for name in names}
