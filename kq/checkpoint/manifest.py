"""kq-manifest.json: what a finished kq checkpoint holds, with a sha256 per file.

It is written last, atomically: a folder without it is not a finished checkpoint
(a run that died left `.kq-work/` instead, and resumes from it).
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from kq.format import MANIFEST_NAME, RANK_SHARDS_DIR, WORK_DIR, write_json_atomic  # noqa: F401  (this module's API)

# Folders inside a checkpoint that are not part of it: huggingface_hub's upload state, an
# unfinished run's state, and `kq shard`'s per-rank files (derived, with their own manifest).
IGNORED_DIRS = (".cache", WORK_DIR, RANK_SHARDS_DIR)


def sha256_file(path: str | Path, chunk: int = 16 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()


def read_manifest(folder: Path) -> dict | None:
    p = Path(folder) / MANIFEST_NAME
    if not p.exists():
        return None
    try:
        return json.loads(p.read_text())
    except json.JSONDecodeError:
        return None
