"""The one compiled part: keyed BLAKE3 digests of many rows at once (csrc/row_digests.c). It is
optional: without a C compiler the package installs and ``keys.row_digests`` hashes row by row
in Python (the same digests, slower); ``python -m sgl_embeds_srt.cpu.check`` says which.

A wheel also carries ``PTH`` at the top of site-packages: every Python process of the environment
then imports ``sgl_embeds_srt.cpu.finder``, which makes the CPU kernel fallback importable as
``sgl_kernel`` where no real one is installed (it defers to a real one). Its line names no path,
so the environment can move. (An editable install has no build_lib: scripts/setup.sh copies it.)"""

import shutil
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_py import build_py

# "zz": after an editable install's finder .pth (they run in alphabetical order)
PTH = Path("sgl_embeds_srt/cpu/zz_sgl_embeds_cpu_kernels.pth")


class BuildWithPth(build_py):
    def run(self) -> None:
        super().run()
        shutil.copy(PTH, Path(self.build_lib, PTH.name))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        return [*super().get_outputs(include_bytecode), str(Path(self.build_lib, PTH.name))]


setup(ext_modules=[Extension("sgl_embeds_srt._row_digests", ["csrc/row_digests.c"],
                             extra_compile_args=["-O3", "-std=c11"], optional=True)],
      cmdclass={"build_py": BuildWithPth})
