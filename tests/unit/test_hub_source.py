"""kq.checkpoint.hub against the loopback Hub stand-in, through huggingface_hub's real client.

The client side runs in a subprocess so huggingface_hub reads HF_ENDPOINT / HF_HUB_OFFLINE /
HF_HOME at import, exactly as it does for a user.
"""

import json
import os
import textwrap
from pathlib import Path

import pytest

from hub_standin import HubStandin, run_python

TOKEN = "hf_standin_secret_token_0123456789"

CLIENT = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from kq.errors import KqError
    from kq.checkpoint import hub
    try:
        result = ({body})
    except KqError as err:
        print(str(err), file=sys.stderr)
        sys.exit(2)
    print(json.dumps(result, default=str))
    """
)


def call(env, body: str):
    r = run_python(CLIENT.format(body=body), env)
    assert r.returncode in (0, 2), r.stderr
    return r


@pytest.fixture()
def src(tmp_path):
    d = tmp_path / "src"
    d.mkdir()
    (d / "config.json").write_text('{"model_type": "glm_moe_dsa"}')
    (d / "model-00001-of-00002.safetensors").write_bytes(os.urandom(300_000))
    (d / "model-00002-of-00002.safetensors").write_bytes(os.urandom(200_000))
    return d


@pytest.fixture()
def hub(tmp_path, src):
    with HubStandin(tmp_path / "hub", tokens={TOKEN: "alice"}) as h:
        h.add_repo_from_folder("zai-org/Tiny-FP8", src)
        yield h


def test_resolve_repo_lists_files_sizes_and_commit(hub, src, tmp_path):
    r = call(hub.client_env(home=tmp_path / "home"), "hub.resolve_repo('zai-org/Tiny-FP8').__dict__")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["sha"] == hub.head("zai-org/Tiny-FP8").sha
    for f in src.iterdir():
        assert info["files"][f.name] == f.stat().st_size
    assert info["from_cache"] is False


def test_fetch_file_downloads_into_staging_then_release_deletes_it(hub, src, tmp_path):
    env = hub.client_env(home=tmp_path / "home")
    stage = tmp_path / "stage"
    name = "model-00001-of-00002.safetensors"
    r = call(env, f"str(hub.fetch_file('zai-org/Tiny-FP8', {name!r}, dest_dir=Path({str(stage)!r})))")
    assert r.returncode == 0, r.stderr
    got = Path(json.loads(r.stdout))
    assert got == stage / name
    assert got.read_bytes() == (src / name).read_bytes()
    # Nothing went into the user's cache: the download was kq's own.
    assert not (tmp_path / "home" / "hub" / "models--zai-org--Tiny-FP8").exists()
    r = call(env, f"hub.release_file(Path({str(got)!r}), Path({str(stage)!r}))")
    assert json.loads(r.stdout) is True and not got.exists()


def test_file_in_user_cache_is_used_in_place_and_never_deleted(hub, src, tmp_path):
    env = hub.client_env(home=tmp_path / "home")
    name = "model-00002-of-00002.safetensors"
    # The user downloaded it earlier, into their HF cache.
    r = run_python(f"from huggingface_hub import hf_hub_download; print(hf_hub_download('zai-org/Tiny-FP8', {name!r}))", env)
    assert r.returncode == 0, r.stderr
    cached = r.stdout.strip()
    gets_before = hub.count("GET", f"/resolve/")
    stage = tmp_path / "stage"
    r = call(env, f"str(hub.fetch_file('zai-org/Tiny-FP8', {name!r}, dest_dir=Path({str(stage)!r})))")
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    assert got == cached and hub.count("GET", "/resolve/") == gets_before  # no second download, no copy
    assert not (stage / name).exists()
    r = call(env, f"hub.release_file(Path({got!r}), Path({str(stage)!r}))")
    assert json.loads(r.stdout) is False and Path(cached).is_file()


def test_offline_uses_cache_and_says_so_when_nothing_is_cached(hub, tmp_path):
    env = hub.client_env(home=tmp_path / "home")
    name = "config.json"
    assert run_python(f"from huggingface_hub import hf_hub_download; hf_hub_download('zai-org/Tiny-FP8', {name!r})", env).returncode == 0
    offline = {**env, "HF_HUB_OFFLINE": "1"}
    n = len(hub.requests)
    r = call(offline, "hub.resolve_repo('zai-org/Tiny-FP8').__dict__")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    assert info["from_cache"] and info["sha"] == hub.head("zai-org/Tiny-FP8").sha and "config.json" in info["files"]
    r = call(offline, f"str(hub.fetch_file('zai-org/Tiny-FP8', 'config.json', revision={info['sha']!r}, dest_dir=Path('unused')))")
    assert r.returncode == 0 and "/hub/models--zai-org--Tiny-FP8/snapshots/" in r.stdout
    assert len(hub.requests) == n  # offline means offline
    r = call(offline, "hub.fetch_file('zai-org/Tiny-FP8', 'model-00001-of-00002.safetensors', dest_dir=Path('x'))")
    assert r.returncode == 2 and "offline (HF_HUB_OFFLINE=1)" in r.stderr and "not in the Hugging Face cache" in r.stderr
    r = call({**offline, "HF_HOME": str(tmp_path / "empty")}, "hub.resolve_repo('zai-org/Tiny-FP8')")
    assert r.returncode == 2 and "offline" in r.stderr


@pytest.mark.parametrize(
    "setup, body, expected",
    [
        ("none", "hub.resolve_repo('zai-org/Nope')", "repo zai-org/Nope not found"),
        ("gated", "hub.fetch_file('zai-org/Gated', 'config.json', dest_dir=Path('s'))", "zai-org/Gated is gated"),
        ("private", "hub.resolve_repo('bob/Private')", "repo bob/Private not found"),
        ("badtoken", "hub.resolve_repo('zai-org/Tiny-FP8')", "the Hub rejected your token"),
        ("none", "hub.fetch_file('zai-org/Tiny-FP8', 'nope.json', dest_dir=Path('s'))", "has no file 'nope.json'"),
        ("none", "hub.resolve_repo('zai-org/Tiny-FP8', revision='v9')", "revision 'v9' not found"),
        ("none", "hub.fetch_file('zai-org/Tiny-FP8', '../../etc/passwd', dest_dir=Path('s'))", "unsafe file name"),
    ],
)
def test_errors_are_one_clear_line(hub, src, tmp_path, setup, body, expected):
    if setup == "gated":
        hub.add_repo_from_folder("zai-org/Gated", src, gated=True)
    if setup == "private":
        hub.add_repo_from_folder("bob/Private", src, private=True)
    token = "hf_rejected_token_xyz" if setup == "badtoken" else TOKEN
    r = call(hub.client_env(token=token, home=tmp_path / "home"), body)
    assert r.returncode == 2, r.stdout + r.stderr
    msg = r.stderr.strip()
    assert expected in msg and "\n" not in msg and "Traceback" not in msg
    assert token not in msg


@pytest.mark.slow
def test_network_failure_is_one_line(tmp_path):
    # A stand-in that has stopped: its loopback port refuses connections, fast and offline-safe.
    with HubStandin(tmp_path / "h") as h:
        env = h.client_env(home=tmp_path / "home")
    r = call(env, "hub.resolve_repo('zai-org/Tiny-FP8')")
    assert r.returncode == 2 and "cannot reach the Hub" in r.stderr and "\n" not in r.stderr.strip()
    r = call(env, "hub.fetch_file('zai-org/Tiny-FP8', 'config.json', revision='a'*40, dest_dir=Path('s'))")
    assert r.returncode == 2 and "cannot reach the Hub" in r.stderr


def test_cut_download_resumes_with_range_and_ends_identical(hub, src, tmp_path):
    # huggingface_hub writes in 10 MiB chunks: cut after the first one so a Range resume is due.
    name = "model-big.safetensors"
    (src / name).write_bytes(os.urandom(12 * 1024 * 1024))
    hub.add_repo_from_folder("zai-org/Big", src)
    hub.drop_after_bytes(11 * 1024 * 1024)
    stage = tmp_path / "stage"
    r = call(hub.client_env(home=tmp_path / "home"),
             f"str(hub.fetch_file('zai-org/Big', {name!r}, dest_dir=Path({str(stage)!r})))")
    assert r.returncode == 0, r.stderr
    assert (stage / name).read_bytes() == (src / name).read_bytes()
    assert hub.count("GET", f"/resolve/") == 2  # the cut one and the resumed one
    assert [rng for p, rng in hub.range_requests if p.endswith(name)] == [f"bytes={10 * 1024 * 1024}-"]


def test_private_repo_is_read_with_the_owners_token(hub, src, tmp_path):
    hub.add_repo_from_folder("alice/Private-FP8", src, private=True)
    stage = tmp_path / "stage"
    body = f"str(hub.fetch_file('alice/Private-FP8', 'config.json', dest_dir=Path({str(stage)!r})))"
    r = call(hub.client_env(token=TOKEN, home=tmp_path / "home"), body)
    assert r.returncode == 0, r.stderr
    assert (stage / "config.json").read_bytes() == (src / "config.json").read_bytes()
    r = call(hub.client_env(home=tmp_path / "home2"), body)  # anonymous: not visible
    assert r.returncode == 2 and "repo alice/Private-FP8 not found" in r.stderr
