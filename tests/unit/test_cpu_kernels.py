"""The pure-torch sgl_kernel CPU fallback against direct reference computations (no server)."""

from __future__ import annotations

import concurrent.futures
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from sgl_embeds_cpu import kernels, plugin

# numbers compared across code paths: run again with AVX2 kernels (scripts/test_portable.sh)
pytestmark = pytest.mark.exactness


def test_assign_req_to_token_pool_matches_reference():
    pool = torch.zeros(4, 12, dtype=torch.int32)
    ref = pool.clone()
    rows, starts, ends = torch.tensor([2, 0, 3]), torch.tensor([1, 0, 5]), torch.tensor([4, 2, 5])
    out = torch.arange(100, 105, dtype=torch.int64)
    kernels.assign_req_to_token_pool_cpu(rows, pool, starts, ends, out, pool.shape[1])
    offset = 0
    for r, s, e in zip(rows.tolist(), starts.tolist(), ends.tolist()):
        ref[r, s:e] = out[offset : offset + e - s].int()
        offset += e - s
    assert torch.equal(pool, ref) and pool[2, 1:4].tolist() == [100, 101, 102]


def test_copy_all_layer_kv_cache_matches_reference_including_overlap():
    bufs = [torch.randn(10, 3, 4), torch.randn(10, 8).half()]
    refs = [b.clone() for b in bufs]
    src, tgt = torch.tensor([1, 2, 3]), torch.tensor([2, 3, 7])  # overlapping: reads before writes
    ptrs = torch.tensor([b.data_ptr() for b in bufs], dtype=torch.int64)
    strides = torch.tensor([b[0].numel() * b.element_size() for b in bufs], dtype=torch.int64)
    kernels.copy_all_layer_kv_cache_cpu(ptrs, strides, tgt, src)
    for b, r in zip(bufs, refs):
        r[tgt] = r[src].clone()
        assert torch.equal(b, r)


def test_unimplemented_op_raises_naming_the_op():
    from sgl_embeds_cpu.kernels import decode_attention_cpu  # any name imports

    with pytest.raises(NotImplementedError, match="sgl_kernel.decode_attention_cpu"):
        decode_attention_cpu(1, 2)


def _run(code: str, path_extra: str = "", opt_in: bool = True) -> str:
    prelude = f"import sys; sys.path.insert(0, {path_extra!r})\n" if path_extra else ""
    env = {k: v for k, v in os.environ.items() if k != plugin.OPT_IN}
    env.update({plugin.OPT_IN: "1"} if opt_in else {})
    result = subprocess.run([sys.executable, "-W", "ignore", "-c", prelude + textwrap.dedent(code)],
                            capture_output=True, text=True, timeout=300, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip()


# What a process of this environment loads of the CPU kernels: the client and the span plugin
# imported, SGLang's platform resolved as each SGLang process resolves it (its platform plugins
# called: the finders must be there now, before any plugin of SGLang's general group runs, as in
# a scheduler process), then the general plugin of the CPU kernels run; what is loaded then.
LOADED = """
    import sys
    from importlib.metadata import entry_points
    import sgl_embeds, sgl_embeds_srt.plugin, sgl_embeds_protocol.targets
    import sglang.srt.utils.common, sglang.srt.platforms
    assert sglang.srt.platforms._current_platform is not None
    print(sorted(type(f).__name__ for f in sys.meta_path if getattr(f, "sgl_embeds_fallback", False)))
    [cpu_hooks] = [e for e in entry_points(group="sglang.srt.plugins") if e.name == "sgl_embeds_cpu"]
    cpu_hooks.load()()
    print(sorted(m for m in sys.modules if m.split(".")[0] in ("sgl_kernel", "sgl_embeds_cpu")))
    from sglang.srt.plugins.hook_registry import HookRegistry
    print(sorted(t for t in HookRegistry._hooks if t in CPU_TARGETS))
"""


def _loaded(opt_in: bool, then: str = "") -> list[str]:
    cpu_targets = f"CPU_TARGETS = {sorted(plugin.hook_table())!r}\n"
    return _run(cpu_targets + textwrap.dedent(LOADED) + textwrap.dedent(then), opt_in=opt_in).splitlines()


@pytest.fixture(scope="module")
def fresh():
    """The fresh processes of the tests below, run at once (each mostly imports SGLang, on one
    core): their output lines by test."""
    runs = {"without": lambda: _loaded(opt_in=False),
            "with": lambda: _loaded(opt_in=True, then=OPTED_IN_KERNELS),
            "qwen_vl": _qwen_vl_modules}
    with concurrent.futures.ThreadPoolExecutor(len(runs)) as pool:
        started = {name: pool.submit(run) for name, run in runs.items()}
        return {name: future.result() for name, future in started.items()}


def test_a_process_without_the_opt_in_loads_no_cpu_kernel(fresh):
    """Acceptance of issue #44 (item 3): no finder, no ``sgl_kernel``, none of the kernels' modules;
    the CPU plugin's entry points ran (its switch module is loaded) and did nothing."""
    finders, modules, hooks = fresh["without"]
    assert finders == "[]"
    assert modules == "['sgl_embeds_cpu', 'sgl_embeds_cpu.plugin']"
    assert hooks == "[]"


OPTED_IN_KERNELS = """
    import sgl_kernel, sgl_kernel.mamba
    print(sgl_kernel.__file__)
"""


def test_with_the_opt_in_sglang_turns_the_cpu_kernels_on(fresh):
    """The same process with ``SGLANG_EMBEDS_CPU_KERNELS=1``: SGLang's platform resolution installed
    the finders, ``sgl_kernel`` (and ``sgl_kernel.mamba``) are the stand-ins, and the general
    plugin registered the CPU hooks."""
    finders, _, hooks, origin = fresh["with"]
    assert finders == "['FallbackKernelFinder', 'KernelsFirstFinder']"
    assert origin.endswith("sgl_embeds_cpu/kernels.py")
    assert hooks == str(sorted(plugin.hook_table()))


def test_a_real_sgl_kernel_wins_over_the_fallback(tmp_path):
    real = tmp_path / "sgl_kernel"
    real.mkdir()
    (real / "__init__.py").write_text("REAL = True\n")
    out = _run("from sgl_embeds_cpu import plugin; plugin.turn_on(); import sgl_kernel; "
               "print(getattr(sgl_kernel, 'REAL', False))", str(tmp_path))
    assert out == "True"


def _qwen_vl_modules() -> list[str]:
    code = textwrap.dedent("""
        import torch
        import sglang.srt.multimodal.processors.qwen_vl  # noqa: F401
        from sgl_embeds_cpu.kernels import TORCH_OPS
        for name in TORCH_OPS:
            print(getattr(torch.ops.sgl_kernel, name).default._schema)
        x = torch.ones(2)
        torch.ops.sgl_kernel.fused_sigmoid_mul_cpu(x, torch.zeros(2))
        print(x.tolist())
        try:
            torch.ops.sgl_kernel.fused_input_proj_cpu(torch.zeros(1, 4), torch.zeros(4, 4), torch.zeros(2, 4), True)
        except NotImplementedError as e:
            print(e)
    """)
    env = {**os.environ, "SGLANG_USE_CPU_ENGINE": "1", plugin.OPT_IN: "1"}
    out = subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True,
                         env=env, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.splitlines()


def test_qwen_vl_modules_import_and_their_torch_ops_are_registered(fresh):
    """SGLang's Qwen-VL processor imports models/qwen3_5.py, whose module level looks up torch ops
    of sgl_kernel (issue #22): in a fresh process, as a server's processor pool would. The ops
    Qwen3.5 calls on this CPU compute (tests/unit/test_cpu_gdn.py checks their numbers); the one
    only reached with AMX raises naming itself."""
    lines = fresh["qwen_vl"]
    assert [line.split("(")[0] for line in lines[:-2]] == [f"sgl_kernel::{n}" for n in kernels.TORCH_OPS]
    assert lines[-2] == "[0.5, 0.5]"
    assert "sgl_kernel.fused_input_proj_cpu is not implemented" in lines[-1]
