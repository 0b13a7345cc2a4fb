"""The routed experts with FP8 (e4m3) input activations, computed the way a W4A8 kernel does:
for `kq eval --activations fp8` (the quality cost of W4AFP8 prefill beside W4A16).

Per expert projection with input x [T, K] (gate/up: the layer's hidden states; down: the
SiLU-and-multiply output), INT4 codes q [N, K] and group scales s [N, K/g]:
  a      = amax / 448, per token (one amax per row of x) or per tensor (one amax over every
           row the projection sees in the forward call: all tokens for gate/up, all routed
           (token, expert) rows for down, as SGLang's CUTLASS W4A8 MoE computes it)
  x8     = e4m3(clamp(x / a, -448, 448))                       round to nearest even
  y[n]   = a * sum_g s[n, g] * sum_{k in g} x8[k] * q[n, k]      fp32 partial sum per K group
The codes come from the checkpoint's packed bytes, not from the dequantized weights.
Everything else in the layer (attention, shared expert, router) runs as in the W4A16 rows.
"""
from __future__ import annotations

import torch

from kq.checkpoint.pack import unpack_int4

E4M3_MAX = 448.0
MODES = ("token", "tensor")
# No zero scale for an all-zero row or tensor (SGLang starts its amax at this floor too).
_MIN_AMAX = 1e-10


def act_scale(x: torch.Tensor, mode: str) -> torch.Tensor:
    """x [T, K] float32 -> the dequantization scale: [T, 1] per token, [1, 1] per tensor."""
    if mode == "token":
        amax = x.abs().amax(dim=-1, keepdim=True)
    elif mode == "tensor":
        amax = x.abs().amax().reshape(1, 1) if x.numel() else x.new_zeros(1, 1)
    else:
        raise ValueError(f"activation scale mode {mode!r}: use token or tensor")
    return amax.clamp_min(_MIN_AMAX) / E4M3_MAX


def quantize_e4m3(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The e4m3 values (as float32) a kernel multiplies: x / scale rounded to e4m3."""
    return (x / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)


def w4a8_matmul(x8: torch.Tensor, a: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """x8 [T, K] e4m3 values, a its scale ([T, 1] or [1, 1]), codes [N, K] int8, scales [N, K/g]
    -> [T, N] float32: per-K-group fp32 partial sums, group scale applied to each, then a."""
    n, k = codes.shape
    g = k // scales.shape[1]
    s = scales.to(torch.float32)
    acc = x8.new_zeros(x8.shape[0], n)
    for j in range(scales.shape[1]):
        part = x8[:, j * g:(j + 1) * g] @ codes[:, j * g:(j + 1) * g].to(torch.float32).T
        acc += part * s[:, j]
    return acc * a


def fp8_linear(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, mode: str) -> torch.Tensor:
    a = act_scale(x, mode)
    return w4a8_matmul(quantize_e4m3(x, a), a, codes, scales)


class Fp8ActExperts(torch.nn.Module):
    """Drop-in for a transformers `<Family>Experts` module (same forward signature):
    gate_up codes [E, 2I, H] with scales [E, 2I, H/g], down codes [E, H, I] with [E, H, I/g]."""

    def __init__(self, w13: torch.Tensor, s13: torch.Tensor, w2: torch.Tensor, s2: torch.Tensor, act_fn,
                 mode: str):
        super().__init__()
        if mode not in MODES:
            raise ValueError(f"activation scale mode {mode!r}: use token or tensor")
        self.w13, self.s13, self.w2, self.s2, self.act_fn, self.mode = w13, s13, w2, s2, act_fn, mode
        self.num_experts = w13.shape[0]

    @torch.no_grad()
    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        x = hidden_states.to(torch.float32)
        a1 = act_scale(x, self.mode)
        x8 = quantize_e4m3(x, a1)
        rows = []  # (expert, token ids, top-k slots, SiLU(gate) * up)
        for e in range(self.num_experts):
            tok, pos = torch.where(top_k_index == e)
            if tok.numel() == 0:
                continue
            gu = w4a8_matmul(x8[tok], a1[tok] if self.mode == "token" else a1, self.w13[e], self.s13[e])
            gate, up = gu.chunk(2, dim=-1)
            rows.append((e, tok, pos, self.act_fn(gate) * up))
        out = torch.zeros_like(x)
        if not rows:
            return out.to(hidden_states.dtype)
        a2_all = act_scale(torch.cat([h for *_, h in rows]), "tensor") if self.mode == "tensor" else None
        for e, tok, pos, h in rows:
            a2 = act_scale(h, "token") if a2_all is None else a2_all
            y = w4a8_matmul(quantize_e4m3(h, a2), a2, self.w2[e], self.s2[e])
            out.index_add_(0, tok, y * top_k_weights[tok, pos, None].to(torch.float32))
        return out.to(hidden_states.dtype)


def expert_codes(reader, prefix: str, n_experts: int) -> tuple[torch.Tensor, ...]:
    """(w13 codes, w13 scales, w2 codes, w2 scales) of one layer's routed experts, from the
    checkpoint's packed INT4 bytes (gate and up stacked as transformers fuses them)."""
    def one(module):
        shape = reader.raw(f"{module}.weight_shape").tolist()
        return unpack_int4(reader.raw(f"{module}.weight_packed"), int(shape[1])), reader.raw(f"{module}.weight_scale")

    w13, s13, w2, s2 = [], [], [], []
    for e in range(n_experts):
        m = f"{prefix}mlp.experts.{e}."
        (qg, sg), (qu, su), (qd, sd) = one(m + "gate_proj"), one(m + "up_proj"), one(m + "down_proj")
        w13.append(torch.cat([qg, qu]))
        s13.append(torch.cat([sg, su]))
        w2.append(qd)
        s2.append(sd)
    return torch.stack(w13), torch.stack(s13), torch.stack(w2), torch.stack(s2)


def fp8_act_hook(mode: str):
    """A LayerwiseModel `on_load` hook: replaces each MoE layer's routed experts by their FP8-
    activation computation (codes from the checkpoint; the dequantized expert weights are freed)."""
    def hook(model, layer, i: int) -> None:
        mlp = getattr(layer, "mlp", None)
        experts = getattr(mlp, "experts", None)
        if experts is None or not hasattr(experts, "gate_up_proj"):
            return  # a dense layer
        codes = expert_codes(model.reader, model.layer_prefix(i), model.n_experts())
        mlp.experts = Fp8ActExperts(*(t.to(model.device) for t in codes), experts.act_fn, mode)
    return hook


def has_int4_experts(reader, prefix: str) -> bool:
    return f"{prefix}mlp.experts.0.gate_proj.weight_packed" in reader


__all__ = ["E4M3_MAX", "MODES", "act_scale", "quantize_e4m3", "w4a8_matmul", "fp8_linear", "Fp8ActExperts",
           "expert_codes", "fp8_act_hook", "has_int4_experts"]
