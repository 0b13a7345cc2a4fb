"""What every checkpoint source gives the plan and the run (source.py's LocalSource, hub_source.py's
HubSource; source.open_source picks one)."""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from kq.checkpoint.index import INDEX_NAME, Index
from kq.checkpoint.safetensors_io import TensorEntry
from kq.format import MANIFEST_NAME

# Files that are rewritten (config, index) or belong to the source's own repo page.
NOT_COPIED = {"config.json", INDEX_NAME, "README.md", ".gitattributes", MANIFEST_NAME}


@dataclass
class Source:
    name: str                                   # what the user typed, for messages
    config: dict
    index: Index
    headers: dict[str, dict[str, TensorEntry]]  # shard -> tensor -> entry
    extra_files: dict[str, int] = field(default_factory=dict)  # non-weight file -> size
    repo_id: str | None = None                  # Hub repo id when known
    revision: str | None = None

    def shard_bytes(self, shard: str) -> int:
        return max((e.end for e in self.headers[shard].values()), default=0)

    def entry(self, name: str) -> TensorEntry:
        return self.headers[self.index.weight_map[name]][name]

    # overridden by HubSource
    def shard_path(self, shard: str) -> Path:
        raise NotImplementedError

    def release(self, shard: str) -> None:
        pass

    def copy_extras(self, dest: Path) -> None:
        raise NotImplementedError

    def local_folder(self) -> Path:
        """A folder that reads like the local checkpoint, for the stages that read whole layers
        with the model's own code (GPTQ, `kq eval`)."""
        raise NotImplementedError
