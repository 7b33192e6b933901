"""ninfer-inspect: print an artifact's components, formats, bindings, metadata (objects with --objects)."""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from collections.abc import Sequence

from ninfer.artifact import Artifact, open_artifact
from ninfer.cli.common import make_parser, run_cli


def _binding_target(binding: dict) -> str:
    if "object" in binding:
        return binding["object"]
    return " + ".join(f"{p['object']}[{p['range'][0]}:{p['range'][1]}]" for p in binding["parts"])


def summary(art: Artifact) -> dict:
    objects = art.directory["objects"]
    tensors = [o for o in objects if o["kind"] == "tensor"]
    formats: Counter = Counter()
    format_bytes: Counter = Counter()
    for o in tensors:
        formats[o["format"]] += 1
        format_bytes[o["format"]] += o["bytes"]
    return {
        "path": str(art.path),
        "artifact_id": art.artifact_id,
        "file_bytes": art.path.stat().st_size,
        "metadata": art.metadata,
        "components": {
            name: {
                "config_keys": len(c.config),
                "resources": {r: art.object_info(i)["bytes"] for r, i in c.resources.items()},
            }
            for name, c in art.components.items()
        },
        "objects": len(objects),
        "tensors": len(tensors),
        "bindings": len(art.bindings),
        "uses": len(art.directory.get("uses", [])),
        "formats": {f: {"objects": n, "bytes": format_bytes[f]} for f, n in sorted(formats.items())},
        "provenance": art.provenance,
    }


def _print_text(art: Artifact, info: dict, show_objects: bool) -> None:
    print(f"{info['path']}: {info['file_bytes']:,} bytes, id {info['artifact_id']}")
    for key, value in info["metadata"].items():
        print(f"  metadata.{key}: {value}")
    for name, comp in info["components"].items():
        arch = art.components[name].config.get("architecture", "")
        roles = ", ".join(f"{r} ({n:,} B)" for r, n in comp["resources"].items()) or "no resources"
        print(
            f"  component {name}{' (' + arch + ')' if arch else ''}: {comp['config_keys']} config keys; "
            f"{roles}"
        )
    print(
        f"  {info['objects']} objects ({info['tensors']} tensors), {info['bindings']} bindings, "
        f"{info['uses']} uses"
    )
    for fmt, v in info["formats"].items():
        print(f"  format {fmt:14s} {v['objects']:5d} objects {v['bytes']:>16,} bytes")
    sources = info["provenance"].get("sources", {})
    for name, src in sources.items():
        print(
            f"  source {name}: {src.get('path')} ({src.get('bytes', 0):,} bytes, header sha256 "
            f"{str(src.get('header_sha256', ''))[:16]}…)"
        )
    if not show_objects:
        return
    print("objects:")
    for o in art.directory["objects"]:
        if o["kind"] == "tensor":
            print(
                f"  {o['id']}  {o['format']:12s} {str(o['shape']):22s} offset {o['offset']:>14,}  "
                f"{o['bytes']:>14,} B"
            )
        else:
            print(f"  {o['id']}  resource     {'':22s} offset {o['offset']:>14,}  {o['bytes']:>14,} B")
    print("bindings:")
    for name, binding in art.bindings.items():
        t = art.tensor(name)
        print(f"  {name:52s} {t.format:12s} {str(list(t.shape)):20s} -> {_binding_target(binding)}")
    for use in art.directory.get("uses", []):
        print(f"  use {use['parameter']}: {use['auxiliaries']}")


def build_parser() -> argparse.ArgumentParser:
    p = make_parser(
        "ninfer-inspect", "Print a .ninfer artifact's components, formats, bindings and metadata."
    )
    p.add_argument("artifact", metavar="ART", help="the .ninfer file")
    p.add_argument("--objects", action="store_true", help="also list every object and binding")
    p.add_argument(
        "--json", action="store_true", help="print JSON: the summary, plus the full directory with --objects"
    )
    return p


def _body(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    art = open_artifact(args.artifact)
    info = summary(art)
    if args.json:
        if args.objects:
            info["directory"] = art.directory
        json.dump(info, sys.stdout, indent=1)
        print()
    else:
        _print_text(art, info, args.objects)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(_body, argv)


if __name__ == "__main__":
    sys.exit(main())
