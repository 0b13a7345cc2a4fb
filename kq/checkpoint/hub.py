"""Hub sources: what the quantize pipeline needs from the Hugging Face Hub.

Two verbs, both through huggingface_hub's own client (so HF_TOKEN, `hf auth login`,
HF_ENDPOINT and HF_HUB_OFFLINE behave as users expect):

- `resolve_repo(repo_id, revision)` -> RepoInfo: the commit sha and every file with its size.
- `fetch_file(repo_id, filename, revision=, dest_dir=)` -> Path: one file, on local disk.

Ownership rule: a file already in the user's HF cache is returned *where it is* (no copy of a
5 GB shard, and offline mode works); anything downloaded goes to `dest_dir`, a staging folder
kq owns.  Delete fetched files only through `release_file`, which refuses to touch anything
outside `dest_dir` — kq never deletes from the user's cache.

Every failure a user can cause or fix becomes a one-line KqError.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from kq.errors import KqError

_SHA = re.compile(r"^[0-9a-f]{40}$")


@dataclass(frozen=True)
class RepoInfo:
    repo_id: str
    revision: str | None  # what was asked for (None = the default branch)
    sha: str  # the commit it resolved to: pass this to fetch_file so every shard comes from one commit
    files: dict[str, int]  # path in repo -> size in bytes
    from_cache: bool = False  # True when answered from the local HF cache (offline / Hub unreachable)

    def size(self, filename: str) -> int:
        return self.files[filename]


def _offline() -> bool:
    from huggingface_hub import constants

    return constants.is_offline_mode()


def _endpoint() -> str:
    from huggingface_hub import constants

    return constants.ENDPOINT


def check_filename(filename: str) -> None:
    # Names come from a remote index: refuse anything that could leave dest_dir.
    p = PurePosixPath(filename)
    if not filename or p.is_absolute() or ".." in p.parts or "\\" in filename or filename.startswith("~"):
        raise KqError(f"refusing unsafe file name from the repo index: {filename!r}")


class HubUnreachable(KqError):
    """The Hub could not be asked (offline mode, or no network) and the local cache does not answer."""


def _hub_error(err: BaseException, repo_id: str, revision: str | None, filename: str | None = None) -> KqError:
    """Map huggingface_hub / network exceptions to one line that says what to do."""
    import httpx
    from huggingface_hub import errors as E

    rev = f" at revision {revision}" if revision else ""
    what = f"{repo_id}/{filename}" if filename else repo_id
    if isinstance(err, E.GatedRepoError):
        return KqError(
            f"{repo_id} is gated: accept its terms at {_endpoint()}/{repo_id} with your account, then use a token "
            "of that account (HF_TOKEN or `hf auth login`)"
        )
    if isinstance(err, E.RepositoryNotFoundError):
        return KqError(
            f"repo {repo_id} not found on {_endpoint()} (if it is private, set HF_TOKEN or run `hf auth login` "
            "with an account that can see it)"
        )
    if isinstance(err, E.RevisionNotFoundError):
        return KqError(f"revision {revision!r} not found in {repo_id}")
    if isinstance(err, getattr(E, "RemoteEntryNotFoundError", ())) or (
        isinstance(err, E.HfHubHTTPError) and err.response is not None and err.response.status_code == 404
    ):
        return KqError(f"{repo_id} has no file {filename!r}{rev}")
    if isinstance(err, E.HfHubHTTPError) and err.response is not None:
        status = err.response.status_code
        if status == 401:
            return KqError(
                "the Hub rejected your token (HF_TOKEN or the saved `hf auth login` token): replace it, or unset "
                "HF_TOKEN for public repos"
            )
        if status == 403:
            return KqError(f"your token is not allowed to read {repo_id}: use a token with read access to it")
        return KqError(f"the Hub answered HTTP {status} for {what}{rev}; retry later")
    if isinstance(err, E.LocalEntryNotFoundError) or isinstance(err, E.OfflineModeIsEnabled):
        if _offline():
            return HubUnreachable(
                f"offline (HF_HUB_OFFLINE=1) and {what}{rev} is not in the Hugging Face cache: run once online, "
                "or unset HF_HUB_OFFLINE"
            )
        return HubUnreachable(
            f"cannot reach the Hub at {_endpoint()} to get {what}{rev} and it is not cached: check the network, "
            "or use a local folder"
        )
    if isinstance(err, (httpx.TransportError, ConnectionError, TimeoutError)):
        return HubUnreachable(f"cannot reach the Hub at {_endpoint()} ({type(err).__name__}): check the network and retry")
    raise err  # not a user-fixable condition: keep the traceback


# ---- resolve ---------------------------------------------------------------------------


def _cached_snapshot(repo_id: str, revision: str | None) -> tuple[str, Path] | None:
    """(sha, snapshot folder) of a repo revision in the local HF cache, if any."""
    from huggingface_hub import constants

    repo_dir = Path(constants.HF_HUB_CACHE) / ("models--" + repo_id.replace("/", "--"))
    rev = revision or "main"
    sha = rev if _SHA.match(rev) else None
    ref = repo_dir / "refs" / rev
    if sha is None and ref.is_file():
        sha = ref.read_text().strip()
    if sha is None or not (repo_dir / "snapshots" / sha).is_dir():
        return None
    return sha, repo_dir / "snapshots" / sha


def _resolve_from_cache(repo_id: str, revision: str | None) -> RepoInfo | None:
    found = _cached_snapshot(repo_id, revision)
    if found is None:
        return None
    sha, snap = found
    # Only what was downloaded before is listed; the pipeline checks the index for missing shards.
    files = {
        f.relative_to(snap).as_posix(): f.stat().st_size
        for f in sorted(snap.rglob("*"))
        if f.is_file()
    }
    return RepoInfo(repo_id, revision, sha, files, from_cache=True)


def resolve_repo(repo_id: str, revision: str | None = None) -> RepoInfo:
    """The commit `revision` points to and the size of every file in it."""
    import httpx
    from huggingface_hub import HfApi, errors as E

    if _offline():
        info = _resolve_from_cache(repo_id, revision)
        if info is None:
            raise _hub_error(E.OfflineModeIsEnabled(), repo_id, revision)
        return info
    try:
        mi = HfApi().model_info(repo_id, revision=revision, files_metadata=True)
    except (httpx.TransportError, ConnectionError, TimeoutError) as err:
        # Like hf_hub_download: when the Hub cannot be reached, a cached snapshot still answers.
        info = _resolve_from_cache(repo_id, revision)
        if info is None:
            raise _hub_error(err, repo_id, revision) from None
        return info
    except E.HfHubHTTPError as err:
        raise _hub_error(err, repo_id, revision) from None
    files = {s.rfilename: int(s.size) for s in (mi.siblings or []) if s.size is not None}
    return RepoInfo(repo_id, revision, mi.sha, files)


# ---- fetch -----------------------------------------------------------------------------


def fetch_file(repo_id: str, filename: str, *, revision: str | None = None, dest_dir: Path) -> Path:
    """One file of the repo on local disk: the user's cached copy if there is one, else a
    download into `dest_dir` (resumable: a partial download continues on the next call).

    Pass `revision=RepoInfo.sha` so every file comes from the same commit."""
    import httpx
    from huggingface_hub import HfApi, errors as E, hf_hub_download, try_to_load_from_cache

    check_filename(filename)
    asked = revision
    try:
        # A branch name may have moved since the cache was filled: pin it to its commit first,
        # so the cache is only trusted for the exact commit (hf_hub_download would otherwise
        # *copy* a cached shard into dest_dir).  Offline, the cache is all there is.
        if not _offline() and not (revision and _SHA.match(revision)):
            revision = HfApi().model_info(repo_id, revision=revision).sha
        cached = try_to_load_from_cache(repo_id, filename, revision=revision)
        if isinstance(cached, str) and os.path.isfile(cached):
            return Path(cached)
        if _offline():
            raise E.LocalEntryNotFoundError("not cached")
        dest_dir = Path(dest_dir)
        dest_dir.mkdir(parents=True, exist_ok=True)
        path = hf_hub_download(repo_id, filename, revision=revision, local_dir=dest_dir)
    except (httpx.TransportError, ConnectionError, TimeoutError) as err:
        # Hub unreachable: a cached copy still answers, as hf_hub_download itself would do.
        cached = try_to_load_from_cache(repo_id, filename, revision=asked)
        if isinstance(cached, str) and os.path.isfile(cached):
            return Path(cached)
        raise _hub_error(err, repo_id, asked, filename) from None
    except (E.HfHubHTTPError, E.LocalEntryNotFoundError) as err:
        raise _hub_error(err, repo_id, asked, filename) from None
    return Path(path)


def release_file(path: Path, dest_dir: Path) -> bool:
    """Delete a fetched file if (and only if) it lives in kq's staging folder `dest_dir`.

    Returns True when it was deleted; a file in the user's HF cache is left alone."""
    path, dest_dir = Path(path), Path(dest_dir)
    try:
        rel = path.resolve().relative_to(dest_dir.resolve())
    except ValueError:
        return False
    path.unlink(missing_ok=True)
    # huggingface_hub's per-file download metadata: stale once the file is gone.
    meta = dest_dir / ".cache" / "huggingface" / "download" / f"{rel.as_posix()}.metadata"
    meta.unlink(missing_ok=True)
    return True
