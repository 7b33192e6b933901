"""`ninfer-perplexity`: perplexity of a text file through the engine's own path, per KV dtype.

Compares KV dtypes (and, run on two artifacts, weight formats): the text is fed as one sequence in
`--chunk` pieces and every key is read back from the KV pool of the chosen dtype.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

from ninfer.cli.bench import parse_kv_dtypes, perplexity_row, table
from ninfer.cli.common import make_parser, run_cli
from ninfer.engine.engine import DTYPES, Engine, EngineConfig
from ninfer.errors import EngineConfigError
from ninfer.kernels.kv_quant import KV_DTYPES


def build_parser() -> argparse.ArgumentParser:
    p = make_parser("ninfer-perplexity",
                    "Perplexity of a text file, to compare KV dtypes and weight formats.")
    p.add_argument("model", help="path of the .ninfer artifact")
    p.add_argument("text", type=Path, help="UTF-8 text file to score")
    p.add_argument("--tokens", type=int, default=3072, help="score the file's first N tokens (default 3072)")
    p.add_argument("--kv-dtype", default="bf16", help="KV dtype, or a comma-separated list to compare "
                                                      f"({', '.join(KV_DTYPES)}; default bf16)")
    p.add_argument("--chunk", type=int, default=512, help="tokens fed per forward (default 512)")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] (default cpu)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES),
                   help="compute dtype (default float32)")
    p.add_argument("-o", "--output", choices=("table", "json"), default="table", help="output format")
    return p


def body(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    if args.tokens < 2 or args.chunk < 1:
        raise EngineConfigError("--tokens must be >= 2 and --chunk >= 1")
    kv_dtypes = parse_kv_dtypes(args.kv_dtype)
    if not args.text.is_file():
        raise EngineConfigError(f"text file not found: {args.text}")
    text = args.text.read_text(encoding="utf-8", errors="replace")
    config = EngineConfig(max_context=args.tokens, kv_capacity=args.tokens, kv_dtype=kv_dtypes[0],
                          device=args.device, dtype=args.dtype, prefill_chunk=args.chunk)
    engine = Engine(args.model, config)
    ids = engine.tokenizer.encode(text)[: args.tokens]
    if len(ids) < 2:
        raise EngineConfigError(f"{args.text} holds fewer than 2 tokens")
    common = dict(model=Path(args.model).stem, device=args.device, dtype=args.dtype)
    rows = []
    for kv in kv_dtypes:
        if kv != engine.config.kv_dtype:
            config = replace(engine.config, kv_dtype=kv)
            engine = Engine.from_model(engine.model, config, tuple(engine.eos_ids))
        rows.append({**common, "kv_dtype": kv, **perplexity_row(engine, ids)})
    print(json.dumps(rows, indent=1) if args.output == "json" else table(rows))
    print(f"{len(ids)} tokens of {args.text}", file=sys.stderr)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(body, argv)


if __name__ == "__main__":
    sys.exit(main())
