"""`kq quantize --activations fp8` and `kq config`: one set of INT4 weights, two configs (W4A16 for
decode pools, W4AFP8 for prefill pools). Real kq outputs, real files, the real CLI."""
from __future__ import annotations

import json
import os
import shutil

import pytest

from kq.checkpoint.ct_config import experts_fp8_activations, with_activations
from kq.errors import KqError
from kq_testutil import run_kq

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def pair(small_glm5, tmp_path_factory):
    """The same source quantized at group 128 with --activations none and fp8."""
    root = tmp_path_factory.mktemp("w4afp8")
    for act in ("none", "fp8"):
        r = run_kq("quantize", small_glm5, "--out", root / act, "--group-size", 128, "--activations", act,
                   "--device", "cpu")
        assert r.returncode == 0, r.stderr
    return root / "none", root / "fp8"


def _cfg(d):
    return json.loads((d / "config.json").read_text())


def _tree(d):
    return {p.relative_to(d).as_posix(): p for p in d.rglob("*") if p.is_file()}


def test_fp8_activations_change_only_the_config(pair):
    a, b = pair
    fa, fb = _tree(a), _tree(b)
    assert set(fa) == set(fb)
    same = {n for n in fa if fa[n].read_bytes() == fb[n].read_bytes()}
    assert set(fa) - same == {"config.json", "kq-manifest.json"}
    assert any(n.endswith(".safetensors") for n in same)
    ga = _cfg(a)["quantization_config"]["config_groups"]["int4_experts"]
    gb = _cfg(b)["quantization_config"]["config_groups"]["int4_experts"]
    assert "input_activations" not in ga
    assert gb.pop("input_activations") == {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "token",
                                           "dynamic": True}
    assert ga == gb
    ca, cb = _cfg(a), _cfg(b)
    del ca["quantization_config"]["config_groups"]["int4_experts"], cb["quantization_config"]["config_groups"]["int4_experts"]
    assert ca == cb
    assert not experts_fp8_activations(_cfg(a)["quantization_config"])
    assert experts_fp8_activations(_cfg(b)["quantization_config"])
    ma, mb = (json.loads((d / "kq-manifest.json").read_text()) for d in pair)
    assert "activations" not in ma["options"] and mb["options"]["activations"] == "fp8"   # W4A16: as before
    assert ma["tensors"] == mb["tensors"]


def test_other_activation_schemes_are_refused_by_the_query():
    qc = {"config_groups": {"int4_experts": {"weights": {"num_bits": 4, "group_size": 128},
                                             "input_activations": {"num_bits": 8, "type": "int", "dynamic": True}}}}
    with pytest.raises(KqError, match="neither absent"):
        experts_fp8_activations(qc)
    assert experts_fp8_activations(None) is False


def test_group_32_with_fp8_is_refused_up_front(small_glm5, tmp_path):
    r = run_kq("quantize", small_glm5, "--out", tmp_path / "x", "--group-size", 32, "--activations", "fp8")
    assert r.returncode == 2
    assert r.stderr.strip().splitlines() == ["kq: error: --activations fp8 needs INT4 group size 128 (SGLang's "
                                             "W4AFP8 MoE kernel supports group 128 only), not group 32: quantize "
                                             "with --group-size 128"]
    assert not (tmp_path / "x").exists()
    r = run_kq("quantize", small_glm5, "--out", tmp_path / "x", "--activations", "int8")
    assert r.returncode == 2 and "--activations int8: use none (W4A16) or fp8 (W4AFP8)" in r.stderr


def test_a_finished_run_is_not_reused_for_the_other_activations(pair, small_glm5):
    a, _ = pair
    r = run_kq("quantize", small_glm5, "--out", a, "--group-size", 128, "--activations", "fp8")
    assert r.returncode == 2 and "made with other options" in r.stderr


@pytest.mark.parametrize("link", ["hard", "symlink"])
def test_kq_config_links_and_verifies(pair, tmp_path, link):
    a, b = pair
    src = shutil.copytree(a, tmp_path / "src")
    before = {n: (p.read_bytes(), p.stat().st_mtime_ns) for n, p in _tree(src).items()}
    out = tmp_path / "pools" / "prefill"
    r = run_kq("config", src, "--activations", "fp8", "--out", out, "--link", link)
    assert r.returncode == 0, r.stderr
    assert {n: (p.read_bytes(), p.stat().st_mtime_ns) for n, p in _tree(src).items()} == before  # OUT untouched
    # The config is byte for byte what quantize --activations fp8 writes.
    assert (out / "config.json").read_bytes() == (b / "config.json").read_bytes()
    assert not (out / "config.json").is_symlink() and (out / "config.json").stat().st_nlink == 1
    man = json.loads((out / "kq-manifest.json").read_text())
    for name in man["files"]:
        if name == "config.json":
            continue
        p = out / name
        if link == "symlink":
            assert p.is_symlink() and not os.path.isabs(os.readlink(p))
            assert p.resolve() == (src / name).resolve()
        else:
            assert not p.is_symlink() and os.path.samefile(p, src / name)
    assert man["options"]["activations"] == "fp8"
    assert man["derived"]["by"] == "kq config" and man["derived"]["from_activations"] == "none"
    assert man["derived"]["links"] == link and man["derived"]["from"] == str(src.resolve())
    r = run_kq("verify", out)
    assert r.returncode == 0, r.stderr
    # And back: the decode-pool twin of the prefill folder has the W4A16 config again.
    back = tmp_path / "pools" / "decode"
    assert run_kq("config", out, "--activations", "none", "--out", back, "--link", link).returncode == 0
    assert (back / "config.json").read_bytes() == (a / "config.json").read_bytes()
    assert run_kq("verify", back).returncode == 0
    if link == "symlink":  # links point at the real files, not at other links
        assert all(os.readlink(back / n).startswith("../../src/") for n in man["files"] if n != "config.json")
    # The pair moved together keeps working with relative symlinks; hard links survive deleting OUT.
    if link == "hard":
        shutil.rmtree(src)
        assert run_kq("verify", out).returncode == 0
    else:
        moved = tmp_path / "moved"
        moved.mkdir()
        shutil.move(src, moved / "src")
        shutil.move(tmp_path / "pools", moved / "pools")
        assert run_kq("verify", moved / "pools" / "prefill").returncode == 0
        shutil.rmtree(moved / "src")
        r = run_kq("verify", moved / "pools" / "prefill")
        assert r.returncode == 2 and "listed in the manifest but missing" in r.stderr


def test_kq_config_refusals(pair, tmp_path):
    a, b = pair
    full = tmp_path / "full"
    full.mkdir()
    (full / "x").write_text("x")
    unfinished = shutil.copytree(a, tmp_path / "unfinished")
    (unfinished / "kq-manifest.json").unlink()
    cases = [
        (("config", a, "--activations", "fp8", "--out", full), "exists and is not an empty folder"),
        (("config", unfinished, "--activations", "fp8", "--out", tmp_path / "n1"), "not a finished kq checkpoint"),
        (("config", tmp_path / "nope", "--activations", "fp8", "--out", tmp_path / "n2"), "no such folder"),
        (("config", a, "--activations", "none", "--out", tmp_path / "n3"), "already asks for --activations none"),
        (("config", a, "--activations", "fp8", "--out", a / "sub"), "inside it"),
        (("config", a, "--activations", "bf8", "--out", tmp_path / "n4"), "--activations bf8: use none"),
        (("config", a, "--activations", "fp8", "--out", tmp_path / "n5", "--link", "copy"), "--link copy: use hard or symlink"),
    ]
    for args, msg in cases:
        r = run_kq(*args)
        assert r.returncode == 2, (args, r.stderr)
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("kq: error:") and msg in lines[0], (args, r.stderr)
    for n in ("n1", "n2", "n3", "n4", "n5"):
        assert not (tmp_path / n).exists()
    assert not list(tmp_path.glob(".*kq-config-tmp"))
    assert [p.name for p in full.iterdir()] == ["x"]
    # A source that fails verification (a shard's size changed) is not derived from.
    broken = shutil.copytree(a, tmp_path / "broken")
    shard = next(broken.glob("*.safetensors"))
    with open(shard, "ab") as f:
        f.write(b"\0")
    r = run_kq("config", broken, "--activations", "fp8", "--out", tmp_path / "n6")
    assert r.returncode == 2 and "fails `kq verify --fast`" in r.stderr and not (tmp_path / "n6").exists()


def test_group_32_checkpoint_cannot_become_w4afp8(small_glm5_out, tmp_path):
    r = run_kq("config", small_glm5_out, "--activations", "fp8", "--out", tmp_path / "p")
    assert r.returncode == 2 and "needs INT4 group size 128" in r.stderr and "not group 32" in r.stderr
    assert not (tmp_path / "p").exists()
    qc = json.loads((small_glm5_out / "config.json").read_text())["quantization_config"]
    with pytest.raises(KqError, match="not group 32"):
        with_activations(qc, "fp8")


def test_verify_flags_an_activation_scheme_sglang_would_misread(pair, tmp_path):
    from kq.checkpoint.manifest import sha256_file
    from kq.checkpoint.verify import verify_checkpoint

    a, _ = pair
    for acts, expect in (({"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True},
                          "neither absent (W4A16) nor dynamic 8-bit float (W4AFP8)"),):
        bad = shutil.copytree(a, tmp_path / "bad")
        cfg = _cfg(bad)
        cfg["quantization_config"]["config_groups"]["int4_experts"]["input_activations"] = acts
        (bad / "config.json").write_text(json.dumps(cfg))
        man = json.loads((bad / "kq-manifest.json").read_text())
        man["files"]["config.json"] = {"sha256": sha256_file(bad / "config.json"), "size": (bad / "config.json").stat().st_size}
        (bad / "kq-manifest.json").write_text(json.dumps(man))
        problems = verify_checkpoint(bad, hashes=True)
        assert len(problems) == 1 and problems[0].startswith("config.json: ") and expect in problems[0], problems


@pytest.mark.parametrize("link", ["hard", "symlink"])
def test_publish_of_a_linked_folder_uploads_the_real_bytes(pair, tmp_path, link):
    from hub_standin import HubStandin

    a, _ = pair
    src = shutil.copytree(a, tmp_path / "src")
    out = tmp_path / "prefill"
    assert run_kq("config", src, "--activations", "fp8", "--out", out, "--link", link).returncode == 0
    token = "hf_kqtest_w4afp8_0123456789"
    with HubStandin(tmp_path / "hub", tokens={token: "alice"}) as hub:
        r = run_kq("publish", out, "alice/W4AFP8", "--workers", 1, env=hub.client_env(token=token, home=tmp_path / "home"))
        assert r.returncode == 0, r.stderr
        remote = hub.repo_dir("alice/W4AFP8")
        man = json.loads((out / "kq-manifest.json").read_text())
        for name in man["files"]:
            assert (remote / name).read_bytes() == (out / name).read_bytes(), name
            assert not (remote / name).is_symlink()
        assert json.loads((remote / "config.json").read_text())["quantization_config"]["config_groups"][
            "int4_experts"]["input_activations"]["type"] == "float"
        card = (remote / "README.md").read_text()
        assert "(W4AFP8)" in card and "- w4afp8" in card and "w4a16" not in card.lower().split("---")[1]
    # Publishing wrote the card and the upload state into OUT2 only.
    assert not (src / "README.md").exists() and not (src / ".cache").exists()
