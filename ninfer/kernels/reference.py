"""Plain-PyTorch reference versions of the hot ops: obviously right, used on CPU and as the oracle for
the fast (Triton) kernels. Every function computes in fp32 and returns its input's dtype unless noted.

Conventions (token-major, one sequence per call unless noted):
  x [T, ...]; heads on dim 1; GDN recurrent state [Hv, Dk, Dv] fp32; value head j uses key head
  j // (Hv // Hk) ("grouped" order, as transformers' Qwen3.5).
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F


def rms_norm(x: torch.Tensor, w: torch.Tensor, eps: float, zero_centred: bool) -> torch.Tensor:
    """RMSNorm over the last dim: `x/rms(x)·(1+w)` when `zero_centred` (Qwen3.5), else `x/rms(x)·w`."""
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    scale = 1.0 + w.float() if zero_centred else w.float()
    return (normed * scale).to(x.dtype)


def gated_rms_norm(o: torch.Tensor, z: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    """The GDN output norm over the last dim: `rmsnorm(o)·w·silu(z)` (plain w, not 1+w)."""
    of = o.float()
    normed = of * torch.rsqrt(of.pow(2).mean(-1, keepdim=True) + eps)
    return (normed * w.float() * F.silu(z.float())).to(o.dtype)


def l2_norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """`x / sqrt(sum(x²) + eps)` over the last dim (the GDN q/k normalisation)."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).sum(-1, keepdim=True) + eps)).to(x.dtype)


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU activation `silu(gate)·up`."""
    return (F.silu(gate.float()) * up.float()).to(gate.dtype)


def rope_inv_freq(rotary_dim: int, theta: float) -> torch.Tensor:
    """Inverse frequencies [rotary_dim/2], fp32: `theta^(-2i/rotary_dim)`."""
    return 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, dtype=torch.float32) / rotary_dim))


@functools.cache
def inv_freq_on(rotary_dim: int, theta: float, device: torch.device) -> torch.Tensor:
    """`rope_inv_freq` made once per device: no host-to-device copy per forward (CUDA-graph capture)."""
    return rope_inv_freq(rotary_dim, theta).to(device)


def mrope_cos_sin(
    positions: torch.Tensor,
    rotary_dim: int,
    theta: float,
    sections: tuple[int, ...] | list[int] | None = None,
    interleaved: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, rotary_dim] fp32 for rotate-half RoPE, optionally multi-axis (mRoPE).

    positions: [T] (plain RoPE, or text tokens: same position on all axes) or [3, T] (t, h, w).
    sections: frequencies per axis (t, h, w), summing to rotary_dim/2. interleaved (Qwen3.5): frequency
    i belongs to h if i % 3 == 1 and i < 3·sections[1], to w if i % 3 == 2 and i < 3·sections[2], else
    t. Not interleaved (Qwen2-VL): contiguous blocks t | h | w. The frequencies are then repeated for the
    two halves, as rotate-half expects.
    """
    inv_freq = inv_freq_on(rotary_dim, theta, positions.device)
    if positions.dim() == 1:
        return rope_cos_sin(positions, inv_freq)
    per_axis = positions.to(torch.float32)[:, :, None] * inv_freq[None, None, :]  # [3, T, F]
    axis = mrope_axis_of_frequency(rotary_dim // 2, sections, interleaved).to(positions.device)
    return _cos_sin(per_axis.gather(0, axis[None, None, :].expand(1, positions.shape[1], -1))[0])


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, 2F] fp32 of positions [T] and inverse frequencies [F] (fp32 angles pos·freq)."""
    return _cos_sin(positions.to(torch.float32)[:, None] * inv_freq.to(positions.device)[None, :])


def _cos_sin(freqs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotate-half tables of angles [T, F]: each repeated for both halves."""
    freqs = torch.cat([freqs, freqs], dim=-1)
    return freqs.cos(), freqs.sin()


def mrope_axis_of_frequency(
    n_freq: int, sections: tuple[int, ...] | list[int] | None, interleaved: bool
) -> torch.Tensor:
    """Which position axis (0 t, 1 h, 2 w) drives each of the `n_freq` rotary frequencies."""
    axis = torch.zeros(n_freq, dtype=torch.long)
    if sections is None:
        return axis
    sections = list(sections)[:3]
    if sum(sections) != n_freq:
        raise ValueError(f"mrope sections {sections} must sum to rotary_dim/2 = {n_freq}")
    if interleaved:
        for a in (1, 2):
            axis[a : 3 * sections[a] : 3] = a
    else:
        axis[sections[0] : sections[0] + sections[1]] = 1
        axis[sections[0] + sections[1] :] = 2
    return axis


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat([-x[..., half:], x[..., :half]], dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE on the first `rotary_dim = cos.shape[-1]` dims of x [T, H, D]; the rest passes.

    cos/sin: [T, rotary_dim] (as from `mrope_cos_sin`).
    """
    rotary_dim = cos.shape[-1]
    xf = x.float()
    rot, rest = xf[..., :rotary_dim], xf[..., rotary_dim:]
    c, s = cos.float()[:, None, :], sin.float()[:, None, :]
    rot = rot * c + rotate_half(rot) * s
    return torch.cat([rot, rest], dim=-1).to(x.dtype)


def causal_conv1d(
    x: torch.Tensor, weight: torch.Tensor, conv_state: torch.Tensor, silu: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal conv over time, continuing from `conv_state`.

    x [T, C], weight [C, K], conv_state [C, K-1] (the previous K-1 inputs, oldest first; zeros at the
    start of a sequence). Returns y [T, C] (x's dtype; SiLU applied when `silu`) and the new conv state
    [C, K-1] (conv_state's dtype): the last K-1 inputs of [previous state; x].
    """
    T = x.shape[0]
    K = weight.shape[1]
    full = torch.cat([conv_state.float(), x.float().t()], dim=1)  # [C, K-1+T]
    windows = full.unfold(1, K, 1)  # [C, T, K]: window t covers inputs t..t+K-1 (t+K-1 is token t)
    y = (windows * weight.float()[:, None, :]).sum(-1).t()  # [T, C]
    if silu:
        y = F.silu(y)
    new_state = full[:, T:].to(conv_state.dtype)
    return y.to(x.dtype), new_state


def _expand_key_heads(t: torch.Tensor, value_heads: int) -> torch.Tensor:
    """[T, Hk, D] -> [T, Hv, D] with value head j reading key head j // (Hv/Hk)."""
    ratio = value_heads // t.shape[1]
    return t.repeat_interleave(ratio, dim=1) if ratio > 1 else t


def gdn_recurrent(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    return_all_states: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule, one token at a time (the definition).

    q, k [T, Hk, Dk] (already L2-normalised; q already scaled by 1/sqrt(Dk)), v [T, Hv, Dv],
    g [T, Hv] (log decay, <= 0), beta [T, Hv], state [Hv, Dk, Dv]. Per value head and token:
      S ← exp(g)·S;  S ← S + k ⊗ beta·(v − Sᵀk);  o = Sᵀq.
    Returns o [T, Hv, Dv] (v's dtype) and the final state [Hv, Dk, Dv] fp32 — or, with
    `return_all_states`, the state after every token [T, Hv, Dk, Dv] (for speculative verification).
    The input state is not modified.
    """
    Hv = v.shape[1]
    qf = _expand_key_heads(q, Hv).float()
    kf = _expand_key_heads(k, Hv).float()
    vf, gf, bf = v.float(), g.float(), beta.float()
    S = state.float().clone()
    outs, states = [], []
    for t in range(v.shape[0]):
        S = S * gf[t].exp()[:, None, None]
        predicted = torch.einsum("hkv,hk->hv", S, kf[t])
        delta = (vf[t] - predicted) * bf[t][:, None]
        S = S + kf[t][:, :, None] * delta[:, None, :]
        outs.append(torch.einsum("hkv,hk->hv", S, qf[t]))
        if return_all_states:
            states.append(S)
    o = torch.stack(outs).to(v.dtype) if outs else v.new_zeros(v.shape)
    if return_all_states:
        return o, (torch.stack(states) if states else S.new_zeros((0, *S.shape)))
    return o, S


def gdn_chunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract and results as `gdn_recurrent` (within fp32 rounding), in the chunked WY form.

    Inside a chunk with cumulative log decay Γ_t and initial state S0 the per-token updates
    u_t = β_t(v_t − e^{Γ_t} S0ᵀk_t − Σ_{j<t} e^{Γ_t−Γ_j}(k_t·k_j) u_j) form a unit lower-triangular
    system (I + L) U = β∘V − β∘e^{Γ}∘K S0, solved once per chunk; then
    O = (e^{Γ}∘Q) S0 + (QKᵀ ∘ e^{Γ_t−Γ_j}, j<=t) U and S_C = e^{Γ_C} S0 + (e^{Γ_C−Γ_j}∘K)ᵀ U.
    """
    T, Hv = v.shape[0], v.shape[1]
    if T == 0:
        return v.new_zeros(v.shape), state.float().clone()
    qf = _expand_key_heads(q, Hv).float().transpose(0, 1)  # [Hv, T, Dk]
    kf = _expand_key_heads(k, Hv).float().transpose(0, 1)
    vf = v.float().transpose(0, 1)  # [Hv, T, Dv]
    gf = g.float().t()  # [Hv, T]
    bf = beta.float().t()
    S = state.float().clone()
    outs = []
    for start in range(0, T, chunk_size):
        end = min(start + chunk_size, T)
        o_chunk, S = _gdn_one_chunk(qf[:, start:end], kf[:, start:end], vf[:, start:end],
                                    gf[:, start:end], bf[:, start:end], S)
        outs.append(o_chunk)
    o = torch.cat(outs, dim=1).transpose(0, 1)
    return o.to(v.dtype).contiguous(), S


def _gdn_one_chunk(q, k, v, g, beta, S0):
    """One chunk of `gdn_chunked`, all head-major fp32: q,k [H,C,Dk], v [H,C,Dv], g,beta [H,C]."""
    C = q.shape[1]
    gamma = g.cumsum(dim=1)  # [H, C]
    diff = gamma[:, :, None] - gamma[:, None, :]  # Γ_t − Γ_j
    lower_incl = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    decay = diff.masked_fill(~lower_incl, float("-inf")).exp()  # 0 above the diagonal
    strict = decay.tril(-1)
    L = beta[:, :, None] * (k @ k.transpose(1, 2)) * strict
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    system = L + eye
    rhs_v = beta[:, :, None] * v
    rhs_k = (beta * gamma.exp())[:, :, None] * k
    w_v = torch.linalg.solve_triangular(system, rhs_v, upper=False, unitriangular=True)
    w_k = torch.linalg.solve_triangular(system, rhs_k, upper=False, unitriangular=True)
    u = w_v - w_k @ S0  # [H, C, Dv]
    attn = (q @ k.transpose(1, 2)) * decay
    o = (q * gamma.exp()[:, :, None]) @ S0 + attn @ u
    tail = (gamma[:, -1:] - gamma).exp()  # e^{Γ_C − Γ_j}
    S = S0 * gamma[:, -1].exp()[:, None, None] + (k * tail[:, :, None]).transpose(1, 2) @ u
    return o, S


def attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal_offset: int, scale: float | None = None
) -> torch.Tensor:
    """Causal grouped-query attention of one sequence.

    q [Tq, Hq, D]; k, v [Tk, Hkv, D] (the whole cache including the new rows). Query row i sits at
    position causal_offset + i and sees keys 0..causal_offset+i. Query head h uses KV head
    h // (Hq/Hkv). Scale 1/sqrt(D) unless given. Returns [Tq, Hq, D] in q's dtype.
    """
    Tq, Hq, D = q.shape
    Tk = k.shape[0]
    ratio = Hq // k.shape[1]
    kf = k.float().repeat_interleave(ratio, dim=1).transpose(0, 1)  # [Hq, Tk, D]
    vf = v.float().repeat_interleave(ratio, dim=1).transpose(0, 1)
    qf = q.float().transpose(0, 1)  # [Hq, Tq, D]
    scores = (qf @ kf.transpose(1, 2)) * (scale if scale is not None else 1.0 / math.sqrt(D))
    rows = torch.arange(Tq, device=q.device)[:, None] + causal_offset
    cols = torch.arange(Tk, device=q.device)[None, :]
    scores = scores.masked_fill(cols > rows, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ vf
    return out.transpose(0, 1).to(q.dtype)
