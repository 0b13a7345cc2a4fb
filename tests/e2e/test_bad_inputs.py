"""Every bad input gets one clear line on stderr, exit code 2, no traceback, and nothing
written: the output folder does not exist afterwards."""
import json
import shutil
import subprocess

import pytest

from kq_testutil import SMALL_GLM5, run_kq
from kq.synth import generate


def _gen(tmp_path, name="src", family="glm5", **kw):
    d = tmp_path / name
    generate(family, d, seed=3, **({**SMALL_GLM5, **kw} if family == "glm5" else kw))
    return d


def _refused(tmp_path, src, *extra, match, env=None):
    out = tmp_path / "out"
    r = run_kq("quantize", src, "--out", out, "--device", "cpu", *extra, env=env)
    lines = [l for l in r.stderr.strip().splitlines() if l.strip()]
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr
    assert len(lines) == 1 and lines[0].startswith("kq: error: "), r.stderr
    assert match in lines[0], lines[0]
    assert not out.exists(), "nothing may be written"
    return lines[0]


def _edit_config(src, fn):
    p = src / "config.json"
    cfg = json.loads(p.read_text())
    fn(cfg)
    p.write_text(json.dumps(cfg))


def test_unknown_family(tmp_path):
    src = _gen(tmp_path)
    _edit_config(src, lambda c: c.update(model_type="llama", architectures=["LlamaForCausalLM"]))
    _refused(tmp_path, src, match="unknown model family: model_type 'llama'")


def test_unsupported_source_format(tmp_path):
    src = _gen(tmp_path)
    _edit_config(src, lambda c: c["quantization_config"].update(quant_method="gptq"))
    _refused(tmp_path, src, match="unsupported source quantization 'gptq'")


def test_missing_shard(tmp_path):
    src = _gen(tmp_path)
    (src / "model-00002-of-00003.safetensors").unlink()
    _refused(tmp_path, src, match="shard(s) named by the index are missing, e.g. model-00002-of-00003.safetensors")


def test_missing_source_folder(tmp_path):
    _refused(tmp_path, tmp_path / "nope", match="no such folder, and not a recipe alias or a Hub repo id")


def test_group_size_not_dividing(tmp_path):
    src = _gen(tmp_path, moe_intermediate=96)
    line = _refused(tmp_path, src, "--group-size", "64", match="group size 64 does not divide down_proj's input dim 96")
    assert "use --group-size 32" in line


def test_group_size_unsupported(tmp_path):
    src = _gen(tmp_path)
    _refused(tmp_path, src, "--group-size", "48", match="--group-size 48 is not supported; use one of 32, 64, 128")


def test_tp_refused_with_working_group_sizes(tmp_path):
    src = _gen(tmp_path, moe_intermediate=512)
    line = _refused(tmp_path, src, "--tp", "8", "--group-size", "128",
                    match="at TP 8: I/TP = 64 is not a multiple of group 128")
    assert line.endswith("use --group-size 32 or 64")


def test_tp_refused_when_nothing_works(tmp_path):
    src = _gen(tmp_path)  # moe_intermediate 128: 16 per rank at TP 8
    _refused(tmp_path, src, "--tp", "8", match="no group size works at TP 8")


def test_ep_not_dividing_experts(tmp_path):
    src = _gen(tmp_path)
    _refused(tmp_path, src, "--ep", "3", match="--ep 3 does not divide the 4 routed experts")


def test_corrupted_shard(tmp_path):
    src = _gen(tmp_path)
    p = src / "model-00003-of-00003.safetensors"
    b = bytearray(p.read_bytes())
    b[8:40] = b"\xff" * 32  # garbage inside the JSON header
    p.write_bytes(bytes(b))
    _refused(tmp_path, src, match="model-00003-of-00003.safetensors: corrupted")


def test_truncated_shard(tmp_path):
    src = _gen(tmp_path)
    p = src / "model-00002-of-00003.safetensors"
    with open(p, "r+b") as f:
        f.truncate(p.stat().st_size - 1000)
    _refused(tmp_path, src, match="model-00002-of-00003.safetensors: truncated")


def test_index_entry_escaping_folder(tmp_path):
    src = _gen(tmp_path)
    p = src / "model.safetensors.index.json"
    idx = json.loads(p.read_text())
    name = next(iter(idx["weight_map"]))
    idx["weight_map"][name] = "../escape.safetensors"
    p.write_text(json.dumps(idx))
    _refused(tmp_path, src, match="unsafe shard file '../escape.safetensors'")


def test_already_int4_kimi_k25(tmp_path):
    src = tmp_path / "k25"
    generate("kimi_k25", src, seed=0)
    _refused(tmp_path, src, match="already INT4")


def test_kq_output_fed_back_is_refused(tmp_path, small_glm5_out):
    _refused(tmp_path, small_glm5_out, match="already INT4")


def test_not_enough_disk(tmp_path):
    src = _gen(tmp_path)
    mnt = tmp_path / "small-disk"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mnt)], capture_output=True, text=True)
    assert r.returncode == 0, f"this test needs root to mount a small tmpfs: {r.stderr}"
    try:
        out = mnt / "out"
        r = run_kq("quantize", src, "--out", out, "--device", "cpu")
        assert r.returncode == 2 and "Traceback" not in r.stderr
        assert r.stderr.startswith("kq: error: not enough disk at ") and " free" in r.stderr, r.stderr
        assert not out.exists()
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


def test_output_folder_with_other_files(tmp_path):
    src = _gen(tmp_path)
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    r = run_kq("quantize", src, "--out", out, "--device", "cpu")
    assert r.returncode == 2 and "is not empty and is not a kq run" in r.stderr
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"]


def test_output_folder_holding_a_different_run(tmp_path, small_glm5, small_glm5_out):
    out = tmp_path / "copy"
    shutil.copytree(small_glm5_out, out)
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    r = run_kq("quantize", small_glm5, "--out", out, "--group-size", "128", "--device", "cpu")
    assert r.returncode == 2 and "already holds a finished kq checkpoint made with other options" in r.stderr
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    # the same options again: nothing to do, exit 0
    r = run_kq("quantize", small_glm5, "--out", out, "--group-size", "32", "--device", "cpu", "--json")
    assert r.returncode == 0 and json.loads(r.stdout)["status"] == "already complete"


def test_bad_option_values(tmp_path, small_glm5):
    for args, msg in ((["--to", "int8"], "--to int8: only int4"), (["--method", "smooth"], "--method smooth: use rtn, gptq, awq or awq+gptq"),
                      (["--clip", "max"], "--clip max: use mse or absmax"), (["--method", "gptq"], "needs --calib")):
        r = run_kq("quantize", small_glm5, "--out", tmp_path / "o", *args)
        assert r.returncode == 2 and msg in r.stderr and "Traceback" not in r.stderr
        assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("name,value,match", [
    ("KQ_SWITCH_INTERVAL_US", "fast", "KQ_SWITCH_INTERVAL_US='fast' is not a number"),
    ("KQ_GPU_WORKERS", "0", "KQ_GPU_WORKERS='0' must be positive"),
    ("KQ_GPU_WORKERS", "2.5", "KQ_GPU_WORKERS='2.5' is not a number"),
])
def test_bad_tuning_knob_in_the_environment(tmp_path, name, value, match):
    _refused(tmp_path, _gen(tmp_path), match=match, env={name: value})
