"""Run a command and sample the peak anonymous memory of its whole process tree.

Anonymous RSS (`RssAnon` in /proc/PID/status) is memory the process owns: heap, torch
tensors in host memory, CUDA's host-side context. It leaves out file-backed pages, so
an mmap'd safetensors shard that the kernel maps in (and can drop at any time) does not
count, which is what "bounded by one shard" is about. The parent samples every
`interval` seconds and sums over the process and all its descendants (a tool may fork
workers); a peak shorter than one interval can be missed.
"""
from __future__ import annotations

import os
import resource
import signal
import subprocess
import threading
import time


def _children() -> dict[int, list[int]]:
    """ppid -> [pid] for every process now alive (no /proc/PID/task/*/children here)."""
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                stat = f.read()
        except OSError:  # exited between listdir and open
            continue
        # the command name sits in parentheses and may hold spaces: split after the last ')'
        ppid = int(stat[stat.rindex(b")") + 2:].split()[1])
        tree.setdefault(ppid, []).append(int(entry))
    return tree


def _rss_anon(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            for line in f:
                if line.startswith(b"RssAnon:"):
                    return int(line.split()[1]) * 1024  # kB
    except OSError:
        pass
    return 0


def tree_rss_anon(root: int) -> int:
    tree, total, todo = _children(), 0, [root]
    while todo:
        pid = todo.pop()
        total += _rss_anon(pid)
        todo.extend(tree.get(pid, ()))
    return total


def run_watched(cmd: list[str], *, env: dict | None = None, stdout=None, stderr=None,
                interval: float = 0.02, timeout: float | None = None) -> dict:
    """-> {"rc", "wall_s", "cpu_s", "peak_rss_anon_bytes", "samples", "timed_out"}; wall time from spawn
    to exit. Past `timeout` seconds the whole process group is killed (rc -9)."""
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    # own process group, so a timeout kills the tool's workers too
    proc = subprocess.Popen(cmd, env=env, stdout=stdout, stderr=stderr, start_new_session=True)
    peak, samples, done = 0, 0, threading.Event()

    def sample() -> None:
        nonlocal peak, samples
        while not done.is_set():
            peak = max(peak, tree_rss_anon(proc.pid))
            samples += 1
            done.wait(interval)

    th = threading.Thread(target=sample, daemon=True)
    th.start()
    timed_out = False
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        timed_out = True
        os.killpg(proc.pid, signal.SIGKILL)
        rc = proc.wait()
    wall = time.perf_counter() - t0
    done.set()
    th.join()
    # CPU seconds of the tree (reaped descendants included): on a machine shared with other
    # work, this moves less than wall time does.
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (ru1.ru_utime - ru0.ru_utime) + (ru1.ru_stime - ru0.ru_stime)
    return {"rc": rc, "wall_s": wall, "peak_rss_anon_bytes": peak, "samples": samples,
            "timed_out": timed_out, "cpu_s": cpu}
