"""Does the memory plan hold? The synthetic model served with `--kv-capacity auto`, the caching allocator
capped at the plan's budget (less what the CUDA context and others hold), a long prompt prefilled chunk by
chunk beside short requests that decode meanwhile: out of memory or not, and the allocator's peaks against
the plan (weights + KV + GDN slots + measured workspace + graphs), its cached split blocks among them.

    python3 bench/memory_probe.py --wtype q4_k --chunk 2048 --headroom-mib 1024 --prompt 16384 --decoders 7
    python3 bench/memory_probe.py --synthetic tiny --device cpu --dtype float32 --prompt 300 --chunk 128 \
        --decoders 2   # CPU smoke (no allocator to cap: the plan and the run only)

gpu-notes "Session 46", run 4: the 27B (q4_k), 1 GiB headroom, 2048-token chunks, 16K prompt beside 7
decoders: no OOM, peak allocated 12 MiB over the plan, peak reserved 845 MiB over (inactive split blocks).

`--stranded`: the allocator's history recorded from the start, its segments read at the out-of-memory (or at
the end): the free bytes it cannot hand back — inactive blocks in segments that also hold live ones — by
where the live blocks beside them were allocated (gpu-notes "Session 54": loading leaves them; the plan holds
them since, as the allocator's slack).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ninfer.cli.bench_suite import _submit, drive  # noqa: E402
from ninfer.engine.engine import DTYPES, Engine, EngineConfig  # noqa: E402
from ninfer.engine.memory import MIB  # noqa: E402
from ninfer.engine.synthetic import synthetic_model  # noqa: E402


def allocation_site(frames: list[dict], roots: tuple[str, ...] = ("ninfer/", "bench/")) -> str:
    """The innermost of a block's allocation frames in our code (`file:line name`), else its innermost."""
    ours = [f for f in frames if any(root in f["filename"] for root in roots)]
    if not (ours or frames):
        return "(no stack)"
    frame = (ours or frames)[0]
    path = frame["filename"]
    return f"{path[max(0, *(path.rfind(root) for root in roots)):]}:{frame['line']} {frame['name']}"


def stranded_by_site(snapshot: dict) -> list[dict]:
    """Inactive bytes in segments that also hold live blocks (`torch.cuda.memory._snapshot()`'s segments of
    the default pool: a CUDA graph's private pool is planned apart), each segment's shared among its live
    blocks' allocation sites by their sizes: rows of site, stranded bytes, live bytes and live blocks, most
    stranded first."""
    rows: dict[str, dict] = {}
    for segment in snapshot["segments"]:
        if tuple(segment.get("segment_pool_id", (0, 0))) != (0, 0):
            continue
        live = [b for b in segment["blocks"] if b["state"] != "inactive"]
        free = sum(b["size"] for b in segment["blocks"] if b["state"] == "inactive")
        if not live or not free:
            continue
        live_bytes = sum(b["size"] for b in live)
        for block in live:
            row = rows.setdefault(allocation_site(block.get("frames", [])),
                                  {"stranded": 0.0, "live": 0, "blocks": 0})
            row["stranded"] += free * block["size"] / live_bytes
            row["live"] += block["size"]
            row["blocks"] += 1
    return sorted(({"site": site, **row} for site, row in rows.items()), key=lambda r: -r["stranded"])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--synthetic", default="27b")
    p.add_argument("--wtype", default="q4_k")
    p.add_argument("--device", default="cuda")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--chunk", type=int, default=2048, help="the engine's prefill chunk")
    p.add_argument("--headroom-mib", type=int, default=1024, help="--kv-headroom-mib")
    p.add_argument("--prompt", type=int, default=16384, help="the long prompt's tokens")
    p.add_argument("--decoders", type=int, default=7, help="short requests decoding beside it")
    p.add_argument("--out", type=Path, help="a folder for memory_probe.json")
    p.add_argument("--stranded", action="store_true",
                   help="record allocation stacks; the free bytes stuck beside live blocks, by site")
    a = p.parse_args()
    on_gpu = a.device.startswith("cuda")
    at_oom: list[dict] = []
    if a.stranded and on_gpu:
        torch.cuda.memory._record_memory_history(max_entries=20_000, stacks="python")
        torch._C._cuda_attach_out_of_memory_observer(lambda *_: at_oom.append(torch.cuda.memory._snapshot()))
    lanes = a.decoders + 1
    model = synthetic_model(a.synthetic, DTYPES[a.dtype], a.device, wtype=a.wtype, quantized_weights=on_gpu)
    config = EngineConfig(max_concurrency=lanes, max_context=a.prompt + 64, kv_capacity="auto" if on_gpu
                          else (a.prompt + 64) * lanes, device=a.device, dtype=a.dtype, prefill_chunk=a.chunk,
                          kv_headroom_mib=a.headroom_mib)
    engine = Engine.from_model(model, config)
    start = engine.memory_ledger()
    print(start.line(), flush=True)
    plan, cap = start.held_bytes, start.budget_bytes - start.other_bytes
    row = dict(model=f"synthetic-{a.synthetic} ({a.wtype})", chunk=a.chunk, headroom_mib=a.headroom_mib,
               prompt=a.prompt, decoders=a.decoders, plan_mib=plan / MIB, cap_mib=cap / MIB, oom=False)
    if on_gpu:
        total = torch.cuda.get_device_properties(a.device).total_memory
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.set_per_process_memory_fraction(cap / total)
    try:
        handles = [_submit(engine, "decode", 40 + 3 * i, 24 + (i % 4) * 8, i) for i in range(a.decoders)]
        handles.append(_submit(engine, "long", a.prompt, 16, 99))
        drive(engine, handles, a.device)
        finishes = [h.last_event.finish_reason for h in handles]
        row["finishes"] = finishes
        row["oom"] = any(f == "error" for f in finishes)
    except torch.OutOfMemoryError as exc:
        row["oom"], row["error"] = True, str(exc).splitlines()[0]
    finally:
        if on_gpu:
            torch.cuda.set_per_process_memory_fraction(1.0)
    if on_gpu:
        stats = torch.cuda.memory_stats()
        row.update(peak_allocated_mib=stats["allocated_bytes.all.peak"] / MIB,
                   peak_reserved_mib=stats["reserved_bytes.all.peak"] / MIB,
                   peak_inactive_split_mib=stats["inactive_split_bytes.all.peak"] / MIB)
    print(engine.memory_ledger().line())
    print("| | MiB |\n|---|---|")
    for key in ("plan_mib", "cap_mib", "peak_allocated_mib", "peak_reserved_mib", "peak_inactive_split_mib"):
        if key in row:
            print(f"| {key.removesuffix('_mib').replace('_', ' ')} | {row[key]:,.0f} |")
    print(f"out of memory: {row['oom']}" + (f" ({row['error']})" if "error" in row else ""))
    if a.stranded and on_gpu:
        sites = stranded_by_site(at_oom[0] if at_oom else torch.cuda.memory._snapshot())
        row["stranded"] = sites
        print(f"free bytes beside live blocks ({'at the out-of-memory' if at_oom else 'at the end'}), "
              f"{sum(r['stranded'] for r in sites) / MIB:,.0f} MiB in all")
        print("| site | stranded MiB | live MiB | live blocks |\n|---|---|---|---|")
        for r in sites[:12]:
            print(f"| {r['site']} | {r['stranded'] / MIB:,.1f} | {r['live'] / MIB:,.1f} | {r['blocks']} |")
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "memory_probe.json").write_text(json.dumps(row, indent=1))
    return 1 if row["oom"] else 0


if __name__ == "__main__":
    sys.exit(main())
