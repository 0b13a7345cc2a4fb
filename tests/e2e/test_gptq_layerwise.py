"""GPTQ layer by layer: what it buys over RTN, the fallback, resume after a crash, memory."""
from __future__ import annotations

import gzip
import json
import subprocess
import sys
import textwrap

import pytest
import torch

from kq.checkpoint.reader import CheckpointReader
from kq.errors import KqError
from kq.model import LayerwiseModel
from kq.quantize.calibration import calibration_ids
from kq.quantize.layerwise import GptqConfig, _moe_inputs, quantize_experts
from kq.quantize.rtn import quantize_rtn
from kq_testutil import SHARED, SMALL_GLM5, TINY_MODEL, calib_text, run_kq

CALIB = SHARED / "data" / "calibration_text.txt.gz"


def _deq(q, s, g):
    o, n = q.shape
    return (q.float().view(o, n // g, g) * s.float()[..., None]).view(o, n)


@pytest.fixture(scope="module")
def tiny_layer1():
    """The trained tiny model's first MoE layer and its inputs from 8 x 256 calibration tokens."""
    r = CheckpointReader(TINY_MODEL)
    m = LayerwiseModel(r)
    ids = calibration_ids(TINY_MODEL, r.config, CALIB, 8, 256)
    h, c = [m.embed(ids)], [None]
    h[0], c[0] = m.forward_layer(m.load_layer(0), h[0], c[0])
    layer = m.load_layer(1)
    return layer, _moe_inputs(m, layer, h, c)


def test_gptq_lowers_each_experts_output_error_on_the_trained_model(tiny_layer1):
    layer, X = tiny_layer1
    res, stats = quantize_experts(layer, X, GptqConfig(group=32, policy="routed", min_tokens=64))
    _, _, topi = layer.mlp.gate(X)
    Wgu = layer.mlp.experts.gate_up_proj.data
    better = 0
    checked = [e for e in range(Wgu.shape[0]) if e not in stats["rtn_fallback"]]
    assert len(checked) >= 8
    for e in checked:
        xe = X[(topi == e).any(-1)]                                       # the tokens routed to e
        qg, sg, _, _ = res[e]
        qr, sr = quantize_rtn(Wgu[e], 32, "mse")
        err_gptq = (xe @ (Wgu[e] - _deq(qg, sg, 32)).T).square().sum()
        err_rtn = (xe @ (Wgu[e] - _deq(qr, sr, 32)).T).square().sum()
        better += bool(err_gptq < 0.9 * err_rtn)
    assert better == len(checked)


def test_under_calibrated_experts_fall_back_to_rtn(tiny_layer1):
    layer, X = tiny_layer1
    res, stats = quantize_experts(layer, X, GptqConfig(group=32, policy="routed", min_tokens=10 ** 9))
    assert stats["rtn_fallback"] == list(range(16)) and sum(stats["tokens"]) == X.shape[0] * 4
    qg, sg, qd, sd = res[3]
    q, s = quantize_rtn(layer.mlp.experts.down_proj.data[3], 32, "mse")
    assert torch.equal(qd, q) and torch.equal(sd, s)


def test_every_token_policy_calibrates_every_expert(tiny_layer1):
    layer, X = tiny_layer1
    res, stats = quantize_experts(layer, X, GptqConfig(group=32, policy="all", min_tokens=10 ** 9))
    assert stats["rtn_fallback"] == [] and sorted(res) == list(range(16))
    assert stats["rare"] == list(range(16))   # still reported: fewer routed tokens than min_tokens
    qg, sg, _, _ = res[8]                                                 # a rarely routed expert
    qr, _ = quantize_rtn(layer.mlp.experts.gate_up_proj.data[8], 32, "mse")
    assert not torch.equal(qg, qr)


def test_calibration_windows_cover_the_whole_text(tmp_path):
    src = tmp_path / "ids.jsonl.gz"
    with gzip.open(src, "wt") as f:
        for d in range(10):
            f.write(json.dumps({"input_ids": list(range(d * 100 + 2, d * 100 + 90))}) + "\n")
    cfg = {"eos_token_id": 1, "vocab_size": 4096, "max_position_embeddings": 64}
    ids = calibration_ids(tmp_path, cfg, src, 5, 16)
    stream = []
    for d in range(10):
        stream += ([1] if d else []) + list(range(d * 100 + 2, d * 100 + 90))
    assert ids[0].tolist() == stream[:16] and ids[-1].tolist() == stream[-16:]   # first and last window
    with pytest.raises(KqError, match="fewer than"):
        calibration_ids(tmp_path, cfg, src, 1000, 16)
    with pytest.raises(KqError, match="max_position_embeddings"):
        calibration_ids(tmp_path, cfg, src, 2, 128)


GPTQ_ARGS = ["--method", "gptq", "--calib-samples", "8", "--calib-seqlen", "64", "--group-size", "32",
             "--device", "cpu"]

# POINT n: SIGKILL once layer n - 1 is done (on_layer), i.e. after layer n's compute, before its files go to
# the writer; write:NAME: in the writer thread, once NAME's temp file is complete, before its rename.
KILLER = textwrap.dedent("""
    import os, signal, sys, threading, torch
    from pathlib import Path
    import kq.quantize.layerwise as lw
    from kq.checkpoint.source import open_source
    from kq.quantize.plan import make_plan
    from kq.quantize.run import Options, run_quantize
    from kq.quantize.layerwise import gptq_expert_codes
    src, out, calib, point = sys.argv[1], Path(sys.argv[2]), sys.argv[3], sys.argv[4]
    device = torch.device(sys.argv[5] if len(sys.argv) > 5 else "cpu")
    source = open_source(src)
    plan = make_plan(source, group_size=32)
    def on_layer(done, total, stats):
        if point == str(done):
            os.kill(os.getpid(), signal.SIGKILL)
    if point.startswith("write:"):
        save_file = lw.save_file
        def killing_save(tensors, filename, metadata=None):
            save_file(tensors, filename, metadata=metadata)
            if Path(filename).name.startswith(point[len("write:"):]):
                if threading.current_thread() is threading.main_thread():
                    os._exit(3)   # not written in the background
                os.kill(os.getpid(), signal.SIGKILL)
        lw.save_file = killing_save
    codes = gptq_expert_codes(source, plan, out, calib=calib, samples=8, seqlen=64, device=device,
                              on_layer=on_layer)
    run_quantize(source, plan, out, Options(method="gptq", group_size=32, calib=calib), device=device,
                 expert_codes=codes)
""")


def _files(folder):
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def gptq_reference(tmp_path_factory, small_glm5):
    d = tmp_path_factory.mktemp("gptq")
    calib = calib_text(d)
    out = d / "ref"
    r = run_kq("quantize", small_glm5, "--out", out, "--calib", calib, *GPTQ_ARGS)
    assert r.returncode == 0, r.stderr
    return calib, out


def _resume_matches(src, out, calib, ref):
    """Rerun the killed quantize into `out`: it ends with the uninterrupted run's bytes (`ref`)."""
    r = run_kq("quantize", src, "--out", out, "--calib", calib, *GPTQ_ARGS)
    assert r.returncode == 0, r.stderr
    want, got = _files(ref), _files(out)
    want.pop("kq-manifest.json"), got.pop("kq-manifest.json")   # holds the creation time
    assert got.keys() == want.keys()
    assert all(got[k] == want[k] for k in want), [k for k in want if got[k] != want[k]]


@pytest.mark.parametrize("kill_after", [1, 2, 3])
def test_crash_at_a_layer_boundary_then_resume_is_byte_identical(tmp_path, small_glm5, gptq_reference, kill_after):
    calib, ref = gptq_reference
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-c", KILLER, str(small_glm5), str(out), str(calib), str(kill_after)],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == -9, r.stderr
    state = json.loads((out / ".kq-work" / "gptq" / "state.json").read_text())
    assert state["next_layer"] == kill_after
    _resume_matches(small_glm5, out, calib, ref)


def test_killed_while_the_writer_thread_writes_a_layer_then_resume_is_byte_identical(tmp_path, small_glm5,
                                                                                      gptq_reference):
    """Killed in the background writer, mid-way through layer 1's files (the next inputs complete, the codes
    in their temp file) while the main thread has gone on to layer 2: the state still names layer 1 undone,
    and the rerun redoes it and ends with the uninterrupted run's bytes."""
    calib, ref = gptq_reference
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-c", KILLER, str(small_glm5), str(out), str(calib), "write:layer-0001"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == -9, r.stderr
    work = out / ".kq-work" / "gptq"
    assert json.loads((work / "state.json").read_text())["next_layer"] == 1
    assert (work / "acts-0002.safetensors").exists() and (work / "layer-0001.safetensors.tmp").exists()
    assert not (work / "layer-0001.safetensors").exists()
    _resume_matches(small_glm5, out, calib, ref)


def test_a_failed_background_write_ends_the_pass_before_the_layer_is_marked_done(tmp_path, small_glm5,
                                                                                 monkeypatch):
    """An error in the writer thread (here a full disk while layer 1's codes are written) is raised by the
    pass itself, after layer 2's compute, and leaves no state or file that names layer 1 done."""
    import kq.quantize.layerwise as lw
    from kq.quantize.layerwise import gptq_quantize_layers
    save_file = lw.save_file

    def disk_full_at_layer_1(tensors, filename, metadata=None):
        if filename.endswith("layer-0001.safetensors.tmp"):
            raise OSError(28, "No space left on device")
        save_file(tensors, filename, metadata=metadata)
    monkeypatch.setattr(lw, "save_file", disk_full_at_layer_1)
    r = CheckpointReader(small_glm5)
    m = LayerwiseModel(r)
    ids = calibration_ids(small_glm5, r.config, calib_text(tmp_path), 8, 32)
    work = tmp_path / "work"
    done = []
    with pytest.raises(OSError, match="No space left"):
        for i, _, _ in gptq_quantize_layers(m, ids, GptqConfig(group=32), work):
            done.append(i)
    assert done == [0]
    assert json.loads((work / "state.json").read_text())["next_layer"] == 1
    assert sorted(p.name for p in work.iterdir()) == ["acts-0001.safetensors", "acts-0002.safetensors",
                                                       "layer-0000.safetensors", "state.json"]


def test_a_finished_layers_codes_are_the_parts_of_the_run_that_finished_it(tmp_path, small_glm5):
    """Codes parts of a layer left by an unfinished attempt at another world size (here a rank 2 part, with
    wrong codes) are deleted before the layer is marked done; the layer's files are then exactly this run's."""
    from safetensors import safe_open
    from safetensors.torch import save_file
    from kq.quantize.layerwise import gptq_quantize_layers
    r = CheckpointReader(small_glm5)
    m = LayerwiseModel(r)
    ids = calibration_ids(small_glm5, r.config, calib_text(tmp_path), 8, 32)
    work = tmp_path / "work"
    work.mkdir()
    name = m.layer_prefix(1) + "mlp.experts.0.gate_proj.weight.packed"
    stale = work / "layer-0001.rank2.safetensors"
    save_file({name: torch.zeros(4, 4, dtype=torch.int32)}, str(stale))
    for i, files, _ in gptq_quantize_layers(m, ids, GptqConfig(group=32), work):
        if i == 1:
            assert files == [work / "layer-0001.safetensors"] and not stale.exists()
            with safe_open(str(files[0]), framework="pt") as t:
                assert t.get_tensor(name).shape != (4, 4)
            assert json.loads((work / "state.json").read_text())["next_layer"] == 2
            break


def test_the_calibration_pass_is_a_step_run_once_before_any_shard_job(tmp_path, small_glm5):
    """run_quantize runs the calibrated method's pass (CalibratedCodes.run) once, on its own thread, after
    it has claimed the output folder and before any shard job; the shard jobs (3 at once) only look
    codes up, and a look-up before the pass is refused."""
    import threading
    from kq.checkpoint.source import open_source
    from kq.quantize.layerwise import CalibratedCodes, gptq_expert_codes
    from kq.quantize.plan import make_plan
    from kq.quantize.run import Options, run_quantize
    source = open_source(str(small_glm5))
    plan = make_plan(source, group_size=32)
    out = tmp_path / "out"
    codes = gptq_expert_codes(source, plan, out, calib=str(calib_text(tmp_path)), samples=4, seqlen=32,
                              device=torch.device("cpu"))
    assert isinstance(codes, CalibratedCodes) and not out.exists()   # nothing written yet
    name = next(t.src for sp in plan.shards for t in sp.tensors if t.action != "copy" and ".layers.1." in t.src)
    with pytest.raises(KqError, match="before the calibration pass"):
        codes(name, torch.zeros(1), None)
    events = []
    run, lookup = codes.run, codes.codes

    def spy_run():
        events.append(("run", (out / ".kq-work" / "run.json").exists(), threading.current_thread()))
        run()
        events.append(("ran", None, None))

    def spy_lookup(*a):
        events.append(("codes", None, threading.current_thread()))
        return lookup(*a)
    codes.run, codes.codes = spy_run, spy_lookup
    summary = run_quantize(source, plan, out, Options(method="gptq", group_size=32, jobs=3, calib="calib.txt"),
                           device=torch.device("cpu"), expert_codes=codes)
    assert summary["status"] == "written" and run_kq("verify", out).returncode == 0
    kinds = [e[0] for e in events]
    assert kinds[:2] == ["run", "ran"] and kinds.count("run") == 1 and set(kinds[2:]) == {"codes"}
    assert events[0][1] is True and events[0][2] is threading.main_thread()   # folder claimed, not a shard thread
    assert codes.summary["calibration_tokens"] > 0


@pytest.mark.gpu
def test_crash_and_resume_on_the_gpu_is_byte_identical(tmp_path, small_glm5):
    """The same on CUDA (TF32 Hessians, cuBLAS): a run killed after layer 2 and resumed gives the
    bytes of an uninterrupted CUDA run."""
    calib = calib_text(tmp_path)
    args = [*GPTQ_ARGS[:-1], "cuda"]
    ref, out = tmp_path / "ref", tmp_path / "out"
    r = run_kq("quantize", small_glm5, "--out", ref, "--calib", calib, *args)
    assert r.returncode == 0, r.stderr
    r = subprocess.run([sys.executable, "-c", KILLER, str(small_glm5), str(out), str(calib), "2", "cuda"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == -9, r.stderr
    r = run_kq("quantize", small_glm5, "--out", out, "--calib", calib, *args)
    assert r.returncode == 0, r.stderr
    want, got = _files(ref), _files(out)
    want.pop("kq-manifest.json"), got.pop("kq-manifest.json")
    assert got.keys() == want.keys()
    assert all(got[k] == want[k] for k in want), [k for k in want if got[k] != want[k]]


def test_gptq_output_differs_from_rtn_and_verifies(small_glm5, small_glm5_out, gptq_reference):
    _, ref = gptq_reference
    assert run_kq("verify", ref).returncode == 0
    a, b = _files(ref), _files(small_glm5_out)
    shard = "model-00002-of-00003.safetensors"
    assert a[shard] != b[shard]   # same layout, other codes


def test_other_calibration_refuses_to_resume(tmp_path, small_glm5):
    calib = calib_text(tmp_path)
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-c", KILLER, str(small_glm5), str(out), str(calib), "1"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == -9
    other = tmp_path / "other.txt"
    other.write_text(calib.read_text()[::-1])
    r = run_kq("quantize", small_glm5, "--out", out, "--calib", other, *GPTQ_ARGS)
    assert r.returncode == 2 and "other calibration" in r.stderr, r.stderr


def test_gptq_options_are_checked_before_any_work(tmp_path, small_glm5):
    calib = calib_text(tmp_path)
    r = run_kq("quantize", small_glm5, "--out", tmp_path / "o", "--calib", calib, *GPTQ_ARGS, "--calib-policy", "some")
    assert r.returncode == 2 and "--calib-policy some" in r.stderr, r.stderr
    r = run_kq("quantize", small_glm5, "--out", tmp_path / "o", "--calib", calib, *GPTQ_ARGS, "--gptq-damp", "0")
    assert r.returncode == 2 and "damp" in r.stderr, r.stderr
    r = run_kq("quantize", small_glm5, "--out", tmp_path / "o", "--calib", calib, *GPTQ_ARGS, "--gptq-clip", "best")
    assert r.returncode == 2 and "GPTQ clip 'best': use mse, absmax or search" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "o").exists()


def test_refit_option_changes_the_work_fingerprint_default_does_not_move():
    from kq.quantize.layerwise import fingerprint

    class M:   # what fingerprint reads
        reader = type("R", (), {"config": {"a": 1}})()
        dtype = torch.float32
    ids = torch.zeros(2, 4, dtype=torch.int64)
    base = fingerprint(M, ids, GptqConfig(group=32))
    assert fingerprint(M, ids, GptqConfig(group=32, refit=True)) != base
    assert fingerprint(M, ids, GptqConfig(group=32, policy="routed")) != base
    # the default damping is resolved per group size, so an explicit equal value is the same work
    assert fingerprint(M, ids, GptqConfig(group=32, damp=0.01)) == base
    assert GptqConfig(group=128).damp == 0.001 and GptqConfig(group=64).damp == 0.01
    assert fingerprint(M, ids, GptqConfig(group=32, asym=True)) != base
