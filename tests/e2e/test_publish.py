"""`kq publish` end to end: a real kq checkpoint (synth + quantize), the real `kq` CLI in a
subprocess, huggingface_hub's real client, and the loopback Hub stand-in."""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hub_standin import HubStandin

TOKEN = "hf_kqtest_SECRET_4f2a9c1e7b"
BASE = "zai-org/GLM-5.2-FP8"


@pytest.fixture(scope="module")
def checkpoint(small_glm5, tmp_path_factory) -> Path:
    """One real kq output folder for the module: conftest's small GLM-5.2-layout source, quantized."""
    from kq.checkpoint.source import open_source
    from kq.quantize.plan import make_plan
    from kq.quantize.run import Options, run_quantize

    root = tmp_path_factory.mktemp("ckpt")
    src = shutil.copytree(small_glm5, root / "src")
    cfg = json.loads((src / "config.json").read_text())
    cfg["_name_or_path"] = BASE  # as in a config saved from the Hub: becomes the card's base_model
    (src / "config.json").write_text(json.dumps(cfg, indent=2))
    source = open_source(str(src))
    run_quantize(source, make_plan(source, group_size=32), root / "out", Options(group_size=32),
                 device=torch.device("cpu"))
    return root / "out"


@pytest.fixture()
def out(checkpoint, tmp_path) -> Path:
    d = tmp_path / "GLM-INT4"
    shutil.copytree(checkpoint, d)
    return d


@pytest.fixture()
def hub(tmp_path):
    with HubStandin(tmp_path / "hub", tokens={TOKEN: "alice"}, orgs={"alice": ["kq-org"]}) as h:
        yield h


def kq(hub, *args, token=TOKEN, home=None, wait=True, timeout=300):
    env = hub.client_env(token=token, home=home or hub.root / "home")
    cmd = [sys.executable, "-m", "kq", *map(str, args)]
    if not wait:
        return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)


def manifest(out: Path) -> dict:
    return json.loads((out / "kq-manifest.json").read_text())


def assert_no_token_anywhere(out: Path, *texts: str) -> None:
    for t in texts:
        assert TOKEN not in t
    for f in out.rglob("*"):
        if f.is_file():
            assert TOKEN.encode() not in f.read_bytes(), f


def assert_landed(hub, repo_id: str, out: Path, branch: str = "main") -> None:
    remote = hub.repo_dir(repo_id, branch)
    for name, rec in manifest(out)["files"].items():
        assert (remote / name).read_bytes() == (out / name).read_bytes(), name
    for name in ("kq-manifest.json", "README.md"):
        assert (remote / name).read_bytes() == (out / name).read_bytes()
    uploaded = {p.relative_to(remote).as_posix() for p in remote.rglob("*") if p.is_file()}
    expected = set(manifest(out)["files"]) | {"kq-manifest.json", "README.md", ".gitattributes"}
    assert uploaded == expected  # nothing from .cache/ or anything else in OUT


def test_fresh_upload(hub, out):
    r = kq(hub, "publish", out, "alice/GLM-INT4", "--workers", 1)
    assert r.returncode == 0, r.stderr
    assert_landed(hub, "alice/GLM-INT4", out)
    card = (hub.repo_dir("alice/GLM-INT4") / "README.md").read_text()
    assert f"base_model: {BASE}" in card and "--model-path alice/GLM-INT4 --tp 8 --disable-shared-experts-fusion" in card
    assert "published:" in r.stdout and hub.head("alice/GLM-INT4").sha in r.stdout
    shards = [n for n in manifest(out)["files"] if n.endswith(".safetensors")]
    assert sorted(hub.lfs_puts) == sorted(manifest(out)["files"][n]["sha256"] for n in shards)
    assert hub.commit_count("alice/GLM-INT4") == 2  # the Hub's initial commit + one upload commit, as planned
    assert_no_token_anywhere(out, r.stdout, r.stderr)


def test_interrupted_upload_resumes_without_resending(hub, out):
    hub.hold_lfs_puts_after(1)  # the second shard's PUT hangs: kill the client there
    p = kq(hub, "publish", out, "alice/GLM-INT4", "--workers", 1, wait=False)
    try:
        assert hub.held.wait(120), "client never reached the second LFS upload"
    finally:
        os.kill(p.pid, signal.SIGKILL)
        p.communicate(timeout=30)
    hub.release()
    first = list(hub.lfs_puts)
    assert len(first) == 1 and not (hub.repo_dir("alice/GLM-INT4") / "kq-manifest.json").exists()
    assert (out / ".cache" / "kq-publish.json").exists()

    puts_before = hub.count("PUT")
    r = kq(hub, "publish", out, "alice/GLM-INT4", "--workers", 1)
    assert r.returncode == 0, r.stderr
    assert_landed(hub, "alice/GLM-INT4", out)
    second = hub.lfs_puts[len(first):]
    assert first[0] not in second  # the shard already sent was not sent again
    assert len(hub.lfs_puts) == len(set(hub.lfs_puts)) == 3
    assert hub.count("PUT") - puts_before == 2
    assert_no_token_anywhere(out, r.stdout, r.stderr)


def test_rejected_token(hub, out):
    r = kq(hub, "publish", out, "alice/GLM-INT4", token="hf_not_a_valid_token_123")
    assert r.returncode == 2
    err = r.stderr.strip().splitlines()[-1]
    assert "the Hub rejected your token" in err and "Traceback" not in r.stderr
    assert "hf_not_a_valid_token_123" not in r.stdout + r.stderr
    assert "alice/GLM-INT4" not in hub.repos
    assert hub.count("POST") == 0


def test_no_token(hub, out):
    r = kq(hub, "publish", out, "alice/GLM-INT4", token=None)
    assert r.returncode == 2 and "no Hugging Face token" in r.stderr and "Traceback" not in r.stderr
    assert hub.requests == []


def test_name_collision_refused_and_branch_allowed(hub, out, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text("{}")
    (other / "README.md").write_text("someone else's model\n")
    hub.add_repo_from_folder("alice/GLM-INT4", other)
    commits = hub.commit_count("alice/GLM-INT4")
    r = kq(hub, "publish", out, "alice/GLM-INT4")
    assert r.returncode == 2 and "already exists on the Hub and holds something else" in r.stderr
    assert "Traceback" not in r.stderr
    assert hub.commit_count("alice/GLM-INT4") == commits and hub.count("PUT") == 0
    assert not (out / ".cache" / "kq-publish.json").exists()
    # Publishing to a branch of it is an explicit choice: main stays as it was.
    r = kq(hub, "publish", out, "alice/GLM-INT4", "--revision", "int4")
    assert r.returncode == 0, r.stderr
    assert_landed(hub, "alice/GLM-INT4", out, branch="int4")
    card = (hub.repo_dir("alice/GLM-INT4", "int4") / "README.md").read_text()
    assert "--model-path alice/GLM-INT4 --revision int4 --tp 8" in card
    assert (hub.repo_dir("alice/GLM-INT4") / "README.md").read_text() == "someone else's model\n"


def test_other_namespace_refused(hub, out):
    r = kq(hub, "publish", out, "bob/GLM-INT4")
    assert r.returncode == 2 and "user alice cannot write to namespace bob" in r.stderr
    r = kq(hub, "publish", out, "kq-org/GLM-INT4", "--private", "--workers", 1)
    assert r.returncode == 0, r.stderr
    assert hub.repos["kq-org/GLM-INT4"].private


def test_checkpoint_failing_verification_is_refused(hub, out):
    shard = sorted(out.glob("model-*.safetensors"))[0]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF  # one flipped byte in the last tensor
    shard.write_bytes(bytes(data))
    r = kq(hub, "publish", out, "alice/GLM-INT4")
    assert r.returncode == 2 and "fails verification" in r.stderr and "not publishing" in r.stderr
    assert hub.requests == []  # refused before any network call
    assert not (out / "README.md").exists()


def test_unfinished_folder_refused(hub, out):
    (out / "kq-manifest.json").unlink()
    r = kq(hub, "publish", out, "alice/GLM-INT4")
    assert r.returncode == 2 and "not a finished kq checkpoint" in r.stderr and hub.requests == []


def test_dry_run_prints_files_bytes_commits_and_card(hub, out):
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    r = kq(hub, "publish", out, "alice/GLM-INT4", "--dry-run")
    assert r.returncode == 0, r.stderr
    m = manifest(out)
    files = dict(m["files"])
    files["kq-manifest.json"] = {"size": (out / "kq-manifest.json").stat().st_size}
    card_start = r.stdout.index("README.md:\n")
    card = r.stdout[card_start + len("README.md:\n"):]
    files["README.md"] = {"size": len(card.rstrip("\n").encode()) + 1}
    for name, rec in files.items():
        assert any(line.split() == [name, f"{rec['size']:,}"] for line in r.stdout.splitlines()), name
    total = sum(rec["size"] for rec in files.values())
    assert f"files:   {len(files)} files, {total:,} bytes" in r.stdout
    assert "commits: 1 (" in r.stdout
    assert "create alice/GLM-INT4 if it does not exist" in r.stdout
    assert card.startswith("---\n") and f"base_model: {BASE}" in card
    assert hub.requests == []  # a dry run sends nothing
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before  # and writes nothing
    assert_no_token_anywhere(out, r.stdout, r.stderr)


def test_user_card_is_kept_unless_overwrite(hub, out):
    (out / "README.md").write_text("# my own card\n")
    r = kq(hub, "publish", out, "alice/GLM-INT4", "--workers", 1)
    assert r.returncode == 0, r.stderr
    assert (hub.repo_dir("alice/GLM-INT4") / "README.md").read_text() == "# my own card\n"
    r = kq(hub, "publish", out, "alice/GLM-INT4", "--workers", 1, "--overwrite-card")
    assert r.returncode == 0, r.stderr
    assert "base_model_relation: quantized" in (hub.repo_dir("alice/GLM-INT4") / "README.md").read_text()
    assert_landed(hub, "alice/GLM-INT4", out)


def test_connection_cut_mid_shard_is_retried_and_lands_intact(hub, out):
    hub.drop_after_bytes(200_000)  # the first upload body dies part-way
    r = kq(hub, "publish", out, "alice/GLM-INT4", "--workers", 1)
    assert r.returncode == 0, r.stderr
    assert_landed(hub, "alice/GLM-INT4", out)
    assert hub.count("PUT") == 4 and len(hub.lfs_puts) == len(set(hub.lfs_puts)) == 3


def test_republish_same_checkpoint_from_a_fresh_copy_sends_nothing(hub, out, tmp_path):
    r = kq(hub, "publish", out, "alice/GLM-INT4", "--workers", 1)
    assert r.returncode == 0, r.stderr
    commits, puts = hub.commit_count("alice/GLM-INT4"), hub.count("PUT")
    copy = shutil.copytree(out, tmp_path / "copy", ignore=shutil.ignore_patterns(".cache"))
    r = kq(hub, "publish", copy, "alice/GLM-INT4", "--workers", 1)  # no local resume state at all
    assert r.returncode == 0, r.stderr
    assert hub.count("PUT") == puts and hub.commit_count("alice/GLM-INT4") == commits
    assert_landed(hub, "alice/GLM-INT4", copy)


def test_publishing_to_a_second_repo_sends_everything_there(hub, out):
    assert kq(hub, "publish", out, "alice/First", "--workers", 1).returncode == 0
    r = kq(hub, "publish", out, "alice/Second", "--workers", 1)
    assert r.returncode == 0, r.stderr
    assert_landed(hub, "alice/Second", out)


def test_someone_elses_repo_is_refused_in_one_line(hub, out, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text("{}")
    hub.add_repo_from_folder("bob/Model", other)
    r = kq(hub, "publish", out, "bob/Model", "--revision", "int4")
    assert r.returncode == 2 and "user alice cannot write to namespace bob" in r.stderr
    assert "Traceback" not in r.stderr and hub.count("PUT") == 0 and "int4" not in hub.repos["bob/Model"].branches


def test_offline_or_unreachable_hub_is_one_line(tmp_path, out):
    with HubStandin(tmp_path / "gone", tokens={TOKEN: "alice"}) as gone:
        pass  # stopped: its loopback port now refuses connections
    r = kq(gone, "publish", out, "alice/GLM-INT4")
    assert r.returncode == 2 and "cannot reach the Hub at http://127.0.0.1:" in r.stderr
    assert "Traceback" not in r.stderr
    env_offline = gone.client_env(token=TOKEN, HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, "-m", "kq", "publish", str(out), "alice/GLM-INT4"], env=env_offline,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "HF_HUB_OFFLINE is set" in r.stderr and "Traceback" not in r.stderr
    r = subprocess.run([sys.executable, "-m", "kq", "publish", str(out), "alice/GLM-INT4", "--dry-run"],
                       env=env_offline, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "files:" in r.stdout
