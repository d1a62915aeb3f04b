"""A changed SGLang internal refuses a real launch: ``python -m sglang.launch_server`` and
``sglang.Engine(...)`` run in a child process after one internal there is replaced (a function of
the same signature and another body), so the refusal is seen where a user would see it: exit
status and message, not a mocked check."""

from __future__ import annotations

import pytest

import helpers
from sgl_embeds.testing.server import cpu_launch_args, free_port

# A child's first lines: replace one internal by a function of the same signature and another
# body (defined in a file, as SGLang's are, so its source can be read), as a changed SGLang would.
CHANGE_PREPARE_FOR_EXTEND = """
from sglang.srt.managers import schedule_batch
_stock = schedule_batch.ScheduleBatch.prepare_for_extend
def prepare_for_extend(self, *args, **kwargs):
    return _stock(self, *args, **kwargs)
schedule_batch.ScheduleBatch.prepare_for_extend = prepare_for_extend
"""


@pytest.mark.server
def test_a_changed_target_refuses_launch_server(tmp_path, llama_dir):
    argv = ["sglang.launch_server", "--model-path", str(llama_dir), "--host", "127.0.0.1",
            "--port", str(free_port()), *cpu_launch_args()]
    out = helpers.run_with_changed_sglang(tmp_path, CHANGE_PREPARE_FOR_EXTEND,
                     f"import runpy\nsys.argv = {argv!r}\nrunpy.run_module('sglang.launch_server', run_name='__main__')")
    assert out.returncode == 1, out.stderr[-3000:]
    assert "sgl_embeds refuses to start" in out.stderr
    assert "ScheduleBatch.prepare_for_extend: its source changed" in out.stderr
    assert "no longer mentions ['prefill_input_ids_cpu'" in out.stderr
    assert "fired up and ready" not in out.stderr + out.stdout


@pytest.mark.server
def test_a_missing_target_makes_engine_raise(tmp_path, llama_dir):
    change = "from sglang.srt.managers import schedule_batch\ndel schedule_batch.Req.set_finish_with_abort\n"
    engine = (f"import sglang\n"
              f"try:\n"
              f"    sglang.Engine(model_path={str(llama_dir)!r}, device='cpu', attention_backend='torch_native',\n"
              f"                  disable_cuda_graph=True, disable_overlap_schedule=True)\n"
              f"except SystemExit as e:\n"
              f"    print('REFUSED', e)\n"
              f"    sys.exit(3)\n")
    out = helpers.run_with_changed_sglang(tmp_path, change, engine)
    assert out.returncode == 3, out.stderr[-3000:]
    assert "REFUSED sgl_embeds refuses to start" in out.stdout
    assert "Req.set_finish_with_abort: cannot be resolved" in out.stdout
