"""Fill one decoder layer's parameters from a checkpoint, whatever its storage.

The checkpoint names experts one Linear at a time (`mlp.experts.E.gate_proj`), while
transformers 5 holds a layer's experts as two fused 3D parameters:
  gate_up_proj [E, 2*I, H] = cat(gate_proj [I, H], up_proj [I, H]) per expert
  down_proj    [E, H, I]
Every Linear is dequantized by the reader (block FP8, per-channel FP8, INT4, BF16).
"""
from __future__ import annotations

from typing import Callable, Protocol

import torch

from kq.errors import KqError


class Reader(Protocol):
    config: dict
    def __contains__(self, name: str) -> bool: ...
    def raw(self, name: str) -> torch.Tensor: ...
    def weight(self, module: str) -> torch.Tensor: ...


# (module name, float32 weight) -> float32 weight: lets a caller substitute experts
# (e.g. an in-memory RTN or GPTQ result) without writing a checkpoint.
ExpertOverride = Callable[[str, torch.Tensor], torch.Tensor]

_FUSED = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def expert_names(prefix: str, n_experts: int, fused: str) -> list[list[str]]:
    """Checkpoint module names feeding a fused parameter: [expert][part]."""
    return [[f"{prefix}mlp.experts.{e}.{p}" for p in _FUSED[fused]] for e in range(n_experts)]


def load_tensor(reader: Reader, prefix: str, key: str, like: torch.Tensor, n_experts: int,
                override: ExpertOverride | None, experts=None) -> torch.Tensor:
    """The value for state-dict `key` of the layer whose checkpoint prefix is `prefix`. With `experts`
    (a collection of expert indices), the fused expert parameters hold only those experts; the
    others are left uninitialised for the caller to fill (kq.quantize.distributed.load_layer)."""
    if key.startswith("mlp.experts.") and key.split(".")[-1] in _FUSED:
        fused = key.split(".")[-1]
        out = torch.empty(like.shape, dtype=like.dtype)
        for e, parts in enumerate(expert_names(prefix, n_experts, fused)):
            if experts is not None and e not in experts:
                continue
            ws = []
            for m in parts:
                w = reader.weight(m)
                ws.append(override(m, w) if override else w)
            out[e] = torch.cat(ws, 0) if len(ws) > 1 else ws[0]
        return out
    name = prefix + key
    if key.endswith(".weight") and (name + "_packed" in reader or _is_quantized_linear(reader, name)):
        t = reader.weight(name[: -len(".weight")])
    elif name in reader:
        t = reader.raw(name)
    else:
        raise KqError(f"the checkpoint has no tensor {name!r}, which the {reader.config.get('model_type')} "
                      "architecture needs")
    if tuple(t.shape) != tuple(like.shape):
        raise KqError(f"{name}: shape {tuple(t.shape)} in the checkpoint, {tuple(like.shape)} expected from config.json")
    return t.to(like.dtype)


def _is_quantized_linear(reader: Reader, name: str) -> bool:
    return any(name + s in reader for s in ("_scale_inv", "_scale"))
