"""What the int8 activation's group size costs in accuracy (CPU): perplexity of a real model with the input of
every Linear quantised to int8 in groups of G values and back, as the GPU's decode GEMVs see it (G = 32 is
`quantize_activation_reference`: d = max|x| / 127 a group, round half to even), for each G of --groups (0: not
quantised). Decides whether a GEMV may take one activation scale per 256 inputs (one float conversion a block,
as llama.cpp's CPU dot products do with q8_K) instead of one per 32.

    python bench/act_group_ppl.py --text docs/engine.md --tokens 1024 --groups 0,32,64,128,256
    python bench/act_group_ppl.py --model smollm2 --text README.md

--model: a packaged model's key (`ninfer.models_cache.MODELS`: fetched and converted once into the cache) or
a `.ninfer` path.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from ninfer import models_cache
from ninfer.engine.engine import Engine, EngineConfig
from ninfer.engine.perplexity import perplexity
from ninfer.models.weights import Linear


def fake_quantize(x: torch.Tensor, group: int) -> torch.Tensor:
    """x through int8 codes in groups of `group` along its last axis (the scales stay float32)."""
    if group == 0:
        return x
    k = x.shape[-1]
    pad = -k % group  # a width that is no multiple of the group: the last group is shorter
    xg = torch.nn.functional.pad(x.float(), (0, pad)).reshape(*x.shape[:-1], (k + pad) // group, group)
    d = xg.abs().amax(-1, keepdim=True) / torch.tensor(127.0)
    q = torch.round(xg / torch.where(d == 0, torch.ones_like(d), d)).clamp(-127, 127)
    return (q * d).reshape(*x.shape[:-1], k + pad)[..., :k].to(x.dtype)


def artifact(model: str) -> Path:
    if model in models_cache.MODELS:
        return models_cache.converted_artifact(models_cache.MODELS[model], quiet=True)
    return Path(model)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen2.5-coder", help="packaged model key or .ninfer path")
    p.add_argument("--text", type=Path, required=True, help="text whose first --tokens tokens are scored")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--groups", default="0,32,256", help="group sizes, 0 = the unquantised activation")
    args = p.parse_args()
    path = artifact(args.model)
    engine = Engine(path, EngineConfig(device="cpu", dtype="float32", max_context=args.tokens + 16,
                                       kv_capacity=args.tokens + 16, prefill_chunk=256))
    ids = engine.tokenizer.encode(args.text.read_text(encoding="utf-8"))[: args.tokens]
    forward = Linear.forward
    print(f"{path.name}: {len(ids)} tokens of {args.text}")
    print("| group | perplexity | vs unquantised | seconds |\n|---|---|---|---|")
    base = None
    for group in (int(g) for g in args.groups.split(",")):
        Linear.forward = lambda self, x, *a, _g=group, **kw: forward(self, fake_quantize(x, _g), *a, **kw)
        t0 = time.monotonic()
        try:
            ppl, _ = perplexity(engine, ids)
        finally:
            Linear.forward = forward
        base = ppl if base is None else base
        seconds = time.monotonic() - t0
        print(f"| {group or '-'} | {ppl:.4f} | {ppl / base - 1:+.3%} | {seconds:.0f} |", flush=True)


if __name__ == "__main__":
    main()
