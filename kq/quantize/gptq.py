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
No act-order (REFERENCE.md section 3: unsafe for the down projection at TP > 1).
"""
from __future__ import annotations

import torch

from kq.quantize.rtn import group_scale  # the same scale search as RTN


def hessian_inverse_factor(H: torch.Tensor, damp: float) -> tuple[torch.Tensor, torch.Tensor]:
    """H [E, n, n] -> (upper Cholesky factor of (H + damp*mean(diag) I)^-1 [E, n, n], dead [E, n]).

    Inputs that never fired (zero diagonal) get a unit diagonal so H stays invertible;
    their weight columns are irrelevant to the output and quantize by plain rounding.
    """
    H = H.clone()
    diag = H.diagonal(dim1=-2, dim2=-1)                                          # [E, n] (view)
    dead = diag == 0
    diag[dead] = 1.0
    mean = diag.mean(-1, keepdim=True)                                           # [E, 1]
    diag += damp * mean
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
                  block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """W [E, out, in], H [E, in, in] (or [1, in, in], shared) -> (q int8 [E, out, in], scale bf16 [E, out, in/group])."""
    E, n_out, n_in = W.shape
    assert n_in % group == 0 and block % group == 0
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
                s = group_scale(W1[:, :, j:j + group], clip)                     # [E, out, 1]
                S[:, :, col // group] = s[..., 0]
            w = W1[:, :, j]                                                      # [E, out]
            q = (w / s[..., 0]).round().clamp(-8, 7)
            Q[:, :, col] = q.to(torch.int8)
            d = U1[:, j, j][:, None]                                             # [E, 1]
            err = (w - q * s[..., 0]) / d                                        # [E, out]
            W1[:, :, j:] -= err[:, :, None] * U1[:, None, j, j:]                 # [E, out, b-j]
            Err[:, :, j] = err
        W[:, :, b1:] -= Err @ U[:, b0:b1, b1:]                                   # [E, out, in-b1]
    return Q, S.to(torch.bfloat16)
