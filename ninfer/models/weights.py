"""Weights as the model sees them: a `Linear` / `Embedding` that keep the artifact's stored tensor and,
on CPU, a dense copy in the compute dtype made once at load.

A quantized GPU backend replaces `Linear.forward` (it has `stored`, the raw GGUF blocks, and
`input_columns`) without touching the model files.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ninfer.errors import ArtifactError
from ninfer.kernels.gguf_matmul import KERNEL_FORMATS

# Set by `load_model(..., quantized_weights=True)` while it builds a model: Linears keep GGUF blocks.
QUANTIZED_LINEARS: ContextVar[bool] = ContextVar("quantized_linears", default=False)


@contextmanager
def _scoped(var: ContextVar[bool], value: bool) -> Iterator[None]:
    token = var.set(value)
    try:
        yield
    finally:
        var.reset(token)


def quantized_linears(enabled: bool):
    """Build every `Linear` in this block in quantized mode (GGUF formats) or dense mode."""
    return _scoped(QUANTIZED_LINEARS, enabled)


# Whether quantized-mode models run the Linears of one input as one `MergedLinear` (default on; tests turn it
# off to compare). Dense mode never merges: the CPU reference stays one matmul per parameter.
MERGED_PROJECTIONS: ContextVar[bool] = ContextVar("merged_projections", default=True)


def merged_projections(enabled: bool):
    """Build quantized-mode models in this block with (default) or without merged projections."""
    return _scoped(MERGED_PROJECTIONS, enabled)


def merging_projections() -> bool:
    """True while building a model whose same-input Linears become `MergedLinear`s (quantized mode)."""
    return QUANTIZED_LINEARS.get() and MERGED_PROJECTIONS.get()


class StoredLike(Protocol):
    shape: Any

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor: ...


class WeightSource(Protocol):
    """What the models need from `ninfer.artifact.Artifact` (tests may supply their own)."""

    def tensor(self, name: str) -> StoredLike: ...

    def input_columns(self, name: str) -> torch.Tensor | None: ...


def has_tensor(source: WeightSource, name: str) -> bool:
    """True when `name` is bound in the source (optional parameters: biases, untied head)."""
    for method in ("has", "has_tensor"):
        if hasattr(source, method):
            return bool(getattr(source, method)(name))
    bindings = getattr(source, "bindings", None)
    if isinstance(bindings, dict):
        return name in bindings
    try:
        source.tensor(name)
    except (KeyError, ArtifactError):
        return False
    return True


def same_stored_object(source: WeightSource, a: str, b: str) -> bool:
    """True when two names are bound to one stored object (a tied output head): load it once."""
    bindings = getattr(source, "bindings", None)
    if not isinstance(bindings, dict) or a not in bindings or b not in bindings:
        return False
    return "object" in bindings[a] and bindings[a] == bindings[b]


def load_dense(
    source: WeightSource, name: str, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """Dequantise one stored tensor into a dense tensor of `dtype` on `device`."""
    return source.tensor(name).dequantize(torch.float32).to(device=device, dtype=dtype).contiguous()


def load_vector(source: WeightSource, name: str, device: torch.device | str) -> torch.Tensor:
    """Small vectors (norm weights, A_log, dt_bias) stay fp32 whatever the compute dtype."""
    return load_dense(source, name, torch.float32, device)


def keeps_blocks(stored: StoredLike, quantized: bool | None) -> bool:
    """Quantized mode (`quantized`, or the `quantized_linears` block when None) keeps the GGUF blocks of the
    formats the kernels decode resident; everything else is dequantised once."""
    quantized = QUANTIZED_LINEARS.get() if quantized is None else quantized
    return quantized and getattr(stored, "format", "f32").removeprefix("gguf_") in KERNEL_FORMATS


def resident_weight(source: WeightSource, name: str, dtype: torch.dtype, device: torch.device | str,
                    quantized: bool | None) -> tuple[nn.Buffer | None, nn.Buffer | None]:
    """`(dense weight, None)` or `(None, GGUF rows uint8 [rows, row_bytes] on device)` (see keeps_blocks)."""
    stored = source.tensor(name)
    if keeps_blocks(stored, quantized):
        return None, nn.Buffer(stored.data.to(device))
    return nn.Buffer(load_dense(source, name, dtype, device)), None


def aligned_run(scatter: torch.Tensor) -> int:
    """The longest power-of-two run r (dividing the length) such that `scatter` maps every r-aligned run of
    columns onto one r-aligned run of consecutive columns (the whole length for the identity, 1 for a
    scattered permutation): a producer whose programs each write such a run may quantise it in place."""
    s = scatter.to("cpu", torch.long)
    run = 1
    while s.numel() % (2 * run) == 0:
        runs = s.view(-1, 2 * run)
        starts = runs[:, :1]
        steps = torch.arange(2 * run).expand_as(runs)
        if (starts % (2 * run)).any() or not torch.equal(runs - starts, steps):
            break
        run *= 2
    return run


@dataclass(frozen=True)
class RepackedLayout:
    """A lane-per-row layout a quantized Linear may take on load: which weights (`wanted(format, out, in,
    device)`), the repack of their GGUF rows, the matmul on the words, the activation grouping it reads;
    `takes_conv`: its matmul takes a GDN decode conv (`conv=`) for its GEMV's epilogue."""

    wanted: Callable[[str, int, int, torch.device], bool]
    repack: Callable[[torch.Tensor], torch.Tensor]
    matmul: Callable[..., torch.Tensor]
    group: Callable[[], int]
    takes_conv: bool = False


@functools.cache
def lane_layouts() -> dict[str, RepackedLayout]:
    """The layouts by name, in the order they are tried: "il32" (iq3_s, `kernels.gemv_il`), "q6il" (the q6_k
    heads, `kernels.gemv_q6il`), "q4il" (q4_k matrices of ≥ 5120 rows, `kernels.gemv_q4il`)."""
    from ninfer.kernels import gemv_il, gemv_q4il, gemv_q6il

    return {
        "il32": RepackedLayout(gemv_il.il32_wanted, gemv_il.repack_il32, gemv_il.il_matmul, gemv_il.il_group,
                               takes_conv=True),
        "q6il": RepackedLayout(gemv_q6il.q6il_wanted, gemv_q6il.repack_q6il, gemv_q6il.q6il_matmul,
                               lambda: 256),
        "q4il": RepackedLayout(gemv_q4il.q4il_wanted, gemv_q4il.repack_q4il, gemv_q4il.q4il_matmul,
                               lambda: 256, takes_conv=True),
    }


class Linear(nn.Module):
    """`y = x[..., input_columns] @ Wᵀ (+ b)`; W [out, in] from the artifact.

    Dense mode (default, the CPU reference): W dequantised once to the compute dtype (`weight`).
    Quantized mode (`quantized=True`, GGUF block formats only): the raw blocks (`raw`, uint8
    [out, row_bytes]) move to `device` as stored and every call runs `kernels.gguf_matmul.quant_matmul`
    (Triton on CUDA; its reference elsewhere); on CUDA the large iq3_s matrices, the q6_k output heads and
    the q4_k matrices of ≥ 5120 rows are repacked once, lane per row, at the same size (`layout`,
    `lane_layouts`).
    Other formats stay dense in either mode.
    """

    def __init__(
        self,
        source: WeightSource,
        name: str,
        dtype: torch.dtype,
        device: torch.device | str,
        bias_name: str | None = None,
        quantized: bool | None = None,
    ):
        super().__init__()
        self.name = name
        self.dtype = dtype
        self.stored = source.tensor(name)
        self.out_features, self.in_features = (int(n) for n in self.stored.shape)
        self.format = getattr(self.stored, "format", "f32")
        self.weight, self.raw = resident_weight(source, name, dtype, device, quantized)
        columns = source.input_columns(name)
        self.input_columns = None if columns is None else columns.to(device=device, dtype=torch.long)
        # where each input column goes in the gathered order: lets the producer of x write it pre-gathered
        # (and quantise it on the way, in runs of `scatter_run` columns that stay together)
        self.input_scatter = None if columns is None else torch.argsort(self.input_columns)
        self.scatter_run = self.in_features if columns is None else aligned_run(torch.argsort(columns))
        self.bias = None if bias_name is None else nn.Buffer(load_dense(source, bias_name, dtype, device))
        self._take_layout()

    def _take_layout(self) -> None:
        """`layout`: the first of `lane_layouts()` whose policy picks this weight (the same bytes repacked
        once, lane per row), else "gguf" (the rows as stored)."""
        self.layout = "gguf"
        if self.raw is None:
            return
        for name, layout in lane_layouts().items():
            if layout.wanted(self.format, self.out_features, self.in_features, self.raw.device):
                self.raw, self.layout = nn.Buffer(layout.repack(self.raw)), name
                return

    def activation_group(self) -> int:
        """Inputs per scale of the int8 activation this Linear's decode GEMVs read (the `kernels.ops` kernel
        that makes x writes it so): its lane layout's, else 32."""
        return lane_layouts()[self.layout].group() if self.layout != "gguf" else 32

    def forward(self, x: torch.Tensor, columns_applied: bool = False, conv=None) -> torch.Tensor:
        """`columns_applied`: x already is in `input_columns` order (`ops.gated_rms_norm(gather=...)`).
        `conv`: a `kernels.gdn_decode.ConvEpilogue` of the first outputs the matmul may run (quantized: the
        rows kernels' and the il32 / q4il ones' (`gemv_il.lane_conv`); `conv.applied` says whether it
        did, else the caller runs it)."""
        if self.input_columns is not None and not columns_applied:
            x = x.index_select(-1, self.input_columns)
        x = x.to(self.dtype)
        if self.raw is None:
            return F.linear(x, self.weight, self.bias)
        if self.layout != "gguf":
            lane = lane_layouts()[self.layout]
            y = (lane.matmul(self.raw, x, self.out_features, conv=conv) if lane.takes_conv
                 else lane.matmul(self.raw, x, self.out_features))
        else:
            from ninfer.kernels.gguf_matmul import quant_matmul

            y = quant_matmul(self.raw, self.format, x, self.out_features, conv=conv)
        return y if self.bias is None else y + self.bias

    @classmethod
    def stacked(
        cls, source: WeightSource, names: Sequence[str], dtype: torch.dtype, device: torch.device | str,
        quantized: bool,
    ) -> Linear:
        """One Linear over the rows of several stored tensors of one format and input width (no bias, no
        input columns): GGUF rows are copied side by side into one `raw` buffer on `device`."""
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        stored = [source.tensor(n) for n in names]
        self.name, self.dtype, self.stored = "|".join(names), dtype, None
        self.out_features, self.in_features = sum(int(s.shape[0]) for s in stored), int(stored[0].shape[1])
        self.format = getattr(stored[0], "format", "f32")
        if keeps_blocks(stored[0], quantized):
            raw = torch.empty((self.out_features, stored[0].data.shape[1]), dtype=torch.uint8, device=device)
            row = 0
            for s in stored:
                raw[row : row + s.data.shape[0]].copy_(s.data)
                row += s.data.shape[0]
            self.weight, self.raw = None, nn.Buffer(raw)
        else:
            dense = torch.cat([load_dense(source, n, dtype, device) for n in names])
            self.weight, self.raw = nn.Buffer(dense), None
        self.input_columns, self.input_scatter, self.bias = None, None, None
        self._take_layout()
        return self


class MergedLinear(nn.Module):
    """Linears that read the same input, run as one matmul per storage format over their concatenated rows
    (GGUF rows of one format and width concatenate as bytes), e.g. GDN q|k|v|z in q4_k and a|b in q8_0.

    `parts` names the outputs: each is one or more member names whose outputs come back side by side —
    a column view of one matmul's output when its members share a format, else concatenated.
    """

    def __init__(
        self, source: WeightSource, parts: Sequence[Sequence[str]], dtype: torch.dtype,
        device: torch.device | str,
    ):
        super().__init__()
        names = [n for part in parts for n in part]
        by_format: dict[str, list[str]] = {}
        rows: dict[str, int] = {}
        for n in names:
            st = source.tensor(n)
            if source.input_columns(n) is not None:
                raise ValueError(f"{n} has recorded input columns; it cannot share a merged matmul")
            if int(st.shape[1]) != int(source.tensor(names[0]).shape[1]):
                raise ValueError(f"{n} does not read the same input width as {names[0]}")
            by_format.setdefault(getattr(st, "format", "f32"), []).append(n)
            rows[n] = int(st.shape[0])
        quantized = QUANTIZED_LINEARS.get()
        self.groups = nn.ModuleList(
            Linear.stacked(source, members, dtype, device, quantized) for members in by_format.values())
        where: dict[str, tuple[int, int, int]] = {}  # name -> (group, first column, end column)
        for g, members in enumerate(by_format.values()):
            col = 0
            for n in members:
                where[n] = (g, col, col + rows[n])
                col += rows[n]
        self.parts: list[tuple[tuple[int, int, int], ...]] = []
        for part in parts:
            spans: list[tuple[int, int, int]] = []
            for g, a, b in (where[n] for n in part):
                if spans and spans[-1][0] == g and spans[-1][2] == a:
                    spans[-1] = (g, spans[-1][1], b)
                else:
                    spans.append((g, a, b))
            self.parts.append(tuple(spans))

    def activation_group(self) -> int:
        """`Linear.activation_group` of its largest matmul (a smaller one of another format may quantise x
        again)."""
        return max(self.groups, key=lambda g: g.out_features).activation_group()

    def forward(self, x: torch.Tensor, conv=None) -> list[torch.Tensor]:
        """One output per part, `[..., part width]` (views into the group outputs where possible). `conv`: a
        `kernels.gdn_decode.ConvEpilogue` of the first part, handed to its matmul where that part is the
        first columns of one group."""
        first = self.parts[0][0]
        whole = len(self.parts[0]) == 1 and first[1] == 0
        ys = [group(x, conv=conv if whole and g == first[0] else None) for g, group in enumerate(self.groups)]
        outs = []
        for spans in self.parts:
            pieces = [ys[g][..., a:b] for g, a, b in spans]
            outs.append(pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=-1))
        return outs


class Embedding(nn.Module):
    """Token embedding table [vocab, hidden]; also serves as a tied output head (`as_output_head`).

    Dense mode: the table dequantised once to the compute dtype (`weight`). Quantized mode (as for `Linear`,
    GGUF formats the kernels decode): the rows stay GGUF blocks on `device` (`raw`) and a lookup decodes only
    the gathered rows, so the table costs its stored bytes; as a tied head it multiplies via `quant_matmul`.
    """

    def __init__(
        self,
        source: WeightSource,
        name: str,
        dtype: torch.dtype,
        device: torch.device | str,
        quantized: bool | None = None,
    ):
        super().__init__()

        self.name = name
        self.dtype = dtype
        self.stored = source.tensor(name)
        self.num_rows, self.dim = (int(n) for n in self.stored.shape)
        self.format = getattr(self.stored, "format", "f32")
        self.weight, self.raw = resident_weight(source, name, dtype, device, quantized)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.raw is None:
            return self.weight.index_select(0, ids.to(device=self.weight.device, dtype=torch.long))
        from ninfer.kernels.gguf_matmul import dequantize_rows

        return dequantize_rows(self.raw, self.format, self.num_rows, self.dim, self.dtype,
                               rows=ids.to(device=self.raw.device, dtype=torch.long))

    def as_output_head(self, x: torch.Tensor) -> torch.Tensor:
        """`x [..., hidden] -> [..., vocab]` logits through this table (a tied output head)."""
        if self.raw is None:
            return F.linear(x.to(self.weight.dtype), self.weight)
        from ninfer.kernels.gguf_matmul import quant_matmul

        return quant_matmul(self.raw, self.format, x.to(self.dtype), self.num_rows)
