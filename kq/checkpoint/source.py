"""Where a checkpoint comes from: a local folder or a Hub repo (or a recipe alias).

A Source gives the plan everything it needs before any weight is read (config,
index, every shard's header) and hands shards to the run one at a time:
`shard_path(name)` makes the shard available locally (a Hub shard is downloaded into
kq's staging folder), `release(name)` says the run is done with it (a streamed Hub
shard is deleted then; a local file never is).
"""
from __future__ import annotations

import shutil
from pathlib import Path

from kq.checkpoint.index import load_json, load_local_index
from kq.checkpoint.safetensors_io import read_header
from kq.checkpoint.source_base import NOT_COPIED, Source  # noqa: F401  (kq.checkpoint.source's API)
from kq.errors import KqError
from kq.format import atomic_path


class LocalSource(Source):
    folder: Path

    @classmethod
    def open(cls, folder: str | Path) -> "LocalSource":
        folder = Path(folder)
        if not folder.is_dir():
            raise KqError(f"{folder}: no such folder (and not a known alias or Hub repo id)")
        cfg_path = folder / "config.json"
        if not cfg_path.exists():
            raise KqError(f"{folder}: no config.json: not a model checkpoint folder")
        config = load_json(cfg_path)
        index = load_local_index(folder)
        missing = [s for s in index.shards if not (folder / s).is_file()]
        if missing:
            raise KqError(f"{folder}: {len(missing)} shard(s) named by the index are missing, e.g. {missing[0]}")
        headers = {s: read_header(folder / s).tensors for s in index.shards}
        for name, shard in index.weight_map.items():
            if name not in headers[shard]:
                raise KqError(f"{shard}: tensor {name!r} listed in the index is not in the shard")
        extras = {p.name: p.stat().st_size for p in sorted(folder.iterdir())
                  if p.is_file() and not p.name.startswith(".") and p.name not in NOT_COPIED
                  and not p.name.endswith(".safetensors")}
        src = cls(name=str(folder), config=config, index=index, headers=headers, extra_files=extras,
                  repo_id=config.get("_name_or_path") or None)
        src.folder = folder
        return src

    def shard_path(self, shard: str) -> Path:
        return self.folder / shard

    def local_folder(self) -> Path:
        return self.folder

    def copy_extras(self, dest: Path) -> None:
        for name in self.extra_files:
            with atomic_path(dest / name) as tmp:
                shutil.copyfile(self.folder / name, tmp)


def open_source(spec: str, *, staging: Path | None = None, stream: bool = False,
                revision: str | None = None) -> Source:
    """A local folder, a recipe alias (`glm-5.2`) or a Hub repo id (`org/name`)."""
    from kq.recipes import resolve_alias
    p = Path(spec).expanduser()
    if p.exists():
        return LocalSource.open(p)
    repo = resolve_alias(spec) or (spec if _looks_like_repo_id(spec) else None)
    if repo is None:
        raise KqError(f"{spec}: no such folder, and not a recipe alias or a Hub repo id (org/name); "
                      "`kq quantize --help` lists the aliases")
    from kq.checkpoint.hub_source import HubSource
    return HubSource.open(repo, revision=revision, staging=staging, stream=stream)


def _looks_like_repo_id(s: str) -> bool:
    parts = s.split("/")
    return len(parts) == 2 and all(parts) and not s.startswith((".", "/", "~"))
