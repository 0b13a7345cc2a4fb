"""`kq shard`: argument handling only; the work (and the format) is in kq.sglang.rank_shards."""
from __future__ import annotations

import json
import time
from pathlib import Path

import typer

from kq.cli.common import human_bytes, require
from kq.cli.progress import stderr


def shard(
    folder: Path = typer.Argument(..., help="A finished kq checkpoint folder (written by kq quantize)."),
    tp: int = typer.Option(..., "--tp", help="Tensor-parallel degree SGLang will run at (--tp)."),
    ep: int = typer.Option(1, "--ep", help="Expert-parallel degree (SGLang's --ep-size); must divide --tp."),
    as_json: bool = typer.Option(False, "--json", help="Print a machine-readable summary on stdout."),
) -> None:
    """Write per-rank files of the routed experts (each rank's slice, in the checkpoint's layout) under
    FOLDER/kq-shards/tp{TP}-ep{EP}/. With kq's SGLang plugin installed, each rank then reads only
    its own expert bytes.

    Example:\n
      kq shard ./GLM-5.2-INT4 --tp 8
    """
    from kq.sglang.rank_shards import write_rank_shards

    require(folder.is_dir(), f"{folder}: no such folder")
    require(tp >= 1 and ep >= 1, "--tp and --ep must be at least 1")
    t0 = time.perf_counter()
    with stderr.status(f"cutting {folder} into {tp} ranks (EP {ep}) …"):
        out = write_rank_shards(folder, tp, ep)
    manifest = json.loads((out / "manifest.json").read_text())
    size = sum(f["size"] for f in manifest["files"].values())
    summary = {"out": str(out), "tp": tp, "ep": ep, "files": len(manifest["files"]), "bytes": size,
               "seconds": round(time.perf_counter() - t0, 3)}
    if as_json:
        typer.echo(json.dumps(summary))
    else:
        stderr.print(f"done: {out} ({summary['files']} rank files, {human_bytes(size)}) in {summary['seconds']} s")
