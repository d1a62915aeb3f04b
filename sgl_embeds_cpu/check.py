"""``python -m sgl_embeds_cpu.check``: prove the environment can run SGLang here.

On CPU it opts in to the CPU kernels as ``sgl_embeds serve`` does for SGLang's processes
(``SGLANG_EMBEDS_CPU_KERNELS=1``) and sees SGLang turn them on through the installed entry point; on a
GPU it leaves the real ``sgl_kernel`` alone. Then it imports ``sgl_kernel`` (real or fallback),
the SGLang modules that need it on CPU (Qwen3.5's Gated DeltaNet backend among them), and checks
every guard; exits non-zero with the reason if anything is missing. Says which row hashing path was built: native (the C extension of
setup.py) or the Python fallback.
"""

from __future__ import annotations

import os
import sys


def main() -> int:
    import torch

    from sgl_embeds_cpu import finder, plugin

    os.environ.setdefault("SGLANG_USE_CPU_ENGINE", "1")
    if not torch.cuda.is_available():
        os.environ[plugin.OPT_IN] = "1"
        import sglang.srt.utils.common  # noqa: F401  (resolves SGLang's platform: its plugins run)

        if not any(isinstance(f, finder.FallbackKernelFinder) for f in sys.meta_path):
            print(f"the CPU kernels did not turn on with {plugin.OPT_IN}=1: SGLang did not call the entry "
                  "point sgl_embeds_cpu (group sglang.srt.platforms); is this package installed?")
            return 1
    import sgl_kernel

    origin = getattr(sgl_kernel, "__file__", "?")
    print(f"sgl_kernel: {origin}")
    import sglang.srt.mem_cache.allocation  # noqa: F401  (imports a CPU op at import time)
    # Qwen3.5's Gated DeltaNet backend looks up its sgl_kernel.mamba functions and torch ops on import
    import sglang.srt.layers.attention.linear.gdn_backend  # noqa: F401

    from sgl_embeds_protocol import targets

    found = targets.problems()
    if found:
        print("SGLang internals missing or changed (see sgl_embeds_protocol/targets.py):\n  " + "\n  ".join(found))
        return 1
    print(f"sglang {targets.installed_version()}: all {len(targets.TARGETS)} guarded internals as recorded")
    from sgl_embeds_protocol import keys

    if keys.native_rows is not None:
        print(f"row hashing: native (C extension {keys.native_rows.__file__})")
    else:
        print("row hashing: fallback (Python, one BLAKE3 call per row: the same digests, slower); "
              "the C extension sgl_embeds_protocol._row_digests was not built")
    return 0


if __name__ == "__main__":
    sys.exit(main())
