"""How far the engine's logits move between routes, on the tiny fixture files: a one-lane greedy decode
(prefill in 16-token chunks, then one column a step) against the CPU fp32 reference and against the same
device's prefill of the prompt plus the decode's own tokens in one chunk (the many-column routes), every
fourth step. Greedy tests that compare runs taking different routes (one lane against four, GPU against
CPU) may only trust steps whose top-1/top-2 margin exceeds twice these distances. The rounds run without
CUDA graphs (a replay's logits never reach Python; eager rounds give the same numbers).

    python bench/logit_drift.py [--device cuda] [--files model-bf16.gguf,model-q4_k_m.gguf]

Prints, per file and prompt, max |Δ logit| at steps 0, 4, ..., 20: decode vs CPU, one chunk vs CPU, decode
vs one chunk. Needs NINFER_SHARED (the fixtures) and tests/ on the path (it reuses the tests' drivers).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
from conftest import convert_tiny, reference_prompts  # noqa: E402
from test_engine_invariants import greedy_logits  # noqa: E402

from ninfer.artifact import open_artifact  # noqa: E402
from ninfer.models import load_model  # noqa: E402

STEPS = 24


def last_logits(model, device: str, dtype: str, ids: tuple[int, ...], max_tokens: int,
                chunk: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens and each round's last-position logits for one prompt alone."""
    kv = "fp32" if device == "cpu" else "bf16"
    tokens, logits = greedy_logits(model, device, dtype, kv, {"x": ids}, max_tokens, chunk, graphs=False)
    return tokens["x"], logits["x"]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--files", default="model-bf16.gguf,model-q4_k_m.gguf")
    args = ap.parse_args(argv)
    prompts = reference_prompts()
    for name in args.files.split(","):
        artifact = open_artifact(convert_tiny(Path(tempfile.mkdtemp()) / "tiny.ninfer", name))
        test = load_model(artifact, dtype=torch.bfloat16, device=args.device, load_mtp=False,
                          quantized_weights=name != "model-bf16.gguf")
        ref = load_model(artifact, load_mtp=False)
        for p, ids in prompts.items():
            tokens, decoded = last_logits(test, args.device, "bfloat16", ids, STEPS, 16)
            rows = {"decode vs CPU": [], "one chunk vs CPU": [], "decode vs one chunk": []}
            for k in range(0, STEPS, 4):
                forced = tuple(ids) + tuple(tokens[:k])
                cpu = last_logits(ref, "cpu", "float32", forced, 1, 128)[1][0]
                chunk = last_logits(test, args.device, "bfloat16", forced, 1, 128)[1][0]
                for key, a, b in (("decode vs CPU", decoded[k], cpu), ("one chunk vs CPU", chunk, cpu),
                                  ("decode vs one chunk", decoded[k], chunk)):
                    rows[key].append(f"{(a - b).abs().max().item():.3f}")
            print(f"{name} {p} ({args.device}): " + " | ".join(f"{k} {' '.join(v)}" for k, v in rows.items()),
                  flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
