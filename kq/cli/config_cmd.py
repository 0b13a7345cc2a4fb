"""`kq config`: argument handling only; the work is in kq.checkpoint.variant."""
from __future__ import annotations

import json
from pathlib import Path

import typer

from kq.cli.common import human_bytes
from kq.cli.progress import stderr


def config(
    folder: Path = typer.Argument(..., help="A finished kq checkpoint folder (written by kq quantize); only read."),
    activations: str = typer.Option(..., "--activations", help="The new folder's expert input activations: "
                                    "none (W4A16, for decode pools) or fp8 (W4AFP8: dynamic FP8 activations on "
                                    "the INT4 experts, for prefill pools; group 128 only)."),
    out: Path = typer.Option(..., "--out", "-o", help="The new folder (new or empty)."),
    link: str = typer.Option("hard", "--link", help="hard (default: plain files that survive deleting FOLDER; "
                             "same filesystem only) or symlink (relative links: works across filesystems, "
                             "breaks if FOLDER is deleted or moved alone)."),
    as_json: bool = typer.Option(False, "--json", help="Print a machine-readable summary on stdout."),
) -> None:
    """Make a second folder over the same weights with another expert-activation config: every
    tensor file is linked (no copy), config.json differs only in the INT4 group's
    input_activations, and its kq-manifest.json lets `kq verify` pass and records what it is.

    Examples:\n
      kq config ./GLM-5.2-INT4 --activations fp8 --out ./GLM-5.2-W4AFP8     # prefill pool\n
      kq config ./GLM-5.2-W4AFP8 --activations none --out ./GLM-5.2-INT4    # decode pool
    """
    from kq.checkpoint.variant import derive_variant

    with stderr.status(f"checking {folder} and linking its files into {out} …"):
        summary = derive_variant(folder, out, activations=activations, link=link)
    if as_json:
        typer.echo(json.dumps(summary))
    else:
        stderr.print(f"done: {out} ({summary['linked_files']} files {'hard-linked' if link == 'hard' else 'symlinked'}, "
                     f"{human_bytes(summary['linked_bytes'])}, nothing copied; activations {summary['was']} -> "
                     f"{activations}); check it with `kq verify {out}`")
