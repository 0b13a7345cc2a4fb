"""The quantize run: plan in, finished checkpoint folder out, shard by shard.

Order of work, and why:
1. `check_output` refuses a folder holding anything but this same run (before the
   long part), and `check_disk` refuses a disk that cannot hold the output.
2. A calibrated method (GPTQ, AWQ) runs its layer-wise pass as a step of its own
   (CalibratedStep.run, resumable layer by layer), once, before any shard job: the shard
   jobs then only look codes up.
3. Each output shard is written tensor by tensor to `<shard>.tmp` and renamed, then
   recorded in `.kq-work/state.json`. Killed anywhere, a rerun skips recorded shards
   and redoes the rest; the output is deterministic, so it ends byte-identical.
4. Index, config.json, the copied non-weight files, then `kq-manifest.json` last.
Memory: a few expert tensors per shard job (float32 on the device on the CPU path) plus
I/O chunks; kept tensors are copied from an mmap of their source file range.
Profiling: KQ_PROFILE=1 sums wall time per stage over threads (read, h2d, kernel, d2h,
write, sha256, fsync, waits) and prints one line to stderr; the summary gets "profile".
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol

import torch

from kq import __version__
from kq.checkpoint.manifest import MANIFEST_NAME, WORK_DIR, read_manifest, write_json_atomic
from kq.checkpoint.safetensors_io import TORCH_DTYPE, StreamingShardWriter, read_header
from kq.profile import PROFILE, Profile
from kq.checkpoint.source import Source
from kq.errors import KqError
from kq.quantize import distributed
from kq.quantize.experts import rtn_parts
from kq.quantize.plan import FP8, Plan, check_group

from kq.format import INDEX_NAME  # noqa: E402
PREFETCH = 4  # expert tensors read ahead of the quantizer (and written behind it)
READERS = 2   # threads per shard job reading expert tensors (quantized on the job's own thread)
# GPU with kq's RTN: threads per shard job that each read *and* quantize an expert tensor (on a
# CUDA stream of their own), so one shard's pipeline is not held to one thread's H2D/sync/D2H.
# 2, not 4: with 5 shard jobs at once more threads mostly queue for the GIL (H200, full-size
# GLM-5.2 layer, one call: 2 threads 2.53 / 2.42 GB/s, 4 threads 1.86 / 2.21, 8 threads 2.34 / 2.08;
# BENCHMARKS.md run 14). KQ_GPU_WORKERS overrides it.
GPU_WORKERS = 2


def _env_number(name: str, default, kind=int):
    """A tuning knob from the environment (benchmarks/rtn.py A/Bs them); a bad value is refused."""
    raw = os.environ.get(name, "")
    if not raw:
        return default
    try:
        value = kind(raw)
    except ValueError:
        raise KqError(f"{name}={raw!r} is not a number") from None
    if value <= 0:
        raise KqError(f"{name}={raw!r} must be positive")
    return value


class Progress(Protocol):
    def start_shard(self, name: str, total_bytes: int) -> None: ...
    def advance(self, shard: str, nbytes: int) -> None: ...
    def end_shard(self, name: str, skipped: bool) -> None: ...


METHODS = ("rtn", "gptq", "awq", "awq+gptq")


@dataclass(frozen=True)
class Options:
    """Every option of a quantize run, validated here and only here (`kq quantize` parses its flags into
    one; `dataclasses.replace` validates again). What the manifest records of them: `finish`; what makes
    a folder 'this same run': `fingerprint`."""
    method: str = "rtn"          # rtn | gptq | awq | awq+gptq
    group_size: int | None = 128  # None: the family's default, until the plan sets it (replace)
    clip: str = "mse"            # mse | absmax (RTN)
    stream: bool = False
    activations: str = "none"    # none (W4A16) | fp8 (W4AFP8): config.json only, same tensors
    jobs: int = 1                # output shards written at once (not part of the result)
    keep_mtp: bool = False       # the MTP layer's experts left as they came
    kv_cache: str | None = None  # "fp8": calibrated FP8 KV-cache scales written beside the shards
    # Calibration (methods other than rtn, and --kv-cache): the text and the method's options
    calib: str | None = None     # a local file or a Hub dataset (kq.quantize.calibration.resolve_calib)
    calib_samples: int = 512
    calib_seqlen: int = 512
    calib_policy: str = "all"    # kq.quantize.layerwise.POLICIES
    gptq_damp: float | None = None
    gptq_clip: str = "mse"
    gptq_asym: bool = False
    gptq_refit: bool = False
    gptq_expert_chunk: int = 16  # gptq, awq+gptq (awq alone splits one expert at a time)
    # Host tuning, from the environment by default (benchmarks/rtn.py A/Bs them; not part of the result)
    gpu_workers: int = field(default_factory=lambda: _env_number("KQ_GPU_WORKERS", GPU_WORKERS))
    switch_us: float = field(default_factory=lambda: _env_number("KQ_SWITCH_INTERVAL_US",
                                                                 sys.getswitchinterval() * 1e6, float))

    def __post_init__(self):
        from kq.checkpoint.ct_config import FP8_ACTIVATION_GROUP, check_activations

        def require(cond: bool, msg: str) -> None:
            if not cond:
                raise KqError(msg)
        require(self.method in METHODS, f"--method {self.method}: use rtn, gptq, awq or awq+gptq")
        require(self.clip in ("mse", "absmax"), f"--clip {self.clip}: use mse or absmax")
        # before the plan (group None): as at the family's default group; again with the plan's
        if self.group_size is not None:
            check_group(self.group_size)
        check_activations(self.activations, self.group_size if self.group_size is not None else FP8_ACTIVATION_GROUP)
        require(not (self.stream and distributed.world().on), "--stream under torchrun: ranks would delete shards "
                "others still read; download the source first (run without --stream)")
        require(self.gptq_expert_chunk >= 1, f"--gptq-expert-chunk {self.gptq_expert_chunk}: use 1 or more")
        require(self.kv_cache in (None, "fp8"), f"--kv-cache {self.kv_cache}: only fp8 is supported")
        require(self.kv_cache is None or self.calib is not None, "--kv-cache fp8 needs --calib FILE (calibration text)")
        if self.method == "awq":
            given = [o for o, v in (("--gptq-damp", self.gptq_damp is not None), ("--gptq-clip", self.gptq_clip != "mse"),
                                    ("--gptq-asym", self.gptq_asym), ("--gptq-refit-scales", self.gptq_refit),
                                    ("--gptq-expert-chunk", self.gptq_expert_chunk != 16)) if v]
            require(not given, f"{', '.join(given)}: GPTQ options; use them with --method gptq or awq+gptq")
        if self.method != "rtn":
            from kq.quantize.layerwise import POLICIES
            require(self.calib is not None,
                    f"--method {self.method} needs --calib FILE (calibration text, or a Hub dataset org/name)")
            require(self.calib_policy in POLICIES, f"--calib-policy {self.calib_policy}: use one of {', '.join(POLICIES)}")
        require(self.jobs >= 1, f"--jobs {self.jobs}: use 1 or more")
        self.method_config()   # a bad GPTQ option (--gptq-clip, --gptq-damp) is refused now

    def method_config(self):
        """The calibrated method's config (GptqConfig, AwqConfig; kq.quantize.layerwise's pass), None for rtn."""
        if self.method == "rtn" or self.group_size is None:
            return None
        from kq.quantize.layerwise import GptqConfig
        gptq = dict(damp=self.gptq_damp, refit=self.gptq_refit, clip=self.gptq_clip, asym=self.gptq_asym)
        if self.method == "gptq":
            return GptqConfig(group=self.group_size, policy=self.calib_policy, expert_chunk=self.gptq_expert_chunk,
                              **gptq)
        from kq.quantize.awq import AwqConfig
        # only the GPTQ options given go into the config (and so into the resume fingerprint)
        given = {k: v for k, v in gptq.items() if v not in (None, False, "mse")}
        if self.gptq_expert_chunk != GptqConfig.expert_chunk:
            given["expert_chunk"] = self.gptq_expert_chunk
        return AwqConfig(method=self.method, group=self.group_size, policy=self.calib_policy,
                         gptq=given if self.method == "awq+gptq" else {})

    def fingerprint(self, source: Source) -> str:
        """What must match for an existing folder to count as 'this same run'."""
        key = {"method": self.method, "group_size": self.group_size, "clip": self.clip,
               "source_index": hashlib.sha256(json.dumps(source.index.weight_map, sort_keys=True).encode()).hexdigest(),
               "source_config": hashlib.sha256(json.dumps(source.config, sort_keys=True).encode()).hexdigest(),
               "kq_format": 1, **({"keep_mtp": True} if self.keep_mtp else {}),
               **({"kv_cache": self.kv_cache} if self.kv_cache else {})}
        if self.activations != "none":  # absent for W4A16, so earlier runs still resume
            key["activations"] = self.activations
        return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]


# Given the expert weight's source name -> (weight_packed, weight_scale, weight_shape).
ExpertCodes = Callable[[str, torch.Tensor, torch.Tensor | None], tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


class CalibratedStep(Protocol):
    """A calibrated method's codes (kq.quantize.layerwise.CalibratedCodes): `run()` is its model pass,
    which run_quantize runs once before any shard job; calling it is then only a look-up (ExpertCodes)."""
    def run(self) -> None: ...
    def __call__(self, name: str, w: torch.Tensor, scale: torch.Tensor | None) -> tuple: ...


def check_output(out: Path, fingerprint: str) -> str:
    """'new', 'resume' or 'done'; refuses anything else with one line."""
    if not out.exists():
        return "new"
    if not out.is_dir():
        raise KqError(f"--out {out} exists and is not a folder")
    man = read_manifest(out)
    if man is not None:
        if man.get("run", {}).get("fingerprint") == fingerprint:
            return "done"
        raise KqError(f"--out {out} already holds a finished kq checkpoint made with other options or from another "
                      "source; choose another --out or delete it")
    run = out / WORK_DIR / "run.json"
    if run.exists():
        try:
            fp = json.loads(run.read_text()).get("fingerprint")
        except json.JSONDecodeError:
            fp = None
        if fp == fingerprint:
            return "resume"
        raise KqError(f"--out {out} holds an unfinished kq run with other options or another source; "
                      "rerun it with those options, or delete the folder")
    if any(out.iterdir()):
        raise KqError(f"--out {out} is not empty and is not a kq run; choose an empty or new folder")
    return "new"


def check_disk(out: Path, need: int) -> None:
    probe = out
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free < need:
        raise KqError(f"not enough disk at {probe}: the run needs {_gb(need)} more, {_gb(free)} free")


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.2f} MB"


def _load_state(path: Path) -> dict:
    try:
        state = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        state = {"shards": {}}  # killed before the first shard was recorded
    # Under torchrun, ranks other than 0 record their shards in files of their own.
    for p in sorted(path.parent.glob("state.rank*.json")):
        try:
            state["shards"].update(json.loads(p.read_text())["shards"])
        except (OSError, json.JSONDecodeError, KeyError):
            pass
    return state


def _state_path(work: Path, rank: int) -> Path:
    return work / ("state.json" if rank == 0 else f"state.rank{rank}.json")


def preflight(source: Source, plan: Plan, out: Path, opts: Options) -> str:
    """Every check about the output folder and the disk, before anything is written:
    returns 'new', 'resume' or 'done'."""
    kind = check_output(out, opts.fingerprint(source))
    if kind == "done":
        return kind
    state = _load_state(out / WORK_DIR / "state.json") if kind == "resume" else {"shards": {}}
    remaining = sum(s.nbytes for s in plan.shards if s.name not in state["shards"])
    staging = 2 * max(source.shard_bytes(s) for s in source.index.shards) if getattr(source, "remote", False) else 0
    check_disk(out, remaining + staging + sum(source.extra_files.values()))
    return kind


def default_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def run_quantize(source: Source, plan: Plan, out: Path, opts: Options, *,
                 device: torch.device | None = None, progress: Progress | None = None,
                 expert_codes: ExpertCodes | CalibratedStep | None = None,
                 after_shard: Callable[[str], None] | None = None,
                 kv_scales: dict[int, float] | None = None) -> dict:
    """expert_codes: kq's RTN when None; a CalibratedStep's `run()` (its calibration pass) runs here, once,
    after the output folder is claimed and before any shard job (in every world size).
    kv_scales: {layer: FP8 KV-cache scale} (kq.quantize.kv_scales) to write with the checkpoint."""
    out = Path(out)
    device = device or default_device()
    fp = opts.fingerprint(source)
    world = distributed.world()
    state_kind = distributed.agree(lambda: preflight(source, plan, out, opts))
    if state_kind == "done":
        return {"status": "already complete", "out": str(out), **(read_manifest(out) or {}).get("sizes", {})}
    work = out / WORK_DIR
    state_path = _state_path(work, world.rank)
    state = _load_state(work / "state.json") if state_kind == "resume" else {"shards": {}}
    distributed.barrier()   # every rank has read the folder's state before anything is written
    if world.lead:
        work.mkdir(parents=True, exist_ok=True)
        write_json_atomic(work / "run.json", {"fingerprint": fp, "kq_version": __version__, "source": source.name})
    distributed.barrier()

    PROFILE.reset()
    # kq's own RTN on the GPU is thread-safe: read and quantize in the same worker threads.
    fused = expert_codes is None and device.type == "cuda"
    if expert_codes is None:
        def expert_codes(name, w, scale):
            return rtn_parts(name, w, scale, group=plan.group_size, clip=opts.clip, device=device)

    t0 = time.time()
    calibrate = getattr(expert_codes, "run", None)
    if calibrate is not None:
        calibrate()  # a calibrated method's layer pass: every rank takes part, shards or not
    # How many pending shards still need each source shard (to release streamed ones early).
    # Under torchrun each rank writes its block of the plan's shards (the same block on a resume).
    mine = distributed.split(len(plan.shards))
    pending = [s for i, s in enumerate(plan.shards) if i in mine and not _shard_done(out, s.name, state)]
    uses: dict[str, int] = {}
    for s in pending:
        for n in s.needs:
            uses[n] = uses.get(n, 0) + 1
    lock = threading.Lock()  # state.json, the use counts and the callbacks are shared by the jobs

    def one(sp):
        if progress:
            progress.start_shard(sp.name, sp.nbytes)
        paths = {n: source.shard_path(n) for n in sp.needs}
        for n, p in paths.items():
            read_header(p)  # a Hub download could be truncated: check before writing anything
        sha, size = _write_shard(source, sp, out / sp.name, paths, expert_codes, progress, device, fused,
                                 opts.gpu_workers)
        with lock:
            state["shards"][sp.name] = {"sha256": sha, "size": size}
            write_json_atomic(state_path, state)
            if progress:
                progress.end_shard(sp.name, False)
            for n in sp.needs:
                uses[n] -= 1
                if uses[n] == 0:
                    source.release(n)
            if after_shard:
                after_shard(sp.name)

    for i, sp in enumerate(plan.shards):
        if i in mine and sp not in pending and progress:
            progress.end_shard(sp.name, True)
    # With many threads (jobs x workers, plus writers and hashers) the I/O threads queue for the
    # GIL behind the ones running Python; KQ_SWITCH_INTERVAL_US shortens the interpreter's switch
    # interval for the run (restored after it).
    switch = sys.getswitchinterval()
    sys.setswitchinterval(opts.switch_us / 1e6)
    try:
        _run_jobs(one, pending, opts.jobs)
    finally:
        sys.setswitchinterval(switch)
    if world.on:
        # Every rank's records for rank 0, which writes the index, config and manifest (after all
        # shards exist: gathering is the barrier); the others are done.
        records = distributed.gather_objects(state["shards"])
        if not world.lead:
            return {"status": "written", "out": str(out), "rank": world.rank, "shards": len(pending)}
        for rec in records:
            state["shards"].update(rec)
        if progress:
            progress.advance("", sum(sp.nbytes for i, sp in enumerate(plan.shards) if i not in mine))
        write_json_atomic(work / "state.json", state)
    seconds = time.time() - t0
    prof = None
    if PROFILE.on:
        prof = PROFILE.summary() | {"jobs": opts.jobs, "shards": len(pending)}
        print(Profile.line(prof) + f"; {len(pending)} shards, jobs {opts.jobs}", file=sys.stderr, flush=True)
    summary = finish(source, plan, out, opts, fp, state, seconds, kv_scales)
    if prof is not None:
        summary["profile"] = prof
    return summary


def _run_jobs(one, pending: list, jobs: int) -> None:
    if jobs <= 1:
        for sp in pending:
            one(sp)
        return
    # Output shards are independent: several at once keep the disk, the hashing and the
    # GPU busy together (each job is itself pipelined, see _write_shard).
    with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="kq-shard") as ex:
        for f in [ex.submit(one, sp) for sp in pending]:
            f.result()


def _shard_done(out: Path, name: str, state: dict) -> bool:
    rec = state["shards"].get(name)
    p = out / name
    return rec is not None and p.exists() and p.stat().st_size == rec["size"]


def _write_shard(source: Source, sp, final: Path, paths: dict, expert_codes: ExpertCodes, progress,
                 device: torch.device, fused: bool = False, gpu_workers: int = GPU_WORKERS) -> tuple[str, int]:
    """One output shard, pipelined: reader threads fetch the next expert tensors from the
    source files (plain file reads, which release the GIL, into pinned memory when a GPU
    is used), the calling thread quantizes, and one writer thread appends tensors to the
    shard in order (the writer hashes on a thread of its own). With `fused` (kq's RTN on
    the GPU) the GPU_WORKERS reader threads also quantize what they read, each on its own
    CUDA stream, and the calling thread only hands results to the writer in order. A few
    experts are in flight either way, so memory stays bounded by a few expert tensors."""
    wm = source.index.weight_map
    pin = device.type == "cuda"

    def load(name: str) -> torch.Tensor:
        t0 = time.perf_counter()
        e = source.headers[wm[name]][name]
        buf = torch.empty(e.nbytes, dtype=torch.uint8, pin_memory=pin)
        view = memoryview(buf.numpy())
        with open(paths[wm[name]], "rb", buffering=0) as f:
            f.seek(e.start)
            got = 0
            while got < e.nbytes:
                n = f.readinto(view[got:])
                if not n:
                    raise KqError(f"{wm[name]}: ended early while reading {name}")
                got += n
        PROFILE.add("read", t0, e.nbytes)
        return buf.view(TORCH_DTYPE[e.dtype]).reshape(e.shape)

    def load_expert(name: str):
        w = load(name)
        scale = None
        if w.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            scale = load(name + "_scale_inv" if name + "_scale_inv" in wm else name + "_scale")
        return w, scale

    def task(name: str):
        w, scale = load_expert(name)
        return expert_codes(name, w, scale) if fused else (w, scale)

    workers = gpu_workers if fused else READERS
    ahead = max(PREFETCH, workers + 2)
    experts = list(dict.fromkeys(t.src for t in sp.tensors if t.action != "copy"))
    writer = StreamingShardWriter(final, [(t.name, t.dtype, t.shape) for t in sp.tensors], {"format": "pt"})
    readers = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kq-read")
    wpool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kq-write")  # one worker: writes stay in order
    writes: deque = deque()
    try:
        pending = {n: readers.submit(task, n) for n in experts[:ahead]}
        nxt = ahead
        parts: dict[str, tuple] = {}
        for t in sp.tensors:
            if len(writes) > 2 * PREFETCH:
                t0 = time.perf_counter()
                while len(writes) > 2 * PREFETCH:
                    writes.popleft().result()
                PROFILE.add("wait:write", t0)
            if t.action == "copy":
                entry = source.headers[wm[t.src]][t.src]
                writes.append(wpool.submit(writer.copy_from, t.name, paths[wm[t.src]], entry))
                if progress:
                    progress.advance(sp.name, entry.nbytes)
                continue
            if t.src not in parts:
                t0 = time.perf_counter()
                got = pending.pop(t.src).result()
                PROFILE.add("wait:expert", t0)
                if nxt < len(experts):
                    pending[experts[nxt]] = readers.submit(task, experts[nxt])
                    nxt += 1
                parts[t.src] = got if fused else expert_codes(t.src, *got)
                del got
                if progress:
                    progress.advance(sp.name, source.headers[wm[t.src]][t.src].nbytes)
            part = parts[t.src][("packed", "scale", "shape").index(t.action)]
            writes.append(wpool.submit(writer.write, t.name, part))
            if t.action == "shape":
                del parts[t.src]
        while writes:
            writes.popleft().result()
        return writer.close()
    except BaseException:
        for f in writes:
            f.cancel()
        wpool.shutdown(wait=True)
        writer.abort()
        raise
    finally:
        readers.shutdown(wait=True, cancel_futures=True)
        wpool.shutdown(wait=True)


def plan_prefix(source: Source) -> str:
    return "language_model." if "language_model.model.embed_tokens.weight" in source.index.weight_map else ""


def output_config(source: Source, plan: Plan, activations: str = "none", kv_cache: bool = False) -> dict:
    """The output's config.json: the source's, with kq's compressed-tensors quantization_config
    (activations: the INT4 group's input activations, none or fp8; kv_cache: FP8 KV-cache scales are
    written beside the shards, so the config names the kv_cache_scheme SGLang reads them by)."""
    from kq.checkpoint.ct_config import build_quantization_config  # imports transformers: only when needed
    config = dict(source.config)
    kept = {t.name: t for sp in plan.shards for t in sp.tensors if t.action == "copy"}
    bf16_linears = sorted(n[: -len(".weight")] for n, t in kept.items()
                          if n.endswith(".weight") and len(t.shape) == 2 and t.dtype not in FP8
                          and not n.endswith("embed_tokens.weight"))
    config["quantization_config"] = build_quantization_config(
        source.config, group_size=plan.group_size, source_format=plan.recipe.source_format,
        bf16_linears=bf16_linears, has_fp8=any(t.dtype in FP8 for t in kept.values()), activations=activations,
        mtp_layer=plan.mtp_layer)
    if kv_cache:
        from kq.quantize.kv_scales import KV_CACHE_SCHEME
        config["quantization_config"]["kv_cache_scheme"] = dict(KV_CACHE_SCHEME)
    return config


def finish(source: Source, plan: Plan, out: Path, opts: Options, fp: str, state: dict, seconds: float,
           kv_scales: dict[int, float] | None = None) -> dict:
    """Index, config, copied files, then the manifest (last: it marks the folder finished)."""
    weight_map = {t.name: sp.name for sp in plan.shards for t in sp.tensors}
    tensors = {t.name: {"dtype": t.dtype, "shape": list(t.shape), "file": sp.name} for sp in plan.shards for t in sp.tensors}
    total = plan.output_bytes
    if kv_scales:
        from kq.quantize.kv_scales import write_scales
        written = write_scales(out, kv_scales, plan_prefix(source))
        state["shards"][written["file"]] = {"sha256": written["sha256"], "size": written["size"]}
        for name in written["tensors"]:
            weight_map[name] = written["file"]
            tensors[name] = {"dtype": "F32", "shape": [], "file": written["file"]}
        total += written["nbytes"]
    write_json_atomic(out / INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": weight_map})
    write_json_atomic(out / "config.json", output_config(source, plan, opts.activations, kv_cache=bool(kv_scales)))
    source.copy_extras(out)
    files = {name: {"sha256": rec["sha256"], "size": rec["size"]} for name, rec in state["shards"].items()}
    from kq.checkpoint.manifest import sha256_file
    for name in ["config.json", INDEX_NAME, *source.extra_files]:
        files[name] = {"sha256": sha256_file(out / name), "size": (out / name).stat().st_size}
    manifest = {
        "kq_version": __version__,
        "format": "compressed-tensors pack-quantized (INT4 routed experts), other tensors as in the source",
        "source": {"name": source.name, "repo_id": source.repo_id, "revision": source.revision,
                   "family": plan.recipe.family, "model_type": source.config.get("model_type")},
        "options": {"method": opts.method, "group_size": plan.group_size, "clip": opts.clip if opts.method == "rtn" else None,
                    "mtp_experts": plan.mtp_experts,
                    # absent for W4A16 (as in the fingerprint), so a W4A16 manifest is what it always was
                    **({"activations": opts.activations} if opts.activations != "none" else {}),
                    **({"kv_cache": opts.kv_cache} if opts.kv_cache else {})},
        "sizes": {"source_bytes": plan.source_bytes, "output_bytes": plan.output_bytes,
                  "per_gpu_bytes_tp8": plan.per_gpu_bytes(8)},
        "classes": plan.classes,
        "run": {"fingerprint": fp},
        "files": dict(sorted(files.items())),
        "tensors": tensors,
    }
    write_json_atomic(out / MANIFEST_NAME, manifest)
    shutil.rmtree(out / WORK_DIR, ignore_errors=True)
    return {"status": "written", "out": str(out), "seconds": round(seconds, 2),
            "source_bytes": plan.source_bytes, "output_bytes": plan.output_bytes}
