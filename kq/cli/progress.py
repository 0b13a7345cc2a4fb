"""Rich progress for long runs: overall and per-shard bars with bytes/s and ETA, on stderr."""
from __future__ import annotations

from rich.console import Console
from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                           TransferSpeedColumn)

stderr = Console(stderr=True)


class ShardProgress:
    """Implements kq.quantize.run.Progress with two rich bars."""

    def __init__(self, total_bytes: int, n_shards: int, enabled: bool = True):
        self.p = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                          TransferSpeedColumn(), TimeRemainingColumn(), console=stderr,
                          disable=not enabled, transient=False)
        self.total = self.p.add_task(f"all {n_shards} shards", total=total_bytes)
        self.shards: dict[str, int] = {}

    def __enter__(self):
        self.p.__enter__()
        return self

    def __exit__(self, *a):
        self.p.__exit__(*a)

    def start_shard(self, name: str, total_bytes: int) -> None:
        self.shards[name] = self.p.add_task(f"  {name}", total=total_bytes)

    def advance(self, shard: str, nbytes: int) -> None:
        self.p.advance(self.total, nbytes)
        if shard in self.shards:
            self.p.advance(self.shards[shard], nbytes)

    def end_shard(self, name: str, skipped: bool) -> None:
        task = self.shards.pop(name, None)
        if task is not None:
            self.p.remove_task(task)
        if skipped:
            self.p.console.print(f"  {name}: already written, skipped (resume)")
