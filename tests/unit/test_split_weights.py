"""A split LLM's weights read in place: ``split`` links the checkpoint's files into ``llm/`` (no
tensor copied) with the name of each tensor the LLM loads; the server's loader hook and
``load_split_llm`` read them under those names, skip the vision half's, and refuse a folder whose
files lack one of them."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from sgl_embeds.vlm import load_split_llm, split
from sgl_embeds.vlm.files import weight_index
from sgl_embeds_protocol.split_weights import WEIGHTS_FILE, renamed, weight_names, write_weight_names
from sgl_embeds_srt import loader
from sgl_embeds_testing import reference as ref
from sgl_embeds_testing.models import tiny_llava_dir


def test_names_round_trip_and_a_bad_record_is_refused(tmp_path):
    assert weight_names(tmp_path) is None  # no file: the folder's own names
    write_weight_names(tmp_path, {"model.norm.weight": "model.language_model.norm.weight"})
    assert weight_names(tmp_path) == {"model.language_model.norm.weight": "model.norm.weight"}
    for bad in ({"format": "other/1", "names": {}}, {"names": {"a": 1}}, [1, 2],
                {"format": "sgl_embeds.split_weights/1", "names": {"a": "k", "b": "k"}}):
        (tmp_path / WEIGHTS_FILE).write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=WEIGHTS_FILE):
            weight_names(tmp_path)


def test_renamed_skips_the_unnamed_and_refuses_a_missing_tensor():
    by_key = {"lm.a": "a", "lm.b": "b"}
    assert list(renamed([("lm.a", 1), ("vision.x", 2), ("lm.b", 3)], by_key, "here")) == [("a", 1), ("b", 3)]
    with pytest.raises(ValueError, match="here: 1 of the LLM's tensors .* 'lm.b'"):
        list(renamed([("lm.a", 1), ("vision.x", 2)], by_key, "here"))


def test_the_loader_hook_renames_under_the_source_prefix(tmp_path):
    write_weight_names(tmp_path, {"model.norm.weight": "model.language_model.norm.weight"})
    stored = [("p.model.language_model.norm.weight", 1), ("p.model.vision_tower.x", 2)]

    def original(self, source, *args, **kwargs):
        return iter(stored)

    source = SimpleNamespace(model_or_path=str(tmp_path), prefix="p.")
    assert list(loader.weights_iterator(original, None, source)) == [("p.model.norm.weight", 1)]
    plain = SimpleNamespace(model_or_path=str(tmp_path / "elsewhere"), prefix="p.")
    assert list(loader.weights_iterator(original, None, plain)) == stored  # no names: as SGLang reads it


@pytest.fixture(scope="module")
def llava_split(tmp_path_factory):
    src = tiny_llava_dir("llama")
    llm, _ = split(src, tmp_path_factory.mktemp("split"), log=lambda _: None)
    return src, llm


def test_split_links_the_checkpoints_files_and_copies_no_tensor(llava_split):
    src, llm = llava_split
    linked = sorted(llm.glob("*.safetensors"))
    assert linked and all(os.path.samefile(f, src / f.name) for f in linked)
    assert {f.name for f in linked} == {f.name for f in weight_index(src).values()}
    names = weight_names(llm)
    assert sorted(names.values()) == sorted(ref.split_llm_weights(llm))
    assert all(key.startswith(("model.language_model.", "language_model.")) for key in names)
    assert "lm_head.weight" in names.values()  # the tiny LLaVA's is not tied


def test_load_split_llm_equals_the_vlm_and_refuses_a_missing_tensor(llava_split, tmp_path):
    src, llm = llava_split
    vlm, _ = ref.hf_llava(str(src))
    ids = torch.tensor([[0, 40, 41, 100, 7, 300]])
    with torch.no_grad():
        assert torch.equal(load_split_llm(llm, dtype=torch.float32)(ids).logits, vlm(input_ids=ids).logits)
    broken = tmp_path / "broken"
    shutil.copytree(llm, broken, symlinks=True)
    record = json.loads((broken / WEIGHTS_FILE).read_text())
    record["names"]["model.norm.weight"] = "no.such.key"
    (broken / WEIGHTS_FILE).write_text(json.dumps(record))
    with pytest.raises(ValueError, match="model.norm.weight"):
        load_split_llm(broken)


def test_across_file_systems_the_files_are_symbolic_links(tmp_path, monkeypatch):
    def cross_device(target, link):
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", cross_device)
    src = tiny_llava_dir("llama")
    llm, _ = split(src, tmp_path / "out", log=lambda _: None)
    linked = sorted(llm.glob("*.safetensors"))
    assert linked and all(f.is_symlink() and Path(os.readlink(f)) == (src / f.name).resolve() for f in linked)
    assert sorted(ref.split_llm_weights(llm)) == sorted(weight_names(llm).values())
