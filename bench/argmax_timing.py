"""What the decode round's last device ops cost between two graphs: the greedy argmax over the logits and the
head's bf16 → fp32 cast (`compute_logits`), µs a call in one CUDA graph of back-to-back calls on one buffer
(the head has just written it: L2), at 1-8 rows of the 27B's vocabulary.

    PYTHONPATH=$PWD python3 bench/argmax_timing.py [--vocab 248320 --rows 1,4,8]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.gpu_check import graph_us  # noqa: E402


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--vocab", type=int, default=248320)
    p.add_argument("--rows", default="1,4,8")
    a = p.parse_args()
    print(f"{'rows':>4} {'argmax µs':>10} {'cast µs':>8}")
    for rows in (int(r) for r in a.rows.split(",")):
        logits = torch.randn(rows, a.vocab, device="cuda")
        half = logits.to(torch.bfloat16)
        want = logits.double().argmax(-1)
        assert torch.equal(logits.argmax(-1), want)
        argmax = graph_us([lambda x=logits: x.argmax(-1)] * 8)
        cast = graph_us([lambda x=half: x.float()] * 8)
        print(f"{rows:>4} {argmax:>10.2f} {cast:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
