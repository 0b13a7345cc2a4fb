"""Lazy, mmap'd reading of a local checkpoint folder, whatever its storage.

`CheckpointReader.weight(module)` gives the float32 weight of a Linear module from
any of the storages kq meets: DeepSeek-style block FP8 (`weight` + `weight_scale_inv`
multiplier per 128x128 block), compressed-tensors per-channel FP8 (`weight` +
`weight_scale` [out, 1]), kq's own output (block FP8 scales renamed `weight_scale`;
INT4 `weight_packed`/`weight_scale`/`weight_shape`), or plain BF16/F32. Shards are
opened on first use and stay mmap'd, so only the tensors asked for are paged in.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch
from safetensors import safe_open

from kq.checkpoint.index import Index, load_json, load_local_index
from kq.checkpoint.pack import dequantize_int4
from kq.checkpoint.safetensors_io import ShardHeader, read_header
from kq.errors import KqError


class CheckpointReader:
    def __init__(self, folder: str | Path, index: Index | None = None):
        self.folder = Path(folder)
        if not self.folder.is_dir():
            raise KqError(f"{self.folder}: no such checkpoint folder")
        cfg = self.folder / "config.json"
        if not cfg.exists():
            raise KqError(f"{self.folder}: no config.json: not a model checkpoint folder")
        self.config = load_json(cfg)
        self.index = index or load_local_index(self.folder)
        self._handles: dict[str, object] = {}
        self._headers: dict[str, ShardHeader] = {}

    # -- what is there ------------------------------------------------------------
    def names(self) -> list[str]:
        return list(self.index.weight_map)

    def __contains__(self, name: str) -> bool:
        return name in self.index.weight_map

    def shard_of(self, name: str) -> str:
        try:
            return self.index.weight_map[name]
        except KeyError:
            raise KqError(f"tensor {name!r} is not in the checkpoint's index") from None

    def header(self, shard: str) -> ShardHeader:
        if shard not in self._headers:
            p = self.folder / shard
            if not p.exists():
                raise KqError(f"{self.folder}: shard {shard} named by the index is missing")
            self._headers[shard] = read_header(p)
        return self._headers[shard]

    def meta(self, name: str) -> tuple[str, tuple[int, ...]]:
        e = self.header(self.shard_of(name)).tensors.get(name)
        if e is None:
            raise KqError(f"{self.shard_of(name)}: tensor {name!r} listed in the index is not in the shard")
        return e.dtype, e.shape

    # -- tensors ------------------------------------------------------------------
    def raw(self, name: str) -> torch.Tensor:
        shard = self.shard_of(name)
        self.meta(name)  # validates the header once (truncation, presence)
        h = self._handles.get(shard)
        if h is None:
            h = self._handles[shard] = safe_open(str(self.folder / shard), framework="pt")
        return h.get_tensor(name)

    def weight(self, module: str) -> torch.Tensor:
        """float32 [out, in] weight of a Linear module, dequantized from any storage."""
        if f"{module}.weight_packed" in self:
            return dequantize_int4(self.raw(f"{module}.weight_packed"), self.raw(f"{module}.weight_scale"),
                                   self.raw(f"{module}.weight_shape").tolist())
        w = self.raw(f"{module}.weight")
        if w.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
            return w.to(torch.float32)
        for scale_name in (f"{module}.weight_scale_inv", f"{module}.weight_scale"):
            if scale_name in self:
                return dequantize_fp8(w, self.raw(scale_name))
        raise KqError(f"{module}: FP8 weight without a weight_scale_inv / weight_scale tensor")

    def close(self) -> None:
        self._handles.clear()


def dequantize_fp8(w: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    """FP8 weight [out, in] times its scale: per-tensor ([] or [1]), per-channel
    ([out, 1]) or per block ([ceil(out/b0), ceil(in/b1)], block size derived)."""
    out, n_in = w.shape
    wf = w.to(torch.float32)
    s = s.to(torch.float32)
    if s.numel() == 1:
        return wf * s.reshape(())
    if s.dim() == 2 and s.shape == (out, 1) and out > 1:
        return wf * s
    if s.dim() != 2:
        raise KqError(f"FP8 scale of shape {tuple(s.shape)} does not fit a weight of shape {(out, n_in)}")
    b0 = _block_size(out, s.shape[0])
    b1 = _block_size(n_in, s.shape[1])
    full = s.repeat_interleave(b0, 0)[:out].repeat_interleave(b1, 1)[:, :n_in]
    return wf * full


def _block_size(n: int, nblocks: int) -> int:
    # The smallest power-of-two block that needs exactly nblocks blocks (128 in practice).
    for b in (128, 64, 256, 32, 512, 16, 8, 1024):
        if math.ceil(n / b) == nblocks:
            return b
    raise KqError(f"FP8 block scale with {nblocks} blocks does not fit a dimension of {n}")
