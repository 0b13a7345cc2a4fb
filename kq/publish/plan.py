"""What `kq publish` would send: the files, their bytes, and the commits.

The upload set is exactly the checkpoint as the manifest describes it, plus the manifest,
the card and `kq-eval.json` when present — never anything else in OUT (`.cache/` holds
huggingface_hub's resume state, `.kq-work/` a quantize run's).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from kq.errors import KqError
from kq.publish.card import CARD_NAME, EVAL_NAME, MANIFEST_NAME

# huggingface_hub's upload_large_folder commits files in batches of these sizes, growing
# after each quick commit (huggingface_hub/_upload_large_folder.py, COMMIT_SIZE_SCALE, start
# index 1).  Read from the library when it has them, so the plan follows the installed version.
_FALLBACK_SCALE = [20, 50, 75, 100, 125, 200, 250, 400, 600, 1000]


def _commit_batches(n_files: int) -> list[int]:
    try:
        from huggingface_hub._upload_large_folder import COMMIT_SIZE_SCALE as scale
    except ImportError:  # the private constant moved: fall back to 1.33's values
        scale = _FALLBACK_SCALE
    batches, idx, left = [], 1, n_files
    while left > 0:
        b = min(left, scale[idx])
        batches.append(b)
        left -= b
        idx = min(idx + 1, len(scale) - 1)
    return batches


@dataclass
class PublishPlan:
    out_dir: Path
    repo_id: str
    revision: str | None
    private: bool
    files: dict[str, int]  # path in repo -> bytes
    card_action: str  # "write" | "keep kq card" | "keep user card" | "overwrite user card"
    commit_batches: list[int] = field(default_factory=list)

    @property
    def total_bytes(self) -> int:
        return sum(self.files.values())

    def lines(self) -> list[str]:
        """The dry-run report: exactly what would be created and sent."""
        target = f"{self.repo_id}" + (f" @ branch {self.revision}" if self.revision else "")
        out = [
            f"would publish {self.out_dir} to {target} ({'private' if self.private else 'public'})",
            f"  repo:    create {self.repo_id} if it does not exist"
            + (f"; create branch {self.revision} from main if it does not exist" if self.revision else ""),
            f"  card:    README.md — {self.card_action}",
            f"  files:   {len(self.files)} files, {self.total_bytes:,} bytes",
        ]
        width = max(len(p) for p in self.files)
        out += [f"    {p:<{width}}  {n:>16,}" for p, n in self.files.items()]
        batches = self.commit_batches
        out.append(
            f"  commits: {len(batches)} (huggingface_hub's large-folder upload commits after all files are sent, "
            f"in batches of {', '.join(map(str, batches))} file(s); a resumed upload commits only what is left)"
        )
        return out


def _safe(name: str) -> bool:
    p = PurePosixPath(name)
    return bool(name) and not p.is_absolute() and ".." not in p.parts and "\\" not in name and p.parts[0] not in (".cache", ".kq-work")


def plan_publish(out_dir: Path, repo_id: str, *, revision: str | None = None, private: bool = False,
                 card_action: str = "write", card_text: str | None = None) -> PublishPlan:
    """card_text: the card that will be written before the upload (None: README.md as it is)."""
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        raise KqError(f"{out_dir}: no such folder")
    mpath = out_dir / MANIFEST_NAME
    if not mpath.is_file():
        raise KqError(f"{out_dir}: no {MANIFEST_NAME}: not a finished kq checkpoint (run or resume `kq quantize` first)")
    try:
        manifest = json.loads(mpath.read_text())
        listed = {name: int(rec["size"]) for name, rec in manifest["files"].items()}
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError, ValueError) as e:
        raise KqError(f"{mpath}: unreadable manifest ({e}); re-run `kq quantize`") from None
    bad = [n for n in listed if not _safe(n)]
    if bad:
        raise KqError(f"{mpath}: file name {bad[0]!r} points outside the checkpoint")
    files = dict(listed)
    extras = [MANIFEST_NAME, CARD_NAME] + ([EVAL_NAME] if (out_dir / EVAL_NAME).is_file() else [])
    for name in extras:
        p = out_dir / name
        if p.is_file():
            files[name] = p.stat().st_size
    if card_text is not None:
        files[CARD_NAME] = len(card_text.encode())
    return PublishPlan(out_dir, repo_id, revision, private, dict(sorted(files.items())), card_action,
                       _commit_batches(len(files)))


def check_repo_id(repo_id: str) -> None:
    parts = repo_id.split("/")
    if len(parts) != 2 or not all(parts) or any(not all(c.isalnum() or c in "-_." for c in p) for p in parts) \
            or any(p.startswith((".", "-")) or p.endswith(".") or ".." in p for p in parts) or len(parts[1]) > 96:
        raise KqError(f"{repo_id!r} is not a Hub repo id: use namespace/name (letters, digits, '-', '_', '.')")
