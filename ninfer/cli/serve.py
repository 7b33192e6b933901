"""ninfer-serve: serve one .ninfer artifact over OpenAI-, Anthropic- and llama.cpp-compatible HTTP APIs."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from ninfer.cli.common import make_parser, run_cli
from ninfer.errors import EngineConfigError

KV_DTYPES_NOW = ("bf16", "int8", "rk8v4", "rk4v4")
KV_DTYPES_LATER = ("fp8", "nvfp4", "k8v4", "rk4v4-e8", "rk2v4-e8")
MAX_CONCURRENCY = 8


def build_parser() -> argparse.ArgumentParser:
    p = make_parser(
        "ninfer-serve", "Serve a .ninfer model over OpenAI / Anthropic / llama.cpp-compatible HTTP APIs."
    )
    p.add_argument("model", metavar="MODEL.ninfer", help="the artifact to serve (from ninfer-convert)")
    _network_flags(p)
    _request_flags(p)
    _engine_flags(p)
    _later_flags(p)
    return p


def _network_flags(p: argparse.ArgumentParser) -> None:
    """Where and how the server listens."""
    net = p.add_argument_group("network")
    net.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    net.add_argument(
        "--port", metavar="N", type=int, default=8080, help="port to bind (default 8080; 0 = any free port)"
    )
    net.add_argument(
        "--model-id", metavar="ID", help="public model id (default: the artifact's metadata.name)"
    )
    net.add_argument(
        "--api-key",
        metavar="KEY",
        default=os.environ.get("NINFER_API_KEY"),
        help="require 'Authorization: Bearer KEY' or 'x-api-key: KEY' on every route but /health "
        "(default: $NINFER_API_KEY, else no key)",
    )
    net.add_argument("--cors", metavar="ORIGINS", help="comma-separated allowed CORS origins, or '*'")
    net.add_argument(
        "--max-request-mib",
        metavar="MIB",
        type=float,
        default=32.0,
        help="largest accepted request body in MiB; larger bodies get 413 (default 32)",
    )
    net.add_argument(
        "--request-log", metavar="FILE", type=Path, help="append one JSON line per finished request to FILE"
    )
    net.add_argument(
        "--log-level",
        default="info",
        choices=("debug", "info", "warning", "error"),
        help="server log level (default info: one line per request)",
    )


def _request_flags(p: argparse.ArgumentParser) -> None:
    """Admission and per-request defaults."""
    gen = p.add_argument_group("requests")
    gen.add_argument(
        "--max-concurrency",
        metavar="N",
        type=int,
        default=1,
        help=f"requests decoded together in one batch, 1..{MAX_CONCURRENCY} (default 1)",
    )
    gen.add_argument(
        "--max-pending-requests",
        metavar="N",
        type=int,
        default=16,
        help="requests allowed to wait for a lane; beyond that 429 server_overloaded (default 16)",
    )
    gen.add_argument(
        "--pending-timeout-ms",
        metavar="N",
        type=int,
        default=0,
        help="a request waiting longer gets 503 request_queue_timeout (default 0 = wait forever)",
    )
    gen.add_argument(
        "--default-max-tokens",
        metavar="N",
        type=int,
        default=4096,
        help="output budget of requests that name none, clipped to the context left (default 4096)",
    )
    gen.add_argument(
        "--chat-template",
        metavar="FILE",
        type=Path,
        help="Jinja chat template to use instead of the artifact's",
    )


def _engine_flags(p: argparse.ArgumentParser) -> None:
    """The engine behind the server."""
    eng = p.add_argument_group("engine")
    eng.add_argument(
        "--max-context",
        metavar="N",
        type=int,
        default=4096,
        help="longest prompt + output of one request in tokens (default 4096)",
    )
    eng.add_argument(
        "--kv-capacity",
        metavar="N|auto",
        default="auto",
        help="tokens in the shared KV pool, or 'auto' = the largest that fits (default auto)",
    )
    eng.add_argument(
        "--kv-dtype",
        default="bf16",
        choices=KV_DTYPES_NOW + KV_DTYPES_LATER,
        help="KV cache format (default bf16); fp8 and the later formats are not available yet",
    )
    eng.add_argument(
        "--kv-headroom-mib",
        metavar="N",
        type=int,
        default=1024,
        help="device memory left free by --kv-capacity auto (default 1024): the allocator's cache beyond "
        "the measured workspace (~850 MiB for a 27B at a 2048-token chunk on an H200), other processes",
    )
    eng.add_argument(
        "--gdn-state-fp16", action="store_true", help="keep Gated DeltaNet states in fp16 (default fp32)"
    )
    eng.add_argument(
        "--no-cuda-graphs", dest="cuda_graphs", action="store_false",
        help="run decode rounds eagerly instead of replaying captured CUDA graphs (default: graphs on CUDA)",
    )
    eng.add_argument(
        "--decode-lookahead", action=argparse.BooleanOptionalAction, default=None,
        help="decode rounds launch the next round before their tokens reach the host "
             "(default: on CUDA yes, on CPU no)",
    )
    eng.add_argument(
        "--prefill-chunk",
        metavar="N",
        type=int,
        help="prompt tokens per prefill step (default: the engine's)",
    )
    eng.add_argument("--device", default="auto", help="cpu, cuda, cuda:N or auto (default: cuda if visible)")
    eng.add_argument(
        "--dtype",
        default=None,
        choices=("float32", "bfloat16", "float16"),
        help="compute dtype (default float32 on CPU, bfloat16 on GPU)",
    )
    eng.add_argument(
        "--gpu-memory-limit-mib",
        metavar="N",
        type=int,
        help="plan memory as if the GPU had only this much (to size for smaller cards)",
    )


def _later_flags(p: argparse.ArgumentParser) -> None:
    """Flags of features that do not exist yet: parsed, validated, refused at start."""
    later = p.add_argument_group("not available yet (parsed and validated; refused at start)")
    later.add_argument(
        "--spec", choices=("none", "mtp"), default="none", help="speculative decoding with the MTP head"
    )
    later.add_argument(
        "--draft-tokens", metavar="N", type=int, help="drafted tokens per round with --spec mtp, 1..15"
    )
    later.add_argument("--vision", action="store_true", help="accept images (needs the vision component)")
    later.add_argument(
        "--vision-residency", choices=("resident", "overlay", "cpu"), help="where the vision tower lives"
    )
    later.add_argument(
        "--vision-max-merged", metavar="N", type=int, help="cap of merged vision tokens per image"
    )
    later.add_argument(
        "--host-kv-mib",
        metavar="N",
        type=int,
        default=0,
        help="pinned host memory for retained KV (0 = none)",
    )
    later.add_argument(
        "--device-profile",
        choices=("auto", "off", "calibrate"),
        default="auto",
        help="kernel routes from ninfer-calibrate (auto: use one if present; none exist yet)",
    )
    later.add_argument(
        "--device-profile-path",
        metavar="FILE",
        type=Path,
        help="device profile file written by ninfer-calibrate",
    )


def check_args(args: argparse.Namespace) -> None:
    """Every refusal before anything is loaded or bound: one line naming the flag and the fix."""
    _check_ranges(args)
    _check_later_features(args)
    if not Path(args.model).is_file():
        raise EngineConfigError(f"model file not found: {args.model}; convert one with ninfer-convert")
    if args.chat_template is not None and not args.chat_template.is_file():
        raise EngineConfigError(f"--chat-template {args.chat_template}: file not found")
    if args.request_log is not None and not args.request_log.parent.is_dir():
        raise EngineConfigError(
            f"--request-log {args.request_log}: folder {args.request_log.parent} does not exist"
        )


def _check_ranges(args: argparse.Namespace) -> None:
    if not 1 <= args.max_concurrency <= MAX_CONCURRENCY:
        raise EngineConfigError(f"--max-concurrency must be 1..{MAX_CONCURRENCY}, got {args.max_concurrency}")
    if not 0 <= args.port <= 65535:
        raise EngineConfigError(f"--port must be 0..65535, got {args.port}")
    for flag in ("max_context", "default_max_tokens"):
        if getattr(args, flag) < 1:
            raise EngineConfigError(f"--{flag.replace('_', '-')} must be >= 1, got {getattr(args, flag)}")
    for flag in ("max_pending_requests", "pending_timeout_ms", "kv_headroom_mib"):
        if getattr(args, flag) < 0:
            raise EngineConfigError(f"--{flag.replace('_', '-')} must be >= 0, got {getattr(args, flag)}")
    if args.prefill_chunk is not None and args.prefill_chunk < 1:
        raise EngineConfigError(f"--prefill-chunk must be >= 1, got {args.prefill_chunk}")
    if args.max_request_mib <= 0:
        raise EngineConfigError(f"--max-request-mib must be > 0, got {args.max_request_mib:g}")
    if args.gpu_memory_limit_mib is not None and args.gpu_memory_limit_mib < 1:
        raise EngineConfigError(f"--gpu-memory-limit-mib must be >= 1, got {args.gpu_memory_limit_mib}")
    args.kv_capacity = parse_kv_capacity(args.kv_capacity)
    if args.kv_capacity != "auto" and args.kv_capacity < args.max_context:
        raise EngineConfigError(
            f"--kv-capacity {args.kv_capacity} is smaller than --max-context {args.max_context}; "
            "raise --kv-capacity (or use auto) or lower --max-context"
        )


def parse_kv_capacity(value: str) -> int | str:
    if value == "auto":
        return "auto"
    try:
        tokens = int(value.replace(",", "").replace("_", ""))
    except ValueError:
        raise EngineConfigError(f"--kv-capacity must be a token count or 'auto', got {value!r}") from None
    if tokens < 1:
        raise EngineConfigError(f"--kv-capacity must be >= 1 token, got {tokens}")
    return tokens


def _check_later_features(args: argparse.Namespace) -> None:
    if args.draft_tokens is not None and not 1 <= args.draft_tokens <= 15:
        raise EngineConfigError(f"--draft-tokens must be 1..15, got {args.draft_tokens}")
    if args.draft_tokens is not None and args.spec != "mtp":
        raise EngineConfigError("--draft-tokens needs --spec mtp")
    if args.vision_max_merged is not None and args.vision_max_merged < 1:
        raise EngineConfigError(f"--vision-max-merged must be >= 1, got {args.vision_max_merged}")
    if (args.vision_residency or args.vision_max_merged) and not args.vision:
        raise EngineConfigError("--vision-residency and --vision-max-merged need --vision")
    if args.host_kv_mib < 0:
        raise EngineConfigError(f"--host-kv-mib must be >= 0, got {args.host_kv_mib}")
    if args.spec == "mtp":
        raise EngineConfigError("--spec mtp: speculative decoding is not available yet; drop --spec")
    if args.vision:
        raise EngineConfigError("--vision: image input is not available yet; drop --vision")
    if args.host_kv_mib > 0:
        raise EngineConfigError("--host-kv-mib: host KV retention is not available yet; use 0")
    if args.kv_dtype in KV_DTYPES_LATER:
        raise EngineConfigError(
            f"--kv-dtype {args.kv_dtype} is not available yet; use one of {', '.join(KV_DTYPES_NOW)}"
        )
    if args.device_profile == "calibrate" or args.device_profile_path is not None:
        raise EngineConfigError(
            "device profiles (--device-profile calibrate, --device-profile-path) are not "
            "available yet; drop the flag"
        )


def engine_config(args: argparse.Namespace):
    from ninfer.engine.engine import EngineConfig

    device = args.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = args.dtype or ("float32" if device == "cpu" else "bfloat16")
    extra = {"prefill_chunk": args.prefill_chunk} if args.prefill_chunk is not None else {}
    return EngineConfig(
        max_concurrency=args.max_concurrency,
        max_context=args.max_context,
        kv_capacity=args.kv_capacity,
        kv_dtype=args.kv_dtype,
        gdn_state_fp16=args.gdn_state_fp16,
        max_pending_requests=args.max_pending_requests,
        pending_timeout_ms=args.pending_timeout_ms or None,
        device=device,
        dtype=dtype,
        gpu_memory_limit_mib=args.gpu_memory_limit_mib,
        kv_headroom_mib=args.kv_headroom_mib,
        cuda_graphs=args.cuda_graphs,
        decode_lookahead=args.decode_lookahead,
        **extra,
    )


def _body(argv: Sequence[str] | None) -> int:
    args = build_parser().parse_args(argv)
    check_args(args)
    config = engine_config(args)
    config.validate()  # every engine-level refusal before binding the port

    from ninfer.serve.app import create_app
    from ninfer.serve.engine_backend import EngineBackend
    from ninfer.serve.server import Server, bind_socket
    from ninfer.serve.state import ServeSettings

    _setup_logging(args.log_level)
    settings = ServeSettings(
        api_key=args.api_key or None,
        max_request_mib=args.max_request_mib,
        default_max_tokens=args.default_max_tokens,
        request_log=args.request_log,
        cors=tuple(o.strip() for o in (args.cors or "").split(",") if o.strip()),
        served_model_id=args.model_id,
    )
    sock = bind_socket(args.host, args.port)
    host, port = sock.getsockname()[:2]
    print(
        f"ninfer-serve: listening on http://{host}:{port} (loading {args.model})", file=sys.stderr, flush=True
    )

    def load():
        backend = EngineBackend.load(args.model, config, args.model_id, args.chat_template)
        print(backend.engine.memory_ledger().line(), file=sys.stderr, flush=True)
        print(
            f"ninfer-serve: serving '{args.model_id or backend.info.model_id}' on http://{host}:{port}",
            file=sys.stderr,
            flush=True,
        )
        return backend

    app = create_app(settings)
    return Server(app, sock, load, log_level="warning").run()


def _setup_logging(level: str) -> None:
    logger = logging.getLogger("ninfer.serve")
    logger.setLevel(level.upper())
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(asctime)s %(message)s", "%H:%M:%S"))
        logger.addHandler(handler)
        logger.propagate = False


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli(_body, argv)


if __name__ == "__main__":
    sys.exit(main())
