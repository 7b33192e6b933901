"""Whether Triton kernels can run here, and a `jit` that interprets kernels on CPU-only machines.

On a machine without CUDA a compiled Triton kernel cannot run at all, so kernels are decorated in
interpreter mode there: the CPU tests then run the very kernel source the GPU runs (on tiny shapes).
"""

from __future__ import annotations

import functools
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


try:  # grid dependency control (Triton ≥ 3.3)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # pragma: no cover - no Triton, or an older one: pdl_enabled() is False
    gdc_launch_dependents = gdc_wait = None


@functools.cache
def pdl_enabled() -> bool:
    """Programmatic dependent launch for the decode-step kernels that take a `PDL` flag: compiled Triton on
    a Hopper-or-newer GPU, unless NINFER_PDL=0. Such a kernel, launched with the attribute, may be scheduled
    before the kernel ahead of it has finished and waits for its results in `pdl_start` before touching any
    memory: the launch latency between kernels overlaps the previous kernel, inside CUDA graphs too (H200:
    a chain of small kernels 1.04–1.22 → 0.78 µs a kernel; Q4_K tg128 156.2 → 166.7 tok/s)."""
    if gdc_wait is None or INTERPRET or not CUDA or os.environ.get("NINFER_PDL", "1") == "0":
        return False
    return torch.cuda.get_device_capability()[0] >= 9


def pdl_options(t: torch.Tensor, trigger: bool = True) -> dict:
    """The launch keywords of a kernel with a `PDL` constexpr for tensors on t's device: where
    `pdl_enabled`, a programmatic dependent launch that (`trigger`) lets the next kernel launch as soon as
    this one starts — right for small kernels; a GEMV that did so ran its norm + GEMV pairs 4.5 → 6.5 µs a
    kernel (its successor's waiting programs take the SMs its later waves need), so GEMVs let the next kernel
    launch only once their programs leave the main loop (`late_release`)."""
    if t.is_cuda and pdl_enabled():
        return {"PDL": 2 if trigger else 3 if late_release() else 1, "launch_pdl": True}
    return {"PDL": 0}


def reread_launch_settings() -> None:
    """Forget the cached NINFER_PDL / NINFER_PDL_LATE (benchmarks and tests that change them; kernels
    launched from then on, and graphs captured, use the new values)."""
    for cached in (pdl_enabled, late_release):
        cached.cache_clear()


@functools.cache
def late_release() -> bool:
    """Whether the GEMVs (`trigger=False`) let the next kernel launch once their programs leave the main loop
    (`pdl_release`), so that its launch overlaps their last sums and stores; NINFER_PDL_LATE=0 turns it off
    (H200, the graphed 27B decode step: Q4_K 5.81 → 5.73 ms, IQ3_S 8.14 → 8.02; one lane +2 %)."""
    return os.environ.get("NINFER_PDL_LATE", "1") == "1"


@jit
def pdl_start(PDL: tl.constexpr):
    """First thing in a kernel launched by `pdl_options` (PDL 0: plain launch, a no-op; 1: wait until the
    previous kernel has finished and its writes are visible; 2: first let the next kernel launch; 3: wait, and
    let the next kernel launch later, in `pdl_release`)."""
    if PDL == 2:
        gdc_launch_dependents()
    if PDL != 0:
        gdc_wait()


@jit
def pdl_release(PDL: tl.constexpr):
    """After a GEMV's main loop: with PDL 3 (`late_release`), let the next kernel launch now."""
    if PDL == 3:
        gdc_launch_dependents()


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
