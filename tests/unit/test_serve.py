"""``python -m sgl_embeds serve``'s plan for each family (no server: ``serve.plan`` builds the launch
and ``main`` stops before running it): the split of a LLaVA checkpoint made once, in a folder
keyed by its content; a Qwen-VL one served natively with the multimodal flags; a text LLM as it is;
any other family a one-line error naming the families served."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from sgl_embeds import serve
from sgl_embeds.testing.models import tiny_llava_dir, tiny_model_dir
from sgl_embeds.testing.qwen_vl import tiny_qwen2_5_vl_dir
from sgl_embeds_srt import family


@pytest.fixture
def split_cache(tmp_path, monkeypatch):
    monkeypatch.setattr(serve, "cache_root", lambda: tmp_path)  # not the tiny models' cache
    return tmp_path / "splits"


def test_llava_is_split_once_into_a_folder_keyed_by_its_content(split_cache, tmp_path):
    launch = serve.plan(tiny_llava_dir("llama"), ["--port", "1234"], progress=False)
    assert launch.family == "llava" and launch.model_dir.parent.parent == split_cache
    assert launch.args[-2:] == ["--port", "1234"]  # the user's flags last: they override
    written = json.loads((launch.model_dir / family.FAMILY_FILE).read_text())
    assert written == {"family": "llava", "vision_dir": "../vision", "image_token": "<image>"}
    stamp = (launch.model_dir / "model.safetensors").stat().st_mtime_ns
    again = serve.plan(tiny_llava_dir("llama"), [], progress=False)
    assert again.model_dir == launch.model_dir
    assert (launch.model_dir / "model.safetensors").stat().st_mtime_ns == stamp  # not split again
    # another content, another folder
    changed = tmp_path / "changed"
    shutil.copytree(tiny_llava_dir("llama"), changed)
    (changed / "generation_config.json").write_text('{"note": "changed"}')
    assert serve.plan(changed, [], progress=False).model_dir != launch.model_dir
    assert sorted(p.name for p in split_cache.iterdir()) == sorted(
        {launch.model_dir.parent.name, serve.plan(changed, [], progress=False).model_dir.parent.name})


def test_qwen_vl_is_served_natively_with_the_multimodal_flags(split_cache):
    launch = serve.plan(tiny_qwen2_5_vl_dir(), [], progress=False)
    assert launch.model_dir == tiny_qwen2_5_vl_dir() and not split_cache.exists()
    assert "--enable-multimodal" in launch.args
    if serve.on_cpu():
        assert launch.env == {"SGLANG_USE_CPU_ENGINE": "1"}
        assert "--mm-attention-backend" in launch.args and "--device" in launch.args
    line = launch.command_line()
    assert "-m sglang.launch_server --model-path " in line and line.startswith("SGLANG_USE_CPU_ENGINE=1 ")


def test_serve_serves_natively_what_the_plugin_serves_natively():
    from sgl_embeds_srt.image_spans import KNOWN_MROPE_MODEL_TYPES, SERVED_MODEL_TYPES

    assert serve.NATIVE_FAMILIES == SERVED_MODEL_TYPES
    assert set(KNOWN_MROPE_MODEL_TYPES) - set(SERVED_MODEL_TYPES) == set(serve.REFUSED)


def test_a_text_llm_is_served_as_it_is(split_cache):
    launch = serve.plan(tiny_model_dir("llama"), [], progress=False)
    assert launch.family is None and launch.model_dir == tiny_model_dir("llama")
    assert "--enable-multimodal" not in launch.args


@pytest.mark.parametrize("model_type, why", [("mllama", ""), ("qwen3_vl_moe", "3 deepstack layers")])
def test_an_unknown_or_refused_family_is_one_line_naming_the_served(tmp_path, model_type, why):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type,
                                                      "architectures": ["XForConditionalGeneration"]}))
    done = subprocess.run([sys.executable, "-m", "sgl_embeds", "serve", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    error = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and f"model_type {model_type!r}" in error[0] and why in error[0]
    assert "LLaVA-1.5" in error[0] and "Qwen2.5-VL" in error[0] and "text LLMs" in error[0]
    assert "sglang.launch_server" not in done.stdout
