"""AWQ (activation-aware weight quantization, Lin et al. 2023) for the routed experts of one MoE layer.

Only the scale that folds without touching a kept byte is used: an expert's down_proj input
channels. The down projection's input is h = act(gate(x)) * up(x), and h_j is linear in up(x)_j,
so scaling down's column j by s_j and dividing up's row j by s_j is the same function exactly
(before rounding). Both weights are quantized anyway, so the fold costs nothing at serve time.
The gate/up inputs cannot be scaled: their inverse would have to fold into the shared
post-attention RMSNorm, which also feeds the router (BF16, kept) and the shared expert (FP8,
kept); docs/eval-awq.md has the details.

Per expert (tokens per the GPTQ calibration policy: every token by default):
 1. h from the full-precision gate/up; m = mean |h| per channel (routing-weighted for the
    `weighted` policy), G = h^T h;
 2. scale search: s = m^alpha / sqrt(max * min) over alpha = 0, 1/n, ..., (n-1)/n; each
    candidate quantizes W_down * s with kq's RTN (MSE clipping) and is scored by the down
    output error over the calibration tokens, tr(D G D^T) with D = W_down - Q(W_down s) / s.
    alpha = 0 (no scaling) is a candidate, so the search never does worse on that error;
 3. fold s (up rows / s, down columns * s);
 4. method awq: every weight quantized with an activation-weighted clip search: per output
    row and group, the divisor of kq.quantize.rtn.MSE_DIVISORS whose error weighted by the
    group's block of the input Gram matrix, d^T H_gg d, is least. gate/up use X^T X; down
    uses the Gram of the activations of the *quantized* gate/up (what it sees when served);
    method awq+gptq: GPTQ (kq.quantize.layerwise.quantize_experts, all its options) on the
    scaled weights instead.
Everything is deterministic (no randomness, fixed reduction shapes): two runs give the same bytes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kq.errors import KqError
from kq.quantize.rtn import _TINY, group_scale, quantize_rtn, search_divisors

METHODS = ("awq", "awq+gptq")
_S_MIN = 1e-4  # a channel that never fires gets this mean activation (its scale stays finite)


@dataclass(frozen=True)
class AwqConfig:
    method: str = "awq"         # awq | awq+gptq (part of the fingerprint: the two never resume each other)
    group: int = 128
    policy: str = "all"         # calibration tokens per expert, as GPTQ's (kq.quantize.layerwise.POLICIES)
    grid: int = 20              # alpha candidates 0, 1/grid, ..., (grid-1)/grid
    min_tokens: int = 32        # routed tokens below which an expert is not scaled (and, awq: RTN)
    batch: int = 8              # calibration windows per forward call
    gptq: dict = field(default_factory=dict)   # awq+gptq: GptqConfig options (damp, clip, block, ...)

    @property
    def expert_chunk(self) -> int:
        """The unit of the torchrun expert split (kq.quantize.layerwise.n_chunks): one expert for awq (every
        step is per expert), GPTQ's own chunk for awq+gptq (one batched solve, not to be cut)."""
        return self.gptq_config().expert_chunk if self.method == "awq+gptq" else 1

    def solve_experts(self, layer, X: torch.Tensor) -> tuple[dict, dict]:
        """kq.quantize.layerwise.solve_experts' AWQ branch: split across torchrun ranks as GPTQ is, by
        expert chunks (kq.quantize.layerwise.solve_layer_experts)."""
        from kq.quantize.layerwise import solve_layer_experts
        return solve_layer_experts(layer, X, self, solve=awq_quantize_experts)

    def __post_init__(self):
        from kq.quantize.layerwise import POLICIES
        if self.method not in METHODS:
            raise KqError(f"AWQ method {self.method!r}: use {', '.join(METHODS)}")
        if self.policy not in POLICIES:
            raise KqError(f"AWQ policy {self.policy!r}: use {', '.join(POLICIES)}")
        if self.grid < 1:
            raise KqError(f"AWQ grid {self.grid}: use 1 or more alpha candidates")
        if self.method == "awq+gptq":
            self.gptq_config()   # refuse bad GPTQ options now

    def gptq_config(self):
        from kq.quantize.layerwise import GptqConfig
        return GptqConfig(group=self.group, policy=self.policy, min_tokens=self.min_tokens, batch=self.batch,
                          **self.gptq)


def routing_weights(layer, X: torch.Tensor) -> torch.Tensor:
    """The layer's own router on X [T, H] -> routing weight per expert and token [E, T] (0: not routed)."""
    _, topw, topi = layer.mlp.gate(X)                                             # [T, k] each
    E = layer.mlp.experts.gate_up_proj.shape[0]
    weight = torch.zeros(E, X.shape[0], dtype=torch.float32, device=X.device)
    tok = torch.arange(X.shape[0], device=X.device)
    for k in range(topi.shape[1]):
        weight[topi[:, k].long(), tok] = topw[:, k].float()
    return weight


def _glu(x: torch.Tensor, wgu: torch.Tensor, act) -> torch.Tensor:
    """x [T, H], wgu [2I, H] -> h = act(gate x) * (up x) [T, I]."""
    g, u = (x @ wgu.T).split(wgu.shape[0] // 2, dim=-1)
    return act(g) * u


def _dequant(q: torch.Tensor, s: torch.Tensor, group: int) -> torch.Tensor:
    """q int8 [..., out, in], s [..., out, in/group] -> float32 [..., out, in]."""
    *lead, o, n = q.shape
    return (q.float().view(*lead, o, n // group, group) * s.float()[..., None]).view(*lead, o, n)


def fold(wgu: torch.Tensor, wd: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """wgu [2I, H] (gate rows, then up rows: transformers' fused layout), wd [H, I], s [I] ->
    (wgu with up row j / s_j, wd with column j * s_j): act(gate x) * (up x) / s, times wd * s, is the
    same function."""
    inter = wgu.shape[0] // 2
    wgu = wgu.clone()
    wgu[inter:] /= s[:, None]
    return wgu, wd * s[None, :]


@torch.no_grad()
def search_scale(wd: torch.Tensor, m: torch.Tensor, G: torch.Tensor, group: int, grid: int,
                 max_elems: int = 1 << 26) -> tuple[torch.Tensor, float]:
    """wd [H, I] (down), m [I] mean |h|, G [I, I] = h^T h -> (s [I] float32, chosen alpha).

    The s = m^alpha (normalised by sqrt(max * min)) of the grid whose RTN-quantized W_down * s leaves
    the least down output error tr(D G D^T), D = W_down - Q(W_down * s) / s. First minimum on ties.
    Candidates are scored several at a time (at most max_elems weights at once)."""
    n_out, n_in = wd.shape
    m = m.float().clamp(min=_S_MIN)
    alphas = torch.arange(grid, dtype=torch.float32, device=wd.device) / grid
    S = m[None, :].pow(alphas[:, None])                                            # [C, I]
    S = S / (S.amax(-1, keepdim=True) * S.amin(-1, keepdim=True)).sqrt()
    errs = []
    step = max(1, max_elems // wd.numel())
    for c0 in range(0, grid, step):
        s = S[c0:c0 + step, None, :]                                               # [c, 1, I]
        ws = (wd[None] * s).view(-1, n_in // group, group)                         # [c*H, G, g]
        sc = group_scale(ws, "mse")                                                # kq's RTN (MSE clipping)
        q = (ws / sc).round().clamp(-8, 7) * sc
        D = wd[None] - q.view(-1, n_out, n_in) / s                                 # [c, H, I]
        errs.append(((D @ G) * D).sum((-1, -2)))
    best = int(torch.cat(errs).argmin())                                            # first on ties
    return S[best], best / grid


@torch.no_grad()
def clip_quantize(W: torch.Tensor, H: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Activation-weighted clip search: W [E, out, in], H [E|1, in, in] (input Gram) ->
    (q int8 [E, out, in], scale bf16 [E, out, in/group]).

    Per output row and group, the bf16-rounded scale amax / d (d from MSE_DIVISORS; 7.5 is absmax)
    whose error d_g^T H_gg d_g (the group's share of the output error over the calibration tokens,
    cross-group terms left out as in AWQ's clip search) is least; first minimum on ties."""
    E, n_out, n_in = W.shape
    G = n_in // group
    Wg = W.float().view(E, n_out, G, group).permute(0, 2, 1, 3)                    # [E, G, out, g]
    idx = torch.arange(G, device=W.device)
    Hb = H.float().view(-1, G, group, G, group)[:, idx, :, idx, :]                  # [G, E|1, g, g]
    Hb = Hb.permute(1, 0, 2, 3)                                                     # [E|1, G, g, g]
    amax = Wg.abs().amax(-1, keepdim=True).clamp(min=_TINY)                        # [E, G, out, 1]

    def error(s):
        D = Wg - (Wg / s).round().clamp(-8, 7) * s                                  # [E, G, out, g]
        return ((D @ Hb) * D).sum(-1, keepdim=True)                                 # [E, G, out, 1]
    best_s = search_divisors(amax, error)
    q = (Wg / best_s).round().clamp(-8, 7).to(torch.int8)
    q = q.permute(0, 2, 1, 3).reshape(E, n_out, n_in)
    return q, best_s[..., 0].permute(0, 2, 1).to(torch.bfloat16).contiguous()


@torch.no_grad()
def awq_quantize_experts(layer, X: torch.Tensor, cfg: AwqConfig, chunks=None) -> tuple[dict, dict]:
    """AWQ of one MoE layer's routed experts from the MoE block's inputs X [T, H]; with `chunks`, only the
    experts of those chunks of cfg.expert_chunk experts (torchrun: this rank's block). The same results
    and stats as kq.quantize.layerwise.quantize_experts (plus "alpha": {expert: the chosen exponent, None
    where unscaled} for the experts solved). Those experts' weights are left folded (scaled) in place;
    the others are not touched."""
    from kq.quantize.layerwise import _gram, chunk_experts, quantize_experts
    ex = layer.mlp.experts
    act = ex.act_fn
    Wgu, Wd = ex.gate_up_proj.data, ex.down_proj.data                               # [E, 2I, H], [E, H, I]
    E = Wgu.shape[0]
    mine = chunk_experts(E, cfg, chunks)
    weight = routing_weights(layer, X)
    routed = weight > 0
    counts = routed.sum(1).tolist()
    calibrated = [cfg.policy == "all" or counts[e] >= cfg.min_tokens for e in range(E)]
    xs = {e: X if cfg.policy == "all" else X[routed[e]] for e in mine}
    rs = {e: weight[e][routed[e]][:, None] if cfg.policy == "weighted" else None for e in mine}
    alphas: dict = dict.fromkeys(mine)
    for e in mine:
        if not calibrated[e]:
            continue
        wgu, wd = Wgu[e].float(), Wd[e].float()
        h = _glu(xs[e], wgu, act)
        if rs[e] is not None:
            h = h * rs[e]
        s, alphas[e] = search_scale(wd, h.abs().mean(0), h.T @ h, cfg.group, cfg.grid)
        del h
        wgu, wd = fold(wgu, wd, s)
        Wgu[e], Wd[e] = wgu.to(Wgu.dtype), wd.to(Wd.dtype)
    if cfg.method == "awq+gptq":
        res, stats = quantize_experts(layer, X, cfg.gptq_config(), chunks=chunks)
        return res, stats | {"alpha": alphas}
    out, fallback = {}, []
    Hx = (X.T @ X)[None] if cfg.policy == "all" and mine else None                 # [1, H, H]
    for e in mine:
        if not calibrated[e]:
            fallback.append(e)
            qg, sg = quantize_rtn(Wgu[e].float(), cfg.group, "mse")
            qd, sd = quantize_rtn(Wd[e].float(), cfg.group, "mse")
            out[e] = (qg, sg, qd, sd)
            continue
        H = Hx if Hx is not None else _gram(xs[e], rs[e])[None]
        qg, sg = clip_quantize(Wgu[e].float()[None], H, cfg.group)
        a = _glu(xs[e], _dequant(qg[0], sg[0], cfg.group), act)   # what the quantized gate/up feed down
        qd, sd = clip_quantize(Wd[e].float()[None], _gram(a, rs[e])[None], cfg.group)
        del a
        out[e] = (qg[0], sg[0], qd[0], sd[0])
    rare = [e for e in range(E) if counts[e] < cfg.min_tokens]
    return out, {"tokens": counts, "rare": rare, "rtn_fallback": fallback, "alpha": alphas}
