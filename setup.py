"""The one compiled part: keyed BLAKE3 digests of many rows at once (csrc/row_digests.c). It is
optional: without a C compiler the package installs and ``keys.row_digests`` hashes row by row
in Python (the same digests, slower); ``python -m sgl_embeds_cpu.check`` says which."""

from setuptools import Extension, setup

setup(ext_modules=[Extension("sgl_embeds_protocol._row_digests", ["csrc/row_digests.c"],
                             extra_compile_args=["-O3", "-std=c11"], optional=True)])
