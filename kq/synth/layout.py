"""What a synthetic checkpoint holds: tensor entries and the producers of their values.

A family module describes its checkpoint by adding *groups* to a Layout: one group is
the set of tensors that come from one draw (a block-FP8 Linear gives `weight` +
`weight_scale_inv`). Nothing is generated here. A producer yields *pieces*
`(name, byte offset within that tensor, tensor)`, row block by row block for big
weights, and the writer puts each piece where it belongs, so a full-size layer
never sits in RAM at once.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterator

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


@dataclass(frozen=True)
class Entry:
    name: str  # full tensor name, prefix included
    dtype: str  # safetensors dtype string
    shape: tuple[int, ...]
    group: str  # key of the producer that makes this tensor

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize


Piece = tuple[str, int, torch.Tensor]  # (unprefixed name, byte offset in the tensor, data)
Producer = Callable[[int, str], Iterator[Piece]]  # (seed, group key) -> pieces


def whole(make: Callable[[torch.Generator], dict[str, torch.Tensor]]) -> Producer:
    """A producer for small tensors made in one go from one generator."""

    def produce(seed: int, key: str) -> Iterator[Piece]:
        for name, t in make(values.generator(seed, key)).items():
            yield name, 0, t

    return produce


class Layout:
    """Ordered tensor entries plus producers. `prefix` (e.g. "language_model.") is added
    to the names of the groups added while it is set, but not to their seed key, so a
    prefixed checkpoint carries the same bytes as the plain one."""

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

    def pieces(self, group: str) -> Iterator[Piece]:
        """Yield (full name, byte offset, tensor) pieces that together make the group."""
        prefix, produce = self._producers[group]
        for name, off, t in produce(self.seed, group):
            yield prefix + name, off, t

    # -- the tensor kinds real checkpoints hold -----------------------------------
    def fp8_block_linear(self, module: str, out: int, inn: int) -> None:
        """DeepSeek-style block FP8: X.weight F8 [out,in] + X.weight_scale_inv F32 [ceil/128]."""
        ib = math.ceil(inn / values.BLOCK)
        w, s = f"{module}.weight", f"{module}.weight_scale_inv"
        specs = [(w, "F8_E4M3", (out, inn)), (s, "F32", (math.ceil(out / values.BLOCK), ib))]

        def produce(seed, key):
            for r0, rows in values.weight_rows(seed, key, out, inn):
                q, sc = values.fp8_block_rows(rows)
                yield w, r0 * inn, q
                yield s, (r0 // values.BLOCK) * ib * 4, sc

        self.add(module, specs, produce)

    def fp8_channel_linear(self, module: str, out: int, inn: int, scale_dtype: str, bias: bool = False) -> None:
        """compressed-tensors float-quantized, strategy channel: X.weight F8 + X.weight_scale [out,1]."""
        w, s, b = f"{module}.weight", f"{module}.weight_scale", f"{module}.bias"
        specs = [(w, "F8_E4M3", (out, inn)), (s, scale_dtype, (out, 1))] + ([(b, "BF16", (out,))] if bias else [])
        sdt = DTYPES[scale_dtype]

        def produce(seed, key):
            for r0, rows in values.weight_rows(seed, key, out, inn):
                q, sc = values.fp8_channel_rows(rows, sdt)
                yield w, r0 * inn, q
                yield s, r0 * sdt.itemsize, sc
            if bias:
                yield b, 0, values.small(values.generator(seed, key + "#bias"), (out,), 0.02, torch.bfloat16)

        self.add(module, specs, produce)

    def int4_linear(self, module: str, out: int, inn: int, group: int) -> None:
        """compressed-tensors pack-quantized (as Kimi K2.5+ ships its experts): weight_packed
        I32 [out, in/8], weight_scale BF16 [out, in/group], weight_shape I32 [2]."""
        p, s, sh = f"{module}.weight_packed", f"{module}.weight_scale", f"{module}.weight_shape"
        specs = [(p, "I32", (out, inn // 8)), (s, "BF16", (out, inn // group)), (sh, "I32", (2,))]

        def produce(seed, key):
            for r0, rows in values.weight_rows(seed, key, out, inn):
                packed, sc = values.int4_rows(rows, group)
                yield p, r0 * (inn // 8) * 4, packed
                yield s, r0 * (inn // group) * 2, sc
            yield sh, 0, torch.tensor([out, inn], dtype=torch.int32)

        self.add(module, specs, produce)

    def dense(self, name: str, shape: tuple[int, ...], dtype: str = "BF16", std: float = 0.02) -> None:
        """An unquantized tensor (embeddings, router, BF16 projections, biases). Matrices
        stream by row blocks like the quantized weights (BF16 attention is full size in K2.5)."""
        dt = DTYPES[dtype]
        if len(shape) != 2:
            self.add(name, [(name, dtype, shape)], whole(lambda g: {name: values.small(g, shape, std, dt)}))
            return

        def produce(seed, key):
            for r0, rows in values.weight_rows(seed, key, shape[0], shape[1], std):
                yield name, r0 * shape[1] * dt.itemsize, rows.to(dt)

        self.add(name, [(name, dtype, shape)], produce)

    def norm(self, name: str, n: int) -> None:
        self.add(name, [(name, "BF16", (n,))], whole(lambda g: {name: values.norm_weight(g, n)}))
