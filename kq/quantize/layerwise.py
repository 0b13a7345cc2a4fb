"""GPTQ of the routed experts, one decoder layer at a time, straight from the FP8 source.

Per decoder layer i (hidden states of all calibration windows held between layers):
 1. load layer i from the source (dequantized), run the windows up to the MoE block and
    keep its inputs X [T, H] (a pre-hook stops the forward there);
 2. route X with the layer's own router (correction bias for selection only, group-limited
    top-k, norm_topk_prob, routed_scaling_factor: transformers' module does all of it);
 3. per expert: Hessian of gate/up from X (policy below), GPTQ gate+up together (same
    inputs, rows independent), then the down projection's Hessian from the *quantized*
    gate/up's activations, GPTQ down; experts of a layer are solved together in chunks;
 4. put the dequantized INT4 experts into the layer and run the windows through the
    whole layer: these outputs (quantization errors included) feed layer i+1.
After each layer the packed results and the next layer's inputs are written atomically
to the work folder (by a background thread, while the next layer computes; the layer counts
as done only once they are on disk), so a run killed anywhere resumes at the last finished
layer and ends with the same bytes.

MoE calibration policy (docs/eval-gptq.md has the measurements; `kq quantize --calib-policy`):
  all (default): every token through every expert (the gate/up Hessian is one X^T X shared
    by all experts of the layer); only routed outputs are kept for propagation.
  routed: an expert's Hessians use only the tokens the router sends to it, i.e. the
    inputs it sees at serve time. An expert with fewer than `min_tokens` routed tokens is
    under-calibrated: it falls back to kq's RTN (MSE clipping) and is listed in the run
    summary.
  weighted: as routed, each token's contribution weighted by its routing weight squared.
"""
from __future__ import annotations

import gc
import hashlib
import json
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from kq.checkpoint.pack import pack_int4
from kq.errors import KqError
from kq.format import atomic_path, write_json_atomic
from kq.model import LayerwiseModel
from kq.quantize import distributed
from kq.quantize.gptq import gptq_quantize
from kq.quantize.rtn import quantize_rtn

STATE = "state.json"
POLICIES = ("all", "routed", "weighted")  # MoE calibration policies, default first (module docstring)


def default_damp(group: int) -> float:
    """GPTQ's damping when none is given. Measured on the trained tiny model (docs/eval-gptq.md): at
    group 128 less damping lowers the KL (0.1 / 0.01 / 0.001: 0.01022 / 0.00974 / 0.00948), at group 32
    it raises it (0.01: 0.00807, 0.001: 0.00877). With 128-wide groups the scales absorb less of the
    weights' shape and GPTQ's compensation does more of the work; with 32-wide groups the extra freedom
    mostly fits the calibration tokens."""
    return 0.001 if group >= 128 else 0.01


@dataclass(frozen=True)
class GptqConfig:
    group: int = 128
    policy: str = "all"         # all | routed | weighted (measured: docs/eval-gptq.md)
    clip: str = "mse"           # scale choice inside GPTQ: mse | absmax | search (kq.quantize.gptq)
    damp: float | None = None   # fraction of the mean Hessian diagonal added to it; None: default_damp(group)
    block: int = 128            # GPTQ lazy-update block (columns)
    refit: bool = False         # least-squares refit of each row's group scales after GPTQ (kq.quantize.gptq)
    asym: bool = False          # down projection: aim at the full-precision path's output (quantize_experts)
    min_tokens: int = 32        # routed tokens below which an expert falls back to RTN
    expert_chunk: int = 16      # experts solved together (memory: chunk x in^2 x 4 bytes)
    batch: int = 8              # calibration windows per forward call

    def __post_init__(self):
        if self.damp is None:
            object.__setattr__(self, "damp", default_damp(self.group))
        if self.policy not in POLICIES:
            raise KqError(f"GPTQ policy {self.policy!r}: use {', '.join(POLICIES)}")
        if self.clip not in ("mse", "absmax", "search"):
            raise KqError(f"GPTQ clip {self.clip!r}: use mse, absmax or search")
        if not 0 < self.damp <= 1:
            raise KqError(f"GPTQ damp {self.damp}: use a fraction in (0, 1], e.g. 0.01")
        if self.block % self.group:
            raise KqError(f"GPTQ block {self.block} must be a multiple of the group size {self.group}")


class _Stop(Exception):
    pass


def _moe_inputs(model: LayerwiseModel, layer, hidden: list[torch.Tensor], carry: list) -> torch.Tensor:
    """The MoE block's input for every calibration token: [T, H] float32, in window order. Under
    torchrun each rank runs its block of batches (distributed.over_windows gathers them)."""
    xs = []

    def hook(_mod, args):
        xs.append(args[0].reshape(-1, args[0].shape[-1]).float())
        raise _Stop

    def one(b: int) -> torch.Tensor:
        try:
            model.forward_layer(layer, hidden[b], carry[b])
        except _Stop:
            pass
        return xs.pop()

    h = layer.mlp.register_forward_pre_hook(hook)
    try:
        return torch.cat(distributed.over_windows(one, len(hidden), model.device))
    finally:
        h.remove()


def _propagate(model: LayerwiseModel, layer, hidden: list, carry: list) -> None:
    """Every window through the whole layer, in place: hidden/carry become the next layer's inputs.
    Under torchrun each rank runs its own block of batches (distributed.split; the same block at every
    layer) and keeps only those: no rank needs another's windows (each rank saves its own)."""
    for b in distributed.split(len(hidden)):
        hidden[b], carry[b] = model.forward_layer(layer, hidden[b], carry[b])


def solve_layer_experts(layer, X: torch.Tensor, cfg: GptqConfig, solve=None) -> tuple[dict, dict]:
    """One layer's routed experts by `solve(layer, X, cfg, chunks=...)` (GPTQ's quantize_experts by
    default): under torchrun each rank solves its block of expert chunks and every rank gets every
    expert's result (distributed.solve_experts)."""
    solve = solve or quantize_experts
    E = layer.mlp.experts.gate_up_proj.shape[0]
    return distributed.solve_experts(lambda chunks: solve(layer, X, cfg, chunks=chunks), n_chunks(E, cfg), X.device)


@contextmanager
def _tf32(device: torch.device):
    """TF32 matmuls on CUDA for the Hessians and the down projection's inputs (fp32 accumulation,
    10-bit-mantissa operands): about 8x faster on an H200, where the every-token down inputs of a
    full-size layer dominate GPTQ's time; the 1% damping is far above that rounding (the 0.1% of
    group 128 is not: a Hessian that TF32 made indefinite gets more damping in the solver's Cholesky
    retries; the g128 KL with TF32 Hessians is not measured). The solver
    itself (error propagation through the inverse Hessian) stays in full fp32."""
    if device.type != "cuda":
        yield
        return
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old


def _act(layer):
    return layer.mlp.experts.act_fn


@torch.no_grad()
def quantize_experts(layer, X: torch.Tensor, cfg: GptqConfig, chunks: Iterable[int] | None = None) -> tuple[dict, dict]:
    """GPTQ of one MoE layer's routed experts from its inputs X [T, H]; with `chunks`, only the experts
    of those expert chunks (chunk k: experts k*expert_chunk ... (k+1)*expert_chunk - 1; see n_chunks).

    -> ({expert: (q_gate_up int8 [2I, H], s_gate_up bf16, q_down int8 [H, I], s_down bf16)},
        {"tokens": [per-expert routed token counts], "rare": [experts with < min_tokens routed tokens],
         "rtn_fallback": [experts quantized by RTN instead (policy routed/weighted)]})
    """
    experts = layer.mlp.experts
    Wgu, Wd = experts.gate_up_proj.data, experts.down_proj.data    # [E, 2I, H], [E, H, I]; float32 per chunk
    E, two_i, _ = Wgu.shape
    inter = two_i // 2
    act = _act(layer)
    _, topw, topi = layer.mlp.gate(X)                                             # [T, k] each
    weight = torch.zeros(E, X.shape[0], dtype=torch.float32, device=X.device)    # [E, T] routing weights
    tok = torch.arange(X.shape[0], device=X.device)
    for k in range(topi.shape[1]):
        weight[topi[:, k].long(), tok] = topw[:, k].float()
    routed = weight > 0
    counts = routed.sum(1).tolist()
    with _tf32(X.device):
        shared_h = (X.T @ X)[None] if cfg.policy == "all" else None             # [1, H, H]
    out, fallback = {}, []
    for k in (range(n_chunks(E, cfg)) if chunks is None else chunks):
        ids = chunk_experts(E, cfg, [k])
        sel = [e for e in ids if cfg.policy == "all" or counts[e] >= cfg.min_tokens]
        for e in ids:
            if e not in sel:
                fallback.append(e)
                qg, sg = quantize_rtn(Wgu[e].float(), cfg.group, "mse")
                qd, sd = quantize_rtn(Wd[e].float(), cfg.group, "mse")
                out[e] = (qg, sg, qd, sd)
        if not sel:
            continue
        xs = [X if cfg.policy == "all" else X[routed[e]] for e in sel]
        # weighted: a token's error reaches the layer output scaled by its routing weight r,
        # so its squared error counts r^2 times: H = sum r^2 x x^T.
        rs = [weight[e][routed[e]][:, None] if cfg.policy == "weighted" else None for e in sel]
        with _tf32(X.device):
            Hgu = shared_h if shared_h is not None else torch.stack([_gram(x, r) for x, r in zip(xs, rs)])
        qgu, sgu = gptq_quantize(Wgu[sel].float(), Hgu, cfg.group, clip=cfg.clip, damp=cfg.damp, block=cfg.block,
                                 refit=cfg.refit)
        del Hgu
        # The down projection sees the activations of the quantized gate/up (sequential within the expert).
        Hd, Wd_target = [], []
        for j, x in enumerate(xs):
            wq = (qgu[j].float().view(two_i, -1, cfg.group) * sgu[j].float()[..., None]).view(two_i, -1)
            with _tf32(X.device):
                g, u = (x @ wq.T).split(inter, dim=-1)
                a = act(g) * u                                                    # [T_e, I]
                Hd.append(_gram(a, rs[j]))
                if cfg.asym:
                    Wd_target.append(_asym_target(Wd[sel[j]].float(), x, Wgu[sel[j]].float(), a, Hd[-1], act,
                                                  rs[j], cfg.damp))
        W_down = torch.stack(Wd_target) if cfg.asym else Wd[sel].float()
        qd, sd = gptq_quantize(W_down, torch.stack(Hd), cfg.group, clip=cfg.clip, damp=cfg.damp, block=cfg.block,
                               refit=cfg.refit)
        del Hd
        for j, e in enumerate(sel):
            out[e] = (qgu[j], sgu[j], qd[j], sd[j])
    rare = [e for e in range(E) if counts[e] < cfg.min_tokens]
    return out, {"tokens": counts, "rare": rare, "rtn_fallback": fallback}


def n_chunks(n_experts: int, cfg: GptqConfig) -> int:
    """How many expert chunks quantize_experts solves (one batched solve each). cfg: anything with an
    `expert_chunk` (GptqConfig, or AwqConfig, whose chunks are split across torchrun ranks the same way)."""
    return -(-n_experts // cfg.expert_chunk)


def chunk_experts(n_experts: int, cfg, chunks: Iterable[int] | None = None) -> list[int]:
    """The experts of expert chunks `chunks` (default all), in order: chunk k holds experts
    k*expert_chunk ... (k+1)*expert_chunk - 1."""
    ks = range(n_chunks(n_experts, cfg)) if chunks is None else chunks
    return [e for k in ks for e in range(k * cfg.expert_chunk, min((k + 1) * cfg.expert_chunk, n_experts))]


def own_experts(n_experts: int, cfg) -> list[int]:
    """The experts this rank solves under torchrun (its block of expert chunks; all in one process)."""
    return chunk_experts(n_experts, cfg, distributed.split(n_chunks(n_experts, cfg)))


def solve_experts(layer, X: torch.Tensor, cfg) -> tuple[dict, dict]:
    """The per-layer point of the layer-wise runner: quantize one layer's routed experts from its MoE
    inputs X [T, H] with the method the config names (GptqConfig: GPTQ; kq.quantize.awq.AwqConfig: AWQ or
    AWQ+GPTQ); both are split across torchrun ranks by solve_layer_experts, in chunks of cfg.expert_chunk
    experts, and return quantize_experts' results and stats."""
    if hasattr(cfg, "solve_experts"):   # AwqConfig (kq.quantize.awq imports this module, not the reverse)
        return cfg.solve_experts(layer, X)
    return solve_layer_experts(layer, X, cfg)


def _asym_target(wd: torch.Tensor, x: torch.Tensor, wgu: torch.Tensor, a: torch.Tensor, h: torch.Tensor, act,
                 r: torch.Tensor | None, damp: float) -> torch.Tensor:
    """The down weights GPTQ should aim at when its inputs a [T, I] come from the quantized gate/up but the
    output should match the full-precision path's, wd a0 (a0 from the original gate/up).

    sum_t |wd a0_t - w a_t|^2 = |w - w*|^2_H + const with H = a^T a and w* = wd C H^-1, C = a0^T a; so GPTQ
    on w* with H minimises the error against the full-precision output (asymmetric calibration, as in
    GPTAQ, Li et al. 2025). H is damped as the solver damps it."""
    from kq.quantize.gptq import _damped
    g0, u0 = (x @ wgu.T).split(a.shape[1], dim=-1)
    a0 = act(g0) * u0
    if r is not None:
        a0, a = a0 * r, a * r
    C = a0.T @ a                                                                   # [I, I]
    hd, _, _ = _damped(h[None], damp)
    return torch.linalg.solve(hd[0], (wd @ C).T).T                                 # wd C H^-1 (H symmetric)


def _gram(x: torch.Tensor, r: torch.Tensor | None) -> torch.Tensor:
    """x^T x, or (r x)^T (r x) with per-token weights r [T, 1]."""
    if r is not None:
        x = x * r
    return x.T @ x


def _dequant(q: torch.Tensor, s: torch.Tensor, group: int) -> torch.Tensor:
    o, n = q.shape
    return (q.float().view(o, n // group, group) * s.float()[..., None]).view(o, n)


def _set_experts(layer, res: dict, group: int) -> None:
    ex = layer.mlp.experts
    for e, (qg, sg, qd, sd) in res.items():
        ex.gate_up_proj.data[e] = _dequant(qg, sg, group).to(ex.gate_up_proj.dtype)
        ex.down_proj.data[e] = _dequant(qd, sd, group).to(ex.down_proj.dtype)


def _names(prefix: str, e: int) -> dict[str, str]:
    return {p: f"{prefix}mlp.experts.{e}.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}


def _packed_tensors(prefix: str, res: dict) -> dict[str, torch.Tensor]:
    """Per expert weight name: `.packed` int32 [out, in/8] and `.scale` bf16 [out, in/group]."""
    t = {}
    for e, (qg, sg, qd, sd) in sorted(res.items()):
        n = _names(prefix, e)
        inter = qg.shape[0] // 2
        for name, q, s in ((n["gate_proj"], qg[:inter], sg[:inter]), (n["up_proj"], qg[inter:], sg[inter:]),
                           (n["down_proj"], qd, sd)):
            t[name + ".packed"] = pack_int4(q.contiguous()).cpu()
            t[name + ".scale"] = s.contiguous().to(torch.bfloat16).cpu()
    return t


def _atomic_save(tensors: dict, path: Path, metadata: dict | None = None) -> None:
    with atomic_path(path) as tmp:
        save_file(tensors, str(tmp), metadata=metadata)


def _atomic_json(data, path: Path) -> None:
    write_json_atomic(path, data, indent=1, end="")


def _host_acts(hidden: list, carry: list) -> dict[str, torch.Tensor]:
    """The batches this process holds (None: another rank's), under their global batch index, as host
    copies of their own (a copy on a CPU run too: the writer thread reads them while the next layer runs)."""
    t = {f"h.{b}": h.contiguous().to("cpu", copy=True) for b, h in enumerate(hidden) if h is not None}
    t.update({f"c.{b}": c.contiguous().to("cpu", copy=True) for b, c in enumerate(carry) if c is not None})
    return t


def _save_acts(path: Path, hidden: list, carry: list) -> None:
    _atomic_save(_host_acts(hidden, carry), path)


class _LayerWriter:
    """Writes one layer's work files (`_atomic_save`: temp file, fsync, rename) on one background thread,
    so that the writes (GBs of next inputs at full size) overlap the next layer's compute.

    The caller makes the host copies itself (device->host copies issued from this thread would queue
    behind the next layer's kernels) and hands over tensors it does not touch again. At most one layer's
    files are in flight: submit() first waits for the previous ones. wait() returns once they are on disk
    and re-raises a failed write's error; a failed write leaves no file at its final path (atomic_path)."""

    def __init__(self):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kq-layer-writer")
        self._pending: Future | None = None

    def submit(self, files: dict[Path, dict[str, torch.Tensor]]) -> None:
        """Write {path: tensors} in that order, in the background."""
        self.wait()
        self._pending = self._pool.submit(self._write, files)

    @staticmethod
    def _write(files: dict[Path, dict[str, torch.Tensor]]) -> None:
        for path, tensors in files.items():
            _atomic_save(tensors, path)

    def wait(self) -> None:
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        # Ending normally every write was waited for; ending on an error (or closed early) the writes in
        # flight finish on disk without being recorded as done, and the error that ends the run is the
        # caller's, not theirs.
        self._pool.shutdown(wait=True)


def _part(work_dir: Path, kind: str, i: int, rank: int | None = None) -> Path:
    """A work file of layer i, kind "acts" (its inputs) or "layer" (its results): one file, or under
    torchrun one part per rank (its calibration batches / its experts)."""
    return work_dir / (f"{kind}-{i:04d}.safetensors" if rank is None else f"{kind}-{i:04d}.rank{rank}.safetensors")


def _parts(work_dir: Path, kind: str, i: int) -> list[Path]:
    """Every file of that kind for layer i that exists: the whole file and any rank's part, of any world size."""
    one = _part(work_dir, kind, i)
    return [p for p in [one] if p.exists()] + sorted(work_dir.glob(f"{kind}-{i:04d}.rank*.safetensors"))


def _acts(work_dir: Path, i: int, rank: int | None = None) -> Path:
    return _part(work_dir, "acts", i, rank)


def _acts_files(work_dir: Path, i: int) -> list[Path]:
    return _parts(work_dir, "acts", i)


def _load_acts(work_dir: Path, i: int, n: int, device, batches: Iterable[int] | None = None) -> tuple[list, list]:
    """The inputs of layer i for `batches` (default all; None for the others), from whichever files hold
    them (a run at another world size wrote other parts; a batch's bytes are the same in any of them)."""
    want = list(range(n) if batches is None else batches)
    hidden: list = [None] * n
    carry: list = [None] * n
    for f in _acts_files(work_dir, i):
        with safe_open(str(f), framework="pt") as t:
            keys = set(t.keys())
            for b in want:
                if hidden[b] is None and f"h.{b}" in keys:
                    hidden[b] = t.get_tensor(f"h.{b}").to(device)
                    carry[b] = t.get_tensor(f"c.{b}").to(device) if f"c.{b}" in keys else None
    lost = [b for b in want if hidden[b] is None]
    if lost:
        raise KqError(f"{work_dir}: the saved inputs of layer {i} lack calibration batches {lost[:4]}; "
                      "delete the output folder and rerun")
    return hidden, carry


def fingerprint(model: LayerwiseModel, ids: torch.Tensor, cfg: GptqConfig) -> str:
    h = hashlib.sha256()
    h.update(json.dumps(model.reader.config, sort_keys=True).encode())
    c = asdict(cfg)
    for opt in ("refit", "asym"):
        if opt in c and not c[opt]:
            del c[opt]   # work folders of runs from before the option resume as before
    h.update(json.dumps(c, sort_keys=True).encode())
    h.update(ids.numpy().tobytes())
    h.update(str(model.dtype).encode())
    return h.hexdigest()[:16]


def gptq_quantize_layers(model: LayerwiseModel, calib_ids: torch.Tensor, cfg: GptqConfig, work_dir: Path, *,
                         on_layer: Callable[[int, int, dict], None] | None = None,
                         ) -> Iterator[tuple[int, list[Path], dict]]:
    """Quantize every MoE decoder layer; yields (layer index, results files, stats) in order, each once the
    layer is done (its files on disk on every rank, the state naming it; on_layer is called just before).
    Layer i's files are written by a background thread while layer i + 1 computes, so its yield comes
    after that compute; the last layer's before the generator ends.

    The results files hold `<expert weight name>.packed` (int32) and `.scale` (bf16)
    for every routed expert of the layer, each expert in one of them. Work state in `work_dir`:
      state.json                     {"fingerprint", "next_layer", "stats"}
      acts-<i>.safetensors           inputs of layer i = next_layer for all windows
      layer-<i>.safetensors          results of finished layers
    Under torchrun `acts-<i>.rank<r>` holds rank r's calibration batches and `layer-<i>.rank<r>` the
    experts rank r solved; a resumed run of any world size reads whichever files exist.
    """
    work_dir = Path(work_dir)
    work_dir.mkdir(parents=True, exist_ok=True)
    fp = fingerprint(model, calib_ids, cfg)
    state_path = work_dir / STATE
    chunks = list(calib_ids.split(cfg.batch))
    # Under torchrun only rank 0 writes the work state (lead); every rank reads it before any write.
    lead = distributed.world().lead

    def read_state():
        st = json.loads(state_path.read_text()) if state_path.exists() else None
        if st is not None and st.get("fingerprint") != fp:
            raise KqError(f"{work_dir} holds an unfinished GPTQ run with other calibration data or options; "
                          "rerun with those, or delete the output folder")
        return st
    state = distributed.agree(read_state)
    # Under torchrun a rank holds, runs and saves only its block of calibration batches.
    mine = distributed.split(len(chunks))
    part = distributed.world().rank if distributed.world().on else None
    if state is None:
        hidden = [model.embed(c) if b in mine else None for b, c in enumerate(chunks)]
        carry: list = [None] * len(chunks)
        state = {"fingerprint": fp, "next_layer": 0, "stats": {}}
        distributed.barrier()
        _save_acts(_acts(work_dir, 0, part), hidden, carry)
        distributed.barrier()
        if lead:
            _atomic_json(state, state_path)
    else:
        hidden, carry = distributed.agree(lambda: _load_acts(work_dir, state["next_layer"], len(chunks),
                                                             model.device, mine))
    distributed.barrier()
    start = state["next_layer"]

    def finish(i: int, stats: dict):
        """Layer i is done once its files are on disk on every rank: results and next inputs first, then
        the state that points at them, then the old inputs go: killed between any two steps, the state
        names complete files."""
        writer.wait()           # this rank's files of layer i (a failed write raises here: no state names it)
        distributed.barrier()   # every part of the results and of the next inputs is complete
        state["next_layer"] = i + 1
        state["stats"][str(i)] = stats
        if lead:
            # parts of layer i left by an unfinished attempt at another world size go before the state
            # names the layer done: a finished layer's files are exactly the parts of the run that did it
            ours = {_part(work_dir, "layer", i, r if part is not None else None) for r in range(distributed.world().size)}
            for p in set(_parts(work_dir, "layer", i)) - ours:
                p.unlink(missing_ok=True)
            _atomic_json(state, state_path)
            for p in _acts_files(work_dir, i):
                p.unlink(missing_ok=True)
        distributed.barrier()   # the layer is done for every rank
        if on_layer:
            on_layer(i + 1, model.num_layers, stats)
        return i, _parts(work_dir, "layer", i), stats

    # Layer i's files are written while layer i + 1 computes; layer i is finished (state, on_layer,
    # yield) just before layer i + 1's files go to the writer, and the last layer before the end.
    pending = None   # (i, stats) of the layer whose files the writer holds
    with _LayerWriter() as writer:
        for i in range(model.num_layers):
            if i < start:
                yield i, _parts(work_dir, "layer", i), state["stats"].get(str(i), {})
                continue
            layer = distributed.load_layer(model, i)
            stats: dict = {}
            res: dict = {}
            own: list = []
            if hasattr(layer.mlp, "experts"):
                X = _moe_inputs(model, layer, hidden, carry)
                res, stats = solve_experts(layer, X, cfg)
                del X
                _set_experts(layer, res, cfg.group)
                own = own_experts(layer.mlp.experts.gate_up_proj.shape[0], cfg)
            _propagate(model, layer, hidden, carry)
            del layer
            gc.collect()
            # The host copies on this thread, before waiting for the previous layer's writes, so they overlap
            # them too (two layers' host copies are held until that wait returns).
            files = {
                _acts(work_dir, i + 1, part): _host_acts(hidden, carry),   # each rank its own batches
                # each rank the codes of the experts it solved (one process: all, in one file)
                _part(work_dir, "layer", i, part): _packed_tensors(model.layer_prefix(i), {e: res[e] for e in own}),
            }
            done = finish(*pending) if pending else None
            writer.submit(files)
            del files   # the writer's until written: not held through the next layer
            pending = (i, stats)
            if done:
                yield done
        if pending:
            yield finish(*pending)


# -- the quantize run's calibrated step ----------------------------------------------------

GPTQ_DIR = "gptq"


def reader_for(source):
    """A CheckpointReader over a Source (a Hub source: every shard downloaded, read through a
    folder of links that looks like the local checkpoint; HubSource.local_folder)."""
    from kq.checkpoint.reader import CheckpointReader
    return CheckpointReader(source.local_folder(), index=source.index)


class CalibratedCodes:
    """A calibrated method (GPTQ, AWQ, AWQ+GPTQ) as a step of `kq.quantize.run.run_quantize`:

    - `run()`: the layer-wise calibration pass (or its resumption) into OUT/.kq-work/gptq.
      run_quantize calls it once, after it has claimed the output folder and before any shard
      job starts (under torchrun on every rank: each takes part in every layer's collectives).
    - `codes(name, w, scale) -> (weight_packed, weight_scale, weight_shape)`, also the object's
      `__call__`: the shard jobs' look-up of one routed-expert weight's codes in the pass's
      per-layer files (it refuses to run before `run()`: no shard job starts a model pass).
      Weights of layers the causal forward never runs (the MTP layer) get kq's RTN with MSE
      clipping: calibrating a speculative-draft layer needs the draft's own forward, and its
      experts only affect acceptance rates.
    - `summary`: the run's calibration summary (filled by `run()`).
    """

    def __init__(self, plan, model: LayerwiseModel, ids: torch.Tensor, cfg, work: Path, device: torch.device,
                 on_layer=None):
        self.plan, self.model, self.ids, self.cfg, self.work = plan, model, ids, cfg, work
        self.device, self.on_layer = device, on_layer
        self.files: dict[int, list[Path]] | None = None   # None until run()
        self._handles: dict[int, list] = {}
        self._open = threading.Lock()   # the shard jobs share the cache of opened results files
        # under_calibrated: experts the router sent fewer than min_tokens calibration tokens
        # ({layer: [experts]}); rtn_fallback: those of them quantized by RTN (policies routed/weighted).
        self.summary = {"calibration_tokens": int(ids.numel()), "policy": cfg.policy, "min_tokens": cfg.min_tokens,
                        "under_calibrated": {}, "rtn_fallback": {}}

    def run(self) -> None:
        """The whole layer-wise pass, once (resumed from the work folder's finished layers)."""
        if self.files is not None:
            return
        files = {}
        for i, fs, stats in gptq_quantize_layers(self.model, self.ids, self.cfg, self.work, on_layer=self.on_layer):
            files[i] = fs
            if stats.get("rare"):
                self.summary["under_calibrated"][str(i)] = stats["rare"]
            if stats.get("rtn_fallback"):
                self.summary["rtn_fallback"][str(i)] = stats["rtn_fallback"]
        if distributed.world().lead:
            _json_safe_write(self.work / "summary.json", self.summary)
        self.files = files

    def codes(self, name: str, w: torch.Tensor, scale: torch.Tensor | None):
        from kq.quantize.experts import dequantize_source, pack_parts
        from kq.recipes import expert_match
        if self.files is None:
            raise KqError("calibrated expert codes asked for before the calibration pass ran (CalibratedCodes.run)")
        m = expert_match(name)
        layer = int(m.group("layer")) if m else -1
        if layer not in self.files:  # the MTP layer (never run by the causal forward): RTN
            wf = dequantize_source(w, scale, self.device)
            q, s = quantize_rtn(wf, self.plan.group_size, "mse")
            return pack_parts(q, s, wf.shape)
        with self._open:
            if layer not in self._handles:  # mmap'd: only the tensors asked for are read
                opened = [safe_open(str(f), framework="pt") for f in self.files[layer]]
                self._handles[layer] = [(t, set(t.keys())) for t in opened]
        t = next((t for t, keys in self._handles[layer] if name + ".packed" in keys), None)   # the part that holds it
        if t is None:
            raise KqError(f"GPTQ results for layer {layer} have no {name}")
        packed, s = t.get_tensor(name + ".packed"), t.get_tensor(name + ".scale")
        return packed, s, torch.tensor([packed.shape[0], packed.shape[1] * 8], dtype=torch.int64)

    def __call__(self, name: str, w: torch.Tensor, scale: torch.Tensor | None):
        return self.codes(name, w, scale)


def gptq_expert_codes(source, plan, out: Path, *, calib: str, samples: int, seqlen: int,
                      device: torch.device, cfg: GptqConfig | None = None, on_layer=None) -> CalibratedCodes:
    """The calibrated step (`CalibratedCodes`) for `kq.quantize.run.run_quantize`, backed by GPTQ
    (or AWQ / AWQ+GPTQ: cfg an AwqConfig).

    Checks and tokenizes the calibration data now (before the long part, nothing written); the
    pass itself runs in `run()`, which run_quantize calls after claiming the output folder, into
    OUT/.kq-work/gptq; run_quantize removes that folder when the checkpoint is finished.
    """
    from kq.checkpoint.manifest import WORK_DIR
    from kq.quantize.calibration import calibration_ids

    cfg = cfg or GptqConfig(group=plan.group_size)
    if cfg.group != plan.group_size:
        raise KqError(f"GPTQ group {cfg.group} differs from the plan's {plan.group_size}")
    reader = reader_for(source)
    model = LayerwiseModel(reader, device=device)   # refuses families kq cannot run
    ids = calibration_ids(reader.folder, reader.config, calib, samples, seqlen)
    return CalibratedCodes(plan, model, ids, cfg, Path(out) / WORK_DIR / GPTQ_DIR, device, on_layer)


def _json_safe_write(path: Path, data) -> None:
    _atomic_json(json.loads(json.dumps(data, default=str)), path)
