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


def loop_body(sass: str) -> list[str]:
    """The instructions of the longest innermost backward branch's span (the block loop, not a loop around
    it such as stream-K's over row tiles); [] when there is none."""
    ins = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4})\*/\s+([^;]*);", sass)]
    loops = [(int(t.group(1), 16), a) for a, i in ins for t in [re.search(r"BRA (0x[0-9a-f]+)", i)]
             if t and int(t.group(1), 16) < a]
    inner = [r for r in loops if not any(r[0] <= o[0] and o[1] <= r[1] and o != r for o in loops)]
    if not inner:
        return []
    lo, hi = max(inner, key=lambda r: r[1] - r[0])
    return [i for a, i in ins if lo <= a <= hi]


def opcode_mix(body: list[str]) -> collections.Counter:
    """Opcode counts of a list of SASS instructions (predicates and modifiers dropped)."""
    return collections.Counter(re.sub(r"^@!?U?P\S+ ", "", i).split()[0].split(".")[0] for i in body)
