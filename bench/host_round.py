"""The engine's own work per decode round (scheduling, staging, sampling, commit): a round's wall time
minus its forward (`runner.run`), at each lane count, through the suite's `drive` (bench_suite), on the CPU
(no decode lookahead there: every round's forward is one `runner.run` call). On a GPU the lookahead overlaps
this work with the next round; measured here it bounds that work from above.

    python bench/host_round.py                       # CPU: the tiny synthetic model, 1 and 8 lanes
    python bench/host_round.py --lanes 1,2,4,8 --rounds 64
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ninfer.cli.bench_suite import _submit, drive  # noqa: E402
from ninfer.engine.engine import Engine, EngineConfig  # noqa: E402
from ninfer.engine.synthetic import synthetic_model  # noqa: E402


def host_ms(lanes: int, rounds: int, geometry: str, device: str) -> tuple[float, float]:
    """(round wall ms, forward ms), means over the rounds where every lane decodes."""
    cfg = EngineConfig(max_concurrency=lanes, max_context=1024, kv_capacity=1024 * lanes, kv_dtype="bf16",
                       device=device, dtype="float32", prefill_chunk=64)
    engine = Engine.from_model(synthetic_model(geometry, torch.float32, device, wtype="bf16",
                                               quantized_weights=False), cfg)
    forward: list[float] = []
    run = engine.runner.run

    def timed(*args, **kw):
        t0 = time.perf_counter()
        out = run(*args, **kw)
        forward.append(time.perf_counter() - t0)
        return out

    engine.runner.run = timed
    drive(engine, [_submit(engine, "warm", 16, 4, 1000 + i) for i in range(lanes)], device)
    forward.clear()
    log = drive(engine, [_submit(engine, "host", 32, rounds + lanes, i) for i in range(lanes)], device)
    both = [(s, f) for (n, decode_only, s), f in zip(log, forward, strict=True) if decode_only and n == lanes]
    return (1e3 * sum(s for s, _ in both) / len(both), 1e3 * sum(f for _, f in both) / len(both))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--lanes", default="1,8")
    p.add_argument("--rounds", type=int, default=128)
    p.add_argument("--synthetic", default="tiny")
    a = p.parse_args()
    torch.set_num_threads(1)
    for lanes in map(int, a.lanes.split(",")):
        wall, fwd = host_ms(lanes, a.rounds, a.synthetic, "cpu")
        print(f"{lanes} lanes: round {wall:.3f} ms, forward {fwd:.3f} ms, "
              f"the engine's own work {wall - fwd:.3f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
