"""`kq card`: argument handling only; the card is built in kq.publish.card."""
from __future__ import annotations

from pathlib import Path

import typer


def card(
    out: Path = typer.Argument(..., help="A finished kq output folder (has kq-manifest.json)."),
    repo_id: str | None = typer.Option(None, "--repo-id", help="Hub repo the card will live in (used in the launch line)."),
    revision: str | None = typer.Option(None, "--revision", help="Hub branch it will live on (added to the launch line)."),
    overwrite_card: bool = typer.Option(False, "--overwrite-card", help="Replace a README.md that kq did not write."),
    show: bool = typer.Option(False, "--print", help="Print the card to stdout instead of writing README.md."),
) -> None:
    """Write OUT/README.md, a model card built only from the run's own records (manifest, config,
    kq-eval.json). A README.md you wrote or edited is kept unless --overwrite-card is given."""
    from kq.publish.card import render_card, write_card

    if show:
        typer.echo(render_card(out, repo_id, revision), nl=False)
        return
    path, written = write_card(out, repo_id, revision=revision, overwrite=overwrite_card)
    if written:
        typer.echo(f"wrote {path}")
    else:
        typer.echo(f"kept {path} (up to date, or not written by kq: pass --overwrite-card to replace it)")
