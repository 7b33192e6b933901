"""Shared CLI frame: --version, one-line errors, exit codes (1 bad input, 2 usage)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from ninfer import __version__
from ninfer.errors import NinferError


def make_parser(prog: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--version", action="version", version=f"{prog} {__version__}")
    return parser


def run_cli(body: Callable[[Sequence[str] | None], int], argv: Sequence[str] | None = None) -> int:
    """Run a CLI body; a NinferError or a missing file becomes `error: ...` on stderr and exit 1."""
    prog = getattr(body, "__module__", "ninfer").rsplit(".", 1)[-1]
    try:
        return body(argv)
    except NinferError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except FileNotFoundError as exc:
        print(f"error: file not found: {exc.filename or exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(f"{prog}: interrupted", file=sys.stderr)
        return 130
