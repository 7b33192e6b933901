"""Coalesced-rows int8-activation GEMV (q4_k, q5_k) vs its float64 twin (Triton interpreter on CPU)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import gemv_case, needs_triton

from ninfer.errors import NinferError
from ninfer.kernels.gemv_q8 import gemv_q8_reference, quantize_activation
from ninfer.kernels.gemv_rows import (
    MAX_COLUMNS,
    ROWS_FORMATS,
    SCHEDULES,
    gemv_rows,
    rows_route,
    split_workspace,
)

pytestmark = [needs_triton, pytest.mark.usefixtures("triton_on_cpu_env")]
REPO = Path(__file__).resolve().parents[1]


# (format, schedule, columns, blocks per row); 10 rows (no multiple of a tile). 4 blocks: whole steps (no
# masks); 2 or 5: a partly masked last step; 3 blocks under split-K 4: empty splits; 17 under split-K 3 at b8:
# one step a split, the last partly masked (the one-launch fixup: `_store_split`)
CASES = [(fmt, sched, m, nb) for fmt in ROWS_FORMATS
         for sched, m, nb in (("rows_n8_m1_b4_w4", 1, 4), ("rows_n4_m1_b8_w4", 1, 5),
                              ("rows_n4_m1_b4_w2_s4", 1, 3), ("rows_n4_m1_b4_w1_r2_ef", 1, 5),
                              ("rows_n8_m4_b4_w1_r4", 3, 4), ("rows_n4_m8_b4_w1_r2_s2", 8, 3),
                              ("rowsp_n4_m1_b4_w1", 1, 4), ("rowsp_n4_m1_b8_w2", 1, 5),
                              ("rowsp_n2_m1_b4_w1_s4", 1, 3), ("rowsp_n2_m4_b4_w1", 3, 2),
                              ("rows_n8_m1_b4_w2_r2_ef", 1, 8), ("rows_n16_m1_b4_w2_r4_ef", 1, 5),
                              ("rows_n8_m1_b8_w4_r2_s3_ef", 1, 17))]


@pytest.mark.parametrize("fmt,sched,width,nb", CASES)
def test_rows_kernel_equals_twin(fmt, sched, width, nb):
    raw, x = gemv_case(fmt, 10, nb * 256, width, seed=ROWS_FORMATS.index(fmt) * 10 + width)
    xa = quantize_activation(x)
    y = gemv_rows(raw, fmt, xa, 10, sched)
    want = gemv_q8_reference(raw, fmt, xa, 10)
    assert y.dtype == torch.float32 and y.shape == (width, 10)
    # fp32 sums of int32 sub-block dot products (as the q8 kernels: ≤ 1.6e-7 of max|y| measured)
    assert (y.double() - want).abs().max() <= 1e-6 * want.abs().max()
    if SCHEDULES[sched].split_k > 1:  # the last split of each tile wrote y and left the workspace zero
        sums, counters = split_workspace(raw.device, 0, 0)
        assert not sums.any() and not counters.any()


def test_rows_route_and_errors():
    assert rows_route("gguf_q4_k", 17408, 5120, 1).name in SCHEDULES
    assert all(rows_route("q5_k", 1024, 5120, m).block_m >= m for m in range(1, MAX_COLUMNS + 1))
    assert rows_route("iq3_s", 17408, 5120, 1) is None
    assert rows_route("q4_k", 17408, 5120, MAX_COLUMNS + 1) is None
    assert rows_route("q4_k", 17408, 5120, 8) is None  # the tensor-core tile is faster there
    # every shape class has a route up to 4 columns, each serving its width
    for shape in ((48, 5120), (5120, 17408), (17408, 5120), (6144, 5120)):
        for fmt in ROWS_FORMATS:
            assert all(rows_route(fmt, *shape, m).block_m >= m for m in range(1, 5))
    # the 27B step's attention input and output projections: the schedules timed on those shapes
    assert rows_route("q4_k", 14336, 5120, 2).name == "rowsp_n2_m2_b4_w1"
    assert rows_route("q4_k", 5120, 6144, 4).name == "rowsp_n2_m4_b4_w1"
    assert rows_route("q4_k", 12288, 5120, 4).name == "rows_n8_m4_b4_w1_r4"  # its shape class's
    raw, x = gemv_case("q6_k", 4, 256, 1, seed=3)
    with pytest.raises(NinferError, match="rows GEMV"):
        gemv_rows(raw, "q6_k", quantize_activation(x), 4, "rows_n8_m1_b4_w4")


def test_sm90_build_does_not_depend_on_the_row_length():
    """Rows of a number of blocks that is not a multiple of 4 (2560, 9728 columns) get Triton's build without
    the 16-divisibility hint on the row length: the same block loop as the 27B's rows (passed in words, such
    rows fell back to narrower loads: 2-3x the instructions)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # compiled mode: a fresh process
    env["NINFER_TRITON_COMPILE_CHECK"] = "1"
    out = subprocess.run([sys.executable, str(REPO / "bench" / "sass_rows.py"), "--unhinted"],
                         capture_output=True, text=True, timeout=300, cwd=REPO, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    loops = re.findall(r"^q4_k:(\S+?)( unhinted)?: regs \d+ loop (\d+)", out.stdout, re.M)
    assert len(loops) == 4 and all(int(n) > 0 for *_, n in loops), out.stdout
    by_name: dict[str, set[str]] = {}
    for name, _, n in loops:
        by_name.setdefault(name, set()).add(n)
    assert all(len(ns) == 1 for ns in by_name.values()), out.stdout


def test_sm90_conv_build_keeps_the_loop():
    """The GDN conv epilogue (gdn_decode.ConvEpilogue) leaves the q4_k routes' block loops as they are and
    their registers near the plain builds' when its operands load after the loop (one column); loaded
    before the wait (two columns) they stay in registers, not local memory."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["NINFER_TRITON_COMPILE_CHECK"] = "1"
    pattern = r"^q4_k:(\S+): regs (\d+) loop (\d+) \(LDG (\d+), IDP (\d+), local (\d+)\)"
    builds = {}
    for flags in ([], ["--conv"], ["--conv", "--early"]):
        out = subprocess.run([sys.executable, str(REPO / "bench" / "sass_rows.py"), "--schedules",
                              "rows_n16_m1_b4_w4_r2_ef,rows_n4_m2_b4_w1_r2", *flags], capture_output=True,
                             text=True, timeout=300, cwd=REPO, env=env)
        assert out.returncode == 0, out.stderr[-2000:]
        for name, *numbers in re.findall(pattern, out.stdout, re.M):
            builds[name, " ".join(flags)] = tuple(map(int, numbers))
    assert len(builds) == 6, builds
    for name in ("rows_n16_m1_b4_w4_r2_ef", "rows_n4_m2_b4_w1_r2"):
        plain, late, early = (builds[name, f] for f in ("", "--conv", "--conv --early"))
        # the same loads and dp4a, no local memory in the loop, about the same instructions
        assert plain[2:] == late[2:] == early[2:] and plain[4] == 0, builds
        assert abs(late[1] - plain[1]) <= 4 and abs(early[1] - plain[1]) <= 16, builds
        assert late[0] <= plain[0] + 4, builds
