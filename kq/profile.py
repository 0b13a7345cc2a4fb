"""KQ_PROFILE=1: where a quantize run's wall time goes, per stage, summed over threads.

The run is host-bound (reads, copies, writes, hashing), so the stages are the I/O ones plus the
GPU's; `kq quantize --json` carries the summary under "profile" and stderr gets one line.
"""
from __future__ import annotations

import os
import threading
import time


class Profile:
    """Wall time per stage, summed over the threads that ran it (so a stage can add up to
    more than the run's wall time), with call counts and bytes. Off unless KQ_PROFILE is
    set (`reset` reads it); off, `add` returns at once. Use:
        t = time.perf_counter(); ...; PROFILE.add("write", t, nbytes)
    Each thread adds to its own table (no lock on the hot path); `summary` merges them."""

    ORDER = ("gpu_first_call", "read", "h2d", "kernel", "d2h", "quant_cpu", "write", "writeback", "sha256",
             "fsync", "wait:expert", "wait:write", "wait:hash")

    def __init__(self) -> None:
        self.on = False
        self._lock = threading.Lock()
        self._local = threading.local()
        self._tables: list[dict] = []
        self.t0 = time.perf_counter()

    def reset(self, on: bool | None = None) -> None:
        self.on = os.environ.get("KQ_PROFILE", "") not in ("", "0") if on is None else on
        with self._lock:
            self._tables = []
            self._local = threading.local()
        self.t0 = time.perf_counter()

    def add(self, stage: str, t0: float, nbytes: int = 0) -> None:
        if not self.on:
            return
        dt = time.perf_counter() - t0
        tab = getattr(self._local, "tab", None)
        if tab is None:
            tab = self._local.tab = {}
            with self._lock:
                self._tables.append(tab)
        rec = tab.get(stage)
        if rec is None:
            rec = tab[stage] = [0.0, 0, 0]
        rec[0] += dt
        rec[1] += 1
        rec[2] += nbytes

    def summary(self) -> dict:
        """{"wall_s": .., "threads": .., "stages": {stage: {"s", "calls", "gb", "gbps"}}} (gbps per thread-second)."""
        merged: dict[str, list] = {}
        with self._lock:
            tables = list(self._tables)
        for tab in tables:
            for k, (sec, n, b) in list(tab.items()):
                m = merged.setdefault(k, [0.0, 0, 0])
                m[0] += sec
                m[1] += n
                m[2] += b
        keys = [k for k in self.ORDER if k in merged] + sorted(k for k in merged if k not in self.ORDER)
        stages = {k: {"s": round(merged[k][0], 3), "calls": merged[k][1], "gb": round(merged[k][2] / 1e9, 3),
                      **({"gbps": round(merged[k][2] / merged[k][0] / 1e9, 2)} if merged[k][2] and merged[k][0] else {})}
                  for k in keys}
        return {"wall_s": round(time.perf_counter() - self.t0, 3), "threads": len(tables), "stages": stages}

    @staticmethod
    def line(summary: dict) -> str:
        parts = []
        for k, v in summary["stages"].items():
            p = f"{k} {v['s']:.2f}s"
            if v["gb"]:
                p += f" {v['gb']:.2f}GB"
                if "gbps" in v:
                    p += f" ({v['gbps']:.2f} GB/s/thread)"
            parts.append(p)
        return (f"kq profile: wall {summary['wall_s']:.2f}s, {summary['threads']} threads; thread-seconds per stage: "
                + " | ".join(parts))


PROFILE = Profile()
