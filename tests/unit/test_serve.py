"""``python -m sgl_embeds serve``'s plan for each family (no server: ``serve.plan`` builds the launch
and ``main`` stops before running it): the split of a LLaVA checkpoint made once, in a folder
keyed by its content; a Qwen-VL one served natively with the multimodal flags; a text LLM as it is;
any other family a one-line error naming the families served. ``--dry-run`` prints every
family's launch line and makes nothing (no split, no server)."""

from __future__ import annotations

import importlib
import json
import os
import shlex
import shutil
import sys
from pathlib import Path

import pytest

from sgl_embeds import serve
from sgl_embeds_testing.florence2 import tiny_florence2_dir
from sgl_embeds_testing.llava_next import tiny_llava_next_dir, tiny_llava_onevision_dir
from sgl_embeds_testing.models import tiny_llava_dir, tiny_model_dir
from sgl_embeds_testing.qwen_vl import tiny_qwen2_5_vl_dir, tiny_qwen2_vl_dir, tiny_qwen3_5_dir, tiny_qwen3_vl_dir
from sgl_embeds_cpu import plugin as cpu_plugin
from sgl_embeds_protocol import family


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
    stamp = (launch.model_dir / "config.json").stat().st_mtime_ns  # written by the split
    again = serve.plan(tiny_llava_dir("llama"), [], progress=False)
    assert again.model_dir == launch.model_dir
    assert (launch.model_dir / "config.json").stat().st_mtime_ns == stamp  # not split again
    # another content, another folder
    changed = tmp_path / "changed"
    shutil.copytree(tiny_llava_dir("llama"), changed)
    (changed / "generation_config.json").write_text('{"note": "changed"}')
    assert serve.plan(changed, [], progress=False).model_dir != launch.model_dir
    assert sorted(p.name for p in split_cache.iterdir() if p.suffix != ".lock") == sorted(
        {launch.model_dir.parent.name, serve.plan(changed, [], progress=False).model_dir.parent.name})


def test_qwen_vl_is_served_natively_with_the_multimodal_flags(split_cache):
    launch = serve.plan(tiny_qwen2_5_vl_dir(), [], progress=False)
    assert launch.model_dir == tiny_qwen2_5_vl_dir() and not split_cache.exists()
    assert "--enable-multimodal" in launch.args
    if serve.on_cpu():
        assert launch.env == {"SGLANG_USE_CPU_ENGINE": "1", "SGLANG_EMBEDS_CPU_KERNELS": "1"}
        assert cpu_plugin.opted_in(launch.env)  # SGLang's processes run with the CPU kernels on
        assert "--mm-attention-backend" in launch.args and "--device" in launch.args
    line = launch.command_line()
    assert "-m sglang.launch_server --model-path " in line and line.startswith("SGLANG_USE_CPU_ENGINE=1 SGLANG_EMBEDS_CPU_KERNELS=1 ")


def test_every_family_record_has_its_code_on_both_sides():
    """A family served whole (native, encoder-decoder) has a client encoder, and an encoder-decoder
    a model class the plugin registers; a split family is one ``split`` splits; a refused one says
    why; each record names a transformers class."""
    import transformers

    from sgl_embeds.vlm import NATIVE_ENCODERS
    from sgl_embeds.vlm.anyres import IMAGE_PROCESSORS
    from sgl_embeds_srt.encoder_prompts import ENCODER_DECODER_ARCHITECTURES

    assert set(NATIVE_ENCODERS) == set(family.names(family.NATIVE)) | set(family.names(family.ENCODER_DECODER))
    from sgl_embeds_srt.florence2 import EntryClass  # the encoder-decoders' model classes

    assert {model_class.__name__ for model_class in EntryClass} == set(ENCODER_DECODER_ARCHITECTURES) != set()
    assert {f.name for f in family.FAMILIES if f.tiling} == set(IMAGE_PROCESSORS)
    for record in family.FAMILIES:
        assert hasattr(transformers, record.hf_class), record
        assert (record.served_as == family.REFUSED) == bool(record.refused)
        assert record.clip_time is None or record.clips
        if record.vision_of:
            assert family.family_of(record.vision_of).served_as == family.NATIVE


def test_a_text_llm_is_served_as_it_is(split_cache):
    launch = serve.plan(tiny_model_dir("llama"), [], progress=False)
    assert launch.family is None and launch.model_dir == tiny_model_dir("llama")
    assert "--enable-multimodal" not in launch.args


def _unserved_checkpoint(folder: Path, model_type: str) -> Path:
    (folder / "config.json").write_text(json.dumps({"model_type": model_type,
                                                    "architectures": ["XForConditionalGeneration"]}))
    return folder


def _assert_one_line_naming_the_served(returncode: int, stdout: str, stderr: str, model_type: str, why: str) -> None:
    assert returncode == 2
    error = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(error) == 1 and f"model_type {model_type!r}" in error[0] and why in error[0]
    assert "LLaVA-1.5" in error[0] and "Qwen2.5-VL" in error[0] and "text LLMs" in error[0]
    assert "sglang.launch_server" not in stdout


@pytest.mark.parametrize("model_type, why", [("mllama", ""), ("qwen3_vl_moe", "3 deepstack layers")])
def test_an_unknown_or_refused_family_is_one_line_naming_the_served(tmp_path, model_type, why, capsys):
    returncode = serve.main([str(_unserved_checkpoint(tmp_path, model_type))])
    _assert_one_line_naming_the_served(returncode, *capsys.readouterr(), model_type, why)


# Every family's tiny checkpoint -> (the family serve names, served natively)
EACH_FAMILY = {
    "llava": (lambda: tiny_llava_dir("llama"), "llava", False),
    "llava_next": (tiny_llava_next_dir, "llava_next", False),
    "llava_onevision": (tiny_llava_onevision_dir, "llava_onevision", False),
    "qwen2_vl": (tiny_qwen2_vl_dir, "qwen2_vl", True),
    "qwen2_5_vl": (tiny_qwen2_5_vl_dir, "qwen2_5_vl", True),
    "qwen3_vl": (tiny_qwen3_vl_dir, "qwen3_vl", True),
    "qwen3_5": (tiny_qwen3_5_dir, "qwen3_5", True),
    "florence2": (tiny_florence2_dir, "florence2", False),
    "text": (lambda: tiny_model_dir("llama"), "text LLM", False),
}


@pytest.mark.parametrize("name", list(EACH_FAMILY))
def test_dry_run_prints_each_familys_launch_line_and_makes_nothing(name, split_cache, capsys):
    checkpoint, family_name, native = EACH_FAMILY[name]
    assert serve.main([str(checkpoint()), "--dry-run", "--port", "1234"]) == 0
    out = capsys.readouterr().out.splitlines()
    line = next(line for line in out if line.startswith(f"[serve] {family_name}: "))
    argv = shlex.split(line.split(": ", 1)[1])
    model = Path(argv[argv.index("--model-path") + 1])
    assert argv[argv.index("-m") + 1] == "sglang.launch_server" and argv[-2:] == ["--port", "1234"]
    assert ("--enable-multimodal" in argv) == native
    # a hybrid model's conv state in the served dtype (float32 on CPU), as the tests serve it
    assert ("SGLANG_MAMBA_CONV_DTYPE=float32" in line.split(": ", 1)[1]) == (name == "qwen3_5"), line
    if family_name in family.names(family.SPLIT):  # the split's folder named, not made
        assert model.parent.parent == split_cache and model.name == "llm"
        assert f"would be split into {model.parent}" in "\n".join(out) and not split_cache.exists()
    elif name == "florence2":  # served whole, without SGLang's warm-up (it has no image rows)
        assert model == checkpoint() and "--skip-server-warmup" in argv, line
    elif name == "qwen3_5":  # saved by transformers: served with the config fields SGLang reads
        assert model.parent == split_cache.parent / "configs" and not model.exists()
    else:
        assert model == checkpoint()


def test_a_hybrid_checkpoint_as_transformers_saves_it_is_served_with_the_fields_sglang_reads(split_cache, capsys):
    """Qwen3.5 saved by transformers lacks ``deepstack_visual_indexes`` and
    ``full_attention_interval``: serve writes them (none; every 4th layer, from ``layer_types``)
    into a config.json beside links to the checkpoint's other files, says so, and leaves the
    checkpoint alone; a layout SGLang cannot describe is refused; a config with both is served
    as it is."""
    checkpoint = tiny_qwen3_5_dir()
    saved = json.loads((checkpoint / "config.json").read_text())
    assert "deepstack_visual_indexes" not in saved["vision_config"]
    assert "full_attention_interval" not in saved["text_config"]
    launch = serve.plan(checkpoint, [], progress=False)
    served = json.loads((launch.model_dir / "config.json").read_text())
    assert served["vision_config"]["deepstack_visual_indexes"] == []
    assert served["text_config"]["full_attention_interval"] == 4
    assert {k: v for k, v in served["text_config"].items() if k != "full_attention_interval"} == saved["text_config"]
    assert sorted(p.name for p in launch.model_dir.iterdir()) == sorted(p.name for p in checkpoint.iterdir())
    assert all((launch.model_dir / p.name).resolve() == p.resolve() for p in checkpoint.iterdir() if p.name != "config.json")
    assert json.loads((checkpoint / "config.json").read_text()) == saved
    out = capsys.readouterr().out
    assert "has no vision_config.deepstack_visual_indexes; serving it as []" in out
    assert "has no text_config.full_attention_interval; serving it as 4" in out
    assert serve.plan(checkpoint, [], progress=False).model_dir == launch.model_dir  # made once
    assert serve.hybrid_config_fixes(served) == []
    uneven = dict(saved, text_config={**saved["text_config"], "layer_types": [
        "full_attention", "linear_attention", "full_attention", "linear_attention"]})
    with pytest.raises(serve.ServeError, match="not full attention at every k-th layer"):
        serve.hybrid_config_fixes(uneven)



def test_launch_prints_the_command_and_says_why_a_server_did_not_start(tmp_path, capsys):
    """``launch`` runs ``python -m sgl_embeds serve`` as a user types it: the command refuses an
    unknown family in one line (a process: ~15 s of imports, so once), which launch passes on."""
    with pytest.raises(RuntimeError) as refused:
        serve.launch(_unserved_checkpoint(tmp_path, "mllama"), "--log-level", "error", timeout=120)
    said, log = str(refused.value).split(":\n", 1)
    assert said == "the server exited (2)"
    _assert_one_line_naming_the_served(2, log, log, "mllama", "")
    printed = capsys.readouterr().out
    assert printed.startswith(f"$ {sys.executable} -m sgl_embeds serve {tmp_path} --host 127.0.0.1 --port ")
    assert printed.rstrip().endswith("--log-level error")


@pytest.mark.parametrize("flags, env, conv", [
    ([], {}, "float32"), (["--dtype", "bfloat16"], {}, None), (["--dtype=bfloat16"], {}, None),
    (["--dtype", "bfloat16", "--dtype", "float32"], {}, "float32"),
    ([], {"SGLANG_MAMBA_CONV_DTYPE": "bfloat16"}, None)])
def test_a_hybrid_models_conv_state_follows_the_served_dtype(split_cache, monkeypatch, flags, env, conv):
    """On CPU (float32 unless the flags say), unless the caller's environment already says."""
    monkeypatch.setattr(serve, "on_cpu", lambda: True)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    launch = serve.plan(tiny_qwen3_5_dir(), flags, progress=False)
    assert launch.env.get("SGLANG_MAMBA_CONV_DTYPE") == conv


def test_a_hub_id_is_served_from_the_local_hugging_face_cache(tmp_path, monkeypatch, capsys):
    """``serve org/name`` (as ``sglang.launch_server`` takes it): the snapshot in the local HF
    cache; an id the cache lacks is one line saying what to do, offline or with --dry-run."""
    import huggingface_hub.constants as hub

    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    repo = tmp_path / "hub" / "models--tiny-org--tiny-llama"
    snapshot = repo / "snapshots" / ("0" * 40)
    shutil.copytree(tiny_model_dir("llama"), snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("0" * 40)
    assert serve.main(["tiny-org/tiny-llama", "--dry-run"]) == 0
    line = next(line for line in capsys.readouterr().out.splitlines() if line.startswith("[serve] text LLM: "))
    argv = shlex.split(line.split(": ", 1)[1])
    assert Path(argv[argv.index("--model-path") + 1]) == snapshot
    assert serve.main(["tiny-org/absent", "--dry-run"]) == 2
    assert "not a folder, nor in the local Hugging Face cache (--dry-run downloads nothing)" in capsys.readouterr().err
    assert serve.main(["tiny-org/absent"]) == 2
    err = capsys.readouterr().err
    assert "could not be downloaded" in err and "hf download tiny-org/absent" in err and len(err.splitlines()) == 1


def test_connect_finds_the_vision_half_of_a_server_launched_with_a_hub_id(tmp_path, monkeypatch):
    """A server launched with ``--model-path org/name`` names the id as its vision half's place:
    ``connect`` takes the snapshot of the local HF cache (offline); an id the cache lacks is
    refused, saying to pass ``vision=``."""
    import huggingface_hub.constants as hub

    from sgl_embeds_protocol.info import ServedModel

    connect = importlib.import_module("sgl_embeds.connect")  # the module (the package names the function)

    monkeypatch.setattr(hub, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(hub, "HF_HUB_OFFLINE", True)
    repo = tmp_path / "hub" / "models--tiny-org--tiny-qwen"
    snapshot = repo / "snapshots" / ("1" * 40)
    shutil.copytree(tiny_qwen2_5_vl_dir(), snapshot)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("1" * 40)
    served = ServedModel("qwen2_5_vl", family.NATIVE, "tiny-org/tiny-qwen", True, 2, {})
    assert Path(connect._served_vision_dir("URL", served)) == snapshot
    absent = ServedModel("qwen2_5_vl", family.NATIVE, "tiny-org/absent", True, 2, {})
    with pytest.raises(ValueError, match=r"vision half is at tiny-org/absent .*nor in the local Hugging "
                       r"Face cache\): pass vision="):
        connect._served_vision_dir("URL", absent)


def test_an_unchanged_checkpoint_is_not_hashed_again(split_cache, tmp_path, monkeypatch):
    """The key of a folder whose files' names, sizes and times are unchanged is read back, not
    computed: no byte is read again; a touched file is hashed again (to the same key)."""
    checkpoint = tmp_path / "ckpt"
    shutil.copytree(tiny_model_dir("llama"), checkpoint)
    key = serve.checkpoint_key(checkpoint, progress=False)

    def never(*args, **kwargs):
        raise AssertionError("hashed again")

    with monkeypatch.context() as patched:
        patched.setattr(serve, "_hash_files", never)
        assert serve.checkpoint_key(checkpoint, progress=False) == key
        os.utime(checkpoint / "config.json", ns=(1, 1))
        with pytest.raises(AssertionError, match="hashed again"):
            serve.checkpoint_key(checkpoint, progress=False)
    assert serve.checkpoint_key(checkpoint, progress=False) == key  # same bytes, same key


def test_builds_of_one_target_take_turns_and_clear_a_killed_builds_folder(tmp_path):
    """Two processes building one target: one builds, the other waits and finds it built; a
    temporary folder a killed build left is removed by the next build."""
    import multiprocessing

    target = tmp_path / "built"
    stale = tmp_path / "built.tmp999999"
    stale.mkdir()
    (stale / "half").write_text("x")
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(2) as pool:
        counts = pool.starmap(_build_slowly, [(str(target),), (str(target),)])
    assert sorted(counts) == [0, 1], "exactly one of the two built it"
    assert (target / "config.json").read_text() == "built" and not stale.exists()
    assert not list(tmp_path.glob("built.tmp*"))


def _build_slowly(target: str) -> int:
    import time

    built = []

    def build(folder):
        built.append(folder)
        time.sleep(0.5)
        (folder / "config.json").write_text("built")

    serve.build_once(Path(target), build)
    return len(built)
