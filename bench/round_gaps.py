"""Whether the suite's aggregate decode waits on the host: `bench_suite.aggregate_decode` (the suite's own
rounds, decode lookahead on) with CUDA events around every graph replay — per round the graph's GPU time and
the GPU time from one graph's end to the next one's start (staging, argmax, the token copies, and any wait on
the host) — beside `step_profile.replay_ms`'s back-to-back replays of the same graph on the lanes' own slots.

    python3 bench/round_gaps.py --wtype q4_k --lanes 1,8   # GPU machine (wheels installed as gpu_bench.sh)

Session 52 (H100, Q4_K, max context 4,096): C = 8 849 tok/s, 9.43 ms a round — the graph 9.34 ms (the replays
alone 9.33-9.43), 0.025 ms between graphs at 1 and 8 lanes alike: the round is the graph's, not the host's.
The suite's C = 8 (max context 16,520: 64 attention splits a sequence, against 32 here) ran 3-4 % lower
(H100: 822 tok/s in session 51's suite; H200: 921.8 against this engine's own-slot replay, 8.366 ms = 956).

    python3 bench/round_gaps.py --wtype q4_k --max-context 4096        # session 52's engine
    python3 bench/round_gaps.py --wtype q4_k --attn-programs 512       # the suite's, attention capped
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from step_profile import add_model_arguments, engine_args, replay_ms  # noqa: E402

from ninfer.cli.bench import make_engine  # noqa: E402
from ninfer.cli.bench_suite import SuiteSizes, aggregate_decode  # noqa: E402
from ninfer.kernels import paged_attention  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_model_arguments(p, "q4_k")
    p.add_argument("--lanes", default="1,8")
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--max-context", type=int, default=SuiteSizes().context_tokens(),
                   help="the engine's max context (default the suite's, 16,520: its page tables' width sets "
                        "the decode attention's splits)")
    p.add_argument("--attn-programs", type=int, default=None,
                   help="paged_attention.DECODE_PROGRAMS for this run (0: no cap)")
    a = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("round_gaps times CUDA graphs: run it on the GPU machine")
    lanes = [int(c) for c in a.lanes.split(",")]
    kv = SuiteSizes(short_prompt=a.prompt, concurrency=(max(lanes),)).kv_tokens()
    if a.attn_programs is not None:
        paged_attention.DECODE_PROGRAMS = a.attn_programs
    engine, name = make_engine(engine_args(a, True, None), "bf16", a.max_context, 2048, lanes=max(lanes),
                               kv_tokens=max(a.max_context, kv))
    marks: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
    replay = torch.cuda.CUDAGraph.replay

    def marked(graph) -> None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        replay(graph)
        end.record()
        marks.append((start, end))

    print(f"{name}, {a.prompt}-token prompts, max context {a.max_context}, "
          f"decode attention programs at most {paged_attention.DECODE_PROGRAMS or 'uncapped'}")
    print("| lanes | suite tok/s | ms a round | graph ms (median, middle half) | between graphs ms | "
          "replays alone, own slots |\n|---|---|---|---|---|---|")
    for c in lanes:
        marks.clear()
        torch.cuda.CUDAGraph.replay = marked
        try:
            rate = aggregate_decode(engine, SuiteSizes(short_prompt=a.prompt), c, "cuda")
        finally:
            torch.cuda.CUDAGraph.replay = replay
        torch.cuda.synchronize()
        steady = marks[len(marks) // 4: 3 * len(marks) // 4]
        graph = statistics.median(s.elapsed_time(e) for s, e in steady)
        gaps = zip(steady, steady[1:], strict=False)  # one graph's end, the next one's start
        between = statistics.median(end.elapsed_time(start) for (_, end), (start, _) in gaps)
        alone = replay_ms(engine, 1, lanes=c, context=a.prompt)
        print(f"| {c} | {rate:.1f} | {c / rate * 1e3:.3f} | {graph:.3f} | {between:.3f} | {alone:.3f} |",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
