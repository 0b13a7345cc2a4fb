"""Running one quantize over several processes with torch.distributed (launched by torchrun).

`torchrun --nproc-per-node N -m kq quantize ...` starts N copies of the same command; each reads
WORLD_SIZE / RANK / LOCAL_RANK from the environment, takes GPU LOCAL_RANK, and joins one process
group (NCCL on GPUs, gloo on the CPU). Without those variables kq runs as one process, as always.

What is split, and why the output keeps the single-process bytes (docs/distributed.md):
- RTN: output shards, a contiguous block of the plan's shards per rank (`split`). Each shard is
  computed exactly as one process computes it; rank 0 writes index/config/manifest last.
- GPTQ, per MoE layer:
  * the load: each rank dequantizes its block of the routed experts, every rank gets all (`load_layer`);
  * calibration windows (in the runner's batches of `batch` windows, so every forward call has the
    single-process batch shape): each rank runs its block of batches through attention, and every
    rank gets every batch's MoE inputs in window order (`over_windows`), bit for bit what one process
    computes; then through the whole layer, keeping (and saving) only its own batches' outputs, the
    next layer's inputs (the block is the same at every layer);
  * experts, in the solver's own chunks of `expert_chunk` experts (a chunk is one batched solve,
    so splitting inside a chunk could change kernel choice and bits): a block of chunks per rank,
    every rank given all MoE inputs X (the Hessian of an expert sums over all windows in one
    matmul, as in one process; partial Hessians per rank would sum in another order).
  AWQ (kq.quantize.awq) goes through the same expert split, by single experts (awq+gptq: GPTQ's chunks).
  Each rank writes its own part of the next inputs and of the layer's codes; only rank 0 writes the
  work state; a layer counts as done once rank 0 has written it, and the ranks meet at a barrier
  before the next one.

Errors: checks that every rank makes (preflight) go through `agree`: one line from the lowest
failing rank, the others exit quietly. An error in one rank mid-stage ends that process; torchrun
then stops the others (no rank is left waiting in a collective).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Callable

import torch

from kq.errors import KqError, QuietExit


@dataclass(frozen=True)
class World:
    rank: int = 0
    size: int = 1
    local_rank: int = 0

    @property
    def on(self) -> bool:
        return self.size > 1

    @property
    def lead(self) -> bool:
        return self.rank == 0


SINGLE = World()
_world = SINGLE


def from_env() -> World:
    """The torchrun environment (WORLD_SIZE, RANK, LOCAL_RANK), or one process without it."""
    if "WORLD_SIZE" not in os.environ:
        return SINGLE
    try:
        w = World(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", "0")))
    except (KeyError, ValueError):
        raise KqError("WORLD_SIZE is set but RANK/LOCAL_RANK are missing or not numbers: launch with torchrun") from None
    if not 0 <= w.rank < w.size:
        raise KqError(f"RANK {w.rank} is outside WORLD_SIZE {w.size}")
    return w


def world() -> World:
    return _world


def setup(device: torch.device) -> tuple[World, torch.device]:
    """Join the process group when launched by torchrun: -> (world, this rank's device).
    A CUDA device becomes cuda:LOCAL_RANK (NCCL); the CPU uses gloo."""
    global _world
    w = from_env()
    if not w.on:
        return w, device
    import torch.distributed as dist
    if device.type == "cuda":
        if w.local_rank >= torch.cuda.device_count():
            raise KqError(f"LOCAL_RANK {w.local_rank}: only {torch.cuda.device_count()} GPU(s) visible; "
                          "use --nproc-per-node <= the GPU count")
        device = torch.device("cuda", w.local_rank)
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        # Backstop only: torchrun stops every rank when one fails, so no collective waits this long
        # unless a rank hangs. A rank may wait at a barrier while rank 0 writes a layer's state.
        timeout = timedelta(seconds=float(os.environ.get("KQ_DIST_TIMEOUT_S", "3600")))
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=timeout,
                                **({"device_id": device} if device.type == "cuda" else {}))
    _world = World(dist.get_rank(), dist.get_world_size(), w.local_rank)
    return _world, device


def teardown() -> None:
    """Leave the process group, all ranks together: a rank that returned early (RTN's non-lead ranks,
    while rank 0 writes index, config and manifest) waits at a barrier, so no rank destroys its
    group while another still talks to it. The CLI then ends a torchrun rank with os._exit
    (kq.cli.main: why)."""
    global _world
    if _world.on:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()
    _world = SINGLE


def split(n: int, w: World | None = None) -> range:
    """This rank's contiguous block of n units: the first n % size ranks get one more."""
    w = w or _world
    base, extra = divmod(n, w.size)
    start = w.rank * base + min(w.rank, extra)
    return range(start, start + base + (w.rank < extra))


def owners(n: int, w: World | None = None) -> list[int]:
    """The rank that owns each of n units under `split`."""
    w = w or _world
    out = []
    for r in range(w.size):
        out += [r] * len(split(n, World(r, w.size)))
    return out


def barrier() -> None:
    if _world.on:
        import torch.distributed as dist
        dist.barrier()


def gather_objects(obj) -> list:
    """Every rank's (picklable, small) obj, in rank order."""
    if not _world.on:
        return [obj]
    import torch.distributed as dist
    got = [None] * _world.size
    dist.all_gather_object(got, obj)
    return got


def agree(fn: Callable[[], object]):
    """Run fn on every rank; if it raised KqError anywhere, every rank stops: the lowest failing
    rank raises its error (one line from the CLI), the others raise QuietExit."""
    err = None
    try:
        value = fn()
    except KqError as e:
        err, value = e, None
    errors = gather_objects(None if err is None else str(err))
    first = next((r for r, e in enumerate(errors) if e is not None), None)
    if first is None:
        return value
    if first == _world.rank:
        raise err
    raise QuietExit(errors[first])


# -- tensors --------------------------------------------------------------------------------

def _meta(t):
    return None if t is None else (tuple(t.shape), str(t.dtype).removeprefix("torch."))


def _send(t: torch.Tensor, src: int, device: torch.device) -> None:
    import torch.distributed as dist
    flat = t.detach().contiguous().reshape(-1).view(torch.uint8)   # bytes: any dtype, exact
    dist.broadcast(flat.to(device), src)


def _recv(meta, src: int, device: torch.device) -> torch.Tensor:
    import torch.distributed as dist
    shape, dtype = meta
    dtype = getattr(torch, dtype)
    n = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    buf = torch.empty(n, dtype=torch.uint8, device=device)
    dist.broadcast(buf, src)
    return buf.view(dtype).reshape(shape)


def share(items: dict, owner: dict, device: torch.device) -> dict:
    """Each rank holds items[k] (a tensor, a tuple of tensors, or None) for the keys it owns;
    -> every key's item on every rank, bit for bit the owner's, on `device`. `owner` maps every
    key to its rank and is the same on all ranks. Tensors travel as bytes (broadcast from the
    owner: NCCL needs them on the GPU, gloo on the CPU)."""
    if not _world.on:
        return dict(items)
    import torch.distributed as dist
    comm = device if dist.get_backend() == "nccl" else torch.device("cpu")
    out = {}
    for r in range(_world.size):
        keys = [k for k in owner if owner[k] == r]
        if not keys:
            continue
        mine = r == _world.rank
        meta = [None]
        if mine:
            meta = [[(k, [_meta(t) for t in items[k]] if isinstance(items[k], tuple) else _meta(items[k]))
                     for k in keys]]
        dist.broadcast_object_list(meta, src=r)
        for k, m in meta[0]:
            if isinstance(m, list):   # a tuple of tensors (or Nones)
                ts = items[k] if mine else (None,) * len(m)
                out[k] = tuple(_one(t, mm, r, mine, comm, device) for t, mm in zip(ts, m))
            else:
                out[k] = _one(items.get(k), m, r, mine, comm, device)
    return out


def _one(t, meta, src: int, mine: bool, comm: torch.device, device: torch.device):
    if meta is None:
        return None
    if mine:
        _send(t, src, comm)
        return t.to(device)
    return _recv(meta, src, comm).to(device)


# Solver stats that list this rank's own experts (joined over ranks); every other list stat is computed
# from the whole layer on every rank ("tokens", "rare") and must agree. Named, not guessed from the values:
# two ranks' own lists may be equal (both empty, say).
OWN_EXPERT_LISTS = frozenset({"rtn_fallback"})


def merge_stats(per_rank: list[dict]) -> dict:
    """The solver's stats of each rank's experts -> one layer's: OWN_EXPERT_LISTS joined in rank order
    (= expert order: ranks own ascending blocks); dicts ({expert: value}) merged; any other value must
    be the same on every rank (computed from the whole layer, e.g. routed token counts)."""
    out: dict = {}
    for k in dict.fromkeys(k for s in per_rank for k in s):
        vals = [s[k] for s in per_rank if k in s]
        if k in OWN_EXPERT_LISTS:
            out[k] = [x for v in vals for x in v]
        elif all(isinstance(v, dict) for v in vals):
            out[k] = {kk: vv for v in vals for kk, vv in v.items()}
        elif all(v == vals[0] for v in vals):
            out[k] = vals[0]
        else:
            raise RuntimeError(f"ranks disagree on the solver's stat {k!r}")
    return out


# -- the runner's split points ----------------------------------------------------------------

def load_layer(model, i: int):
    """(d) Load decoder layer i: each rank reads and dequantizes its block of the routed experts (the
    CPU-bound part of loading), then every rank gets every expert's weights, broadcast in place. Every
    rank holds the whole layer (each window's tokens go to any expert)."""
    if not _world.on:
        return model.load_layer(i)
    import torch.distributed as dist
    E = model.n_experts()
    layer = model.load_layer(i, experts=split(E))
    ex = getattr(layer.mlp, "experts", None)
    if ex is None:
        return layer
    comm = model.device if dist.get_backend() == "nccl" else torch.device("cpu")
    for e, src in enumerate(owners(E)):
        for p in (ex.gate_up_proj, ex.down_proj):
            t = p.data[e]                                   # contiguous: a slice of the first dimension
            flat = t.reshape(-1).view(torch.uint8)
            if flat.device == comm:
                dist.broadcast(flat, src)                   # in place
            else:
                buf = flat.to(comm)
                dist.broadcast(buf, src)
                flat.copy_(buf)
    return layer


def solve_experts(solve: Callable, n_chunks: int, device: torch.device) -> tuple[dict, dict]:
    """(a) Solve one layer's experts across ranks. solve(chunks) -> ({expert: tuple of tensors},
    stats) for the given expert-chunk indices (the solver's own chunking); this rank solves its
    block of chunks, and every rank gets every expert's tensors and the merged stats."""
    if not _world.on:
        return solve(range(n_chunks))
    res, stats = solve(split(n_chunks))
    keys = gather_objects(sorted(res))
    owner = {e: r for r, ks in enumerate(keys) for e in ks}
    return share(res, owner, device), merge_stats(gather_objects(stats))


def over_windows(fn: Callable[[int], object], n: int, device: torch.device) -> list:
    """(b) fn(b) for every calibration batch b in 0..n-1, each rank computing its block of batches;
    -> every batch's result (a tensor, a tuple of tensors or None) on every rank, in window order."""
    if not _world.on:
        return [fn(b) for b in range(n)]
    mine = {b: fn(b) for b in split(n)}
    got = share(mine, dict(enumerate(owners(n))), device)
    return [got[b] for b in range(n)]
