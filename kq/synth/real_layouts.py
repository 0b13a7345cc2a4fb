"""Bundled layouts of published checkpoints: the plan of a real model with no network.

For some recipe aliases kq ships the published checkpoint's layout (`kq/recipes/layouts/<org>_<name>/`):
its config.json as published and `layout.json.gz`, every tensor's name, dtype, shape and shard as
the published shard headers give them. A `LayoutSource` built from it plans exactly like the real
checkpoint (same names, sizes and header lengths), so `kq inspect glm-5.2` answers offline; it holds
no weight bytes, so nothing can be quantized from it.

Shard headers are rebuilt with the safetensors writer's rule (kq.synth.stwriter.header_for: tensors
by dtype, largest element first, then by name; no `__metadata__`), which reproduces the published
header lengths and data offsets where they are known (Kimi K2's model-2-of-61: 293,368 header bytes).
"""
from __future__ import annotations

import gzip
import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from kq.checkpoint.index import Index, check_shard_name
from kq.checkpoint.safetensors_io import DTYPE_SIZE, TensorEntry
from kq.checkpoint.source import Source
from kq.errors import KqError


@dataclass(frozen=True)
class Layout:
    repo_id: str
    config: dict
    tensors: dict[str, tuple[str, tuple[int, ...], str]]   # name -> (dtype, shape, shard)


def bundled_repos() -> list[str]:
    """Hub repo ids whose layout ships with kq."""
    root = resources.files("kq.recipes") / "layouts"
    return sorted(_repo_of(d.name) for d in root.iterdir() if (d / "layout.json.gz").is_file())


def _repo_of(folder_name: str) -> str:
    org, _, name = folder_name.partition("_")
    return f"{org}/{name}"


def read_layout(folder) -> Layout:
    """A layout folder (config.json + layout.json.gz), bundled or not."""
    try:
        config = json.loads((folder / "config.json").read_text())
        data = json.loads(gzip.decompress((folder / "layout.json.gz").read_bytes()))
        tensors = {n: (r["dtype"], tuple(int(x) for x in r["shape"]), check_shard_name(r["shard"]))
                   for n, r in data["tensors"].items()}
    except (OSError, KeyError, TypeError, ValueError) as e:
        raise KqError(f"{folder}: not a kq layout folder ({type(e).__name__}: {e})") from None
    for n, (dt, _, _) in tensors.items():
        if dt not in DTYPE_SIZE:
            raise KqError(f"{folder}: tensor {n!r} has unknown dtype {dt!r}")
    return Layout(data.get("model") or _repo_of(folder.name), config, tensors)


def bundled_layout(repo_id: str) -> Layout | None:
    folder = resources.files("kq.recipes") / "layouts" / repo_id.replace("/", "_", 1)
    if not (folder / "layout.json.gz").is_file():
        return None
    return read_layout(folder)


def shard_entries(layout: Layout) -> dict[str, list]:
    """shard -> its tensors as kq.synth Entries (name, dtype, shape), in index order."""
    from kq.synth.layout import Entry
    out: dict[str, list] = {}
    for name, (dt, shape, shard) in layout.tensors.items():
        out.setdefault(shard, []).append(Entry(name, dt, shape, ""))
    return out


def shard_header(entries: list) -> tuple[bytes, dict[str, int]]:
    """(the shard's first bytes: length + header, {name: absolute data offset}), as published."""
    from kq.synth.stwriter import header_for
    return header_for(entries, metadata=None)


class LayoutSource(Source):
    """A Source with the real checkpoint's config, index and headers, and no bytes."""

    @classmethod
    def open(cls, layout: Layout, name: str | None = None) -> "LayoutSource":
        headers = {}
        for shard, entries in shard_entries(layout).items():
            _, offsets = shard_header(entries)
            headers[shard] = {e.name: TensorEntry(e.name, e.dtype, e.shape, offsets[e.name],
                                                  offsets[e.name] + e.nbytes) for e in entries}
        index = Index.from_json({"weight_map": {n: t[2] for n, t in layout.tensors.items()}})
        src = cls(name=name or layout.repo_id, config=layout.config, index=index, headers=headers,
                  repo_id=layout.repo_id)
        return src

    def _no_bytes(self, what: str):
        raise KqError(f"{self.name}: planned from kq's bundled layout, which holds no weights; {what} needs the "
                      "checkpoint itself (online, or a local folder)")

    def shard_path(self, shard: str) -> Path:
        self._no_bytes("quantizing")

    def copy_extras(self, dest: Path) -> None:
        self._no_bytes("quantizing")

    def local_folder(self) -> Path:
        self._no_bytes("this command")
