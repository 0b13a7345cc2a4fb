"""`kq verify`: argument handling only; the checks are in kq.checkpoint.verify."""
from __future__ import annotations

import json
from pathlib import Path

import typer

from kq.cli.progress import stderr
from kq.errors import KqError


def verify(
    folder: Path = typer.Argument(..., help="A kq output folder."),
    fast: bool = typer.Option(False, "--fast", help="Skip re-hashing (sizes, shapes, scales and config are still checked)."),
    as_json: bool = typer.Option(False, "--json", help="Print {\"ok\": bool, \"problems\": [...]} on stdout."),
) -> None:
    """Re-hash every file against kq-manifest.json and check every tensor's presence, shape and dtype,
    that scales are finite and non-zero, and that config.json matches the tensors."""
    from kq.checkpoint.verify import verify_checkpoint

    with stderr.status(f"verifying {folder} …"):
        problems = verify_checkpoint(folder, hashes=not fast)
    if as_json:
        typer.echo(json.dumps({"ok": not problems, "problems": problems}))
    else:
        for p in problems:
            stderr.print(f"[red]✗[/] {p}")
        if not problems:
            stderr.print(f"[green]✓[/] {folder}: every file matches its manifest hash; tensors, scales and config are consistent")
    if problems:
        raise KqError(f"{folder}: {len(problems)} problem(s) found") if not as_json else typer.Exit(1)
