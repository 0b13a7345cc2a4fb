"""GPTQ for stacks of expert weights: symmetric group-wise INT4, BF16 scales.

The algorithm of Frantar et al. (2022), batched over the experts of a layer:
  W [E, out, in] float32, H [E, in, in] = sum of x x^T over each expert's inputs.
Columns are quantized left to right; each column's rounding error is spread over the
not-yet-quantized columns through the upper Cholesky factor of H^-1, in blocks of
`block` columns (lazy batch updates). A group's scale is chosen when the solver
reaches the group's first column, from the weights as updated so far, and is
rounded to BF16 before any code is picked, so codes * stored scale is exactly what
the solver accounted for. Scale choice ("clip"):
  absmax: amax / 7.5 (compressed-tensors' symmetric convention, as llm-compressor)
  mse:    the divisor from kq.quantize.rtn.MSE_DIVISORS with the least squared error
          on the group's current weights (per output row).
  search: the divisor from the same grid whose play-through of the group's own GPTQ steps
          gives the least solver loss (per output row; _search_group_scale).
No act-order (REFERENCE.md section 3: unsafe for the down projection at TP > 1).

Optional scale refit (refit=True, `kq quantize --gptq-refit-scales`): with the codes fixed,
the layer's output error of one output row, (w - s.q) H (w - s.q)^T, is quadratic in that
row's group scales s, so the best scales solve a (groups x groups) linear system. GPTQ
picks each group's scale before the later groups' codes exist; the refit re-chooses all of
a row's scales together, rounds them to BF16 and keeps them only where the row's error
(same damped H as the solver) went down. Codes are untouched.
"""
from __future__ import annotations

import torch

from kq.quantize.rtn import _TINY, MSE_DIVISORS, group_scale  # the same scale grid as RTN


def hessian_inverse_factor(H: torch.Tensor, damp: float) -> tuple[torch.Tensor, torch.Tensor]:
    """H [E, n, n] -> (upper Cholesky factor of (H + damp*mean(diag) I)^-1 [E, n, n], dead [E, n]).

    Inputs that never fired (zero diagonal) get a unit diagonal so H stays invertible;
    their weight columns are irrelevant to the output and quantize by plain rounding.
    """
    H, dead, mean = _damped(H, damp)
    diag = H.diagonal(dim1=-2, dim2=-1)                                          # [E, n] (view)
    for attempt in range(6):  # an ill-conditioned H gets more damping until it factors
        L, info = torch.linalg.cholesky_ex(H)
        if int(info.max()) == 0:
            break
        diag += damp * mean * (10 ** attempt)
    else:
        raise RuntimeError("Hessian is not positive definite even with heavy damping")
    Hinv = torch.cholesky_inverse(L)
    U, info = torch.linalg.cholesky_ex(Hinv, upper=True)
    if int(info.max()) != 0:
        raise RuntimeError("inverse Hessian is not positive definite")
    return U, dead


@torch.no_grad()
def gptq_quantize(W: torch.Tensor, H: torch.Tensor, group: int, *, clip: str = "mse", damp: float = 0.01,
                  block: int = 128, refit: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """W [E, out, in], H [E, in, in] (or [1, in, in], shared) -> (q int8 [E, out, in], scale bf16 [E, out, in/group])."""
    E, n_out, n_in = W.shape
    assert n_in % group == 0 and block % group == 0
    W0 = W if refit else None
    W = W.to(torch.float32).clone()
    U, dead = hessian_inverse_factor(H.to(torch.float32), damp)
    U = U.expand(E, n_in, n_in) if U.shape[0] == 1 else U
    W.masked_fill_(dead.expand(E, n_in)[:, None, :], 0.0) if dead.any() else None
    Q = torch.empty(E, n_out, n_in, dtype=torch.int8, device=W.device)
    S = torch.empty(E, n_out, n_in // group, dtype=torch.float32, device=W.device)
    for b0 in range(0, n_in, block):
        b1 = min(b0 + block, n_in)
        W1 = W[:, :, b0:b1].clone()                                              # [E, out, b]
        Err = torch.empty_like(W1)
        U1 = U[:, b0:b1, b0:b1]                                                  # [E, b, b]
        for j in range(b1 - b0):
            col = b0 + j
            if col % group == 0:
                if clip == "search":
                    s = _search_group_scale(W1[:, :, j:j + group], U1[:, j:j + group, j:j + group])
                else:
                    s = group_scale(W1[:, :, j:j + group], clip)                 # [E, out, 1]
                S[:, :, col // group] = s[..., 0]
            w = W1[:, :, j]                                                      # [E, out]
            q = (w / s[..., 0]).round().clamp(-8, 7)
            Q[:, :, col] = q.to(torch.int8)
            d = U1[:, j, j][:, None]                                             # [E, 1]
            err = (w - q * s[..., 0]) / d                                        # [E, out]
            W1[:, :, j:] -= err[:, :, None] * U1[:, None, j, j:]                 # [E, out, b-j]
            Err[:, :, j] = err
        W[:, :, b1:] -= Err @ U[:, b0:b1, b1:]                                   # [E, out, in-b1]
    del W, U
    S = S.to(torch.bfloat16)
    if refit:
        S = refit_scales(W0, H, Q, S, group, damp)
    return Q, S


@torch.no_grad()
def _search_group_scale(Wg: torch.Tensor, Ug: torch.Tensor, divisors=MSE_DIVISORS) -> torch.Tensor:
    """Wg [E, out, g] (the group's weights as updated so far), Ug [E, g, g] (the group's block of the
    inverse-Hessian factor) -> the bf16-representable scale per row, float32 [E, out, 1], that
    minimises the solver's own loss over the group, sum_j ((w_j - q_j s) / U_jj)^2, with each
    column's error spread over the group's later columns exactly as the solver will do it.

    Plain MSE scores a scale on the weights before compensation; here each candidate is played
    through the group's GPTQ steps. Cost: len(divisors) x the in-group solver work."""
    amax = Wg.abs().amax(-1, keepdim=True).clamp(min=_TINY)                      # [E, out, 1]
    d = torch.tensor(divisors, dtype=torch.float32, device=Wg.device)
    cand = (amax[None] / d[:, None, None, None]).to(torch.bfloat16).to(torch.float32)  # [C, E, out, 1]
    W = Wg[None].expand(len(divisors), *Wg.shape).clone()                        # [C, E, out, g]
    loss = torch.zeros(cand.shape[:-1], dtype=torch.float32, device=Wg.device)  # [C, E, out]
    for j in range(Wg.shape[-1]):
        w = W[..., j]
        err = (w - (w / cand[..., 0]).round().clamp(-8, 7) * cand[..., 0]) / Ug[None, :, j, j, None]
        loss += err.square()
        W[..., j:] -= err[..., None] * Ug[None, :, None, j, j:]
    best = loss.argmin(0)                                                         # [E, out] (first on ties)
    return cand.gather(0, best[None, ..., None])[0]


def _damped(H: torch.Tensor, damp: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The H the solver works with (dead inputs: unit diagonal; damp x mean diagonal added), dead [.., n],
    and that mean diagonal [.., 1] (the unit of any further damping)."""
    H = H.to(torch.float32).clone()
    diag = H.diagonal(dim1=-2, dim2=-1)
    dead = diag == 0
    diag[dead] = 1.0
    mean = diag.mean(-1, keepdim=True)
    diag += damp * mean
    return H, dead, mean


@torch.no_grad()
def refit_scales(W: torch.Tensor, H: torch.Tensor, Q: torch.Tensor, S: torch.Tensor, group: int,
                 damp: float = 0.01, ridge: float = 1e-6, max_elems: int = 1 << 26) -> torch.Tensor:
    """Least-squares group scales for fixed codes: W [E, out, in], H [E|1, in, in], Q int8 [E, out, in],
    S bf16 [E, out, G] -> bf16 [E, out, G].

    Per output row r (rows are independent): minimise (w - sum_g s_g q_g) H (w - sum_g s_g q_g)^T,
    i.e. A s = b with A[g, h] = q_g^T H_gh q_h and b[g] = q_g^T (H w)_g. A tiny ridge toward the
    current scales keeps A invertible (a group whose codes are all 0 keeps its scale). The result
    is rounded to BF16; a row keeps its new scales only if its error is lower with them, and any
    non-positive scale keeps the old one.
    """
    E, n_out, n_in = W.shape
    G = n_in // group
    Hd, dead, _ = _damped(H, damp)                                                  # [E|1, n, n]
    rows = max(1, min(n_out, max_elems // max(1, n_in * G)))                     # memory: rows x n x G floats
    out = S.clone()
    for e in range(E):
        h = Hd[e if Hd.shape[0] > 1 else 0]                                      # [n, n]
        hb = h.view(n_in, G, group).permute(1, 0, 2)                             # [G, n, g]
        w = W[e].to(torch.float32)
        if dead.any():
            w = w.masked_fill(dead[e if dead.shape[0] > 1 else 0][None, :], 0.0)
        for r0 in range(0, n_out, rows):
            r1 = min(r0 + rows, n_out)
            q = Q[e, r0:r1].to(torch.float32)                                    # [r, n]
            qv = q.view(r1 - r0, G, group)                                       # [r, G, g]
            s0 = S[e, r0:r1].to(torch.float32)                                   # [r, G]
            # T[h, i, r] = sum_k H[i, h*g + k] q[r, h*g + k]: H times row r's group-h codes alone
            T = torch.bmm(hb, qv.permute(1, 2, 0))                               # [G, n, r]
            A = torch.einsum("rgk,hgkr->rgh", qv, T.view(G, G, group, r1 - r0))  # [r, G, G]
            del T
            b = ((w[r0:r1] @ h).view(r1 - r0, G, group) * qv).sum(-1)           # [r, G]
            lam = ridge * A.diagonal(dim1=-2, dim2=-1).mean(-1, keepdim=True).clamp(min=1e-30)  # [r, 1]
            A.diagonal(dim1=-2, dim2=-1).add_(lam)
            s = torch.linalg.solve(A, (b + lam * s0)[..., None])[..., 0]
            s = s.to(torch.bfloat16).to(torch.float32)
            s = torch.where(torch.isfinite(s) & (s > 0), s, s0)

            def err(sc):
                d = w[r0:r1] - (qv * sc[..., None]).view(r1 - r0, n_in)
                return ((d @ h) * d).sum(-1)                                     # [r]
            better = err(s) < err(s0)
            out[e, r0:r1] = torch.where(better[:, None], s, s0).to(torch.bfloat16)
    return out
