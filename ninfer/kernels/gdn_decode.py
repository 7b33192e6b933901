"""Fused Gated DeltaNet decode: conv1d + SiLU, then the gated delta recurrence, on state slots in place.

Decode (and the T ≤ 16 positions of a speculative verification; T a compile-time constant, one build each)
runs two small launches per layer:
1. `_conv_kernel`: per lane and channel, the depthwise causal conv (kernel 4) over the T new inputs,
   continuing from the lane's conv state slot, SiLU (all positions in one tile); updates the conv slot in
   place.
2. `_recurrent_kernel`: per lane, value head and slice of the value dim, q/k L2-normalised, the decay
   `g = -exp(A_log)·softplus(a + dt_bias)` and `beta = sigmoid(b)`, then per position
   `S ← exp(g)·S; S ← S + k ⊗ beta·(v − Sᵀk); o = Sᵀq` (positions unrolled), the state held in registers
   between positions and written back once (fp32 or fp16 slots). Optionally every position's state is
   written too, so a verifier can commit the accepted prefix.
The conv can instead run in the epilogue of the GEMV that makes its input (`ConvEpilogue`: the merged input
projection's rows kernels at one position a lane, `conv_epilogue_store`; the il32 and q4il kernels at T
positions too, `gemv_il.CONV_STAGE`), one launch and one round trip through memory fewer a layer;
`gdn_decode(conv_done=True)` then runs only the recurrence.
At one position a lane the recurrence can also leave its state write to a third launch (`defer_state`:
`PendingState`, `apply_pending`) that a decode graph runs on a side stream, off the chain
(`STATE_SIDE_LANES`).
Layouts: mixed_qkv `[B, T, C]` with C = q (Hk·Dk) | k (Hk·Dk) | v (Hv·Dv), value heads in grouped order
(value head h reads key head h // (Hv/Hk)); conv slots `[slots, C, K-1]` (oldest input first, as
`reference.causal_conv1d`); recurrent slots `[slots, Hv, Dk, Dv]`; `slot_ids` int32 `[B]`.
`gdn_decode_reference` is the same computation from `ninfer.kernels.reference`, lane by lane.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ninfer.errors import NinferError
from ninfer.kernels import reference
from ninfer.kernels.triton_support import HAVE_TRITON, jit, pdl_options, pdl_start, tl, tl_sum, triton_runs_on

# Decode tiles (read at each call; `bench/step_profile.py --sweep gdn=BLOCK_V:WARPS:BLOCK_C` times others in
# the captured 27B step): value columns per recurrence program (Dv / BLOCK_V programs per lane and value
# head) for one lane and for several (H200 session 19: 16 columns made the one-lane step 0.025 ms faster and
# the eight-lane round 0.07 ms slower), that program's warps (one lane, session 37: one warp, whose reductions
# over Dk stay inside it, made the 4-position step 0.1 ms faster), channels per conv program at one position
# (T positions: a T-th as many, at least 32).
RECURRENT_BLOCK_V_ONE_LANE = 16
RECURRENT_BLOCK_V = 32
RECURRENT_WARPS_ONE_LANE = 1
RECURRENT_WARPS = 4
CONV_BLOCK_C = 256
# The recurrence's state read and written evict-first in L2: each lane's state (6.3 MB a layer of the 27B in
# fp32) is touched once a round, the small kernels' vectors again each round (as the il32 weights' loads,
# gemv_il.EVICT). Off: even on the H200 (session 57, graphed rounds on the lanes' own slots, both types at 1
# and 8 lanes within 0.01 ms); NINFER_GDN_STATE_EVICT=0 / 1 for A/B.
STATE_EVICT = False


def state_evict() -> bool:
    """Whether the recurrence reads and writes its state evict-first (`STATE_EVICT`,
    NINFER_GDN_STATE_EVICT)."""
    forced = os.environ.get("NINFER_GDN_STATE_EVICT", "")
    return forced == "1" if forced in ("0", "1") else STATE_EVICT


# The recurrence's state write off the decode chain (`gdn_decode(defer_state=True)`): the recurrence writes
# its outputs and, instead of the state, the normalised k, δ and the decay of each lane and head
# (`PendingState`, a few KB); `apply_pending` then reads the state again and writes decay·S + k ⊗ δ, which a
# CUDA graph can run on a side stream beside the next kernels (`GraphDecodeContext`), joined at the round's
# end. Why: under PDL a kernel's successor waits until its last write is visible, so the state's write (6.3 MB
# a layer a lane of the 27B in fp32) sits on the chain (session 61, H100: the recurrence 0.30 / 1.03 ms of the
# 1- / 8-lane Q4_K round). Timed in session 72 (H100, graphed rounds): at 1 lane Q4_K −0.055 ms, IQ3_S −0.018
# ms; at 8 lanes +0.08 / +0.19 ms (the update's programs beside the GEMVs cost more than the write saved) — so
# only rounds of at most `STATE_SIDE_LANES` lanes defer. Between (session 73, H100, graphs of up to 1 / 2 / 4
# lanes deferring): 2 lanes IQ3_S 6.149 / 6.112 / 6.112 ms, Q4_K 6.166 / 6.182 / 6.183; 4 lanes IQ3_S 7.387 /
# 7.389 / 7.258, Q4_K 6.523 / 6.525 / 6.495 — so up to 4. NINFER_GDN_STATE_SIDE=N sets it (0: never),
# NINFER_GDN_STATE_SIDE_PROGRAMS=N caps the update's programs (0: one a tile).
STATE_SIDE_LANES = 4
STATE_SIDE_PROGRAMS = 0


def state_side() -> int:
    """The most lanes a graphed one-position decode round has for it to write the recurrent state off the
    chain (`STATE_SIDE_LANES`, NINFER_GDN_STATE_SIDE; 0: none)."""
    forced = os.environ.get("NINFER_GDN_STATE_SIDE", "")
    return int(forced) if forced.isdigit() else STATE_SIDE_LANES


def state_side_programs() -> int:
    """`apply_pending`'s programs at most (`STATE_SIDE_PROGRAMS`, NINFER_GDN_STATE_SIDE_PROGRAMS; 0: a tile
    each)."""
    forced = os.environ.get("NINFER_GDN_STATE_SIDE_PROGRAMS", "")
    return int(forced) if forced.isdigit() else STATE_SIDE_PROGRAMS


class GdnKernelError(NinferError):
    """Gated DeltaNet decode inputs of the wrong shape or type."""


@dataclass
class ConvEpilogue:
    """The decode conv + SiLU of a GDN layer (`_conv_kernel` for T tokens a lane), for the GEMV that makes
    its input to do in its epilogue: column m of that GEMV is position m % T of lane m // T; outputs 0..C-1
    are the conv channels; lane b's conv slot `slot_ids[b]` of `slots` `[S, C, 3]` moves on by its T inputs
    and `out` `[B·T, C]` (fp32) gets silu(conv), what `gdn_decode` then reads instead of running its conv
    (`conv_done`). `applied` is set by the GEMV that did it (`gguf_matmul.quant_matmul`: rows kernels
    without split-K, one position a lane; the il32 and q4il kernels, `gemv_il.lane_conv`)."""

    weight: torch.Tensor  # [C, 4] fp32, contiguous
    slots: torch.Tensor  # [S, C, 3], the layer's conv slots (unit stride along the taps)
    slot_ids: torch.Tensor  # [M] int32
    out: torch.Tensor  # [M, C] fp32
    applied: bool = False

    @classmethod
    def of(cls, weight: torch.Tensor, slots: torch.Tensor, slot_ids: torch.Tensor,
           positions: int = 1) -> ConvEpilogue:
        C = slots.shape[1]
        return cls(weight.float().contiguous(), slots, slot_ids,
                   torch.empty((slot_ids.shape[0] * positions, C), dtype=torch.float32, device=slots.device))

    @property
    def channels(self) -> int:
        return self.slots.shape[1]

    @property
    def positions(self) -> int:
        """T, the positions a lane."""
        return self.out.shape[0] // self.slot_ids.shape[0]

    def launch_args(self) -> tuple:
        """The GEMV kernels' conv arguments (cw_ptr, cs_ptr, slot_ptr, co_ptr, C, s_cs)."""
        return self.weight, self.slots, self.slot_ids, self.out, self.channels, self.slots.stride(0)


@dataclass(frozen=True)
class PendingState:
    """A one-position recurrence whose state write was deferred (`gdn_decode(defer_state=True)`): head h of
    lane b's slot `slot_ids[b]` of `state_slots` becomes decay·S + k[b, h // (Hv/Hk)] ⊗ delta[b, h] when
    `apply_pending` runs; until then it holds the state before the step."""

    k: torch.Tensor  # [B, Hk, Dk] fp32, L2-normalised
    delta: torch.Tensor  # [B, Hv, Dv] fp32, β·(v − decay·Sᵀk)
    decay: torch.Tensor  # [B, Hv, Dv] fp32, the head's decay repeated along its value columns
    state_slots: torch.Tensor
    slot_ids: torch.Tensor

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """What `apply_pending` reads (for `Tensor.record_stream` where it runs on another stream)."""
        return self.k, self.delta, self.decay, self.slot_ids


@dataclass(frozen=True)
class GdnDecodeResult:
    """Output `[B, T, Hv, Dv]` (fp32); per-position states when asked for; the state write still to do when
    it was deferred (`pending`, else the slots are up to date)."""

    output: torch.Tensor
    states: torch.Tensor | None = None  # [B, T, Hv, Dk, Dv], the slot dtype
    conv_states: torch.Tensor | None = None  # [B, T, C, K-1]
    pending: PendingState | None = None


def gdn_decode_reference(
    mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, conv_weight: torch.Tensor,
    a_log: torch.Tensor, dt_bias: torch.Tensor, conv_slots: torch.Tensor, state_slots: torch.Tensor,
    slot_ids: torch.Tensor, num_key_heads: int, return_all_states: bool = False, conv_done: bool = False,
) -> GdnDecodeResult:
    """The decode step from the reference ops, one lane at a time; updates the slots in place (`conv_done`:
    mixed_qkv is the conv's output, the conv slots moved on already)."""
    B, T, C = mixed_qkv.shape
    Hv, Dk, Dv = state_slots.shape[1:]
    Hk = num_key_heads
    outs, states, convs = [], [], []
    for lane in range(B):
        slot = int(slot_ids[lane])
        if conv_done:
            y = mixed_qkv[lane].float()
        else:
            y, _ = reference.causal_conv1d(mixed_qkv[lane].float(), conv_weight, conv_slots[slot].float())
            full = torch.cat([conv_slots[slot].float(), mixed_qkv[lane].float().t()], dim=1)
            k_minus_1 = conv_slots.shape[2]
            convs.append(torch.stack([full[:, t + 1:t + 1 + k_minus_1] for t in range(T)]))
            conv_slots[slot] = full[:, T:].to(conv_slots.dtype)
        q = reference.l2_norm(y[:, :Hk * Dk].reshape(T, Hk, Dk)) * Dk ** -0.5
        k = reference.l2_norm(y[:, Hk * Dk:2 * Hk * Dk].reshape(T, Hk, Dk))
        v = y[:, 2 * Hk * Dk:].reshape(T, Hv, Dv)
        g = -a_log.float().exp() * F.softplus(a[lane].float() + dt_bias.float())
        beta = torch.sigmoid(b[lane].float())
        o, s_all = reference.gdn_recurrent(q, k, v, g, beta, state_slots[slot], return_all_states=True)
        state_slots[slot] = s_all[-1].to(state_slots.dtype)
        outs.append(o.float())
        states.append(s_all.to(state_slots.dtype))
    output = torch.stack(outs)
    if not return_all_states:
        return GdnDecodeResult(output)
    return GdnDecodeResult(output, torch.stack(states), torch.stack(convs).to(conv_slots.dtype))


# ---------------------------------------------------------------------------------------------------------
# Triton kernels


@jit
def conv_epilogue_load(mo, no, M, N, cw_ptr, cs_ptr, slot_ptr, C, s_cs):
    """What `conv_epilogue_store` reads for (column mo, row no) besides the GEMV's sums: lane mo's conv slot
    row (its pointer and three values) and the conv weights. The kernel ahead of the projection in the
    decode step (the add + RMSNorm) writes none of it, so a GEMV may load it before its programmatic-launch
    wait (`gemv_rows.conv_early`)."""
    ok = (mo < M) & (no < N) & (no < C)
    slot = tl.load(slot_ptr + tl.minimum(mo, M - 1), mask=mo < M, other=0).to(tl.int64)
    cp = cs_ptr + slot * s_cs + no * 3
    w = cw_ptr + no * 4
    s0 = tl.load(cp, mask=ok, other=0.0).to(tl.float32)
    s1 = tl.load(cp + 1, mask=ok, other=0.0).to(tl.float32)
    s2 = tl.load(cp + 2, mask=ok, other=0.0).to(tl.float32)
    return (cp, s0, s1, s2, tl.load(w, mask=ok, other=0.0), tl.load(w + 1, mask=ok, other=0.0),
            tl.load(w + 2, mask=ok, other=0.0), tl.load(w + 3, mask=ok, other=0.0))


@jit
def conv_epilogue_store(y_ptr, out, mo, no, M, N, stride_ym, co_ptr, C, cp, s0, s1, s2, w0, w1, w2, w3):
    """A GEMV's sums `out` at (column mo, row no) into y as `_store` does (its dtype), and for the rows
    below C the decode conv of `ConvEpilogue` on those very values (the operands of `conv_epilogue_load`):
    silu(conv) into co `[M, C]` and lane mo's conv slot moved on (the arithmetic of `_conv_kernel`)."""
    live = (mo < M) & (no < N)
    x = out.to(y_ptr.dtype.element_ty)
    tl.store(y_ptr + mo * stride_ym + no, x, mask=live)
    ok = live & (no < C)
    x = x.to(tl.float32)
    acc = w0 * s0 + w1 * s1 + w2 * s2 + w3 * x
    tl.store(co_ptr + mo * C + no, acc / (1.0 + tl.exp(-acc)), mask=ok)
    tl.store(cp, s1.to(cp.dtype.element_ty), mask=ok)
    tl.store(cp + 1, s2.to(cp.dtype.element_ty), mask=ok)
    tl.store(cp + 2, x.to(cp.dtype.element_ty), mask=ok)


@jit
def _conv_tap(xb, s0, s1, s2, t, d: tl.constexpr, s_xt, live):
    """The conv input d positions before position t (2-D: positions × channels), fp32: the lane's new input
    t - d, or column 3 + t - d of its conv slot (s0, s1, s2, loaded already) where t - d < 0."""
    src = t - d
    new = tl.load(xb + src * s_xt, mask=live & (src >= 0), other=0.0).to(tl.float32)
    old = tl.where(src == -3, s0[None, :], tl.where(src == -2, s1[None, :], s2[None, :]))
    return tl.where(src >= 0, new, old)


@jit
def _conv_last(xb, s1, s2, T: tl.constexpr, j: tl.constexpr, s_xt, ok):
    """Column j of the slot after all T positions: input T - 3 + j, or the slot's column T + j."""
    if T - 3 + j >= 0:
        return tl.load(xb + (T - 3 + j) * s_xt, mask=ok, other=0.0).to(tl.float32)
    if T + j == 1:
        return s1
    return s2


@jit
def _conv_kernel(
    x_ptr, w_ptr, conv_ptr, slot_ptr, y_ptr, conv_all_ptr,
    C, s_xb, s_xt, s_cs, s_cc,
    T: tl.constexpr, TP: tl.constexpr, BLOCK_C: tl.constexpr, STORE_ALL: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    """All T positions at once (TP: T rounded up to a power of two): every tap of every position is one
    load issued before any is used, where a loop over the positions waited on one load after another. The
    lane's slot and the weights load before the programmatic-launch wait: the projection ahead writes
    neither (this layer's conv wrote the slot a round ago), so only the new inputs wait."""
    lane = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    ok = offs < C
    slot = tl.load(slot_ptr + lane).to(tl.int64)
    cp = conv_ptr + slot * s_cs + offs * s_cc
    s0 = tl.load(cp, mask=ok, other=0.0).to(tl.float32)
    s1 = tl.load(cp + 1, mask=ok, other=0.0).to(tl.float32)
    s2 = tl.load(cp + 2, mask=ok, other=0.0).to(tl.float32)
    w = w_ptr + offs * 4
    w0 = tl.load(w, mask=ok, other=0.0).to(tl.float32)[None, :]
    w1 = tl.load(w + 1, mask=ok, other=0.0).to(tl.float32)[None, :]
    w2 = tl.load(w + 2, mask=ok, other=0.0).to(tl.float32)[None, :]
    w3 = tl.load(w + 3, mask=ok, other=0.0).to(tl.float32)[None, :]
    pdl_start(PDL)
    t = tl.arange(0, TP)[:, None]
    live = (t < T) & ok[None, :]
    xb = x_ptr + lane * s_xb + offs
    x0 = _conv_tap(xb[None, :], s0, s1, s2, t, 3, s_xt, live)  # the oldest tap
    x1 = _conv_tap(xb[None, :], s0, s1, s2, t, 2, s_xt, live)
    x2 = _conv_tap(xb[None, :], s0, s1, s2, t, 1, s_xt, live)
    x3 = _conv_tap(xb[None, :], s0, s1, s2, t, 0, s_xt, live)
    acc = w0 * x0 + w1 * x1 + w2 * x2 + w3 * x3
    tl.store(y_ptr + (lane * T + t) * C + offs[None, :], acc / (1.0 + tl.exp(-acc)), mask=live)
    if STORE_ALL:  # the slot after position t: its last three inputs
        ap = conv_all_ptr + ((lane * T + t) * C + offs[None, :]) * 3
        tl.store(ap, x1.to(conv_all_ptr.dtype.element_ty), mask=live)
        tl.store(ap + 1, x2.to(conv_all_ptr.dtype.element_ty), mask=live)
        tl.store(ap + 2, x3.to(conv_all_ptr.dtype.element_ty), mask=live)
    # the slot moves on to the last three inputs; a thread may overwrite what another read above
    n0 = _conv_last(xb, s1, s2, T, 0, s_xt, ok)
    n1 = _conv_last(xb, s1, s2, T, 1, s_xt, ok)
    n2 = _conv_last(xb, s1, s2, T, 2, s_xt, ok)
    tl.debug_barrier()
    tl.store(cp, n0.to(conv_ptr.dtype.element_ty), mask=ok)
    tl.store(cp + 1, n1.to(conv_ptr.dtype.element_ty), mask=ok)
    tl.store(cp + 2, n2.to(conv_ptr.dtype.element_ty), mask=ok)


@jit
def _add_pairs(a0, b0, a1, b1):
    return a0 + a1, b0 + b1


@jit
def _position(y_ptr, a_ptr, b_ptr, lane, t: tl.constexpr, T: tl.constexpr, C, kh, h, offs_k, offs_v, s_ab,
              s_at, HK: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr):
    """Position t's inputs of one value head as stored: q, k, v (the conv's fp32 outputs), a and b (fp32)."""
    row = y_ptr + (lane * T + t) * C
    q = tl.load(row + kh * DK + offs_k)
    k = tl.load(row + HK * DK + kh * DK + offs_k)
    v = tl.load(row + 2 * HK * DK + h * DV + offs_v)
    av = tl.load(a_ptr + lane * s_ab + t * s_at + h).to(tl.float32)
    bv = tl.load(b_ptr + lane * s_ab + t * s_at + h).to(tl.float32)
    return q, k, v, av, bv


@jit
def _recurrent_kernel(
    y_ptr, a_ptr, b_ptr, alog_ptr, dtb_ptr, state_ptr, slot_ptr, o_ptr, all_ptr, pk_ptr, pd_ptr, pg_ptr,
    C, Hv, s_ab, s_at, s_ss, s_sh,
    T: tl.constexpr, HK: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_V: tl.constexpr,
    STORE_ALL: tl.constexpr, PDL: tl.constexpr = 0, EVICT: tl.constexpr = 0, DEFER: tl.constexpr = 0,
):
    """The state and the head's constants load before the programmatic-launch wait (the kernel ahead, the
    conv or the projection that ran it, writes neither; every kernel before that one has finished). The
    positions are unrolled, the next one's inputs loading while one is used, and a position's Sᵀk and Sᵀq
    are one reduction of the decayed state: o = Sᵀq after the update is decay·Sᵀq + δ·(k·q). EVICT: the
    state read and written evict-first in L2 (`STATE_EVICT`). DEFER (T = 1): the state stays; the update's
    inputs go out instead (`PendingState`: k by the first program of its key head, δ and the decay — the
    latter once a value column, so no scalar store — by every program), for `_pending_kernel`."""
    lane = tl.program_id(0)
    h = tl.program_id(1)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_k = tl.arange(0, DK)
    kh = h // (Hv // HK)
    slot = tl.load(slot_ptr + lane).to(tl.int64)
    sp = state_ptr + slot * s_ss + h * s_sh + offs_k[:, None] * DV + offs_v[None, :]
    if EVICT:
        S = tl.load(sp, eviction_policy="evict_first").to(tl.float32)
    else:
        S = tl.load(sp).to(tl.float32)
    neg_a = -tl.exp(tl.load(alog_ptr + h).to(tl.float32))
    dtb = tl.load(dtb_ptr + h).to(tl.float32)
    pdl_start(PDL)
    q, k, v, av, bv = _position(y_ptr, a_ptr, b_ptr, lane, 0, T, C, kh, h, offs_k, offs_v, s_ab, s_at, HK, DK,
                                DV)
    for t in tl.static_range(T):
        if t + 1 < T:
            qn, kn, vn, an, bn = _position(y_ptr, a_ptr, b_ptr, lane, t + 1, T, C, kh, h, offs_k, offs_v,
                                           s_ab, s_at, HK, DK, DV)
        q = q * (1.0 / tl.sqrt(tl_sum(q * q, axis=0) + 1e-6)) * (1.0 / tl.sqrt(DK * 1.0))
        k = k * (1.0 / tl.sqrt(tl_sum(k * k, axis=0) + 1e-6))
        av = av + dtb
        decay = tl.exp(neg_a * tl.where(av > 20.0, av, tl.log(1.0 + tl.exp(av))))
        beta = 1.0 / (1.0 + tl.exp(-bv))
        sk, sq = tl.reduce((S * k[:, None], S * q[:, None]), 0, _add_pairs)
        delta = (v - decay * sk) * beta
        tl.store(o_ptr + ((lane * T + t) * Hv + h) * DV + offs_v, decay * sq + delta * tl_sum(k * q, axis=0))
        if DEFER:
            # (a tensor mask: the interpreter rejects a scalar one)
            lead = offs_k * 0 + tl.program_id(2) + h % (Hv // HK) == 0
            tl.store(pk_ptr + (lane * HK + kh) * DK + offs_k, k, mask=lead)
            tl.store(pd_ptr + (lane * Hv + h) * DV + offs_v, delta)
            tl.store(pg_ptr + (lane * Hv + h) * DV + offs_v, decay + tl.zeros([BLOCK_V], dtype=tl.float32))
        else:
            S = S * decay + k[:, None] * delta[None, :]
        if STORE_ALL:
            ap = all_ptr + (((lane * T + t) * Hv + h) * DK + offs_k[:, None]) * DV + offs_v[None, :]
            tl.store(ap, S.to(all_ptr.dtype.element_ty))
        if t + 1 < T:
            q, k, v, av, bv = qn, kn, vn, an, bn
    if not DEFER:
        if EVICT:
            tl.store(sp, S.to(state_ptr.dtype.element_ty), eviction_policy="evict_first")
        else:
            tl.store(sp, S.to(state_ptr.dtype.element_ty))


@jit
def _pending_kernel(pk_ptr, pd_ptr, pg_ptr, state_ptr, slot_ptr, Hv, s_ss, s_sh, tiles,
                    HK: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr, BLOCK_V: tl.constexpr):
    """S ← decay·S + k ⊗ δ for each (lane, value head, BLOCK_V value columns) tile, the programs looping over
    the tiles: the fp32 arithmetic of `_recurrent_kernel`'s own update on the values it left (`PendingState`),
    so the slots come out as the fused kernel's."""
    offs_k = tl.arange(0, DK)
    for tile in range(tl.program_id(0), tiles, tl.num_programs(0)):
        lane = tile // (Hv * (DV // BLOCK_V))
        h = tile // (DV // BLOCK_V) % Hv
        offs_v = tile % (DV // BLOCK_V) * BLOCK_V + tl.arange(0, BLOCK_V)
        slot = tl.load(slot_ptr + lane).to(tl.int64)
        sp = state_ptr + slot * s_ss + h * s_sh + offs_k[:, None] * DV + offs_v[None, :]
        S = tl.load(sp).to(tl.float32)
        k = tl.load(pk_ptr + (lane * HK + h // (Hv // HK)) * DK + offs_k)
        delta = tl.load(pd_ptr + (lane * Hv + h) * DV + offs_v)
        decay = tl.load(pg_ptr + (lane * Hv + h) * DV + offs_v)
        S = S * decay[None, :] + k[:, None] * delta[None, :]
        tl.store(sp, S.to(state_ptr.dtype.element_ty))


# ---------------------------------------------------------------------------------------------------------
# Public entry


def _check(mixed_qkv, a, b, conv_weight, conv_slots, state_slots, slot_ids, num_key_heads) -> None:
    B, T, C = mixed_qkv.shape
    Hv, Dk, Dv = state_slots.shape[1:]
    if C != 2 * num_key_heads * Dk + Hv * Dv:
        need = 2 * num_key_heads * Dk + Hv * Dv
        raise GdnKernelError(f"mixed_qkv has {C} channels but {num_key_heads} key heads × {Dk} and {Hv} "
                             f"value heads × {Dv} need {need}; check the layer geometry")
    if tuple(conv_weight.shape) != (C, 4) or tuple(conv_slots.shape[1:]) != (C, 3):
        raise GdnKernelError(f"conv weight must be [{C}, 4] and conv slots [slots, {C}, 3], got "
                             f"{list(conv_weight.shape)} and {list(conv_slots.shape)}")
    if tuple(a.shape) != (B, T, Hv) or tuple(b.shape) != (B, T, Hv):
        raise GdnKernelError(f"a and b must be [{B}, {T}, {Hv}], got {list(a.shape)} and {list(b.shape)}")
    if slot_ids.dtype not in (torch.int32, torch.int64) or slot_ids.shape != (B,):
        raise GdnKernelError(f"slot_ids must be an integer tensor [{B}], got {slot_ids.dtype} "
                             f"{list(slot_ids.shape)}")


def gdn_decode(
    mixed_qkv: torch.Tensor, a: torch.Tensor, b: torch.Tensor, conv_weight: torch.Tensor,
    a_log: torch.Tensor, dt_bias: torch.Tensor, conv_slots: torch.Tensor, state_slots: torch.Tensor,
    slot_ids: torch.Tensor, num_key_heads: int, return_all_states: bool = False, conv_done: bool = False,
    defer_state: bool = False,
) -> GdnDecodeResult:
    """One decode step (T positions per lane) of a GDN layer; conv and recurrent slots updated in place.

    Runs the two Triton launches where Triton can run, else `gdn_decode_reference`. Output fp32.
    `conv_done`: mixed_qkv is the conv's output already (a `ConvEpilogue` ran it and moved the conv slots
    on): only the recurrence runs. `defer_state` (one position a lane): where the
    kernels run, the recurrent slots keep the state before the step and the result's `pending` holds what
    `apply_pending` needs to write it (the reference path updates them at once: `pending` None).
    """
    _check(mixed_qkv, a, b, conv_weight, conv_slots, state_slots, slot_ids, num_key_heads)
    if (conv_done or defer_state) and return_all_states:
        raise GdnKernelError("with conv_done or defer_state there are no per-position states")
    if defer_state and mixed_qkv.shape[1] != 1:
        raise GdnKernelError("defer_state takes one position a lane")
    B, T, C = mixed_qkv.shape
    Hv, Dk, Dv = state_slots.shape[1:]
    usable = (HAVE_TRITON and triton_runs_on(mixed_qkv) and conv_slots.stride(2) == 1
              and state_slots.is_contiguous() and mixed_qkv.stride(2) == 1 and Dk & (Dk - 1) == 0)
    if not usable:
        return gdn_decode_reference(mixed_qkv, a, b, conv_weight, a_log, dt_bias, conv_slots, state_slots,
                                    slot_ids, num_key_heads, return_all_states, conv_done)
    dev = mixed_qkv.device
    if a.stride(2) != 1 or b.stride() != a.stride():  # the kernel reads both with a's strides (column views
        a, b = a.contiguous(), b.contiguous()          # of one projection share them: no copies)
    out = torch.empty((B, T, Hv, Dv), dtype=torch.float32, device=dev)
    states = convs = None
    if return_all_states:
        states = torch.empty((B, T, Hv, Dk, Dv), dtype=state_slots.dtype, device=dev)
        convs = torch.empty((B, T, C, 3), dtype=conv_slots.dtype, device=dev)
    if conv_done:
        y = mixed_qkv.float().contiguous()
    else:
        y = torch.empty((B, T, C), dtype=torch.float32, device=dev)
        tp = 1 << (T - 1).bit_length()
        block_c = max(32, CONV_BLOCK_C // tp)  # a program's tile: CONV_BLOCK_C values, as at one position
        _conv_kernel[(B, -(-C // block_c))](
            mixed_qkv, conv_weight.contiguous(), conv_slots, slot_ids, y, convs if convs is not None else y,
            C, mixed_qkv.stride(0), mixed_qkv.stride(1), conv_slots.stride(0), conv_slots.stride(1),
            T=T, TP=tp, BLOCK_C=block_c, STORE_ALL=return_all_states, **pdl_options(mixed_qkv),
        )
    one = B == 1
    block_v = min(RECURRENT_BLOCK_V_ONE_LANE if one else RECURRENT_BLOCK_V, Dv)
    warps = {} if dev.type == "cpu" else {"num_warps": RECURRENT_WARPS_ONE_LANE if one else RECURRENT_WARPS}
    pending = None
    if defer_state:
        fp32 = {"dtype": torch.float32, "device": dev}
        pending = PendingState(torch.empty((B, num_key_heads, Dk), **fp32), torch.empty((B, Hv, Dv), **fp32),
                               torch.empty((B, Hv, Dv), **fp32), state_slots, slot_ids)
    _recurrent_kernel[(B, Hv, -(-Dv // block_v))](
        y, a, b, a_log, dt_bias, state_slots, slot_ids, out, states if states is not None else out,
        *(pending.tensors()[:3] if pending else (out, out, out)),
        C, Hv, a.stride(0), a.stride(1), state_slots.stride(0), state_slots.stride(1), T=T,
        HK=num_key_heads, DK=Dk, DV=Dv, BLOCK_V=block_v, STORE_ALL=return_all_states, **pdl_options(y),
        EVICT=state_evict(), DEFER=defer_state, **warps,
    )
    return GdnDecodeResult(out, states, convs, pending)


def apply_pending(pending: PendingState, programs: int | None = None) -> None:
    """Write a deferred recurrence's states into their slots (one launch, plain: it waits for the recurrence
    that left them), at most `programs` programs (default `state_side_programs()`; 0: one a tile)."""
    B, Hv, Dv = pending.delta.shape
    Hk, Dk = pending.k.shape[1:]
    block_v = min(RECURRENT_BLOCK_V, Dv)
    tiles = B * Hv * (Dv // block_v)
    cap = state_side_programs() if programs is None else programs
    warps = {} if pending.delta.device.type == "cpu" else {"num_warps": RECURRENT_WARPS}
    _pending_kernel[(min(tiles, cap) if cap > 0 else tiles,)](
        *pending.tensors()[:3], pending.state_slots, pending.slot_ids, Hv, pending.state_slots.stride(0),
        pending.state_slots.stride(1), tiles, HK=Hk, DK=Dk, DV=Dv, BLOCK_V=block_v, **warps,
    )
