"""A Source backed by a Hugging Face Hub repo: planned from headers, fetched shard by shard.

The plan needs every shard's header before any weight moves; huggingface_hub's
`get_safetensors_metadata` reads just those (HTTP range requests), so `kq inspect
glm-5.2` costs a few MB, not 756 GB. Shards are then fetched one at a time through
kq.checkpoint.hub (the user's HF cache is used when it already holds them, and is
never deleted from); with --stream each staged shard is deleted once every output
shard that needs it is written.
"""
from __future__ import annotations

import shutil
from pathlib import Path

from kq.checkpoint import hub
from kq.checkpoint.index import INDEX_NAME, SINGLE_NAME, Index, check_shard_name, load_json
from kq.checkpoint.safetensors_io import TensorEntry, read_header
from kq.checkpoint.source_base import NOT_COPIED, Source
from kq.errors import KqError
from kq.format import atomic_path


class HubSource(Source):
    remote = True

    @classmethod
    def open(cls, repo_id: str, *, revision: str | None = None, staging: Path | None = None,
             stream: bool = False) -> "HubSource":
        info = hub.resolve_repo(repo_id, revision)
        if staging is None or not stream:
            # Not streaming: keep the downloads where a rerun (or `kq eval`) finds them again.
            staging = hub_cache_dir(repo_id)
        meta_dir = staging / ".meta"
        meta = {"config.json": hub.fetch_file(repo_id, "config.json", revision=info.sha, dest_dir=meta_dir)}
        config = load_json(meta["config.json"], "config.json from the Hub")
        if INDEX_NAME in info.files:
            meta[INDEX_NAME] = hub.fetch_file(repo_id, INDEX_NAME, revision=info.sha, dest_dir=meta_dir)
            index = Index.from_json(load_json(meta[INDEX_NAME], f"{INDEX_NAME} from the Hub"))
        elif SINGLE_NAME in info.files:
            index = None
        else:
            raise KqError(f"{repo_id}: no {INDEX_NAME} or {SINGLE_NAME} in the repo: not a safetensors checkpoint")
        headers = _remote_headers(repo_id, info.sha)
        if index is None:
            index = Index({n: SINGLE_NAME for n in headers[SINGLE_NAME]}, [SINGLE_NAME], None)
        missing = [s for s in index.shards if s not in info.files]
        if missing:
            raise KqError(f"{repo_id}: {len(missing)} shard(s) named by the index are not in the repo, e.g. {missing[0]}")
        for name, shard in index.weight_map.items():
            if name not in headers.get(shard, {}):
                raise KqError(f"{repo_id}/{shard}: tensor {name!r} listed in the index is not in the shard")
        extras = {f: size for f, size in info.files.items()
                  if "/" not in f and not f.startswith(".") and f not in NOT_COPIED and not f.endswith(".safetensors")}
        src = cls(name=repo_id, config=config, index=index, headers=headers, extra_files=extras,
                  repo_id=repo_id, revision=info.sha)
        src.staging, src.stream, src._paths, src._meta = Path(staging), stream, {}, meta
        return src

    def shard_path(self, shard: str) -> Path:
        if shard not in self._paths:
            p = hub.fetch_file(self.repo_id, check_shard_name(shard), revision=self.revision, dest_dir=self.staging)
            local = read_header(p).tensors  # a truncated or corrupted download is caught here
            for name, e in self.headers[shard].items():
                got = local.get(name)
                if got is None or (got.dtype, got.shape) != (e.dtype, e.shape):
                    raise KqError(f"{self.repo_id}/{shard}: downloaded shard does not match its header on the Hub ({name})")
            self.headers[shard] = local  # absolute offsets of the local file, for byte copies
            self._paths[shard] = p
        return self._paths[shard]

    def local_folder(self) -> Path:
        """Every shard fetched, then a folder that reads like a local checkpoint (STAGING/.view:
        links to the shards, config.json, the index, tokenizer and other top-level files), for
        the stages that read whole layers with the model's own code: GPTQ and `kq eval`.
        Links, not copies: a shard the user's HF cache holds stays there, in one copy."""
        files = {s: self.shard_path(s) for s in self.index.shards}
        files.update(self._meta)
        for name in self.extra_files:
            files[name] = hub.fetch_file(self.repo_id, name, revision=self.revision, dest_dir=self.staging / ".meta")
        view = self.staging / ".view"
        view.mkdir(parents=True, exist_ok=True)
        for name, p in files.items():
            hub.check_filename(name)  # names from the repo: nothing may leave the view folder
            link, target = view / name, Path(p).resolve()
            if link.is_symlink() and link.resolve() == target:
                continue
            link.unlink(missing_ok=True)
            link.symlink_to(target)
        return view

    def release(self, shard: str) -> None:
        p = self._paths.pop(shard, None)
        if p is not None and self.stream:
            hub.release_file(p, self.staging)

    def copy_extras(self, dest: Path) -> None:
        for name in self.extra_files:
            p = hub.fetch_file(self.repo_id, name, revision=self.revision, dest_dir=self.staging / ".meta")
            with atomic_path(dest / name) as tmp:
                shutil.copyfile(p, tmp)


def hub_cache_dir(repo_id: str) -> Path:
    import os
    base = Path(os.environ.get("KQ_CACHE", Path.home() / ".cache" / "kq"))
    return base / "sources" / repo_id.replace("/", "--")


def _remote_headers(repo_id: str, sha: str) -> dict[str, dict[str, TensorEntry]]:
    """Every shard's tensor table, from the headers alone. Offsets are relative until the
    shard is fetched (the plan needs only dtypes and shapes)."""
    from huggingface_hub import HfApi
    from huggingface_hub import errors as E
    try:
        meta = HfApi().get_safetensors_metadata(repo_id, revision=sha)
    except E.HfHubHTTPError as err:
        raise hub._hub_error(err, repo_id, sha) from None
    except E.NotASafetensorsRepoError:
        raise KqError(f"{repo_id}: not a safetensors repo") from None
    out: dict[str, dict[str, TensorEntry]] = {}
    for shard, fm in meta.files_metadata.items():
        check_shard_name(shard)
        out[shard] = {name: TensorEntry(name, t.dtype, tuple(t.shape), t.data_offsets[0], t.data_offsets[1])
                      for name, t in fm.tensors.items()}
    return out
