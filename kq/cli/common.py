"""Helpers shared by the CLI commands: opening a source the way the user named it."""
from __future__ import annotations

import os
from pathlib import Path

from kq.checkpoint.source import Source, open_source
from kq.errors import KqError

DEMO = "demo"


def demo_source_dir() -> Path:
    """The embedded default: a tiny synthetic GLM-5.2-layout FP8 checkpoint, generated
    once (deterministically) into kq's cache folder."""
    base = Path(os.environ.get("KQ_CACHE", Path.home() / ".cache" / "kq"))
    d = base / "demo-glm5-fp8"
    if not (d / "model.safetensors.index.json").exists():
        from kq.synth import generate
        d.parent.mkdir(parents=True, exist_ok=True)
        tmp = d.with_name(d.name + ".tmp")
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
        generate("glm5", tmp, seed=0)
        shutil.rmtree(d, ignore_errors=True)
        tmp.rename(d)
    return d


def open_any(spec: str, *, staging: Path | None = None, stream: bool = False,
             revision: str | None = None) -> Source:
    if spec == DEMO:
        return open_source(str(demo_source_dir()))
    return open_source(spec, staging=staging, stream=stream, revision=revision)


def checkpoint_folder(spec: str, *, revision: str | None = None) -> Path:
    """A local checkpoint folder for SPEC: the folder itself, or, for a recipe alias or Hub repo id,
    the downloaded checkpoint (kq's Hub cache, or the user's HF cache where it holds a shard)."""
    return open_any(spec, revision=revision).local_folder()


def default_out(spec: str) -> Path:
    name = Path(spec.rstrip("/")).name or "model"
    for suffix in ("-FP8", "-fp8"):
        name = name.removesuffix(suffix)
    return Path(f"{name}-kq-int4")


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    raise AssertionError


def require(cond: bool, msg: str) -> None:
    if not cond:
        raise KqError(msg)
