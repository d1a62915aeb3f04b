"""Pure-torch fallbacks for the ``sgl_kernel`` CPU ops that SGLang 0.5.23's CPU path imports.

The official CPU kernel build (``sglang-kernel-cpu``) has no registry package. ``finder`` makes
``kernels`` importable as ``sgl_kernel`` only when no real ``sgl_kernel`` can be found, so a GPU
machine keeps its real one.
"""
