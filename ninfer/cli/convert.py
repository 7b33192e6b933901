"""ninfer-convert: GGUF / safetensors sources + a metadata folder -> one .ninfer artifact."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from ninfer.cli.common import make_parser, run_cli
from ninfer.convert import ConvertRequest, convert, recipe_names
from ninfer.errors import ConversionError

EPILOG = """example:
  ninfer-convert --model META_DIR --recipe qwen3_8_27b_gguf \\
     --source gguf=Model-IQ3_S-mtp.gguf --source mtp=Model-IQ3_S-mtp.gguf \\
     --source vision=mmproj-BF16.gguf --components text,vision,mtp \\
     --resource chat_template.jinja=template.jinja --name my-model --out model.ninfer
"""


def build_parser() -> argparse.ArgumentParser:
    p = make_parser("ninfer-convert", "Convert GGUF / safetensors sources into one .ninfer artifact.")
    p.formatter_class = argparse.RawDescriptionHelpFormatter
    p.epilog = EPILOG
    p.add_argument(
        "--model",
        type=Path,
        metavar="DIR",
        help="metadata folder: config.json, generation_config.json, tokenizer.json, "
        "tokenizer_config.json (+ chat_template.jinja); vision also preprocessor_config.json "
        "and video_preprocessor_config.json; the qwen3_5 recipe also reads its safetensors",
    )
    p.add_argument(
        "--recipe", required=True, metavar="NAME", help="conversion recipe: " + ", ".join(recipe_names())
    )
    p.add_argument(
        "--source",
        action="append",
        default=[],
        metavar="NAME=PATH",
        help="a source file (repeatable); NAME is gguf, mtp, vision or safetensors. mtp may be the "
        "same file as gguf (an -mtp GGUF); vision is the mmproj GGUF",
    )
    p.add_argument(
        "--components",
        default="text",
        metavar="LIST",
        help="comma-separated components to include: text[,vision][,mtp] (default: text)",
    )
    p.add_argument(
        "--resource",
        action="append",
        default=[],
        metavar="ROLE=PATH",
        help="add or replace a resource (repeatable), e.g. chat_template.jinja=template.jinja, "
        "generation_config.json=PATH",
    )
    p.add_argument(
        "--device",
        default="cpu",
        choices=("cpu", "cuda"),
        help="device for re-encoding work (default cpu; carried blocks are copied as bytes)",
    )
    p.add_argument(
        "--rows-per-chunk",
        type=int,
        default=512,
        metavar="N",
        help="rows streamed per chunk; bounds peak memory (default 512)",
    )
    p.add_argument("--name", help="metadata.name: the public model id (default: the architecture name)")
    p.add_argument("--out", required=True, type=Path, metavar="PATH", help="output .ninfer file")
    p.add_argument("--force", action="store_true", help="overwrite an existing output file")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    return p


def _pairs(parser: argparse.ArgumentParser, values: list[str], flag: str) -> dict[str, Path]:
    pairs: dict[str, Path] = {}
    for value in values:
        name, sep, path = value.partition("=")
        if not sep or not name or not path:
            parser.error(f"{flag} expects NAME=PATH, got {value!r}")
        if name in pairs:
            raise ConversionError(f"{flag} {name}= is given twice; pass each once")
        pairs[name] = Path(path)
    return pairs


def _body(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    request = ConvertRequest(
        recipe=args.recipe,
        out=args.out,
        sources=_pairs(parser, args.source, "--source"),
        components=tuple(c.strip() for c in args.components.split(",") if c.strip()),
        model_dir=args.model,
        resources=_pairs(parser, args.resource, "--resource"),
        device=args.device,
        rows_per_chunk=args.rows_per_chunk,
        name=args.name,
        force=args.force,
        argv=tuple(sys.argv[:1]) + tuple(argv if argv is not None else sys.argv[1:]),
    )
    result = convert(request, progress=not args.quiet)
    print(f"wrote {result.summary.path}")
    print(f"{result.summary.objects} objects")
    print("1 files")
    print(f"{result.seconds:.2f} s")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(_body, argv)


if __name__ == "__main__":
    sys.exit(main())
