"""The safetensors index of a checkpoint: which tensor lives in which shard.

Every shard name comes from a file someone else wrote, so each is validated before
it is joined to a folder: a plain file name ending in .safetensors, nothing that
could climb out of the folder.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from kq.errors import KqError

from kq.format import INDEX_NAME, SINGLE_NAME  # noqa: F401  (kq.checkpoint.index's API)
_SAFE_SHARD = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]*\.safetensors$")


def load_json(path: Path, what: str | None = None) -> dict:
    """A JSON file someone else wrote; a broken one is one clear line, not a traceback."""
    try:
        return json.loads(Path(path).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise KqError(f"{what or path}: not valid JSON ({e})") from None


def check_shard_name(name: str) -> str:
    if not isinstance(name, str) or not _SAFE_SHARD.match(name) or ".." in name:
        raise KqError(f"index names an unsafe shard file {name!r}: only plain *.safetensors names in the checkpoint folder are accepted")
    return name


@dataclass
class Index:
    weight_map: dict[str, str]          # tensor name -> shard file name
    shards: list[str]                   # shard file names, in the order they first appear
    total_size: int | None

    @classmethod
    def from_json(cls, data: dict) -> "Index":
        wm = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(wm, dict) or not wm:
            raise KqError(f"{INDEX_NAME} has no weight_map")
        shards: list[str] = []
        seen = set()
        for name, shard in wm.items():
            check_shard_name(shard)
            if shard not in seen:
                seen.add(shard)
                shards.append(shard)
        shards.sort(key=_shard_sort_key)
        total = (data.get("metadata") or {}).get("total_size")
        return cls(dict(wm), shards, int(total) if total is not None else None)

    def tensors_in(self, shard: str) -> list[str]:
        # Grouped once: a real index has 100k+ names over 60-140 shards (a scan per shard is quadratic).
        by = self.__dict__.get("_by_shard")
        if by is None or sum(map(len, by.values())) != len(self.weight_map):
            by = {}
            for n, s in self.weight_map.items():
                by.setdefault(s, []).append(n)
            self.__dict__["_by_shard"] = by
        return list(by.get(shard, ()))


def _shard_sort_key(name: str):
    # model-2-of-61 before model-10-of-61 (Kimi's shard names are not zero-padded)
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name)]


def load_local_index(folder: Path) -> Index:
    """The index of a local folder; a folder with a single model.safetensors gets an
    index built from that file's header."""
    idx = folder / INDEX_NAME
    if idx.exists():
        return Index.from_json(load_json(idx))
    single = folder / SINGLE_NAME
    if single.exists():
        from kq.checkpoint.safetensors_io import read_header
        h = read_header(single)
        return Index({n: SINGLE_NAME for n in h.tensors}, [SINGLE_NAME], None)
    raise KqError(f"{folder}: no {INDEX_NAME} or {SINGLE_NAME}: not a safetensors checkpoint folder")
