"""Decode tok/s of a synthetic model with greedy tokens and with the Qwen presets' sampling (what
`ninfer-serve` applies to a chat request), at one and four lanes, in one process: what choosing the tokens
costs the round. `--tree DIR` imports ninfer from another checkout (e.g. `git archive 8bdba16 ninfer | tar -x
-C /tmp/old`: main before session 79, which copied a sampled round's logits to the host and sampled there).

    python3 bench/tg_sampling.py --wtype q4_k [--tree /tmp/old]     # GPU machine (wheels as gpu_bench.sh)

Session 79 (H200, 512-token prompts, 128 tokens, two requests a row; tok/s Q4_K / IQ3_S): greedy 197.0 /
191.7 either way; the thinking preset 43.8 / 31.2 on the host → 191.1 / 186.1 on the device, non-thinking
(with its presence penalty) 34.4 / 26.7 → 188.6 / 183.6; four lanes with the thinking preset 44.4 / 38.1 →
650.3 / 538.0 (greedy 667.6 / 550.1). Since session 80 each sampled row twice: the sampler's two kernels
(`ninfer.kernels.sampling`) and its PyTorch ops (NINFER_FUSED_SAMPLER=0).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
p.add_argument("--wtype", default="q4_k")
p.add_argument("--geometry", default="27b")
p.add_argument("--device", default="cuda")
p.add_argument("--prompt", type=int, default=512)
p.add_argument("-n", "--n-gen", type=int, default=128)
p.add_argument("--tree", type=Path, help="import ninfer from this directory (another checkout's)")
p.add_argument("--tag", default="", help="the table's first column (default: the tree)")
a = p.parse_args()
sys.path.insert(0, str(a.tree.resolve() if a.tree else Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from ninfer.cli.bench import bench_prompt, build_parser, make_engine  # noqa: E402
from ninfer.engine.api import GenerationRequest, SamplingParams  # noqa: E402
from ninfer.frontend.presets import NON_THINKING_PRESET, THINKING_PRESET  # noqa: E402

PRESETS = {"greedy": {"temperature": 0.0}, "thinking": THINKING_PRESET, "non-thinking": NON_THINKING_PRESET}
on_gpu = a.device.startswith("cuda")
args = build_parser().parse_args(["--synthetic", a.geometry, "--wtype", a.wtype, "--device", a.device,
                                  "--dtype", "bfloat16" if on_gpu else "float32"])
ctx = a.prompt + a.n_gen + 32
engine, name = make_engine(args, "bf16", ctx, a.prompt, lanes=4, kv_tokens=4 * ctx)
vocab = engine.model.vocab_size


def decode_rate(preset: str, lanes: int, n_gen: int, seed: int) -> float:
    """Generated tokens a second over the rounds where every lane decodes (their prefills excluded)."""
    handles = [engine.submit(GenerationRequest(f"r{i}", bench_prompt(vocab, a.prompt, seed=seed * 10 + i),
                                               SamplingParams(max_tokens=n_gen, ignore_eos=True, seed=i,
                                                              **PRESETS[preset])))
               for i in range(lanes)]
    start, count, ended = None, 0, 0
    while ended < lanes:
        rnd = engine.scheduler.schedule()
        if rnd is not None:
            engine.step(rnd)
        for h in handles:
            while (ev := h.next_event(0)) is not None:
                if start is None and all(x.seq.generated for x in handles):
                    start = time.perf_counter()  # every lane decoding: the clock starts
                elif start is not None:
                    count += len(ev.token_ids)
                ended += ev.finish_reason is not None
    if on_gpu:
        torch.cuda.synchronize()
    return count / (time.perf_counter() - start)


tag = a.tag or (str(a.tree) if a.tree else "this tree")
print("| tree | model | sampling | sampler | lanes | decode tok/s (two requests) |")
print("|---|---|---|---|---|---|")
for preset, lanes in (("greedy", 1), ("thinking", 1), ("non-thinking", 1), ("greedy", 4), ("thinking", 4)):
    # a sampled round's tokens: the two kernels, then PyTorch's ops (NINFER_FUSED_SAMPLER=0), in this process
    for sampler in ("kernels", "pytorch") if preset != "greedy" else ("-",):
        os.environ["NINFER_FUSED_SAMPLER"] = "0" if sampler == "pytorch" else "1"
        decode_rate(preset, lanes, 8, seed=99)  # warm-up: graphs, the sampler's kernels
        rates = [decode_rate(preset, lanes, a.n_gen, seed=r) for r in range(2)]
        rates = " / ".join(f"{r:.1f}" for r in rates)
        print(f"| {tag} | {name} | {preset} | {sampler} | C={lanes} | {rates} |", flush=True)
