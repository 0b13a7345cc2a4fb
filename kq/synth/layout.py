"""What a synthetic checkpoint holds: tensor entries and the producers of their values.

A family module describes its checkpoint by adding *groups* to a Layout: one group is
the set of tensors that come from one draw (a block-FP8 Linear gives `weight` +
`weight_scale_inv`). Nothing is generated here; the writer asks a group's producer for
its tensors when it writes them, so a full-size layer never sits in RAM at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

from . import values

DTYPES: dict[str, torch.dtype] = {
    "F8_E4M3": torch.float8_e4m3fn,
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "I32": torch.int32,
    "I64": torch.int64,
}
ST_NAME = {v: k for k, v in DTYPES.items()}


@dataclass(frozen=True)
class Entry:
    name: str  # full tensor name, prefix included
    dtype: str  # safetensors dtype string
    shape: tuple[int, ...]
    group: str  # key of the producer that makes this tensor

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize


Producer = Callable[[torch.Generator], dict[str, torch.Tensor]]  # returns {unprefixed name: tensor}


class Layout:
    """Ordered tensor entries plus producers. `prefix` (e.g. "language_model.") is added
    to every name but not to the seed key, so a prefixed checkpoint carries the same
    bytes as the plain one."""

    def __init__(self, seed: int, prefix: str = ""):
        self.seed = seed
        self.prefix = prefix
        self.entries: list[Entry] = []
        self._producers: dict[str, tuple[str, Producer]] = {}

    # -- generic ----------------------------------------------------------------
    def add(self, group: str, specs: list[tuple[str, str, tuple[int, ...]]], produce: Producer) -> None:
        if group in self._producers:
            raise ValueError(f"duplicate tensor group {group}")
        self._producers[group] = (self.prefix, produce)
        for name, dtype, shape in specs:
            self.entries.append(Entry(self.prefix + name, dtype, tuple(shape), group))

    def produce(self, group: str) -> dict[str, torch.Tensor]:
        prefix, make = self._producers[group]
        made = make(values.generator(self.seed, group))
        return {prefix + k: v for k, v in made.items()}

    # -- the tensor kinds real checkpoints hold -----------------------------------
    def fp8_block_linear(self, module: str, out: int, inn: int) -> None:
        """DeepSeek-style block FP8: X.weight F8 [out,in] + X.weight_scale_inv F32 [ceil/128]."""
        specs = [
            (f"{module}.weight", "F8_E4M3", (out, inn)),
            (f"{module}.weight_scale_inv", "F32", (math.ceil(out / values.BLOCK), math.ceil(inn / values.BLOCK))),
        ]

        def produce(g):
            q, s = values.fp8_block(values.linear_weight(g, out, inn))
            return {f"{module}.weight": q, f"{module}.weight_scale_inv": s}

        self.add(module, specs, produce)

    def fp8_channel_linear(self, module: str, out: int, inn: int, scale_dtype: str, bias: bool = False) -> None:
        """compressed-tensors float-quantized, strategy channel: X.weight F8 + X.weight_scale [out,1]."""
        specs = [(f"{module}.weight", "F8_E4M3", (out, inn)), (f"{module}.weight_scale", scale_dtype, (out, 1))]
        if bias:
            specs.append((f"{module}.bias", "BF16", (out,)))

        def produce(g):
            q, s = values.fp8_channel(values.linear_weight(g, out, inn), DTYPES[scale_dtype])
            made = {f"{module}.weight": q, f"{module}.weight_scale": s}
            if bias:
                made[f"{module}.bias"] = values.small(g, (out,), 0.02, torch.bfloat16)
            return made

        self.add(module, specs, produce)

    def int4_linear(self, module: str, out: int, inn: int, group: int) -> None:
        """compressed-tensors pack-quantized (as Kimi K2.5+ ships its experts): weight_packed
        I32 [out, in/8], weight_scale BF16 [out, in/group], weight_shape I32 [2]."""
        specs = [
            (f"{module}.weight_packed", "I32", (out, inn // 8)),
            (f"{module}.weight_scale", "BF16", (out, inn // group)),
            (f"{module}.weight_shape", "I32", (2,)),
        ]

        def produce(g):
            packed, scale = values.int4_pack(values.linear_weight(g, out, inn), group)
            shape = torch.tensor([out, inn], dtype=torch.int32)
            return {f"{module}.weight_packed": packed, f"{module}.weight_scale": scale, f"{module}.weight_shape": shape}

        self.add(module, specs, produce)

    def dense(self, name: str, shape: tuple[int, ...], dtype: str = "BF16", std: float = 0.02) -> None:
        """An unquantized tensor (embeddings, router, BF16 projections, biases)."""
        self.add(name, [(name, dtype, shape)], lambda g: {name: values.small(g, shape, std, DTYPES[dtype])})

    def norm(self, name: str, n: int) -> None:
        self.add(name, [(name, "BF16", (n,))], lambda g: {name: values.norm_weight(g, n)})
