"""An encoder-decoder's prompt on the tokenizer side (``sgl_embeds_srt/encoder_prompts.py``): the
decoder's start read from the checkpoint, the encoder prompt's item and its identity (the radix key
of the encoder region: equal only for the same ids from the same tenant's spans), the refusals."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig

from sgl_embeds_srt.encoder_prompts import (
    ENCODER_IDS, NO_ENCODER_PROMPT, EncoderDecoder, as_encoder_prompt, encoder_inputs, encoder_item,
)
from sgl_embeds_srt.prompt_rows import PromptRows
from sgl_embeds_testing.florence2 import MAX_POSITIONS, tiny_florence2_dir


def _model() -> EncoderDecoder:
    checkpoint = tiny_florence2_dir()
    return EncoderDecoder.of(AutoConfig.from_pretrained(checkpoint), str(checkpoint))


def _rows(key: str | None, n: int = 3) -> PromptRows:
    return PromptRows.from_spans([torch.zeros(n, 64)], [key], list(range(n)))


def test_the_decoder_starts_as_the_checkpoints_generation_config_says():
    model = _model()
    assert model.decoder_prompt == (1, 0)  # </s>, then the forced <s> (the tiny tokenizer's ids)
    assert model.encoder_positions == MAX_POSITIONS
    llama = AutoConfig.for_model("llama")
    llama.architectures = ["LlamaForCausalLM"]
    assert EncoderDecoder.of(llama, None) is None


def test_the_encoder_prompt_is_one_item_whose_identity_names_ids_and_tenant():
    model, ids = _model(), [7, 8, 9, 10, 11]
    decoder, rows = as_encoder_prompt(ids, _rows("tenant-a key"), model)
    assert decoder == [1, 0]
    item = encoder_item(rows.images)
    assert item.model_specific_data[ENCODER_IDS] == ids and rows.images.input_ids == decoder
    same = encoder_item(as_encoder_prompt(ids, _rows("tenant-a key"), model)[1].images)
    other_tenant = encoder_item(as_encoder_prompt(ids, _rows("tenant-b key"), model)[1].images)
    other_ids = encoder_item(as_encoder_prompt([7, 8, 9, 10, 12], _rows("tenant-a key"), model)[1].images)
    assert same.pad_values == item.pad_values
    assert other_tenant.pad_values[0] != item.pad_values[0] and other_ids.pad_values[0] != item.pad_values[0]
    assert encoder_item(encoder_inputs([0], [], model, row_positions=[])).model_specific_data[ENCODER_IDS] == [0]
    assert encoder_item(None) is None


def test_a_prompt_without_rows_or_longer_than_the_encoder_is_refused():
    model = _model()
    with pytest.raises(ValueError, match="reads an image"):
        as_encoder_prompt([1, 2, 3], None, model)
    assert "embedding span" in NO_ENCODER_PROMPT
    with pytest.raises(ValueError, match=f"more than the encoder's {MAX_POSITIONS}"):
        as_encoder_prompt(list(range(MAX_POSITIONS + 1)), _rows("k"), model)
