"""`kq quantize` under torchrun (gloo on the CPU): the same bytes as one process, for every file, at world
sizes 2 and 3 (uneven splits); resume after one rank is killed; one error line for all ranks.

Each method is one entry of METHODS (its CLI arguments); the split rules are checked directly below.
"""
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kq_testutil import calib_text, run_kq

from kq.quantize.distributed import World, merge_stats, owners, split

HERE = Path(__file__).resolve().parents[1]  # tests/, where the helper scripts live
# 24 windows of 32 tokens = 3 calibration batches of 8; expert chunks of 1 = 4 chunks of SMALL_GLM5's 4 experts:
# world 2 splits them 2/1 and 2/2, world 3 1/1/1 and 2/1/1.
METHODS = {
    "rtn": ["--group-size", "32", "--device", "cpu"],
    "gptq": ["--method", "gptq", "--calib", "{calib}", "--calib-samples", "24", "--calib-seqlen", "32",
             "--gptq-expert-chunk", "1", "--group-size", "32", "--device", "cpu"],
    # AWQ splits its experts one by one (awq+gptq: by GPTQ's chunks): world 2 takes 2/2, world 3 2/1/1.
    "awq": ["--method", "awq", "--calib", "{calib}", "--calib-samples", "24", "--calib-seqlen", "32",
            "--group-size", "32", "--device", "cpu"],
}


def _args(method, calib):
    return [a.replace("{calib}", str(calib)) for a in METHODS[method]]


def _torchrun(n, *args, timeout=600):
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(HERE.parent))
    return subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(n), "--standalone",
                           "--max-restarts", "0", *map(str, args)], capture_output=True, text=True, env=env,
                          timeout=timeout, cwd=HERE.parent)


def _hashes(folder: Path) -> dict[str, str]:
    return {p.relative_to(folder).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def _experts_in(path: Path) -> list[int]:
    from safetensors import safe_open
    with safe_open(str(path), framework="pt") as t:
        return sorted({int(k.split(".experts.")[1].split(".")[0]) for k in t.keys()})


@pytest.fixture(scope="module")
def calib(tmp_path_factory):
    return calib_text(tmp_path_factory.mktemp("calib"))


@pytest.fixture(scope="module")
def single(tmp_path_factory, small_glm5, calib):
    """The single-process output of each method (plain `kq quantize`, no torchrun), made once. With one
    intra-op thread, as torchrun gives each rank: on the CPU, GPTQ's bytes depend on torch's thread count."""
    made = {}

    def get(method):
        if method not in made:
            out = tmp_path_factory.mktemp(f"single-{method}") / "out"
            r = run_kq("quantize", small_glm5, "--out", out, *_args(method, calib), env={"OMP_NUM_THREADS": "1"})
            assert r.returncode == 0, r.stderr
            made[method] = out
        return made[method]
    return get


def test_split_gives_each_rank_a_contiguous_block_first_ranks_one_more():
    assert [list(split(5, World(r, 3))) for r in range(3)] == [[0, 1], [2, 3], [4]]
    assert [list(split(2, World(r, 3))) for r in range(3)] == [[0], [1], []]
    assert owners(5, World(0, 3)) == [0, 0, 1, 1, 2]
    for n in range(12):
        for size in (1, 2, 3, 8):
            blocks = [list(split(n, World(r, size))) for r in range(size)]
            assert sum(blocks, []) == list(range(n))
            assert max(map(len, blocks)) - min(map(len, blocks)) <= 1


def test_merge_stats_keeps_what_ranks_agree_on_and_joins_per_expert_lists_in_rank_order():
    a = {"tokens": [5, 0, 9, 1], "rare": [1, 3], "rtn_fallback": [1]}
    b = {"tokens": [5, 0, 9, 1], "rare": [1, 3], "rtn_fallback": [3]}
    assert merge_stats([a, b]) == {"tokens": [5, 0, 9, 1], "rare": [1, 3], "rtn_fallback": [1, 3]}
    assert merge_stats([{"scales": {0: 1.0}}, {"scales": {2: 0.5}}]) == {"scales": {0: 1.0, 2: 0.5}}
    # each rank's own list is joined even where two ranks' lists are equal
    assert merge_stats([{"rtn_fallback": []}, {"rtn_fallback": []}]) == {"rtn_fallback": []}
    assert merge_stats([{"rtn_fallback": [2]}, {"rtn_fallback": [2]}]) == {"rtn_fallback": [2, 2]}
    with pytest.raises(RuntimeError, match="disagree"):
        merge_stats([{"n": 1}, {"n": 2}])


@pytest.mark.slow
@pytest.mark.parametrize("method", list(METHODS))
@pytest.mark.parametrize("world", [2, 3])
def test_torchrun_output_is_byte_identical_to_one_process(tmp_path, small_glm5, calib, single, method, world):
    out = tmp_path / "out"
    r = _torchrun(world, "-m", "kq", "quantize", small_glm5, "--out", out, *_args(method, calib))
    assert r.returncode == 0, r.stderr[-3000:]
    assert f"x {world} ranks" in r.stderr and r.stderr.count("done in") == 1   # rank 0 alone reports
    assert _hashes(out) == _hashes(single(method))
    assert not (out / ".kq-work").exists()


@pytest.mark.slow
@pytest.mark.parametrize("method,kill_rank,point,rerun_world", [("rtn", 1, 1, 2), ("gptq", 1, 2, 1),
                                                                ("gptq", 0, 1, 3), ("awq", 1, 2, 3)])
def test_kill_one_rank_then_rerun_resumes_byte_identical(tmp_path, small_glm5, calib, single, method, kill_rank,
                                                         point, rerun_world):
    out = tmp_path / "out"
    r = _torchrun(2, HERE / "_dist_killed_run.py", small_glm5, out, method, calib, kill_rank, point)
    assert r.returncode != 0 and "finished without being killed" not in r.stdout, r.stderr[-3000:]
    assert not (out / "kq-manifest.json").exists()
    if method != "rtn":   # the state names the last layer every rank finished
        work = out / ".kq-work" / "gptq"
        assert json.loads((work / "state.json").read_text())["next_layer"] == point
        # each finished layer's codes: one part per rank, holding exactly the experts that rank solved
        # (expert chunks of 1: SMALL_GLM5's 4 experts split 2/2; layer 0 is dense)
        for i in range(point):
            assert sorted(p.name for p in work.glob(f"layer-{i:04d}*")) == \
                [f"layer-{i:04d}.rank{r}.safetensors" for r in (0, 1)]
            held = [_experts_in(work / f"layer-{i:04d}.rank{r}.safetensors") for r in (0, 1)]
            assert held == ([[], []] if i == 0 else [[0, 1], [2, 3]]), (i, held)
    if rerun_world == 1:   # resumed by one process, without torchrun
        r = run_kq("quantize", small_glm5, "--out", out, *_args(method, calib), env={"OMP_NUM_THREADS": "1"})
    else:
        r = _torchrun(rerun_world, "-m", "kq", "quantize", small_glm5, "--out", out, *_args(method, calib))
    assert r.returncode == 0, r.stderr[-3000:]
    if method == "rtn":
        assert "already written, skipped (resume)" in r.stderr
    assert _hashes(out) == _hashes(single(method))


@pytest.mark.slow
def test_an_error_every_rank_hits_is_one_line(tmp_path, small_glm5):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    r = _torchrun(2, "-m", "kq", "quantize", small_glm5, "--out", out, "--group-size", "32", "--device", "cpu")
    assert r.returncode != 0
    lines = [ln for ln in r.stderr.splitlines() if ln.startswith("kq: error:")]
    assert lines == [f"kq: error: --out {out} is not empty and is not a kq run; choose an empty or new folder"], \
        r.stderr[-3000:]
    # torchrun prints its own report of the failed worker; no traceback comes from kq
    import kq
    pkg = str(Path(kq.__file__).resolve().parent) + "/"   # kq's own files (a clone's folder may be named kq too)
    assert not [ln for ln in r.stderr.splitlines() if ln.strip().startswith("File") and pkg in ln]
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


@pytest.mark.gpu
@pytest.mark.parametrize("method", list(METHODS))
def test_torchrun_on_two_gpus_is_byte_identical_to_one_gpu(tmp_path, small_glm5, calib, method):
    """The same over NCCL: two ranks on two GPUs against one process on one GPU."""
    import torch
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    args = [a if a != "cpu" else "cuda" for a in _args(method, calib)]
    one, two = tmp_path / "one", tmp_path / "two"
    r = run_kq("quantize", small_glm5, "--out", one, *args)
    assert r.returncode == 0, r.stderr
    r = _torchrun(2, "-m", "kq", "quantize", small_glm5, "--out", two, *args)
    assert r.returncode == 0, r.stderr[-3000:]
    assert _hashes(two) == _hashes(one)
