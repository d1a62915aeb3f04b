"""Florence-2's language model served by SGLang: a BART encoder-decoder whose encoder reads a span
prompt (the image's rows from the client's tower and projector, then the task prompt's ids) and
whose decoder generates with cross-attention, on SGLang's encoder-decoder path. The encoder prompt
comes as one multimodal item (``encoder_prompts.py``), its pad sentinels in front of the decoder
prompt; the cross layers write the encoder's keys and values once. KV pool layers: decoder self-
attention ``0 .. D-1``, cross-attention ``D .. 2D-1``; the tower's weights are the client's.
docs/engine.md, "An encoder-decoder (Florence-2)".
"""

from __future__ import annotations

from array import array
from typing import Any, Iterable

import torch
import torch.nn.functional as F
from sglang.srt.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from sglang.srt.layers.logits_processor import LogitsProcessor
from sglang.srt.layers.radix_attention import RadixAttention
from sglang.srt.layers.vocab_parallel_embedding import ParallelLMHead
from sglang.srt.model_loader.weight_utils import default_weight_loader
from sglang.srt.multimodal.processors.base_processor import BaseMultimodalProcessor
from torch import nn

from sgl_embeds_srt.encoder_prompts import ENCODER_IDS, ROW_POSITIONS, encoder_item

POSITION_OFFSET = 2  # BART's learned positions start at row 2 of their table


class _Attention(nn.Module):
    """BART attention with biases, in one of three roles: ``"encoder"`` (both ways, within one
    request, nothing cached), ``"self"`` (the decoder's, causal, cached) or ``"cross"`` (the
    decoder's over the encoder's output, whose keys and values are cached once)."""

    def __init__(self, width: int, heads: int, role: str, layer_id: int = 0):
        super().__init__()
        from sglang.srt.runtime_context import get_parallel  # set only once a server runs

        self.role, self.head_dim = role, width // heads
        self.heads = heads // get_parallel().tp_size  # this rank's
        self.scaling = self.head_dim ** -0.5
        if role == "cross":
            self.q_proj = ColumnParallelLinear(width, width, bias=True)
            self.kv_proj = QKVParallelLinear(width, self.head_dim, 0, heads, bias=True)
        else:
            self.qkv_proj = QKVParallelLinear(width, self.head_dim, heads, heads, bias=True)
        self.out_proj = RowParallelLinear(width, width, bias=True)
        if role != "encoder":
            self.attn = RadixAttention(self.heads, self.head_dim, self.scaling, self.heads, layer_id=layer_id,
                                       is_cross_attention=role == "cross")

    def forward(self, hidden: torch.Tensor, forward_batch: Any = None,
                encoder_out: torch.Tensor | None = None) -> torch.Tensor:
        if self.role == "cross":
            q, _ = self.q_proj(hidden)
            k = v = None  # cached: read from the pool
            if encoder_out is not None:
                kv, _ = self.kv_proj(encoder_out)
                k, v = kv.chunk(2, dim=-1)
            out = self.attn(q, k, v, forward_batch)
        else:
            qkv, _ = self.qkv_proj(hidden)
            q, k, v = qkv.chunk(3, dim=-1)
            if self.role == "encoder":
                q, k, v = (x.view(-1, self.heads, self.head_dim).transpose(0, 1) for x in (q, k, v))
                out = F.scaled_dot_product_attention(q, k, v, scale=self.scaling)
                out = out.transpose(0, 1).reshape(hidden.shape[0], -1)
            else:
                out = self.attn(q, k, v, forward_batch)
        out, _ = self.out_proj(out)
        return out


class _FeedForward(nn.Module):
    def __init__(self, width: int, inner: int, activation: str):
        super().__init__()
        self.fc1 = ColumnParallelLinear(width, inner, bias=True)
        self.fc2 = RowParallelLinear(inner, width, bias=True)
        self.activation = ACTIVATIONS[activation]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden, _ = self.fc1(hidden)
        hidden, _ = self.fc2(self.activation(hidden))
        return hidden


# BART's activation_function values, as HF's ACT2FN computes them
ACTIVATIONS = {"gelu": F.gelu, "relu": F.relu, "gelu_new": lambda x: F.gelu(x, approximate="tanh")}


class _EncoderLayer(nn.Module):
    """Post-LN: attention, residual, norm; feed-forward, residual, norm."""

    def __init__(self, config: Any):
        super().__init__()
        width = config.d_model
        self.self_attn = _Attention(width, config.encoder_attention_heads, "encoder")
        self.self_attn_layer_norm = nn.LayerNorm(width)
        self.ffn = _FeedForward(width, config.encoder_ffn_dim, config.activation_function)
        self.final_layer_norm = nn.LayerNorm(width)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = self.self_attn_layer_norm(hidden + self.self_attn(hidden))
        return self.final_layer_norm(hidden + self.ffn(hidden))


class _DecoderLayer(nn.Module):
    """Post-LN: self-attention, cross-attention, feed-forward, each with its residual and norm."""

    def __init__(self, config: Any, index: int):
        super().__init__()
        width, heads = config.d_model, config.decoder_attention_heads
        self.self_attn = _Attention(width, heads, "self", layer_id=index)
        self.self_attn_layer_norm = nn.LayerNorm(width)
        self.encoder_attn = _Attention(width, heads, "cross", layer_id=config.decoder_layers + index)
        self.encoder_attn_layer_norm = nn.LayerNorm(width)
        self.ffn = _FeedForward(width, config.decoder_ffn_dim, config.activation_function)
        self.final_layer_norm = nn.LayerNorm(width)

    def forward(self, hidden: torch.Tensor, encoder_out: torch.Tensor | None, forward_batch: Any) -> torch.Tensor:
        hidden = self.self_attn_layer_norm(hidden + self.self_attn(hidden, forward_batch))
        hidden = self.encoder_attn_layer_norm(hidden + self.encoder_attn(hidden, forward_batch, encoder_out))
        return self.final_layer_norm(hidden + self.ffn(hidden))


class _Stack(nn.Module):
    """What BART's encoder and decoder share: learned positions (offset 2) and the norm of the
    embeddings; the token table is the model's (``shared``)."""

    def __init__(self, config: Any, layers: list[nn.Module]):
        super().__init__()
        self.embed_positions = nn.Embedding(config.max_position_embeddings + POSITION_OFFSET, config.d_model)
        self.layernorm_embedding = nn.LayerNorm(config.d_model)
        self.layers = nn.ModuleList(layers)

    def embed(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        return self.layernorm_embedding(rows + self.embed_positions(positions + POSITION_OFFSET))


class Florence2ForConditionalGeneration(nn.Module):
    """Florence-2's BART, served: ``forward`` encodes the requests of an extend batch whose
    encoder is not cached, then runs the decoder over the batch."""

    def __init__(self, config: Any, quant_config: Any = None, prefix: str = ""):
        super().__init__()
        text = config.text_config
        self.config, self.text_config = config, text
        self.embed_scale = text.d_model ** 0.5 if text.scale_embedding else 1.0
        self.shared = nn.Embedding(text.vocab_size, text.d_model)
        self.encoder = _Stack(text, [_EncoderLayer(text) for _ in range(text.encoder_layers)])
        self.decoder = _Stack(text, [_DecoderLayer(text, i) for i in range(text.decoder_layers)])
        self.lm_head = ParallelLMHead(text.vocab_size, text.d_model)
        self.logits_processor = LogitsProcessor(text)
        # the KV pool's layers (SGLang sizes the pool by these): the decoder's self- and cross-attention
        self.start_layer, self.end_layer = 0, 2 * text.decoder_layers

    def get_input_embeddings(self) -> nn.Embedding:
        return self.shared

    def pad_input_ids(self, input_ids: array, mm_inputs: Any) -> array:
        """The encoder prompt's pad sentinels (one per position, from the item's identity: equal
        only for an equal prompt, so a cache hit covers the whole encoder region or none of it) in
        front of the decoder prompt; SGLang strips them before the forward."""
        item = encoder_item(mm_inputs)
        n = len(item.model_specific_data[ENCODER_IDS])
        mm_inputs.num_image_tokens = n
        return array("q", item.padding_sequence(n)) + input_ids

    def encode(self, item: Any) -> torch.Tensor:
        """One request's encoder output: its prompt's token rows (scaled as HF's ``shared``
        scales them) with the span rows as sent at their positions, through the encoder."""
        device = self.shared.weight.device
        ids = torch.as_tensor(item.model_specific_data[ENCODER_IDS], dtype=torch.long, device=device)
        at = torch.as_tensor(item.model_specific_data[ROW_POSITIONS], dtype=torch.long, device=device)
        rows = self.shared(ids.index_fill(0, at, 0)) * self.embed_scale
        if at.numel():  # none in a prompt of text alone (SGLang's health check)
            rows[at] = item.feature.to(device=device, dtype=rows.dtype)
        hidden = self.encoder.embed(rows, torch.arange(ids.shape[0], device=device))
        for layer in self.encoder.layers:
            hidden = layer(hidden)
        return hidden

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: Any,
                **kwargs: Any) -> Any:
        encoder_out = None
        if not forward_batch.forward_mode.is_decode():
            cached = forward_batch.encoder_cached or ()
            items = [encoder_item(mm) for mm, done in zip(forward_batch.mm_inputs or (), cached) if not done]
            fresh = [self.encode(item) for item in items if item is not None]
            # in batch order, as SGLang lays out the encoder slots they are written to
            encoder_out = torch.cat(fresh) if fresh else None
        hidden = self.decoder.embed(self.shared(input_ids) * self.embed_scale, positions)
        for layer in self.decoder.layers:
            hidden = layer(hidden, encoder_out, forward_batch)
        return self.logits_processor(input_ids=input_ids, hidden_states=hidden, lm_head=self.lm_head,
                                     logits_metadata=forward_batch)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The language model's weights (``model.language_model.*``, or a remote-code checkpoint's
        ``language_model.model.*``); the tower's and projector's are the client's and skipped.
        q/k/v are stacked, feed-forward layers live in ``ffn``, the LM head is the token table."""
        params = dict(self.named_parameters())
        for name, weight in weights:
            name = _language_model_name(name)
            if name is None:
                continue
            for ours, theirs, shard in _STACKED:
                if theirs in name:
                    param = params[name.replace(theirs, ours)]
                    param.weight_loader(param, weight, shard)
                    break
            else:
                name = name.replace(".fc1.", ".ffn.fc1.").replace(".fc2.", ".ffn.fc2.")
                if name == "shared.weight":
                    default_weight_loader(params["shared.weight"], weight)
                    name = "lm_head.weight"
                if name not in params:
                    continue  # BART's duplicate embed_tokens tables: the same tensor as shared
                param = params[name]
                getattr(param, "weight_loader", default_weight_loader)(param, weight)


class RawImagesRefused(BaseMultimodalProcessor):
    """The multimodal processor SGLang asks for: Florence-2's tower runs on the client, so a
    request with raw images (``image_data``, an ``image_url`` part) is refused with the way in."""

    models = []  # chosen by model_runner.get_mm_processor_cls, not by SGLang's table

    async def process_mm_data_async(self, *args: Any, **kwargs: Any) -> None:
        raise ValueError("Florence-2 is served with its vision tower on the client: send the image's "
                         "rows (sgl_embeds.vlm's florence2 vision half) as an embedding span, not raw images")


_STACKED = (
    (".self_attn.qkv_proj.", ".self_attn.q_proj.", "q"),
    (".self_attn.qkv_proj.", ".self_attn.k_proj.", "k"),
    (".self_attn.qkv_proj.", ".self_attn.v_proj.", "v"),
    (".encoder_attn.kv_proj.", ".encoder_attn.k_proj.", "k"),
    (".encoder_attn.kv_proj.", ".encoder_attn.v_proj.", "v"),
)
_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.")


def _language_model_name(name: str) -> str | None:
    for prefix in _PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return None


EntryClass = [Florence2ForConditionalGeneration]
