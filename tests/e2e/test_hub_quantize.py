"""`kq quantize ORG/NAME` from the loopback Hub stand-in, through huggingface_hub's real client:
the same bytes as quantizing the local folder, streamed shards deleted from kq's staging, and the
user's HF cache used where it already holds a shard — and never deleted from."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from hub_standin import HubStandin
from kq_testutil import calib_text

REPO = "zai-org/Tiny-GLM-FP8"


@pytest.fixture()
def hub(tmp_path, small_glm5):
    with HubStandin(tmp_path / "hub", lifetime=600) as h:
        h.add_repo_from_folder(REPO, small_glm5)
        yield h


def kq(hub, home, *args):
    cmd = [sys.executable, "-m", "kq", *map(str, args)]
    # KQ_CACHE: kq's own Hub download cache goes under the test's home, not the real one
    env = hub.client_env(home=home, KQ_CACHE=str(home / "kq-cache"))
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


def full_gets(hub, name: str) -> int:
    gets = sum(1 for m, p in hub.requests if m == "GET" and p.endswith("/" + name))
    return gets - sum(1 for p, _ in hub.range_requests if p.endswith("/" + name))


def files_of(out: Path) -> dict:
    return json.loads((out / "kq-manifest.json").read_text())["files"]


def test_streamed_hub_quantize_matches_local_and_cleans_staging(hub, tmp_path, small_glm5_out):
    out, stage, home = tmp_path / "out", tmp_path / "stage", tmp_path / "home"
    r = kq(hub, home, "quantize", REPO, "--out", out, "--group-size", 32, "--device", "cpu",
           "--stream", "--staging", stage)
    assert r.returncode == 0, r.stderr
    local = files_of(small_glm5_out)
    remote = files_of(out)
    assert remote.keys() == local.keys()
    for name in local:  # every output file identical to the local-folder run's
        assert remote[name]["sha256"] == local[name]["sha256"], name
    manifest = json.loads((out / "kq-manifest.json").read_text())
    assert manifest["source"]["repo_id"] == REPO and manifest["source"]["revision"] == hub.head(REPO).sha
    assert not list(stage.glob("*.safetensors"))  # streamed shards were released
    # No shard went into the user's cache (huggingface_hub's header reader may cache the small index).
    assert not list((home / "hub").rglob("*.safetensors"))
    for shard in (n for n in remote if n.endswith(".safetensors")):
        assert full_gets(hub, shard) == 1, shard  # each source shard downloaded once; headers by Range


def test_shard_in_user_cache_is_used_and_kept(hub, tmp_path, small_glm5):
    home, out, stage = tmp_path / "home", tmp_path / "out", tmp_path / "stage"
    index = json.loads((small_glm5 / "model.safetensors.index.json").read_text())
    shard = sorted(set(index["weight_map"].values()))[0]
    code = f"from huggingface_hub import hf_hub_download; print(hf_hub_download({REPO!r}, {shard!r}))"
    r = subprocess.run([sys.executable, "-c", code], env=hub.client_env(home=home), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    cached = Path(r.stdout.strip())
    assert full_gets(hub, shard) == 1
    r = kq(hub, home, "quantize", REPO, "--out", out, "--group-size", 32, "--device", "cpu",
           "--stream", "--staging", stage)
    assert r.returncode == 0, r.stderr
    assert cached.is_file() and cached.resolve().read_bytes() == (small_glm5 / shard).read_bytes()
    assert not (stage / shard).exists()
    assert full_gets(hub, shard) == 1  # only header Range reads since: no second download


GPTQ = ["--method", "gptq", "--calib-samples", "4", "--calib-seqlen", "64", "--group-size", "32", "--device", "cpu"]


def test_gptq_from_the_hub_matches_the_local_folder(hub, tmp_path, small_glm5):
    """GPTQ reads whole layers with the model's code: from a Hub repo it does so through a folder of
    links to the downloaded files, and writes the bytes of the local-folder run."""
    calib, home = calib_text(tmp_path), tmp_path / "home"
    local, remote = tmp_path / "local", tmp_path / "remote"
    r = kq(hub, home, "quantize", small_glm5, "--out", local, "--calib", calib, *GPTQ)
    assert r.returncode == 0, r.stderr
    r = kq(hub, home, "quantize", REPO, "--out", remote, "--calib", calib, *GPTQ)
    assert r.returncode == 0, r.stderr
    want, got = files_of(local), files_of(remote)
    assert got.keys() == want.keys() and all(got[n]["sha256"] == want[n]["sha256"] for n in want)
    view = home / "kq-cache" / "sources" / REPO.replace("/", "--") / ".view"
    assert (view / "config.json").is_symlink() and (view / "tokenizer.json").is_symlink()
    assert not any(p.is_file() and not p.is_symlink() for p in view.iterdir())   # links, not copies


def test_eval_against_a_hub_repo_equals_against_the_folder(hub, tmp_path, small_glm5, small_glm5_out):
    text, home = calib_text(tmp_path), tmp_path / "home"
    out = tmp_path / "out"
    import shutil
    shutil.copytree(small_glm5_out, out)
    res = {}
    for against in (str(small_glm5), REPO):
        r = kq(hub, home, "eval", out, "--against", against, "--text", text, "--seqs", "2", "--seqlen", "32", "--json")
        assert r.returncode == 0, r.stderr
        res[against] = json.loads(r.stdout)
    a, b = res[str(small_glm5)], res[REPO]
    assert b["source"] == REPO
    assert (a["kl"], a["top1"], a["ppl_source"], a["ppl_quantized"]) == (b["kl"], b["top1"], b["ppl_source"], b["ppl_quantized"])
    r = kq(hub, home, "eval", out, "--against", "nobody/none", "--text", text)
    assert r.returncode != 0 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    # a mistyped OUT is refused before the source is downloaded
    fresh = tmp_path / "fresh-home"
    r = kq(hub, fresh, "eval", tmp_path / "typo", "--against", REPO, "--text", text)
    assert r.returncode == 2 and "no such checkpoint folder" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not list(fresh.rglob("*.safetensors"))
