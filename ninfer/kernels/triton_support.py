"""Whether Triton kernels can run here, and a `jit` that interprets kernels on CPU-only machines.

On a machine without CUDA a compiled Triton kernel cannot run at all, so kernels are decorated in
interpreter mode there: the CPU tests then run the very kernel source the GPU runs (on tiny shapes).
"""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available() and os.environ.get("NINFER_TRITON_COMPILE_CHECK") != "1":
    # Interpreter mode must be on before triton.language is imported, or its own jit helpers (tl.cdiv,
    # tl.sigmoid...) stay compiled-only; compiled Triton cannot run without a GPU anyway.
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:  # Triton is optional: every kernel has a PyTorch fallback
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where Triton is absent
    triton = None
    tl = None

HAVE_TRITON = triton is not None
CUDA = torch.cuda.is_available()
# NINFER_TRITON_COMPILE_CHECK=1 keeps compiled-mode kernels on a CPU machine, to compile them for a GPU
# target there (bench/compile_check.py) without running them.
INTERPRET = HAVE_TRITON and os.environ.get("NINFER_TRITON_COMPILE_CHECK") != "1" and (
    not CUDA or os.environ.get("TRITON_INTERPRET") == "1")


def jit(fn):
    """`triton.jit`, or Triton's interpreter where no GPU exists (the CPU tests' path)."""
    if not HAVE_TRITON:
        return fn
    if INTERPRET:
        from triton.runtime.interpreter import InterpretedFunction

        return InterpretedFunction(fn)
    return triton.jit(fn)


def triton_runs_on(t: torch.Tensor) -> bool:
    """True when a Triton kernel should take `t`: a CUDA tensor; a CPU tensor only under the interpreter and
    when NINFER_TRITON_ON_CPU=1 (the kernel tests), so CPU inference keeps the fast PyTorch reference path."""
    if not HAVE_TRITON:
        return False
    if t.is_cuda:
        return True
    return INTERPRET and t.device.type == "cpu" and os.environ.get("NINFER_TRITON_ON_CPU") == "1"

if HAVE_TRITON:

    @jit
    def _add(a, b):
        return a + b

    @jit
    def tl_sum(x, axis: tl.constexpr):
        """tl.sum through tl.reduce: Triton's own jit helpers cannot run under the interpreter when triton was
        imported before interpreter mode was switched on (e.g. by transformers)."""
        return tl.reduce(x, axis, _add)

    @jit
    def _max2(a, b):
        return tl.maximum(a, b)

    @jit
    def tl_max(x, axis: tl.constexpr):
        """tl.max through tl.reduce (see tl_sum)."""
        return tl.reduce(x, axis, _max2)
