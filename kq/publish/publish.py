"""`kq publish`: verify, write the card, upload resumably, then check what landed.

Order matters: nothing touches the network before the checkpoint passes `kq verify`
(a broken checkpoint must never reach the Hub), and the upload is only declared done
after the remote file list and sizes match the manifest.

The upload is huggingface_hub's `upload_large_folder`: it keeps per-file progress under
`OUT/.cache/huggingface/` (hashed / uploaded / committed), so re-running the same command
after a crash or Ctrl-C sends only what is missing.  kq adds `OUT/.cache/kq-publish.json`
(the target repo and branch) so that a resumed run is not mistaken for a name collision.
`.cache/` is never uploaded: only the manifest's files, the manifest, the card and
`kq-eval.json` are (see plan.py).

The token is huggingface_hub's (HF_TOKEN or `hf auth login`); kq never reads it into a
message, a log or a file.
"""

from __future__ import annotations

import glob
import json
import shutil
import sys
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from kq.errors import KqError
from kq.format import write_json_atomic
from kq.publish.card import CARD_NAME, MANIFEST_NAME, card_status, render_card, write_card
from kq.publish.plan import PublishPlan, check_repo_id, plan_publish

STATE_NAME = "kq-publish.json"


@dataclass
class PublishResult:
    repo_id: str
    revision: str | None
    url: str
    commit: str
    files: int
    bytes: int
    extra_remote: list[str]


def verify_or_refuse(out_dir: Path) -> None:
    """Run `kq verify`'s checks; refuse to go on if any fails."""
    try:
        from kq.checkpoint.verify import verify_checkpoint
    except ImportError:
        raise KqError("kq verify is not available in this kq build: refusing to publish an unverified checkpoint") from None
    problems = list(verify_checkpoint(Path(out_dir)))
    if problems:
        raise KqError(
            f"{out_dir} fails verification ({len(problems)} problem(s), first: {problems[0]}); "
            f"run `kq verify {out_dir}` for the list — not publishing"
        )


def _card_plan(out_dir: Path, repo_id: str, revision: str | None, overwrite_card: bool) -> tuple[str, str | None]:
    """(what happens to README.md, the text that will be written or None)."""
    status = card_status(out_dir)
    if status == "user" and not overwrite_card:
        return "keep user card (pass --overwrite-card to replace it)", None
    text = render_card(out_dir, repo_id, revision)
    if status != "absent" and (out_dir / CARD_NAME).read_text() == text:
        return "keep kq card (up to date)", None
    action = {"absent": "write kq card", "kq": "rewrite kq card", "user": "overwrite user card"}[status]
    return action, text


def prepare(out_dir: Path, repo_id: str, *, revision: str | None = None, private: bool = False,
            overwrite_card: bool = False) -> tuple[PublishPlan, str | None]:
    """Checks that need no network, in order; returns the plan and the card text to write."""
    check_repo_id(repo_id)
    out_dir = Path(out_dir)
    plan_publish(out_dir, repo_id, revision=revision, private=private)  # folder + manifest readable
    verify_or_refuse(out_dir)
    action, text = _card_plan(out_dir, repo_id, revision, overwrite_card)
    return plan_publish(out_dir, repo_id, revision=revision, private=private, card_action=action,
                        card_text=text), text


# ---- network ---------------------------------------------------------------------------


def _http_status(err: BaseException) -> int | None:
    resp = getattr(err, "response", None)
    return getattr(resp, "status_code", None)


def _auth(api) -> str:
    from huggingface_hub import get_token
    from huggingface_hub.errors import HfHubHTTPError

    if not get_token():
        raise KqError("no Hugging Face token: set HF_TOKEN or run `hf auth login` with a write token")
    try:
        return api.whoami()["name"]
    except HfHubHTTPError as err:
        if _http_status(err) == 401:
            raise KqError("the Hub rejected your token (HF_TOKEN or the saved `hf auth login` token): "
                          "create a new write token and retry") from None
        raise KqError(f"the Hub answered HTTP {_http_status(err)} to the token check; retry later") from None


def _read_state(out_dir: Path) -> dict:
    try:
        return json.loads((out_dir / ".cache" / STATE_NAME).read_text())
    except (FileNotFoundError, json.JSONDecodeError, UnicodeDecodeError):
        return {}


def _write_state(out_dir: Path, state: dict) -> None:
    d = out_dir / ".cache"
    d.mkdir(exist_ok=True)
    write_json_atomic(d / STATE_NAME, state, tmp_name=f".{STATE_NAME}.tmp")


def _same_manifest_remote(api, repo_id: str, revision: str | None, out_dir: Path) -> bool:
    """Does the existing repo already hold this very checkpoint (by its manifest's git oid)?"""
    from huggingface_hub.errors import HfHubHTTPError
    from huggingface_hub.utils.sha import git_hash

    try:
        info = api.get_paths_info(repo_id, [MANIFEST_NAME], revision=revision)
    except HfHubHTTPError:
        return False
    local = git_hash((out_dir / MANIFEST_NAME).read_bytes())
    return any(getattr(f, "blob_id", None) == local for f in info)


def _is_empty_repo(api, repo_id: str) -> bool:
    """A repo holding nothing but the Hub's initial .gitattributes (e.g. created by a run killed
    right after creating it)."""
    from huggingface_hub.errors import HfHubHTTPError

    try:
        return set(api.list_repo_files(repo_id)) <= {".gitattributes"}
    except HfHubHTTPError:
        return False


def _ensure_repo(api, plan: PublishPlan, user: str) -> bool:
    """Create the repo (and branch); refuse a name that belongs to something else. Returns created."""
    from huggingface_hub.errors import HfHubHTTPError

    repo_id, revision, out_dir = plan.repo_id, plan.revision, plan.out_dir
    try:
        api.create_repo(repo_id, repo_type="model", private=plan.private, exist_ok=False)
        created = True
    except HfHubHTTPError as err:
        status = _http_status(err)
        if status == 403 or (status == 401 and repo_id.split("/")[0] != user):
            raise KqError(f"user {user} cannot write to namespace {repo_id.split('/')[0]}: "
                          "use your own namespace or an org you can write to") from None
        if status != 409:
            raise KqError(f"the Hub refused to create {repo_id} (HTTP {status}); retry later") from None
        created = False
        state = _read_state(out_dir)
        resuming = state.get("repo_id") == repo_id and state.get("revision") == revision
        if not (resuming or revision or _is_empty_repo(api, repo_id)
                or _same_manifest_remote(api, repo_id, revision, out_dir)):
            raise KqError(
                f"{repo_id} already exists on the Hub and holds something else: choose another name, "
                f"or pass --revision BRANCH to publish to a branch of it"
            )
    if revision:
        try:
            api.create_branch(repo_id, branch=revision, repo_type="model", exist_ok=True)
        except HfHubHTTPError as err:
            status = _http_status(err)
            why = "your token cannot write to it" if status in (401, 403) else f"HTTP {status}"
            raise KqError(f"cannot create branch {revision!r} in {repo_id}: {why}") from None
    return created


def _upload(api, plan: PublishPlan, num_workers: int | None) -> None:
    allow = [glob.escape(p) for p in plan.files]  # exactly these files, nothing else from OUT
    try:
        with warnings.catch_warnings():
            # 1.33 deprecates it for upload_folder's Xet pipeline; it still is the one whose
            # resume state lives in OUT/.cache and that also works over plain LFS.
            warnings.simplefilter("ignore", FutureWarning)
            api.upload_large_folder(
                repo_id=plan.repo_id, folder_path=plan.out_dir, repo_type="model", revision=plan.revision,
                private=plan.private, allow_patterns=allow, num_workers=num_workers,
                print_report=sys.stdout.isatty(),
            )
    except KeyboardInterrupt:
        raise KqError("upload interrupted: run the same command again to resume (files already sent are not resent)") from None
    except Exception as err:  # noqa: BLE001 — any failure here is resumable; say so in one line
        status = _http_status(err) or _http_status(getattr(err, "__cause__", None))
        if status in (401, 403):  # not transient: retrying will not help
            raise KqError(f"the Hub refused the upload (HTTP {status}): your token cannot write to {plan.repo_id}") from None
        why = f"HTTP {status}" if status else type(getattr(err, "__cause__", None) or err).__name__
        raise KqError(f"upload stopped ({why}): run the same command again to resume "
                      "(files already sent are not resent)") from None


def _check_remote(api, plan: PublishPlan) -> list[str]:
    """Compare the remote file list + sizes (+ LFS sha256) with what was meant to be sent."""
    from huggingface_hub.hf_api import RepoFile

    manifest = json.loads((plan.out_dir / MANIFEST_NAME).read_text())
    shas = {n: r.get("sha256") for n, r in manifest["files"].items()}
    remote = {f.path: f for f in api.list_repo_tree(plan.repo_id, revision=plan.revision, recursive=True)
              if isinstance(f, RepoFile)}
    missing = [p for p in plan.files if p not in remote]
    wrong = [p for p, n in plan.files.items() if p in remote and remote[p].size != n]
    wrong += [p for p, f in remote.items() if p in shas and f.lfs is not None and f.lfs.sha256 != shas[p]]
    if missing or wrong:
        bad = (f"{len(missing)} missing (e.g. {missing[0]})" if missing else "") + \
              (", " if missing and wrong else "") + (f"{len(wrong)} differ (e.g. {wrong[0]})" if wrong else "")
        raise KqError(f"the Hub copy of {plan.repo_id} does not match the manifest: {bad}; "
                      "run the same command again to resume")
    return sorted(p for p in remote if p not in plan.files and p != ".gitattributes")


def publish(out_dir: Path, repo_id: str, *, revision: str | None = None, private: bool = False,
            dry_run: bool = False, overwrite_card: bool = False, num_workers: int | None = None,
            echo: Callable[[str], None] = print) -> PublishResult | PublishPlan:
    out_dir = Path(out_dir)
    plan, card_text = prepare(out_dir, repo_id, revision=revision, private=private, overwrite_card=overwrite_card)
    if dry_run:
        for line in plan.lines():
            echo(line)
        echo("")
        echo("README.md:" if card_text is not None else "README.md (as it is now):")
        echo(card_text if card_text is not None else (out_dir / CARD_NAME).read_text())
        return plan

    from huggingface_hub import HfApi, constants
    from huggingface_hub.errors import HfHubHTTPError

    if constants.is_offline_mode():
        raise KqError("HF_HUB_OFFLINE is set: publishing needs the Hub; unset it (a --dry-run works offline)")
    import httpx

    api = HfApi()
    try:
        return _publish_online(api, plan, card_text, out_dir, repo_id, revision, private, overwrite_card,
                               num_workers, echo)
    except (httpx.TransportError, ConnectionError, TimeoutError) as err:
        raise KqError(f"cannot reach the Hub at {api.endpoint} ({type(err).__name__}): check the network; "
                      "run the same command again to resume") from None
    except HfHubHTTPError as err:  # anything the steps above did not already explain
        raise KqError(f"the Hub answered HTTP {_http_status(err)} while publishing {repo_id}; "
                      "run the same command again to resume") from None


def _publish_online(api, plan: PublishPlan, card_text: str | None, out_dir: Path, repo_id: str,
                    revision: str | None, private: bool, overwrite_card: bool, num_workers: int | None,
                    echo: Callable[[str], None]) -> PublishResult:
    user = _auth(api)
    if card_text is not None:
        write_card(out_dir, repo_id, revision=revision, overwrite=overwrite_card)
        echo(f"card: {plan.card_action} -> {out_dir / CARD_NAME}")
    created = _ensure_repo(api, plan, user)
    echo(f"repo: {'created' if created else 'using existing'} {repo_id}" + (f" @ {revision}" if revision else ""))
    if private and not created:
        echo("note: --private only applies to a new repo; the existing repo keeps its visibility")
    target = {"repo_id": repo_id, "revision": revision}
    if _read_state(out_dir) != target:
        # huggingface_hub's per-file upload state does not record the target repo: state left by
        # an upload to another repo/branch would make it skip files this target never got.
        shutil.rmtree(out_dir / ".cache" / "huggingface" / "upload", ignore_errors=True)
    _write_state(out_dir, target)
    echo(f"uploading {len(plan.files)} files, {plan.total_bytes:,} bytes")
    _upload(api, plan, num_workers)
    extra = _check_remote(api, plan)
    commit = api.model_info(repo_id, revision=revision).sha
    url = f"{api.endpoint}/{repo_id}" + (f"/tree/{revision}" if revision else "")
    echo(f"published: {url} (commit {commit}); remote files and sizes match the manifest")
    if extra:
        echo(f"note: the repo also holds {len(extra)} file(s) not in this checkpoint, e.g. {extra[0]}")
    return PublishResult(repo_id, revision, url, commit, len(plan.files), plan.total_bytes, extra)
