"""Every flag of every command-line program is in its page under docs/ (as `--flag` or `-x/--flag`)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# (module of ninfer.cli, its page, how many long flags it has at least: a parser that lost its flags fails)
PROGRAMS = [
    ("run", "cli-run-bench.md", 20),
    ("bench", "cli-run-bench.md", 20),
    ("perplexity", "cli-run-bench.md", 5),
    ("serve", "cli-serve.md", 30),
    ("convert", "cli-convert.md", 10),
    ("inspect", "cli-convert.md", 2),
    ("demo", "models.md", 6),
]


def long_flags(module: str) -> list[str]:
    parser = importlib.import_module(f"ninfer.cli.{module}").build_parser()
    return [s for a in parser._actions for s in a.option_strings if s.startswith("--") and s != "--help"]


@pytest.mark.parametrize(("module", "page", "least"), PROGRAMS, ids=[m for m, _, _ in PROGRAMS])
def test_every_flag_is_documented(module, page, least):
    doc = (REPO / "docs" / page).read_text(encoding="utf-8")
    flags = long_flags(module)
    assert len(flags) >= least
    missing = [f for f in flags if f"`{f}" not in doc and f"/{f}" not in doc]
    assert not missing, f"ninfer.cli.{module}: undocumented in docs/{page}: {missing}"


def test_a_missing_flag_is_caught(monkeypatch):
    """The check reads the parser as built: a flag added to it without a line in the page is reported."""
    import ninfer.cli.inspect as inspect_cli

    build = inspect_cli.build_parser

    def with_extra():
        parser = build()
        parser.add_argument("--not-in-the-docs", action="store_true")
        return parser

    monkeypatch.setattr(inspect_cli, "build_parser", with_extra)
    with pytest.raises(AssertionError, match="--not-in-the-docs"):
        test_every_flag_is_documented("inspect", "cli-convert.md", 2)
