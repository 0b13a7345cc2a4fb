"""`kq publish`: argument handling only; the work is in kq.publish."""
from __future__ import annotations

from pathlib import Path

import typer


def publish(
    out: Path = typer.Argument(..., help="A finished kq output folder (has kq-manifest.json)."),
    repo_id: str = typer.Argument(..., help="Hub repo to publish to, namespace/name."),
    private: bool = typer.Option(False, "--private", help="Create the repo private (an existing repo keeps its visibility)."),
    revision: str | None = typer.Option(None, "--revision", help="Publish to this branch (created from main if absent)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Verify, then print the files, bytes, commits and card; send nothing."),
    overwrite_card: bool = typer.Option(False, "--overwrite-card", help="Replace a README.md that kq did not write."),
    workers: int | None = typer.Option(None, "--workers", min=1, help="Parallel upload workers (default: huggingface_hub's)."),
) -> None:
    """Verify OUT, write its model card, upload it resumably to the Hub, then check the remote copy
    against the manifest. Uses HF_TOKEN or the `hf auth login` token; an interrupted upload resumes
    when the same command is run again."""
    from kq.publish import publish as run

    typer.echo(f"verifying {out} (re-hashing every file against the manifest) …", err=True)
    run(out, repo_id, revision=revision, private=private, dry_run=dry_run,
        overwrite_card=overwrite_card, num_workers=workers, echo=typer.echo)
