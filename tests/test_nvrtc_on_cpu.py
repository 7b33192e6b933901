"""The NVRTC kernels' CUDA C, run on the CPU (tests/cuda_cpu.py): the il32 dp4a and tensor-core iq3_s GEMVs,
the q4il and q6il GEMVs, on tiny shapes with padded rows and blocks, CTAs looping over several tiles, rings
and split tiles, against the float64 oracle over the GGUF rows (`gemv_q8_reference`); the builds with the
GDN conv in their epilogue (1-8 lanes) against its arithmetic, also as the wrappers launch them; q4il on
staged blocks (cp.async) against its unstaged build; slips in the sources caught. The numpy twins in
test_gemv_il.py / test_gemv_q4il.py / test_gemv_q6il.py check each recipe; these run the very source the GPU
builds (with PDL off)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from conftest import assert_conv_ran, lane_conv_on_and_off
from cuda_cpu import HostKernel

from ninfer.kernels import gemv_il, gemv_q4il, gemv_q6il
from ninfer.kernels.gemv_il import _OUT_KINDS as OUT_KINDS
from ninfer.kernels.gemv_q8 import gemv_q8_reference, quantize_activation_reference
from ninfer.kernels.gguf_matmul import _tables, random_gguf_weight

# fp32 sums in the kernels' order against float64: 1.1e-7 the largest measured on these shapes
FP32_BOUND = 1e-6


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm())


def activation(columns: int, k: int, group: int):
    x = torch.randn(columns, k) * (0.5 + torch.rand(columns, 1))
    return quantize_activation_reference(x, group)


def run_il(source_of, words, xa, n, s: gemv_il.IlSchedule, ctas: int, ring: int, dtype=torch.float32,
           conv=None):
    """One launch of il32 schedule s (its source from `source_of(source)`; `conv`: the CONV build running
    that `ConvEpilogue`); the output, and the tensor-core kernel's per-tile counts after it."""
    columns, k = xa.q.shape
    source = source_of(gemv_il.kernel_source(columns, OUT_KINDS[dtype], dataclasses.replace(s, splits=1),
                                              conv=gemv_il.conv_positions(conv)))
    tiles = gemv_il.il32_shape(n, k)[0]
    y = torch.full((columns, n), float("nan"), dtype=dtype)
    args = [words, xa.words, xa.d, _tables("cpu")[1], y, n, k, y.stride(0)]
    counts = torch.zeros(tiles, dtype=torch.int32)
    if s.kernel == "il_mma":
        part = torch.full((s.splits * columns * tiles * 32,), float("nan"))
        args += [s.splits, part, counts]
        name = "iq3s_il_mma"
    else:
        name = "iq3s_il_gemv"
    HostKernel(source, name)((ctas,), (32 * s.warps,), args + [ring, *gemv_il.conv_arguments(conv)],
                             s.smem_bytes(columns, k, ring))
    return y, counts


def same(source: str) -> str:
    return source


@pytest.mark.parametrize("group", [32, 256])
@pytest.mark.parametrize("columns", [1, 2])
@pytest.mark.parametrize(("n", "k"), [(40, 768), (160, 1024)])
def test_the_dp4a_il32_kernel(n, k, columns, group):
    """Rows padded to a tile and an odd block count (40 × 768); five tiles over two CTAs, summed in a ring
    of 2 and one at a time to the same bits; the bf16 build writes the fp32 sums rounded; the first block
    loaded after the wait (`ahead` 0) the same bits."""
    words = gemv_il.repack_il32(random_gguf_weight("iq3_s", n, k))
    xa = activation(columns, k, group)
    s = gemv_il.il_schedule(columns, k, n, group)
    assert s.kernel == "il"
    want = gemv_q8_reference(gemv_il.unpack_il32(words, n, k), "iq3_s", xa, n)
    y, _ = run_il(same, words, xa, n, s, 2, 2)
    assert rel(y, want) < FP32_BOUND
    assert torch.equal(run_il(same, words, xa, n, s, 2, 1)[0], y)
    assert torch.equal(run_il(same, words, xa, n, s, 2, 2, torch.bfloat16)[0], y.to(torch.bfloat16))
    other = dataclasses.replace(s, ahead=1 - s.ahead)
    assert torch.equal(run_il(same, words, xa, n, other, 2, 2)[0], y)


@pytest.mark.parametrize("group", [32, 256])
@pytest.mark.parametrize("columns", [3, 4, 8])
def test_the_tensor_core_il32_kernel(columns, group):
    """Whole tiles (a ring of 2 and one at a time: the same bits) and tiles split into 2 and 3 pieces across
    CTAs, the last piece adding the slots and leaving the counts zero; the short-row schedule (6 warps)."""
    n, k = 72, 1536
    words = gemv_il.repack_il32(random_gguf_weight("iq3_s", n, k))
    xa = activation(columns, k, group)
    want = gemv_q8_reference(gemv_il.unpack_il32(words, n, k), "iq3_s", xa, n)
    s = gemv_il.il_schedule(columns, k, n, group)
    assert s.kernel == "il_mma"
    y, _ = run_il(same, words, xa, n, dataclasses.replace(s, splits=1), 2, 2)
    assert rel(y, want) < FP32_BOUND
    assert torch.equal(run_il(same, words, xa, n, dataclasses.replace(s, splits=1), 2, 1)[0], y)
    for splits in (2, 3):
        ys, counts = run_il(same, words, xa, n, dataclasses.replace(s, splits=splits), 2, 1)
        assert rel(ys, want) < FP32_BOUND, splits
        assert not counts.any(), splits
    short = dataclasses.replace(s, warps=6, regs=112, splits=1)
    assert rel(run_il(same, words, xa, n, short, 3, 2)[0], want) < FP32_BOUND
    assert torch.equal(run_il(same, words, xa, n, s, 2, 2, torch.bfloat16)[0], y.to(torch.bfloat16))


def run_lane(name: str, source_of, words, xa, n: int, warps: int, smem: int, source: str,
             dtype=torch.float32, conv=None, ctas: int = 2):
    columns = xa.q.shape[0]
    y = torch.full((columns, n), float("nan"), dtype=dtype)
    sums = [xa.s] if name == "q4k_il_mma" else []  # (q4il reads each 32 inputs' sums as the producer wrote)
    HostKernel(source_of(source), name)((ctas,), (32 * warps,), [
        words, xa.words, xa.d, *sums, y, n, xa.q.shape[1], y.stride(0), *gemv_il.conv_arguments(conv)], smem)
    return y


def q4il_case(columns: int, n: int = 72, k: int = 1536, source_of=same, dtype=torch.float32,
              shape=gemv_q4il.SHAPES[1], staged: bool = False, raw=None, cluster: int = 1, conv=None,
              xa=None):
    """q4il over random q4_k rows (and activation, unless given) on two CTAs, or on two clusters of `cluster`
    CTAs."""
    raw = random_gguf_weight("q4_k", n, k) if raw is None else raw
    xa = activation(columns, k, 256) if xa is None else xa
    y = run_lane("q4k_il_mma", source_of, gemv_q4il.repack_q4il(raw), xa, n, shape[0],
                 gemv_q4il.smem_bytes(shape[0], staged, cluster),
                 gemv_q4il.kernel_source(columns, OUT_KINDS[dtype], False, shape,
                                         gemv_il.conv_positions(conv), staged, cluster), dtype, conv,
                 2 * cluster)
    return y, gemv_q8_reference(raw, "q4_k", xa, n)


def q6il_case(columns: int, n: int = 72, k: int = 1536, source_of=same, dtype=torch.float32):
    raw = random_gguf_weight("q6_k", n, k)
    xa = activation(columns, k, 256)
    y = run_lane("q6k_il_mma", source_of, gemv_q6il.repack_q6il(raw), xa, n, gemv_q6il.WARPS,
                 gemv_q6il.smem_bytes(k), gemv_q6il.kernel_source(columns, OUT_KINDS[dtype]), dtype)
    return y, gemv_q8_reference(raw, "q6_k", xa, n)


@pytest.mark.parametrize("shape", gemv_q4il.SHAPES)
@pytest.mark.parametrize("columns", [1, 4, 8])
def test_the_q4il_kernel_on_staged_blocks(columns, shape):
    """`staged`: each warp's next block copied into one of its two slots in shared memory (cp.async, landing
    here only at the copying lane's wait) while it works on the other, its stream across the CTA's tiles: the
    same bits as the unstaged build, within a tile's blocks, over 7 tiles on 2 CTAs (200 × 2560), and with
    warps that have no block (40 × 768: 3 blocks)."""
    for n, k in ((200, 2560), (40, 768)):
        raw = random_gguf_weight("q4_k", n, k)
        torch.manual_seed(1)
        plain, want = q4il_case(columns, n, k, shape=shape, raw=raw)
        torch.manual_seed(1)
        staged, _ = q4il_case(columns, n, k, shape=shape, staged=True, raw=raw)
        assert rel(plain, want) < FP32_BOUND
        assert torch.equal(staged, plain), (n, k)


@pytest.mark.parametrize("cluster", [2, 3])
@pytest.mark.parametrize("columns", [1, 4, 8])
def test_the_q4il_kernel_in_clusters(columns, cluster):
    """Clusters of 2 and 3 CTAs a tile, each rank its share of the blocks, the sums added in rank 0's shared
    memory: the oracle's product over 7 tiles on 2 clusters (200 × 2560: a cluster loops over 3-4 tiles,
    alternating its two sets of sums), with ranks and warps that have no block (40 × 768: 3 blocks), in bf16
    the fp32 sums rounded; with the GDN conv in the epilogue, the same bits and every lane's conv run."""
    from ninfer.kernels.gdn_decode import ConvEpilogue

    shape = gemv_q4il.SHAPES[2]
    for n, k in ((200, 2560), (40, 768)):
        raw = random_gguf_weight("q4_k", n, k)
        torch.manual_seed(1)
        y, want = q4il_case(columns, n, k, shape=shape, raw=raw, cluster=cluster)
        assert rel(y, want) < FP32_BOUND, (n, k)
        torch.manual_seed(1)
        y16, _ = q4il_case(columns, n, k, dtype=torch.bfloat16, shape=shape, raw=raw, cluster=cluster)
        assert torch.equal(y16, y.to(torch.bfloat16)), (n, k)
    ids = torch.randperm(columns + 2)[:columns]
    conv = ConvEpilogue.of(torch.randn(72, 4), torch.randn(columns + 2, 72, 3), ids)
    before = conv.slots.clone()
    torch.manual_seed(2)
    y, _ = q4il_case(columns, 96, 768, dtype=torch.bfloat16, shape=shape, cluster=cluster, conv=conv)
    assert_conv_ran(y, conv, before)
    torch.manual_seed(2)
    plain, _ = q4il_case(columns, 96, 768, dtype=torch.bfloat16, shape=shape, cluster=cluster)
    assert torch.equal(y, plain)


@pytest.mark.parametrize("case", [q4il_case, q6il_case])
@pytest.mark.parametrize("columns", [1, 3, 8])
def test_the_q4il_and_q6il_kernels(case, columns):
    y, want = case(columns)
    assert rel(y, want) < FP32_BOUND
    padded, want_padded = case(columns, 40, 768)  # rows padded to a tile, an odd block count
    assert rel(padded, want_padded) < FP32_BOUND


def evicting(source: str) -> str:
    """The build with its weight loads' cache hints at their strongest (`gemv_il.evict_level` 2; the emulation
    loads them as `__ldg`, which aborts on a shared-memory address)."""
    assert source.startswith("\n#define OUT_KIND") and "#define EVICT 0\n" in source
    return source.replace("#define EVICT 0\n", "#define EVICT 2\n", 1)


@pytest.mark.parametrize("columns", [1, 2, 4])
def test_the_evicting_builds_compute_the_same_bits(columns):
    """EVICT 2 (the weight loads through `ldw` / `ldw4`, q4il's copies with an L2 policy): every kernel the
    same bits as its plain build — the il32 kernel of this width, q4il unstaged, staged (its loads from the
    warp's slots stay shared-memory loads) and in clusters, the q6il head."""
    n, k = 72, 1536
    words = gemv_il.repack_il32(random_gguf_weight("iq3_s", n, k))
    xa = activation(columns, k, 256)
    s = gemv_il.il_schedule(columns, k, n, 256)
    assert torch.equal(run_il(evicting, words, xa, n, s, 2, 2)[0], run_il(same, words, xa, n, s, 2, 2)[0])
    raw = random_gguf_weight("q4_k", 200, 2560)
    for build in ({}, {"staged": True}, {"cluster": 2, "shape": gemv_q4il.SHAPES[2]}):
        torch.manual_seed(3)
        plain, want = q4il_case(columns, 200, 2560, raw=raw, **build)
        torch.manual_seed(3)
        evicted, _ = q4il_case(columns, 200, 2560, source_of=evicting, raw=raw, **build)
        assert torch.equal(evicted, plain), build
        assert rel(plain, want) < FP32_BOUND
    torch.manual_seed(4)
    plain, _ = q6il_case(columns)
    torch.manual_seed(4)
    assert torch.equal(q6il_case(columns, source_of=evicting)[0], plain)


def conv_case(kind: str, columns: int = 1, splits: int = 1, source_of=same, positions: int = 1):
    """The il32 (dp4a at 1-2 columns, tensor cores from 3 with `splits` pieces a tile) or q4il GEMV running
    the GDN decode conv of its first outputs in its epilogue (`CONV_STAGE`), column m position m % T of lane
    m / T (T `positions`): (y, the conv, its slots before, y of the build without the conv)."""
    from ninfer.kernels.gdn_decode import ConvEpilogue

    n, k, c = 96, 768, 72  # channels across a tile's end
    lanes = columns // positions
    ids = torch.randperm(lanes + 2)[:lanes]  # the lanes' slots out of order; int64, as the decode graphs'
    conv = ConvEpilogue.of(torch.randn(c, 4), torch.randn(lanes + 2, c, 3), ids, positions)
    before = conv.slots.clone()
    conv.out.fill_(float("nan"))
    xa = activation(columns, k, 256)
    if kind == "il":
        raw = random_gguf_weight("iq3_s", n, k)
        s = dataclasses.replace(gemv_il.il_schedule(columns, k, n, 256), splits=splits)
        ys = [run_il(source_of if cv else same, gemv_il.repack_il32(raw), xa, n, s, 2, 1 if splits > 1 else 2,
                     torch.bfloat16, cv)[0] for cv in (conv, None)]
    elif kind == "q4il_cluster":
        raw = random_gguf_weight("q4_k", n, k)
        ys = [q4il_case(columns, n, k, dtype=torch.bfloat16, shape=gemv_q4il.SHAPES[2], raw=raw, cluster=2,
                        conv=cv, xa=xa)[0] for cv in (conv, None)]
    else:
        raw = random_gguf_weight("q4_k", n, k)
        warps, ctas = gemv_q4il.SHAPES[1]
        ys = [run_lane("q4k_il_mma", source_of if cv else same, gemv_q4il.repack_q4il(raw), xa, n, warps,
                       gemv_q4il.smem_bytes(warps),
                       gemv_q4il.kernel_source(columns, 1, False, (warps, ctas), gemv_il.conv_positions(cv)),
                       torch.bfloat16, cv) for cv in (conv, None)]
    return ys[0], conv, before, ys[1]


@pytest.mark.parametrize(("kind", "columns", "splits", "positions"), [
    ("il", 1, 1, 1), ("il", 2, 1, 1), ("il", 4, 1, 1), ("il", 8, 1, 1), ("il", 8, 3, 1), ("q4il", 1, 1, 1),
    ("q4il", 4, 1, 1), ("q4il", 8, 1, 1), ("il", 2, 1, 2), ("il", 4, 1, 4), ("il", 8, 1, 4), ("il", 6, 3, 3),
    ("q4il", 4, 1, 4), ("q4il", 8, 1, 2), ("q4il_cluster", 8, 1, 4)])
def test_the_gdn_conv_in_a_gemvs_epilogue(kind, columns, splits, positions):
    """Every lane's conv run on its own slot (the dp4a il32 kernel at 1-2 columns, the tensor-core one at 4
    and 8, whole tiles and split in 3 pieces, q4il at 1, 4, 8), also over a verification's positions a lane
    (2-4; the tensor-core kernel's split tiles, q4il in clusters); the GEMV's own output the same bits as
    the build without the conv."""
    y, conv, before, plain = conv_case(kind, columns, splits, positions=positions)
    assert_conv_ran(y, conv, before)
    assert torch.equal(y, plain) and not y.isnan().any()


# plausible slips, each in one kernel's source: the test above must see every one
MUTATIONS = {
    "dp4a: a sign mask's byte": ("il", "0x4440 + 2 * half + (e >> 1)", "0x4440 + 2 * half"),
    "dp4a: the second block's d": ("il", "h ? f16_hi(b.dw) : f16_lo(b.dw)", "f16_lo(b.dw)"),
    "mma: the lane's sign byte": ("il_mma", "sels = 0x4440 + t", "sels = 0x4440"),
    "mma: a split's last piece": ("il_mma_split", "splits - 1;", "splits;"),
    "q4il: the min term's sign": ("q4il", "-dmin * (float)msum", "dmin * (float)msum"),
    "q6il: the scale unsigned": ("q6il", "0x8880u | (unsigned)", "0x0000u | (unsigned)"),
    "q4il staged: a block read before it landed": ("q4il_staged", "            cp_async_wait_stages();\n",
                                                   ""),
    "q4il staged: the slot being filled read": ("q4il_staged", "slots + (n & 1) * (16 * SLOT_CHUNKS)",
                                                 "slots + ((n + 1) & 1) * (16 * SLOT_CHUNKS)"),
    "q4il clusters: a rank's sums left out": ("q4il_cluster", "r < CLUSTER; ++r) v += set",
                                              "r < CLUSTER - 1; ++r) v += set"),
    "q4il clusters: every rank on the same blocks": ("q4il_cluster", "kb = rank * WARPS + wid;", "kb = wid;"),
    "q4il clusters: a rank's sums into its own memory": ("q4il_cluster",
                                                         "st_rank0(set + rank * 256 + i, tile_sum(red, i));",
                                                         "set[rank * 256 + i] = tile_sum(red, i);"),
    "q4il staged: the stream skips a tile": ("q4il_staged", "QBlock{b.tile + (int)gridDim.x,",
                                             "QBlock{b.tile + 2 * (int)gridDim.x,"),
    "conv: the slot not moved on": ("conv", "cp[0] = s1;", "cp[0] = s0;"),
    "conv: every lane on the first's slot": ("conv", "cv.slot_ids[m * cv.step]", "cv.slot_ids[0]"),
    "conv: a split tile's conv left out": ("conv_split", "conv_store(cv, m, tile * 32 + row, to_out(v));",
                                            "(void)0;"),
    "conv span: every position on the last input": ("conv_span", "y[(lane * CONV + p) * stride_y + row]",
                                                    "y[(lane * CONV + CONV - 1) * stride_y + row]"),
    "conv span: the slot left at its first position": ("conv_span", "    cp[0] = s0;\n    cp[1] = s1;\n",
                                                       "    cp[0] = s1;\n    cp[1] = s2;\n"),
    "conv span: every lane on the first's slot": ("conv_span", "cv.slot_ids[lane * cv.step]",
                                                  "cv.slot_ids[0]"),
    "conv span: a split tile's spans left out": ("conv_span_split", "conv_spans(cv, tile, N, y, stride_y);",
                                                 "(void)0;"),
}


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_a_slip_in_a_kernel_fails(name):
    kind, old, new = MUTATIONS[name]

    def mutate(source: str) -> str:
        assert old in source, name
        return source.replace(old, new)

    if kind in ("il", "il_mma", "il_mma_split"):
        n, k, columns = 72, 1536, 1 if kind == "il" else 4
        words = gemv_il.repack_il32(random_gguf_weight("iq3_s", n, k))
        xa = activation(columns, k, 256)
        s = gemv_il.il_schedule(columns, k, n, 256)
        s = dataclasses.replace(s, splits=2 if kind == "il_mma_split" else 1)
        y = run_il(mutate, words, xa, n, s, 2, 1)[0]
        want = gemv_q8_reference(gemv_il.unpack_il32(words, n, k), "iq3_s", xa, n)
    elif kind.startswith("conv"):  # spans: two lanes of 4
        y, conv, before, _ = conv_case("il", 8 if "span" in kind else 4, 3 if kind.endswith("split") else 1,
                                       source_of=mutate, positions=4 if "span" in kind else 1)
        with pytest.raises(AssertionError):
            assert_conv_ran(y, conv, before)
        return
    elif kind == "q4il_staged":  # 7 tiles on 2 CTAs
        y, want = q4il_case(4, 200, 2560, source_of=mutate, staged=True)
    elif kind == "q4il_cluster":  # 7 tiles on 2 clusters of 2
        y, want = q4il_case(4, 200, 2560, source_of=mutate, cluster=2)
    else:
        y, want = (q4il_case if kind == "q4il" else q6il_case)(4, source_of=mutate)
    assert not rel(y, want) < FP32_BOUND  # (NaN: an output never written)


@pytest.fixture
def launches_on_the_cpu(monkeypatch):
    """The wrappers' own launches (`gemv_il`, `gemv_q4il`) on the CPU: their NVRTC builds through cuda_cpu,
    two CTAs, the H200's shared memory, no PDL, the CUDA-only check of a call left out."""
    import types

    monkeypatch.setattr(gemv_il, "_compiled", lambda columns, kind, s, pdl=False, conv=False, evict=False,
                        prefetch=False:
                        HostKernel(gemv_il.kernel_source(columns, kind, s, False, conv, evict, prefetch),
                                   "iq3s_il_mma" if s.kernel == "il_mma" else "iq3s_il_gemv"))
    monkeypatch.setattr(gemv_q4il, "_compiled", lambda columns, kind, pdl, shape, *build, evict=False,
                        prefetch=False:
                        HostKernel(gemv_q4il.kernel_source(columns, kind, False, shape, *build, evict=evict,
                                                           prefetch=prefetch), "q4k_il_mma"))
    monkeypatch.setattr(gemv_q6il, "_compiled", lambda columns, kind, pdl, evict=False, prefetch=False:
                        HostKernel(gemv_q6il.kernel_source(columns, kind, False, evict, prefetch),
                                   "q6k_il_mma"))
    launch = lambda kernel, ctas, threads, smem, args, pdl: kernel((ctas,), (threads,), args, smem)  # noqa: E731
    for module in (gemv_il, gemv_q4il, gemv_q6il):
        monkeypatch.setattr(module, "_launch", launch)
        monkeypatch.setattr(module, "pdl_enabled", lambda: False)
        monkeypatch.setattr(module, "check_call", lambda kind, words, xa, group: None)
    monkeypatch.setattr(gemv_il, "_launch_shape", lambda device, s, n, k: 2)
    monkeypatch.setattr(gemv_il, "_smem_sm", lambda device: 228 * 1024)
    monkeypatch.setattr(gemv_il, "_smem_optin", lambda device: 227 * 1024)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: types.SimpleNamespace(
        multi_processor_count=1))


@pytest.mark.parametrize(("kind", "columns"), [("il", 1), ("il", 2), ("il", 4), ("q4il", 1), ("q4il", 4),
                                               ("q4il_unstaged", 4)])
def test_the_conv_wrappers_launch_what_the_kernels_take(launches_on_the_cpu, monkeypatch, kind, columns):
    """`il_matmul` / `q4il_matmul` with a GDN decode conv as the engine calls them (`lane_conv`, the GEMV's
    arguments then the conv's last; int32 slot ids, as the paged decode's) on bf16 rows, one a lane: the
    output the same bits as with NINFER_LANE_CONV=0 and within bf16 rounding of the oracle, each lane's slot
    moved on by it."""
    from ninfer.kernels.gdn_decode import ConvEpilogue

    monkeypatch.setenv("NINFER_LANE_CONV_COLUMNS", "8")
    monkeypatch.delenv("NINFER_Q4IL_STAGED", raising=False)  # q4il staged at 1-4 columns by default
    if kind == "q4il_unstaged":
        monkeypatch.setenv("NINFER_Q4IL_STAGED", "0")
        kind = "q4il"
    n, k, c = 96, 768, 40
    fmt = "iq3_s" if kind == "il" else "q4_k"
    raw = random_gguf_weight(fmt, n, k)
    words = gemv_il.repack_il32(raw) if kind == "il" else gemv_q4il.repack_q4il(raw)
    matmul = gemv_il.il_matmul if kind == "il" else gemv_q4il.q4il_matmul
    x = torch.randn(columns, k).to(torch.bfloat16)
    ids = torch.randperm(columns + 1)[:columns].to(torch.int32)
    conv = ConvEpilogue.of(torch.randn(c, 4), torch.randn(columns + 1, c, 3), ids)
    before = conv.slots.clone()
    y = lane_conv_on_and_off(monkeypatch, matmul, words, x, n, conv)
    want = gemv_q8_reference(raw, fmt, quantize_activation_reference(x, 256), n)
    assert rel(y, want) < 5e-3  # bf16 output rounding
    assert_conv_ran(y, conv, before)


@pytest.mark.parametrize("columns", [1, 2, 3])
def test_gemv_q4il_takes_clusters_where_they_pay(launches_on_the_cpu, monkeypatch, columns):
    """On a device where clusters pay, one tile on the emulated SM's two slots (8 warps × 2): clusters of two
    CTAs a tile at 1-2 columns, one CTA at 3 — the same product either way."""
    monkeypatch.delenv("NINFER_Q4IL_CLUSTER", raising=False)
    monkeypatch.setattr(gemv_q4il, "clusters_pay", lambda device: True)
    builds = []
    compiled = gemv_q4il._compiled
    monkeypatch.setattr(gemv_q4il, "_compiled", lambda *a, **kw: builds.append(a) or compiled(*a, **kw))
    n, k = 32, 768
    raw = random_gguf_weight("q4_k", n, k)
    xa = activation(columns, k, 256)
    y = gemv_q4il.gemv_q4il(gemv_q4il.repack_q4il(raw), xa, n)
    assert rel(y, gemv_q8_reference(raw, "q4_k", xa, n)) < FP32_BOUND
    assert builds[-1][-1] == (2 if columns <= gemv_q4il.CLUSTER_COLUMNS else 1)



@pytest.mark.parametrize("spread", ["0", "1"])
@pytest.mark.parametrize("columns", [1, 4])
def test_the_next_gemvs_weights_asked_into_l2(launches_on_the_cpu, monkeypatch, columns, spread):
    """NINFER_NEXT_PREFETCH=KB: a round of GEMVs (il32 — the dp4a kernel at one column, the tensor-core one
    at four — then q4il, then the q6il head) run twice; from the second on, each launches its NEXT build with
    the words of the GEMV launched after it last time and runs over their first bytes as its last arguments:
    the CTAs' prefetches (emulated: counted, each a 16-byte multiple) cover those runs, as one prefix or
    (NINFER_NEXT_PREFETCH_SPREAD=1) at the start of each tile the next launch starts on; the same bits as
    with it off."""
    n, k = 72, 1536
    raws = [random_gguf_weight(fmt, n, k) for fmt in ("iq3_s", "q4_k", "q6_k")]
    words = [gemv_il.repack_il32(raws[0]), gemv_q4il.repack_q4il(raws[1]), gemv_q6il.repack_q6il(raws[2])]
    calls = [lambda w, xa, n: gemv_il.gemv_il(w, xa, n, gemv_il.il_schedule(columns, k, n, 256)),
             gemv_q4il.gemv_q4il, gemv_q6il.gemv_q6il]
    launched = []
    for module in (gemv_il, gemv_q4il, gemv_q6il):
        monkeypatch.setattr(module, "_launch", lambda kernel, ctas, threads, smem, args, pdl: (
            kernel((ctas,), (threads,), args, smem), launched.append((args, kernel.prefetched))))
    monkeypatch.setattr(gemv_il, "_after", {})
    monkeypatch.setattr(gemv_il, "_latest", [None])
    monkeypatch.setattr(gemv_il, "_first", {})
    monkeypatch.setenv("NINFER_NEXT_PREFETCH_SPREAD", spread)
    xa = activation(columns, k, 256)
    monkeypatch.setenv("NINFER_NEXT_PREFETCH", "0")
    plain = [call(w, xa, n) for call, w in zip(calls, words, strict=True)]
    without = [len(a) for a, _ in launched]  # each kernel's arguments with it off
    monkeypatch.setenv("NINFER_NEXT_PREFETCH", "8")
    launched.clear()
    for _ in range(2):
        for call, w, want in zip(calls, words, plain, strict=True):
            assert torch.equal(call(w, xa, n), want)
    # the first round with it on learns the order (the first call's next only at the end): the last four
    # calls take their next
    assert [len(a) for a, _ in launched] == without + [n + 5 for n in without]
    tiles = -(-n // 32)
    for (a, prefetched), w in zip(launched[3:], [words[1], words[2], words[0]], strict=True):
        nxt, cut, stride, run, runs = a[-5:]
        size = min(8 * 1024, w.numel() * w.element_size())
        assert nxt is w
        if spread == "1":  # a share at the start of each tile the next launch starts on (2 or 3 here)
            assert cut == w.numel() * w.element_size() and stride == cut // tiles and runs in (2, 3)
            assert run == (-(-size // runs) + 15) & ~15
        else:  # the prefix, one run a CTA
            assert cut == size and stride == run and runs == -(-size // run)
        assert prefetched == sum(min(run, cut - r * stride) for r in range(runs))
    monkeypatch.setenv("NINFER_NEXT_PREFETCH", "0")
    launched.clear()
    assert torch.equal(calls[0](words[0], xa, n), plain[0])
    assert len(launched[0][0]) == without[0] and launched[0][1] == 0
