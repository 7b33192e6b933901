"""sm_90 builds without a GPU, for counting what a kernel's main loop costs (gpu_check.py --sass,
sass_q8_iq.py): compile a Triton kernel with the 16-divisibility hints Triton specialises at run time, read
its SASS and resource use with the `cuobjdump` Triton bundles, and cut out the longest loop.

The build is the installed Triton's: read it with the GPU machine's (3.6; `make device-triton`, then
`PYTHONPATH=.triton-device python bench/sass_rows.py`). Triton 3.9, which torch 2.13 brings here, lays
several kernels out otherwise (session 22: the q4_k rows GEMVs with 20 barriers and shared-memory round trips
in a loop that 3.6 builds without any)."""

from __future__ import annotations

import collections
import re
import subprocess
import tempfile
from pathlib import Path


def compile_sm90(kernel, sig: dict, const: dict, hinted: tuple[str, ...], num_warps: int,
                 num_stages: int = 3, maxnreg: int = 0):
    """`triton.compile` of `kernel` for sm_90: `sig` the argument types, `const` the constexprs, `hinted` the
    arguments marked 16-divisible; `maxnreg` caps the registers a thread."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = list(sig)
    attrs = {(names.index(n),): [["tt.divisibility", 16]] for n in hinted}
    src = ASTSource(kernel, {**sig, **dict.fromkeys(const, "constexpr")}, const, attrs)
    options = {"num_warps": num_warps, "num_stages": num_stages} | ({"maxnreg": maxnreg} if maxnreg else {})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


def cuobjdump(compiled, flag: str) -> str:
    """`cuobjdump <flag>` (`-sass`, `-res-usage`) of a compiled kernel's cubin."""
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as tmp:
        tmp.write(compiled.asm["cubin"])
        tmp.flush()
        return subprocess.run([str(tool), flag, tmp.name], capture_output=True, text=True, check=True).stdout


def loop_body(sass: str, key: str = "") -> list[str]:
    """The instructions of the longest innermost backward branch's span (the block loop, not a loop around
    it such as stream-K's over row tiles); [] when there is none. `key` (an opcode, e.g. IMMA): instead the
    shortest loop holding the most of that opcode (a block loop with small loops inside it)."""
    ins = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4})\*/\s+([^;]*);", sass)]
    loops = [(int(t.group(1), 16), a) for a, i in ins for t in [re.search(r"BRA (0x[0-9a-f]+)", i)]
             if t and int(t.group(1), 16) < a]
    inner = [r for r in loops if not any(r[0] <= o[0] and o[1] <= r[1] and o != r for o in loops)]
    if key:
        def held(r):
            return sum(1 for a, i in ins
                       if r[0] <= a <= r[1] and re.sub(r"^@!?U?P\S+ ", "", i).startswith(key))
        inner = [max(loops, key=lambda r: (held(r), r[0] - r[1]))] if loops else []
    if not inner:
        return []
    lo, hi = max(inner, key=lambda r: r[1] - r[0])
    return [i for a, i in ins if lo <= a <= hi]


def opcode_mix(body: list[str]) -> collections.Counter:
    """Opcode counts of a list of SASS instructions (predicates and modifiers dropped)."""
    return collections.Counter(re.sub(r"^@!?U?P\S+ ", "", i).split()[0].split(".")[0] for i in body)


# Hopper's pipes a warp instruction occupies, per SM sub-partition (SMSP: a scheduler, one issue a cycle):
# integer logic, shifts, byte permutes and adds on the 16-lane ALU pipe (2 cycles); integer multiplies and
# dot products on the 16-lane FMA-heavy pipe (2); FP32 on both FMA halves (1); conversions and special
# functions on the XU (8); mma.sync m16n8k32 int8 ~8 (the tensor core's dense rate is 4). Shared memory
# answers one 128-byte wavefront a cycle for the whole SM: with every SMSP running the kernel, a wavefront
# costs each SMSP 4 cycles of it. (ncu's pipe descriptions; the rates: the H100 / H200 whitepaper's lanes an
# SM.)
_PIPES = {
    "alu": ("LOP3", "LOP", "PRMT", "SHF", "SHL", "SHR", "LEA", "IADD3", "ISETP", "SEL", "VIMNMX", "IMNMX",
            "FLO", "POPC", "BMSK", "BREV", "PLOP3", "P2R", "R2P", "MOV", "CS2R"),
    "fma_heavy": ("IMAD", "IMUL", "IDP", "VIADD"),
    "fp32": ("FFMA", "FMUL", "FADD", "FMNMX", "FSETP", "FSEL", "HADD2", "HFMA2", "HMUL2", "I2FP"),
    "xu": ("MUFU", "I2F", "F2I", "F2F", "FRND", "F2FP"),
    "tensor": ("IMMA", "HMMA"),
}
_CYCLES = {"alu": 2, "fma_heavy": 2, "fp32": 1, "xu": 8, "tensor": 8}


def pipe_cycles(body: list[str], lds_ways: float = 1.0) -> dict[str, float]:
    """Cycles a pass of a loop `body` (SASS lines) keeps each of one SMSP's resources busy, every SMSP running
    the same loop: `issue` (one instruction a cycle), each pipe of `_PIPES`, and `shared` (4 cycles a
    wavefront: 32-bit shared loads `lds_ways` wavefronts each — their bank conflicts, 2 for a warp reading 16
    copies of a table — wider ones broadcast, one). The largest is the loop's floor at full occupancy; how far
    the measured time sits above it is what latency costs."""
    mix = opcode_mix(body)
    cycles = {"issue": float(len(body))}
    for pipe, ops in _PIPES.items():
        cycles[pipe] = float(_CYCLES[pipe] * sum(mix[op] for op in ops))
    narrow = sum(1 for i in body if re.search(r"\bLDS(\.U?(8|16|32))?\s", re.sub(r"^@!?U?P\S+ ", "", i)))
    cycles["shared"] = 4.0 * (lds_ways * narrow + (mix["LDS"] - narrow) + mix["STS"])
    return cycles

