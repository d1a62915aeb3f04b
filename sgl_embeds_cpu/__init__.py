"""Pure-torch stand-ins for the ``sgl_kernel`` CPU ops that SGLang 0.5.23's CPU path imports, and
the CPU-only engine hooks: an opt-in SGLang plugin of their own (``plugin.py``).

The official CPU kernel build (``sglang-kernel-cpu``) has no registry package. Nothing here loads
unless ``SGLANG_EMBEDS_CPU_KERNELS=1`` is in the environment (``python -m sgl_embeds serve`` and the
test servers set it on CPU); a real ``sgl_kernel`` always wins over the stand-ins.
"""
