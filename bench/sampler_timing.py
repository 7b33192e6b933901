"""Device time of one round's sampling (`sampler.sample_rows`) over the 27B's 248,320 logits a row, its two
kernels (`ninfer.kernels.sampling`) against its PyTorch ops (NINFER_FUSED_SAMPLER=0), at 1–8 rows of the
Qwen presets: the launches queue behind a sleeping kernel, so the time is the device's, not the host's.

    python3 bench/sampler_timing.py          # GPU machine
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from ninfer.engine.api import SamplingParams  # noqa: E402
from ninfer.engine.sampler import SamplerState, sample_rows  # noqa: E402
from ninfer.frontend.presets import NON_THINKING_PRESET, THINKING_PRESET  # noqa: E402

VOCAB, CALLS = 248_320, 30


def device_us(x: torch.Tensor, states: list[SamplerState]) -> float:
    """µs of device time a call, CALLS calls queued behind a ~0.1 s sleep (the host's ~2 ms a call of a
    penalised batch's index building stays ahead of it)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(200_000_000)
    start.record()
    for _ in range(CALLS):
        sample_rows(x, states)
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1000 / CALLS


print("| preset | rows | PyTorch ops µs | two kernels µs |\n|---|---|---|---|")
for name, preset in (("thinking", THINKING_PRESET), ("non-thinking", NON_THINKING_PRESET)):
    for rows in (1, 4, 8):
        states = [SamplerState(SamplingParams(seed=i, **preset), tuple(range(i, 600, 7)))
                  for i in range(rows)]
        for st in states:
            for t in range(0, 2000, 13):
                st.record(t)
        x = torch.randn(rows, VOCAB, device="cuda") * 3
        times = {}
        for fused in ("0", "1", "0", "1"):  # A B A B, each the lower of two
            os.environ["NINFER_FUSED_SAMPLER"] = fused
            sample_rows(x, states)  # warm-up (compiles)
            t = device_us(x, states)
            times[fused] = min(times.get(fused, t), t)
        print(f"| {name} | {rows} | {times['0']:.1f} | {times['1']:.1f} |", flush=True)
