"""kq-manifest.json: what a finished kq checkpoint holds, with a sha256 per file.

It is written last, atomically: a folder without it is not a finished checkpoint
(a run that died left `.kq-work/` instead, and resumes from it).
"""
from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

MANIFEST_NAME = "kq-manifest.json"
WORK_DIR = ".kq-work"
# Folders inside a checkpoint that are not part of it: huggingface_hub's upload state, an
# unfinished run's state, and `kq shard`'s per-rank files (derived, with their own manifest).
IGNORED_DIRS = (".cache", WORK_DIR, "kq-shards")


def sha256_file(path: str | Path, chunk: int = 16 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


def write_json_atomic(path: Path, data) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_manifest(folder: Path) -> dict | None:
    p = Path(folder) / MANIFEST_NAME
    if not p.exists():
        return None
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError:
        return None
