"""Gated DeltaNet prefill: the chunk's q, k, v from its projection (`prefill_qkv`: causal conv + SiLU,
q/k L2-normalised, one Triton launch on CUDA), its decay g and write strength β (`prefill_gates`, one launch)
and the chunked rule (`gdn_prefill`: fla-core's Triton kernels on CUDA, `reference.gdn_chunked` elsewhere).

`gdn_prefill` has the contract of `reference.gdn_chunked`: q, k `[T, Hk, Dk]` (L2-normalised, q already
scaled by 1/sqrt(Dk)), v `[T, Hv, Dv]` (value heads grouped by key head), g, beta `[T, Hv]`, state
`[Hv, Dk, Dv]`; returns (o `[T, Hv, Dv]` in v's dtype, final state fp32). fla-core is optional (the `gpu`
extra).
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ninfer.kernels import reference
from ninfer.kernels.gdn_decode import _conv_tap
from ninfer.kernels.triton_support import HAVE_TRITON, jit, tl, tl_sum, triton_runs_on

PREP_BLOCK_T = 32  # positions a `_prep_kernel` program takes (one head's channels each)


@functools.cache
def _fla_chunk():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception:  # fla-core absent or incompatible with this torch/triton: use the reference
        return None
    return chunk_gated_delta_rule


def fla_available() -> bool:
    return torch.cuda.is_available() and _fla_chunk() is not None


def gdn_prefill(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked gated delta rule over one sequence; fla-core on CUDA when installed."""
    chunk = _fla_chunk() if v.is_cuda else None
    if chunk is None:
        return reference.gdn_chunked(q, k, v, g, beta, state)
    o, final = chunk(q[None], k[None], v[None], g[None].float(), beta[None], scale=1.0,
                     initial_state=state[None].float(), output_final_state=True)
    return o[0].to(v.dtype), final[0].float()


def prefill_qkv_reference(
    mixed_qkv: torch.Tensor, conv_weight: torch.Tensor, conv_slot: torch.Tensor, num_key_heads: int,
    key_dim: int, num_value_heads: int, value_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One chunk's `mixed_qkv [L, C]` -> q, k `[L, Hk, Dk]`, v `[L, Hv, Dv]` in mixed_qkv's dtype: the causal
    conv over [the slot's cached inputs ; the chunk] (fp32), SiLU, q and k L2-normalised, q times
    1/sqrt(Dk); the conv slot `[C, K-1]` moves on to the chunk's last inputs."""
    L = mixed_qkv.shape[0]
    width = conv_slot.shape[1]
    full = torch.cat([conv_slot.float(), mixed_qkv.float().t()], dim=1)  # [C, K-1+L]
    y = F.conv1d(full[None], conv_weight.float()[:, None, :], groups=full.shape[0])[0]
    conv_slot.copy_(full[:, full.shape[1] - width:])
    y = F.silu(y.t())  # [L, C]
    Hk, Dk, Hv, Dv = num_key_heads, key_dim, num_value_heads, value_dim
    q, k, v = y.split([Hk * Dk, Hk * Dk, Hv * Dv], dim=-1)
    q = reference.l2_norm(q.reshape(L, Hk, Dk)) * Dk ** -0.5
    k = reference.l2_norm(k.reshape(L, Hk, Dk))
    dt = mixed_qkv.dtype
    return q.to(dt), k.to(dt), v.reshape(L, Hv, Dv).to(dt)


@jit
def _prep_kernel(x_ptr, w_ptr, slot_ptr, q_ptr, k_ptr, v_ptr, L, s_xl, s_sc, q_scale,
                 HK: tl.constexpr, HV: tl.constexpr, D: tl.constexpr, BLOCK_T: tl.constexpr):
    """Program (position block, head): head < HK a query head, < 2 HK a key head, else a value head — its D
    channels at BLOCK_T positions, conv (taps from the chunk or the slot's columns) + SiLU, the q / k heads
    L2-normalised (q times q_scale), stored in the outputs' dtype."""
    head = tl.program_id(1)
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    d = tl.arange(0, D)
    c = head * D + d
    live = (t < L)[:, None]
    sp = slot_ptr + c * s_sc
    s0 = tl.load(sp).to(tl.float32)
    s1 = tl.load(sp + 1).to(tl.float32)
    s2 = tl.load(sp + 2).to(tl.float32)
    acc = tl.zeros([BLOCK_T, D], dtype=tl.float32)
    xb = x_ptr + c[None, :]
    for j in tl.static_range(4):  # tap j: input t - 3 + j, from the chunk or the slot (the decode conv's)
        acc += tl.load(w_ptr + c * 4 + j).to(tl.float32)[None, :] * _conv_tap(xb, s0, s1, s2, t[:, None],
                                                                              3 - j, s_xl, live)
    y = acc / (1.0 + tl.exp(-acc))
    h = (head + 0 * d)[None, :]  # (tensor compares: the interpreter rejects a scalar bool in a mask)
    is_q = h < HK
    is_k = (h >= HK) & (h < 2 * HK)
    norm = 1.0 / tl.sqrt(tl_sum(y * y, 1) + 1e-6)
    y = tl.where(is_q | is_k, y * norm[:, None], y) * tl.where(is_q, q_scale, 1.0)
    row = t[:, None]
    tl.store(q_ptr + (row * HK + head) * D + d[None, :], y.to(q_ptr.dtype.element_ty), mask=live & is_q)
    tl.store(k_ptr + (row * HK + head - HK) * D + d[None, :], y.to(k_ptr.dtype.element_ty), mask=live & is_k)
    tl.store(v_ptr + (row * HV + head - 2 * HK) * D + d[None, :], y.to(v_ptr.dtype.element_ty),
             mask=live & (h >= 2 * HK))


def prefill_qkv(
    mixed_qkv: torch.Tensor, conv_weight: torch.Tensor, conv_slot: torch.Tensor, num_key_heads: int,
    key_dim: int, num_value_heads: int, value_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`prefill_qkv_reference`'s outputs (and slot update), in one Triton launch where Triton runs and the
    heads are one power-of-two width (the 27B: 128), where the reference runs ~20 PyTorch ops."""
    L, C = mixed_qkv.shape
    Hk, D, Hv = num_key_heads, key_dim, num_value_heads
    width = conv_slot.shape[1]
    if not (HAVE_TRITON and triton_runs_on(mixed_qkv) and D == value_dim and D & (D - 1) == 0
            and width == 3 and tuple(conv_weight.shape) == (C, 4) and C == (2 * Hk + Hv) * D
            and mixed_qkv.stride(1) == 1 and conv_slot.stride(1) == 1):
        return prefill_qkv_reference(mixed_qkv, conv_weight, conv_slot, Hk, D, Hv, value_dim)
    dt = mixed_qkv.dtype
    q = torch.empty((L, Hk, D), dtype=dt, device=mixed_qkv.device)
    k = torch.empty_like(q)
    v = torch.empty((L, Hv, D), dtype=dt, device=mixed_qkv.device)
    _prep_kernel[(-(-L // PREP_BLOCK_T), 2 * Hk + Hv)](
        mixed_qkv, conv_weight.contiguous(), conv_slot, q, k, v, L, mixed_qkv.stride(0), conv_slot.stride(0),
        D ** -0.5, HK=Hk, HV=Hv, D=D, BLOCK_T=PREP_BLOCK_T,
    )
    # the slot moves on after the kernel read it (stream order): the chunk's last three inputs
    conv_slot.copy_(torch.cat([conv_slot, mixed_qkv[max(0, L - width):].t().to(conv_slot.dtype)],
                              dim=1)[:, -width:])
    return q, k, v


def prefill_gates_reference(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
                            ) -> tuple[torch.Tensor, torch.Tensor]:
    """A chunk's decay and write strength, fp32 `[L, Hv]`: g = −exp(a_log)·softplus(a + dt_bias),
    β = sigmoid(b)."""
    g = -a_log.float().exp() * F.softplus(a.float() + dt_bias.float())
    return g, torch.sigmoid(b.float())


@jit
def _gates_kernel(a_ptr, b_ptr, alog_ptr, dtb_ptr, g_ptr, beta_ptr, L, HV, s_al, s_bl,
                  HVP: tl.constexpr, BLOCK_T: tl.constexpr):
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)[:, None]
    h = tl.arange(0, HVP)[None, :]
    ok = (t < L) & (h < HV)
    av = tl.load(a_ptr + t * s_al + h, mask=ok, other=0.0).to(tl.float32)
    av = av + tl.load(dtb_ptr + h, mask=h < HV, other=0.0).to(tl.float32)
    softplus = tl.where(av > 20.0, av, tl.log(1.0 + tl.exp(av)))
    g = -tl.exp(tl.load(alog_ptr + h, mask=h < HV, other=0.0).to(tl.float32)) * softplus
    bv = tl.load(b_ptr + t * s_bl + h, mask=ok, other=0.0).to(tl.float32)
    tl.store(g_ptr + t * HV + h, g, mask=ok)
    tl.store(beta_ptr + t * HV + h, 1.0 / (1.0 + tl.exp(-bv)), mask=ok)


def prefill_gates(a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """`prefill_gates_reference` in one Triton launch where Triton runs (~8 PyTorch ops); a and b may be
    column views of one projection (any row stride, unit column stride)."""
    L, Hv = a.shape
    if not (HAVE_TRITON and triton_runs_on(a) and a.stride(1) == 1 and b.stride(1) == 1
            and a_log.is_contiguous() and dt_bias.is_contiguous()):
        return prefill_gates_reference(a, b, a_log, dt_bias)
    g = torch.empty((L, Hv), dtype=torch.float32, device=a.device)
    beta = torch.empty_like(g)
    _gates_kernel[(-(-L // PREP_BLOCK_T),)](a, b, a_log, dt_bias, g, beta, L, Hv, a.stride(0), b.stride(0),
                                            HVP=max(16, 1 << (Hv - 1).bit_length()), BLOCK_T=PREP_BLOCK_T)
    return g, beta
