"""sm_90 SASS of the NVRTC kernels (il32 iq3_s dp4a / tensor-core, q4il, q6il) without a GPU: the CUDA C
source as the engine builds it, NVRTC from the `nvidia-cuda-nvrtc-cu12` wheel (a CPU torch has none), then
the ptxas and cuobjdump that Triton bundles. Prints the registers and spills, the block loop's opcode mix,
the cycles a pass keeps each of an SM sub-partition's pipes busy (`sass_tools.pipe_cycles`: the loop's
floor at full occupancy), and where in the loop its global loads and mmas sit: session 38 found this way
that ptxas places a block's loads next to their uses whatever the source's order (in the PTX they are all
at the top), so a block's words "loaded at once" cost instructions and no memory round trips (timed: 5-9 %
slower).

    pip download -q --no-deps nvidia-cuda-nvrtc-cu12 -d /tmp/nvrtc
    python -m zipfile -e /tmp/nvrtc/nvidia_cuda_nvrtc_cu12-*.whl /tmp/nvrtc/x
    NVRTC_LIB=/tmp/nvrtc/x/nvidia/cuda_nvrtc/lib/libnvrtc.so.12 \\
        python bench/sass_nvrtc.py il_mma --columns 4 --warps 10 [--regs 96] [--dump] [--conv [T]]
    python bench/sass_nvrtc.py il --columns 2 --against /tmp/prev.py   # the same build as another gemv_il.py?

NVRTC here is CUDA 12's and the device's torch (2.11+cu130) brings 13.0's; `--cubin` builds as the device does
(NVRTC makes the sm_90 cubin itself; Triton's ptxas cannot read CUDA 13's PTX):

    pip download -q --no-deps "nvidia-cuda-nvrtc==13.0.*" -d /tmp/nvrtc13   # then unzip as above
    LD_LIBRARY_PATH=/tmp/nvrtc13/x/nvidia/cu13/lib NVRTC_LIB=/tmp/nvrtc13/x/nvidia/cu13/lib/libnvrtc.so.13 \\
        python bench/sass_nvrtc.py il_mma --columns 4 --cubin

Session 49: 13.0.88 builds every kernel within an instruction or two of 12.9's (il_mma 4 columns 758 / 759,
q4il 278 / 279); 13.5 builds il_mma's block loop at 838 (+10 %).
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.sass_tools import loop_body, opcode_mix, pipe_cycles  # noqa: E402
from ninfer.kernels import gemv_il, gemv_q4il, gemv_q6il  # noqa: E402

KERNELS = ("il", "il_mma", "q4il", "q6il")


def nvrtc_build(source: str, name: str, cubin: bool = False) -> str | bytes:
    """PTX of a CUDA C source by NVRTC (`NVRTC_LIB`: the library's path), or with `cubin` the sm_90 cubin
    NVRTC builds itself, as `torch.cuda._compile_kernel` does on the device."""
    lib = ctypes.CDLL(os.environ.get("NVRTC_LIB", "libnvrtc.so.12"))
    prog = ctypes.c_void_p()
    if lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), f"{name}.cu".encode(), 0, None, None):
        raise SystemExit("nvrtcCreateProgram failed")
    arch = "sm_90" if cubin else "compute_90"
    options = [f"--gpu-architecture={arch}".encode(), b"-default-device", b"--std=c++17"]
    failed = lib.nvrtcCompileProgram(prog, len(options), (ctypes.c_char_p * len(options))(*options))
    size = ctypes.c_size_t()
    if failed:
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        raise SystemExit(log.value.decode())
    get_size, get = ((lib.nvrtcGetCUBINSize, lib.nvrtcGetCUBIN) if cubin
                     else (lib.nvrtcGetPTXSize, lib.nvrtcGetPTX))
    get_size(prog, ctypes.byref(size))
    out = ctypes.create_string_buffer(size.value)
    get(prog, out)
    return out.raw if cubin else out.value.decode()


def sm90_sass(built: str | bytes) -> tuple[str, str]:
    """(the resource lines, the SASS) of PTX built for sm_90 by Triton's bundled ptxas, or of a cubin
    (`cuobjdump -res-usage`'s line), disassembled by Triton's bundled cuobjdump."""
    import triton

    tools = Path(triton.__file__).parent / "backends" / "nvidia" / "bin"
    with tempfile.TemporaryDirectory() as tmp:
        cubin = Path(tmp, "k.cubin")
        if isinstance(built, bytes):
            cubin.write_bytes(built)
            resources = subprocess.run([str(tools / "cuobjdump"), "-res-usage", str(cubin)],
                                       capture_output=True, text=True, check=True).stdout
            resources = "\n".join(f"registers: {line.strip()}" for line in resources.splitlines()
                                  if "REG" in line)
        else:
            Path(tmp, "k.ptx").write_text(built)
            resources = subprocess.run([str(tools / "ptxas"), "-arch=sm_90", "-v", "-o", str(cubin),
                                        f"{tmp}/k.ptx"], capture_output=True, text=True, check=True).stderr
        sass = subprocess.run([str(tools / "cuobjdump"), "-sass", str(cubin)], capture_output=True,
                              text=True, check=True).stdout
    return resources, sass


def source_of(kernel: str, columns: int, warps: int, regs: int, group: int, il=gemv_il,
              conv: bool = False, staged: bool = False, q4il=gemv_q4il, cluster: int = 1,
              ahead: int = 1, evict: int | None = None) -> tuple[str, str]:
    """(the CUDA C the engine builds, its entry name), programmatic launch on, bf16 output; `il` / `q4il`:
    the gemv_il / gemv_q4il module the kernels come from; `conv`: the build with the GDN conv epilogue
    (il32, q4il); `staged`: q4il's build with each warp's next block staged; `cluster`: q4il's build in
    clusters of that many CTAs a tile (5 warps × 3 CTAs an SM, as the 27B's 5120-row matrices take them);
    `ahead`: the dp4a il32 kernel's blocks loaded before the wait (0 or 1); `evict`: the weight loads'
    cache hints (default: the engine's, `gemv_il.evict_level`)."""
    evict = gemv_il.evict_level(kernel) if evict is None else evict
    hints = (evict,) if evict else ()  # (a file from before session 56 builds no hints)
    if kernel in ("il", "il_mma"):
        s = (il.IlSchedule(warps, kernel="il_mma", regs=regs, group=group) if kernel == "il_mma"
             else il.IlSchedule(warps, group=group, regs=regs, ahead=ahead))
        return (il.kernel_source(columns, 1, s, True, conv, *hints),
                "iq3s_il_mma" if kernel == "il_mma" else "iq3s_il_gemv")
    if kernel == "q4il":
        shape = q4il.SHAPES[1] if cluster > 1 else q4il.SHAPES[0]
        return q4il.kernel_source(columns, 1, True, shape, conv, staged, cluster, *hints), "q4k_il_mma"
    return gemv_q6il.kernel_source(columns, 1, True, evict), "q6k_il_mma"


def instructions(sass: str) -> list[str]:
    """The SASS's instructions without their addresses and encodings (two builds compare equal as text)."""
    return [re.sub(r"/\*[0-9a-f]+\*/", "", line).split(";")[0].strip() for line in sass.splitlines()
            if re.search(r"/\*[0-9a-f]{4}\*/", line)]


def q4il_on(il):
    """gemv_q4il loaded afresh on another gemv_il module, whose CUDA C helpers (`CUDA_HELPERS`, ...) it
    takes in."""
    from bench.il_ab import load

    saved = sys.modules["ninfer.kernels.gemv_il"]
    sys.modules["ninfer.kernels.gemv_il"] = il
    try:
        return load(Path(gemv_q4il.__file__), "gemv_q4il_other")
    finally:
        sys.modules["ninfer.kernels.gemv_il"] = saved


def same_build(path: Path, kernel: str, a, sass: str) -> None:
    """Whether another version of `ninfer/kernels/gemv_il.py` (a file) builds this kernel (q4il: on its
    helpers) to the same SASS (session 39: a source rewrite that keeps the 2-column build and changes the
    1-column one), built with the same flags."""
    from bench.il_ab import load

    other = load(path)
    q4il = q4il_on(other) if kernel == "q4il" else gemv_q4il
    resources, theirs = sm90_sass(nvrtc_build(*source_of(kernel, a.columns, a.warps, a.regs, a.group, other,
                                                         a.conv, a.staged, q4il, a.cluster, a.ahead, a.evict),
                                              a.cubin))
    print(f"{path}:", "; ".join(line.split(":", 1)[-1].strip() for line in resources.splitlines()
                                 if "registers" in line or "spill" in line))
    print("the same SASS" if instructions(theirs) == instructions(sass) else "a different SASS")


SMS, CLOCK_GHZ, HBM_TBS = 132, 1.98, 4.8  # the H200's SMs, its SM clock when busy (session 42), HBM


def floor_us(kernel: str, columns: int, warps: int, n: int, k: int, cycles: float) -> tuple[float, float]:
    """(the kernel's time on the N×K matrix were every SM sub-partition busy `cycles` a pass of its loop: the
    SM with the most passes — the dp4a il32 kernel's pass a pair of blocks a warp, the tensor-core il32 and
    q4il kernels' a block — over its four sub-partitions, tiles on CTAs as the wrappers launch them
    (unsplit; q4il on `q4il_shape`'s CTAs); the matrix's bytes at HBM_TBS). The two together say whether the
    loop's instructions or its bytes set the pace; a measured time above both is latency (too little in
    flight)."""
    tiles = -(-n // 32)
    if kernel == "q4il":
        per_sm, passes_a_tile, block = gemv_q4il.q4il_shape(tiles, SMS)[1], k // 256, 144
    else:
        s = (gemv_il.IlSchedule(warps, kernel="il_mma") if kernel == "il_mma"
             else gemv_il.IlSchedule(warps))
        per_sm, block = gemv_il._ctas_per_sm(s, columns, k), gemv_il.BLOCK_BYTES
        passes_a_tile = gemv_il.il32_shape(n, k)[1] if kernel == "il" else k // 256
    ctas = min(tiles, SMS * per_sm)
    passes = -(-ctas // SMS) * -(-tiles // ctas) * passes_a_tile
    return passes / 4 * cycles / CLOCK_GHZ / 1e3, n * k / 256 * block / HBM_TBS / 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("kernel", choices=KERNELS)
    p.add_argument("--columns", type=int, default=4)
    p.add_argument("--warps", type=int, default=10, help="il32 kernels: warps a CTA")
    p.add_argument("--regs", type=int, default=0, help="il32 kernels: registers a thread (0: the engine's)")
    p.add_argument("--group", type=int, default=256, help="il32 kernels: activation values a scale")
    p.add_argument("--dump", action="store_true", help="print the block loop's instructions")
    p.add_argument("--against", type=Path,
                   help="il32 kernels, q4il: another gemv_il.py (q4il: on its helpers), built and compared")
    p.add_argument("--conv", type=int, nargs="?", const=1, default=0,
                   help="il32, q4il: the build with the GDN conv epilogue, N positions a lane (1 without N)")
    p.add_argument("--staged", action="store_true", help="q4il: each warp's next block staged")
    p.add_argument("--cluster", type=int, default=1, help="q4il: clusters of this many CTAs a tile")
    p.add_argument("--ahead", type=int, default=1, choices=(0, 1),
                   help="il (dp4a): the blocks loaded before the wait")
    p.add_argument("--shapes", default="",
                   help="il32, q4il: the floor in µs on an H200 of these matrices (NxK, comma-separated) "
                        "from the binding resource's cycles a pass, beside its HBM floor (`floor_us`)")
    p.add_argument("--lds-ways", type=float, default=0,
                   help="wavefronts a 32-bit shared load takes (bank conflicts; default: 2 for the dp4a "
                        "kernel's 16 copies of the grid, whose loads nearly always meet a two-way conflict, "
                        "else 1)")
    p.add_argument("--evict", type=int, default=None, choices=(0, 1, 2),
                   help="the weight loads' cache hints: 0 plain, 1 not kept in L1, 2 also evict-first in L2 "
                        "(default: the engine's)")
    p.add_argument("--cubin", action="store_true",
                   help="NVRTC builds the sm_90 cubin itself, as on the device (CUDA 13's NVRTC: Triton's "
                        "ptxas cannot read its PTX); registers from cuobjdump -res-usage")
    a = p.parse_args()
    source, name = source_of(a.kernel, a.columns, a.warps, a.regs, a.group, conv=a.conv, staged=a.staged,
                             cluster=a.cluster, ahead=a.ahead, evict=a.evict)
    resources, sass = sm90_sass(nvrtc_build(source, name, a.cubin))
    print("\n".join(line for line in resources.splitlines() if "registers" in line or "spill" in line))
    body = loop_body(sass, {"il": "IDP", "il_mma": "IMMA", "q4il": "IMMA"}.get(a.kernel, ""))
    print(f"block loop: {len(body)} instructions")
    print(", ".join(f"{op} {n}" for op, n in opcode_mix(body).most_common(16)))
    ways = a.lds_ways or (2 if a.kernel == "il" else 1)
    cycles = {k: v for k, v in pipe_cycles(body, ways).items() if v}
    bound = max(cycles, key=cycles.get)
    print(f"cycles a pass of one SM sub-partition's resources (32-bit shared loads {ways:g} wavefronts): "
          + ", ".join(f"{k} {v:.0f}" for k, v in cycles.items()) + f"; the floor: {bound}")
    for shape in filter(None, a.shapes.split(",")):
        n, k = map(int, shape.split("x"))
        busy, hbm = floor_us(a.kernel, a.columns, a.warps, n, k, cycles[bound])
        print(f"{shape}: {busy:.1f} µs at {bound}'s floor (the busiest SM), HBM {hbm:.1f} µs")
    opcodes = [re.sub(r"^@!?U?P\S+ ", "", ins).split()[0] for ins in body]
    for op in ("LDG", "IMMA", "LDS", "LDGSTS"):
        print(f"{op} at", [i for i, code in enumerate(opcodes) if code.startswith(op)])
    if a.dump:
        print("\n".join(body))
    if a.against and a.kernel in ("il", "il_mma", "q4il"):
        same_build(a.against, a.kernel, a, sass)


if __name__ == "__main__":
    main()
