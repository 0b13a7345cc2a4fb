"""StreamingShardWriter: hashing on its own thread, os.write, mmap copies of kept tensors,
and the KQ_PROFILE stage table. Cheap, CPU only."""
import hashlib
import json
import threading

import pytest
import torch
from safetensors.torch import load_file

from kq.checkpoint.safetensors_io import StreamingShardWriter, TensorEntry, read_header
from kq.profile import PROFILE, Profile
from kq_testutil import run_kq


def _src_file(tmp_path, nbytes=3 << 20):
    p = tmp_path / "src.bin"
    data = bytes(range(256)) * (nbytes // 256)
    p.write_bytes(b"x" * 100 + data)
    return p, TensorEntry("kept", "U8", (len(data),), 100, 100 + len(data)), data


def test_writer_bytes_hash_and_copy(tmp_path):
    src, entry, data = _src_file(tmp_path)
    a = torch.arange(3 * 1000, dtype=torch.int32).reshape(3, 1000)
    b = torch.randn(17, 5).to(torch.bfloat16)
    out = tmp_path / "o.safetensors"
    w = StreamingShardWriter(out, [("a", "I32", (3, 1000)), ("kept", "U8", entry.shape), ("b", "BF16", (17, 5))],
                             {"format": "pt"})
    w.write("a", a)
    w.copy_from("kept", src, entry, chunk=1 << 20)  # several chunks
    w.write("b", b)
    sha, size = w.close()
    raw = out.read_bytes()
    assert sha == hashlib.sha256(raw).hexdigest() and size == len(raw)
    assert not (tmp_path / "o.safetensors.tmp").exists()
    got = load_file(out)
    assert torch.equal(got["a"], a) and torch.equal(got["b"], b)
    assert bytes(got["kept"].numpy()) == data
    assert read_header(out).metadata == {"format": "pt"}


def test_writer_refuses_and_aborts_cleanly(tmp_path):
    src, entry, _ = _src_file(tmp_path)
    out = tmp_path / "o.safetensors"
    before = threading.active_count()
    w = StreamingShardWriter(out, [("a", "I32", (2,)), ("kept", "U8", entry.shape)])
    with pytest.raises(RuntimeError, match="out of order"):
        w.write("kept", b"")
    with pytest.raises(RuntimeError, match="header says"):
        w.write("a", torch.zeros(3, dtype=torch.int32))
    w.write("a", torch.zeros(2, dtype=torch.int32))
    src.write_bytes(b"short")  # the source shrank after its header was read
    with pytest.raises(RuntimeError, match="ended early"):
        w.copy_from("kept", src, entry)
    with pytest.raises(RuntimeError, match="never written"):
        w.close()
    w.abort()
    assert not out.exists() and not (tmp_path / "o.safetensors.tmp").exists()
    assert threading.active_count() == before  # the hasher thread is gone


def test_profile_off_is_silent_and_on_sums_stages():
    PROFILE.reset(on=False)
    PROFILE.add("write", 0.0, 10)
    assert PROFILE.summary()["stages"] == {}
    PROFILE.reset(on=True)
    try:
        ts = [threading.Thread(target=PROFILE.add, args=("write", 0.0, 10)) for _ in range(3)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        s = PROFILE.summary()
        assert s["stages"]["write"]["calls"] == 3 and s["threads"] == 3
        assert Profile.line(s).startswith("kq profile: wall ")
    finally:
        PROFILE.reset(on=False)


def test_quantize_profile_in_json_and_stderr(tmp_path, small_glm5, small_glm5_out):
    out = tmp_path / "out"
    r = run_kq("quantize", small_glm5, "--out", out, "--group-size", "32", "--device", "cpu", "--jobs", "2",
               "--json", env={"KQ_PROFILE": "1"})
    assert r.returncode == 0, r.stderr
    summary = json.loads(r.stdout.strip().splitlines()[-1])
    stages = summary["profile"]["stages"]
    assert {"read", "quant_cpu", "write", "sha256", "fsync"} <= set(stages), stages
    assert stages["write"]["gb"] == stages["sha256"]["gb"]  # every written byte was hashed
    assert "kq profile: wall " in r.stderr
    # byte-identical to the session's (unprofiled, one job) output
    for p in small_glm5_out.iterdir():
        if p.is_file():
            assert (out / p.name).read_bytes() == p.read_bytes(), p.name
