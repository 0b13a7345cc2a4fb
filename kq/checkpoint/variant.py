"""`kq config`: a second checkpoint folder over the same weights with another expert-activation
config (W4A16 for a decode pool, W4AFP8 for a prefill pool), without copying any tensor.

Every file the source's manifest lists is linked into the new folder except config.json, which
is rewritten (only the INT4 group's `input_activations` changes), and kq-manifest.json, which
records the new config's hash, the activations and what the folder was derived from. Not
carried over: the model card and kq-eval.json (they describe the source folder) and
kq-shards/ (its rank manifest names the checkpoint manifest it was cut from: run `kq shard`
on the new folder).

Links:
- hard (default): the new folder holds ordinary files. It survives the deletion or move of the
  source folder, and every tool (SGLang, `kq verify`, `kq publish`, huggingface_hub) sees plain
  files. Both folders must be on one filesystem (refused otherwise, with the way out).
- symlink: relative links, so the pair can be moved together, and they work across
  filesystems; deleting or moving the source folder alone breaks the new one (`kq verify`
  says which files are missing).
Neither kind lets a write through one folder leave the other intact, and kq never writes into
a finished folder's tensors (new files are written beside and renamed), so this is safe.

The folder is assembled under a hidden sibling and renamed into place last: a run that dies
leaves no half folder under the requested name.
"""
from __future__ import annotations

import errno
import json
import os
import shutil
from pathlib import Path

from kq.checkpoint.ct_config import ACTIVATIONS, experts_fp8_activations, with_activations
from kq.checkpoint.manifest import MANIFEST_NAME, read_manifest, sha256_file, write_json_atomic
from kq.errors import KqError

LINKS = ("hard", "symlink")


def current_activations(config: dict) -> str:
    return "fp8" if experts_fp8_activations(config.get("quantization_config")) else "none"


def derive_variant(src: Path, dst: Path, *, activations: str, link: str = "hard") -> dict:
    """Write DST: SRC's tensors (linked) with the experts' input activations set to ACTIVATIONS.
    Returns a summary. SRC is only read."""
    from kq.checkpoint.verify import verify_checkpoint

    src, dst = Path(src), Path(dst)
    if activations not in ACTIVATIONS:
        raise KqError(f"--activations {activations}: use none (W4A16) or fp8 (W4AFP8)")
    if link not in LINKS:
        raise KqError(f"--link {link}: use hard or symlink")
    if not src.is_dir():
        raise KqError(f"{src}: no such folder")
    man = read_manifest(src)
    if man is None or not isinstance(man.get("files"), dict):
        raise KqError(f"{src}: no readable {MANIFEST_NAME}: not a finished kq checkpoint (run or resume `kq quantize` first)")
    _check_out(src, dst)
    problems = verify_checkpoint(src, hashes=False)
    if problems:
        raise KqError(f"{src} fails `kq verify --fast` ({len(problems)} problem(s), first: {problems[0]}); "
                      "not deriving a folder from it")
    config = json.loads((src / "config.json").read_text())
    was = current_activations(config)
    if was == activations:
        raise KqError(f"{src} already asks for --activations {activations}; nothing to derive")
    config["quantization_config"] = with_activations(config["quantization_config"], activations)

    tmp = dst.with_name(f".{dst.name}.kq-config-tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        for name in man["files"]:
            if name != "config.json":
                _link(src / name, tmp / name, dst / name, link)
        write_json_atomic(tmp / "config.json", config)
        files = dict(man["files"])
        files["config.json"] = {"sha256": sha256_file(tmp / "config.json"), "size": (tmp / "config.json").stat().st_size}
        new = dict(man)
        new["files"] = dict(sorted(files.items()))
        new["options"] = {**man.get("options", {}), "activations": activations}
        # Never "this same run" for `kq quantize --out DST`: it refuses the folder instead of skipping it.
        new["run"] = {"fingerprint": None}
        new["derived"] = {"by": "kq config", "from": str(src.resolve()), "from_activations": was,
                          "from_manifest_sha256": sha256_file(src / MANIFEST_NAME), "links": link,
                          "changed": ["config.json"]}
        write_json_atomic(tmp / MANIFEST_NAME, new)
        if dst.exists():
            dst.rmdir()  # empty, checked above
        os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    linked = [n for n in man["files"] if n != "config.json"]
    return {"out": str(dst), "from": str(src), "activations": activations, "was": was, "links": link,
            "linked_files": len(linked), "linked_bytes": sum(man["files"][n]["size"] for n in linked)}


def _check_out(src: Path, dst: Path) -> None:
    s, d = src.resolve(), dst.resolve()
    if d == s or s in d.parents:
        raise KqError(f"--out {dst} is {src} or inside it: choose a folder outside the source checkpoint")
    if dst.exists() and (not dst.is_dir() or any(dst.iterdir())):
        raise KqError(f"--out {dst} exists and is not an empty folder; choose a new or empty one")


def _link(target: Path, at: Path, final: Path, kind: str) -> None:
    """Link AT to the real file behind TARGET (a link of a derived folder points at the
    original file, not at another link); FINAL is where AT will live once renamed."""
    real = target.resolve()
    at.parent.mkdir(parents=True, exist_ok=True)
    if kind == "symlink":
        # Relative to where the link will finally sit (AT's folder is FINAL's sibling's, same depth).
        os.symlink(os.path.relpath(real, os.path.abspath(final.parent)), at)
        return
    try:
        os.link(real, at)
    except OSError as e:
        if e.errno in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
            raise KqError(f"cannot hard-link {real} into {final.parent} ({os.strerror(e.errno)}): put --out on "
                          "the same filesystem as the source, or pass --link symlink") from None
        raise
