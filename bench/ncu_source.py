"""Where a kernel's warps wait, per SASS instruction, from Nsight Compute's source page: the stall reasons
over all samples, the op mix by executed instructions, and every instruction holding more than
`1/(2.5·top)` of the samples with its three largest stall reasons.

    ncu --profile-from-start off --clock-control none --section SourceCounters --section WarpStateStats \\
        -o $OUT/il -f python3 bench/ncu_gemv.py --nvrtc --shape 34816x5120 iq3_s:1:cu_il_w10_c16
    ncu -i $OUT/il.ncu-rep --page source --csv --print-source sass > $OUT/src.csv
    python3 bench/ncu_source.py $OUT/src.csv 0        # the first profiled kernel (ncu_gemv calls each twice)

(docs/gpu-notes.md "Session 29": the il32 kernels read this way.)
"""

from __future__ import annotations

import argparse
import collections
import csv
import io
import re

SAMPLES = "Warp Stall Sampling (All Samples)"
EXECUTED = "Instructions Executed"


def kernels(text: str) -> list[tuple[str, list[dict]]]:
    """(name, rows) of each kernel in the dump: a `"Kernel Name","<name>",` line, then a CSV table."""
    out = []
    for part in text.split('"Kernel Name",')[1:]:
        head, _, body = part.partition("\n")
        out.append((head.strip().strip(",").strip('"'), list(csv.DictReader(io.StringIO(body)))))
    return out


def number(row: dict, column: str) -> float:
    return float(row.get(column) or 0)


def opcode(source: str) -> str:
    """`@!P0 LOP3.LUT R1, ...` -> `LOP3`."""
    return re.sub(r"^@!?U?P\w+\s+", "", source.strip()).split(" ")[0].split(".")[0]


def summary(name: str, rows: list[dict], top: int) -> list[str]:
    samples = sum(number(r, SAMPLES) for r in rows) or 1.0
    executed = sum(number(r, EXECUTED) for r in rows) or 1.0
    stalls = [c for c in rows[0] if c.startswith("stall_") and "Not Issued" not in c] if rows else []
    by_stall = collections.Counter({c: sum(number(r, c) for r in rows) for c in stalls})
    by_op = collections.Counter()
    for r in rows:
        by_op[opcode(r["Source"])] += number(r, EXECUTED)
    lines = [f"{name}: {len(rows)} SASS lines, {samples:.0f} samples, {executed:.0f} warp instructions",
             "stalls: " + ", ".join(f"{c[6:]} {v / samples:.1%}" for c, v in by_stall.most_common(8)),
             "ops: " + ", ".join(f"{o} {v / executed:.1%}" for o, v in by_op.most_common(16))]
    for i, r in enumerate(rows):
        s = number(r, SAMPLES)
        if s / samples > 1 / (2.5 * top):
            worst = sorted(((number(r, c), c[6:]) for c in stalls), reverse=True)[:3]
            reasons = " ".join(f"{n} {v / s:.0%}" for v, n in worst)
            where = f"{i:5d} {s / samples:6.1%} executed {number(r, EXECUTED):9.0f}"
            lines.append(f"{where}  {r['Source'][:60]:60s} {reasons}")
    return lines


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("csv", help="ncu --page source --csv --print-source sass output")
    p.add_argument("kernel", type=int, nargs="?", default=0, help="index of the profiled kernel (default 0)")
    p.add_argument("--top", type=int, default=40, help="instructions above 1/(2.5·top) of the samples")
    a = p.parse_args()
    found = kernels(open(a.csv, encoding="utf-8").read())
    if not 0 <= a.kernel < len(found):
        p.error(f"{a.csv} holds {len(found)} kernels; pick an index below that")
    print("\n".join(summary(*found[a.kernel], a.top)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
