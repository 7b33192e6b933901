"""Tensor-core fragment GEMV (q4_k, q5_k, iq3_s; 1–16 columns) vs its float64 twin (Triton interpreter on CPU:
the mma is computed from the whole warp's fragments, so these check the lane map and the indexing)."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import gemv_case, needs_triton

from ninfer.errors import NinferError
from ninfer.kernels.gemv_frag import (
    FRAG_FORMATS,
    MEASURED_ROUTES,
    SCHEDULES,
    frag_route,
    gemv_frag,
    needs_units,
)
from ninfer.kernels.gemv_q8 import gemv_q8_reference, quantize_activation
from ninfer.kernels.gemv_rows import split_workspace

pytestmark = [needs_triton, pytest.mark.usefixtures("triton_on_cpu_env")]
REPO = Path(__file__).resolve().parents[1]


# (format, schedule, columns, rows, blocks per row): one column of one tile; rows not a multiple of the tile
# (clamped loads, masked stores) with two row tiles per warp and split-K 2 over 3 blocks (uneven splits);
# two column tiles (11 columns) with split-K 4 over 3 blocks (an empty split); two warps; iq3_s with one block
# per row (110-byte rows: every second row starts 2 bytes into a word) and with 3 (330 bytes); q6_k (630-byte
# rows: the same alternation); loads one super-block ahead with an empty split and with an uneven one; q4_k /
# q5_k rows of 4 blocks (1024 columns: sizes in words, as the 27B's; else in aligned units, `needs_units`)
CASES = [("q4_k", "frag_w1_r1_m8_s2", 3, 20, 4), ("q5_k", "frag_w1_r1_m8_s2_pf", 5, 16, 4),
         ("q4_k", "frag_w1_r1_m8", 1, 16, 1), ("q4_k", "frag_w1_r2_m8_s2", 5, 40, 3),
         ("q5_k", "frag_w1_r1_m16_s4", 11, 20, 3), ("q5_k", "frag_w2_r1_m8", 8, 40, 2),
         ("iq3_s", "frag_w1_r1_m8", 3, 16, 1), ("iq3_s", "frag_w1_r1_m8_s2", 5, 20, 3),
         ("q6_k", "frag_w1_r1_m8_s2", 5, 20, 3),
         ("q4_k", "frag_w2_r1_m8_s4_pf", 6, 20, 3), ("q5_k", "frag_w1_r1_m8_s2_pf", 8, 20, 3),
         # the 27B routes' two row tiles a warp over two warps (rows past the tile, empty splits); the q6_k
         # head's on one warp (a second program past the rows)
         ("q4_k", "frag_w2_r2_m8_s8", 7, 40, 4), ("iq3_s", "frag_w2_r2_m8_s8", 6, 40, 3),
         ("q6_k", "frag_w1_r2_m8", 4, 40, 2),
         # stream-K (the interpreter is one SM: `stream` programs): 6 steps (3 row tiles of 2 blocks) over 2
         # programs (runs of 3 that cross a row tile), 6 (2 tiles of 3) over 4 (runs of 2, one program
         # without work), 4 over 2, and with prefetch
         ("q4_k", "frag_w1_r1_m8_sk16:2", 5, 40, 2), ("iq3_s", "frag_w1_r1_m8_sk16:4", 3, 20, 3),
         ("q6_k", "frag_w1_r1_m8_sk16:2", 2, 20, 2), ("q5_k", "frag_w2_r1_m8_sk8_pf:2", 8, 40, 2)]


@pytest.mark.parametrize("fmt,sched,width,rows,nb", CASES)
def test_frag_kernel_equals_twin(fmt, sched, width, rows, nb):
    if ":" in sched:  # a stream-K schedule: its programs on the one-SM interpreter
        name, programs = sched.split(":")
        sched = dataclasses.replace(SCHEDULES[name], stream=int(programs))
    sched = SCHEDULES[sched] if isinstance(sched, str) else sched
    raw, x = gemv_case(fmt, rows, nb * 256, width, seed=FRAG_FORMATS.index(fmt) * 10 + width)
    xa = quantize_activation(x)
    y = gemv_frag(raw, fmt, xa, rows, sched)
    want = gemv_q8_reference(raw, fmt, xa, rows)
    assert y.dtype == torch.float32 and y.shape == (width, rows)
    # exact int32 sub-block dots, fp32 scaling and sums (≤ 1.3e-7 of max|y| measured)
    assert (y.double() - want).abs().max() <= 1e-6 * want.abs().max()
    if sched.split_k > 1 and not sched.stream:  # the last split of each tile left sums and counter zero
        sums, counters = split_workspace(raw.device, 0, 0)
        assert not sums.any() and not counters.any()


def test_bf16_experiment_equals_its_twin():
    sys.path.insert(0, str(REPO))
    from bench.frag_bf16 import gemv_frag_bf16, gemv_frag_bf16_twin

    raw, x = gemv_case("q4_k", 24, 512, 3, seed=7)
    y = gemv_frag_bf16(raw, "q4_k", x, 24, "frag_w1_r1_m8_s2")
    want = gemv_frag_bf16_twin(raw, x, 24)
    assert y.shape == (3, 24)
    # fp32 accumulation of exact bf16 products (≤ 1e-7 of max|y| measured)
    assert (y.double() - want).abs().max() <= 1e-6 * want.abs().max()
    with pytest.raises(NinferError, match="bf16 fragment"):
        gemv_frag_bf16(*gemv_case("q5_k", 4, 256, 1, seed=3)[:1], "q5_k", x[:, :256], 4, "frag_w1_r1_m8")


def test_frag_route_and_errors():
    # by shape class (a long-rows shape the 27B step does not run: 5120×13824)
    assert frag_route("gguf_q4_k", 17408, 5120, 8).name in SCHEDULES
    assert frag_route("q4_k", 5120, 13824, 5).name in SCHEDULES
    assert frag_route("q4_k", 5120, 13824, 4).name == "frag_w2_r1_m8_s4_pf"  # long rows: from 4 columns
    assert frag_route("q4_k", 5120, 13824, 3) is None and frag_route("iq3_s", 5120, 13824, 4) is None
    assert all(frag_route("q4_k", 17408, 5120, m) is None for m in (1, 2, 4, 9))  # the rows kernels win
    assert frag_route("q4_k", 12288, 5120, 6).name in SCHEDULES
    assert frag_route("q4_k", 6144, 5120, 8) is None  # smaller matrices: the rows kernels
    assert frag_route("q5_k", 17408, 5120, 8) is None  # not measured
    assert frag_route("iq3_s", 5120, 13824, 8).name == "frag_w2_r1_m8_s8"
    # the 27B step's merged matrices: the schedules timed on them, each serving its widths
    for (fmt, n, k), names in MEASURED_ROUTES.items():
        for m, name in zip((2, 4, 8), names, strict=True):
            got = frag_route(fmt, n, k, m)
            assert (got.name if got else None) == name and (got is None or got.block_m >= m)
        assert frag_route(fmt, n, k, 1) is None
    assert frag_route("q4_k", 34816, 5120, 4) is None and frag_route("q4_k", 5120, 17408, 2).split_k == 8
    assert frag_route("iq3_s", 17408, 5120, 4) is None
    assert all(frag_route("q6_k", 248320, 5120, m).name == "frag_w1_r2_m8" for m in (2, 4, 8))  # the head
    assert frag_route("q6_k", 248320, 5120, 1) is None and frag_route("q6_k", 6144, 5120, 8) is None
    assert frag_route("q6_k", 17408, 5120, 2).name == "frag_w1_r1_m8_s2"
    assert all(s.block_m in (8, 16) and s.block_n % 16 == 0 for s in SCHEDULES.values())
    # q4_k / q5_k sizes in words where Triton specialises them as 16-divisible (the 27B's K), else in units
    assert not any(needs_units(k // 256 * words, k) for k in (1024, 5120, 6144, 17408) for words in (36, 44))
    assert all(needs_units(k // 256 * words, k) for k in (256, 1280, 1536, 2560, 4864) for words in (36, 44))
    raw, x = gemv_case("iq4_xs", 4, 256, 1, seed=3)
    with pytest.raises(NinferError, match="tensor-core fragment"):
        gemv_frag(raw, "iq4_xs", quantize_activation(x), 4, "frag_w1_r1_m8")
    raw, x = gemv_case("iq3_s", 16, 256, 1, seed=3)
    with pytest.raises(NinferError, match="without _pf"):
        gemv_frag(raw, "iq3_s", quantize_activation(x), 16, "frag_w1_r1_m8_s2_pf")


def test_sm90_compile_issues_the_mma_from_registers():
    """The kernel's premise, checked on the sm_90 build: the int8 mma.sync runs once per sub-block (8 per
    super-block and column tile; q4_k's min term: 3 tf32 ones) on operands that never pass through shared
    memory (no barrier, no shared stores or loads in the loop: the lane-first tiles keep one register layout),
    also with the loads one super-block ahead."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled mode: a fresh process
    env["NINFER_TRITON_COMPILE_CHECK"] = "1"
    out = subprocess.run([sys.executable, str(REPO / "bench" / "sass_frag.py"), "--schedules",
                          "frag_w1_r1_m8_s2,frag_w1_r1_m16,frag_w1_r1_m8_s2_pf"], capture_output=True,
                         text=True, timeout=300, cwd=REPO, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("q4_k:frag_")]
    assert len(lines) == 3, out.stdout
    assert "(IMMA 8, HMMA 3, BAR 0, STS 0, LDS 0, local 0)" in lines[0]
    assert "(IMMA 8, HMMA 3, BAR 0," in lines[2]
    assert "(IMMA 16, HMMA 6, BAR 0, STS 0, LDS 0, local 0)" in lines[1]
    # iq3_s: 8 k32 mmas a super-block; q6_k: 2 × 16 k16 ones, one warp (its lanes read consecutive words: a
    # lane axis Triton saw as contiguous would be vectorised and break the one-element-per-lane map)
    # Every format also as built for rows of 256·odd columns (K % 512 ≠ 0: the row length and the scale
    # stride are not multiples of 16 and Triton specialises without that hint): the same loop. Passed in
    # words, such sizes made Triton put 2 words to a thread (2 over lanes), which broke the lane-first
    # fragments (q4_k: 16 mmas a super-block and garbage sums on the H200 at 24×1280; iq3_s / q6_k: twice
    # the instructions).
    for fmt, imma, hmma in (("q4_k", 8, 3), ("iq3_s", 8, 0), ("q6_k", 32, 0)):  # q6_k: 16 groups × 2
        args = ["--format", fmt, "--schedules", "frag_w1_r1_m8_s2", "--unhinted"]
        out = subprocess.run([sys.executable, str(REPO / "bench" / "sass_frag.py"), *args],
                             capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
        assert out.returncode == 0 and f"{fmt}:frag_w1_r1_m8_s2:" in out.stdout, out.stderr[-2000:]
        hinted, unhinted = (re.search(rf"^{fmt}:frag_w1_r1_m8_s2{label}: .* loop (\d+) .*$", out.stdout, re.M)
                            for label in ("", " unhinted"))
        # the same loop (q4_k: one instruction more in the aligned-units build)
        assert hinted and unhinted and abs(int(hinted[1]) - int(unhinted[1])) <= 2, out.stdout
        for line in (hinted[0], unhinted[0]):
            assert f"(IMMA {imma}, HMMA {hmma}, BAR 0, STS 0, LDS 0, local 0)" in line, out.stdout
