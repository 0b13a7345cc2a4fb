"""`kq shard`: each per-rank file holds exactly the checkpoint-layout slices SGLang's FusedMoE weight
loader takes from the full checkpoint for that rank, and the plugin's rank loader puts them in the
layer's parameters (main venv, no SGLang: its parallel layout is stood in for). The SGLang side —
that these equal what SGLang's own loader puts on each rank — is tests/sglang/test_plugin.py."""
from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from kq_testutil import run_kq

H, I, E, G = 128, 256, 8, 32
LAYERS = ["model.layers.1.mlp.experts", "model.layers.2.mlp.experts", "model.layers.3.mlp.experts"]
PARAMS = ("w13_weight_packed", "w13_weight_scale", "w2_weight_packed", "w2_weight_scale")


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    from kq.synth import generate

    root = tmp_path_factory.mktemp("shard")
    src = generate("glm5", root / "src", seed=3, hidden=H, n_experts=E, moe_intermediate=I, num_layers=3,
                   vocab=512, intermediate=256)
    r = run_kq("quantize", src, "--out", root / "int4", "--group-size", G, "--device", "cpu")
    assert r.returncode == 0, r.stderr
    return root / "int4"


def full(folder, name):
    """A tensor of the full checkpoint, found through its index."""
    idx = json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(folder / idx[name]), "pt") as f:
        return f.get_tensor(name)


def reference(folder, layer, tp, ep, t, e):
    """Rank (ep e, tp t)'s slice by index arithmetic on the checkpoint tensors: experts
    [e*E/ep, (e+1)*E/ep); gate and up rows [t*i, (t+1)*i) stacked gate then up; down's input
    columns t*i..(t+1)*i, i.e. packed words t*i/8.. and scale groups t*i/G.., i = I/(tp/ep)."""
    i = I // (tp // ep)
    per = E // ep
    out = {k: [] for k in PARAMS}
    for x in range(e * per, (e + 1) * per):
        for what, div in (("packed", 8), ("scale", G)):
            gate = full(folder, f"{layer}.{x}.gate_proj.weight_{what}")
            up = full(folder, f"{layer}.{x}.up_proj.weight_{what}")
            down = full(folder, f"{layer}.{x}.down_proj.weight_{what}")
            out[f"w13_weight_{what}"].append(torch.cat([gate[t * i:(t + 1) * i], up[t * i:(t + 1) * i]]))
            out[f"w2_weight_{what}"].append(down[:, t * i // div:(t + 1) * i // div])
    return {k: torch.stack(v) for k, v in out.items()}


@pytest.mark.parametrize("tp,ep", [(8, 1), (8, 2), (2, 1)])
def test_shard_files_hold_the_ranks_checkpoint_slices(ckpt, tp, ep):
    r = run_kq("shard", ckpt, "--tp", tp, "--ep", ep, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    d = ckpt / "kq-shards" / f"tp{tp}-ep{ep}"
    assert out["out"] == str(d) and out["files"] == tp
    mf = json.loads((d / "manifest.json").read_text())
    assert (mf["format"], mf["tp"], mf["ep"], mf["group"]) == ("kq-rank-shards/2", tp, ep, G)
    assert sorted(mf["layers"]) == LAYERS
    i = I // (tp // ep)
    for e in range(ep):
        for t in range(tp // ep):
            with safe_open(str(d / f"ep{e}-tp{t}.safetensors"), "pt") as f:
                assert f.metadata() == {"format": "kq-rank-shards/2"}
                assert set(f.keys()) == {f"{ly}.{k}" for ly in LAYERS for k in PARAMS}
                for layer in LAYERS:
                    want = reference(ckpt, layer, tp, ep, t, e)
                    got = {k: f.get_tensor(f"{layer}.{k}") for k in PARAMS}
                    assert got["w13_weight_packed"].shape == (E // ep, 2 * i, H // 8)
                    assert got["w2_weight_scale"].shape == (E // ep, H, i // G)
                    for k in PARAMS:
                        assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), (layer, e, t, k)
    for name, meta in mf["files"].items():
        assert (d / name).stat().st_size == meta["size"]


class _Layer(torch.nn.Module):
    """The parameters KqMoEMethod.create_weights registers on one rank's FusedMoE (zeros)."""
    def __init__(self, e_local, i):
        super().__init__()
        shapes = {"w13_weight_packed": ((e_local, 2 * i, H // 8), torch.int32),
                  "w13_weight_scale": ((e_local, 2 * i, H // G), torch.bfloat16),
                  "w2_weight_packed": ((e_local, H, i // 8), torch.int32),
                  "w2_weight_scale": ((e_local, H, i // G), torch.bfloat16)}
        for n, (s, dt) in shapes.items():
            self.register_parameter(n, torch.nn.Parameter(torch.zeros(s, dtype=dt), requires_grad=False))


@pytest.fixture
def running(monkeypatch, ckpt):
    """Stand in for SGLang's parallel layout: rank_loader._layout() answers (folder, tp, ep, t, e)."""
    from kq.sglang import rank_loader

    def set_layout(tp, ep, t, e):
        monkeypatch.setattr(rank_loader, "_layout", lambda: (str(ckpt), tp, ep, t, e))
        rank_loader._manifest.cache_clear()
    yield set_layout
    rank_loader._manifest.cache_clear()


def test_rank_loader_fills_the_layers_params_with_the_ranks_slices(ckpt, running):
    from kq.kernels import prepack_moe
    from kq.sglang import rank_loader

    r = run_kq("shard", ckpt, "--tp", 4, "--ep", 2)
    assert r.returncode == 0, r.stderr
    tp, ep, t, e = 4, 2, 1, 1
    running(tp, ep, t, e)
    layer = _Layer(E // ep, I // (tp // ep))
    info = rank_loader.find_for_layer(layer, "model.layers.2.mlp.experts", G)
    assert info == {"path": str(ckpt / "kq-shards" / "tp4-ep2" / "ep1-tp1.safetensors"),
                    "layer": "model.layers.2.mlp.experts"}
    rank_loader.fill_params(layer, info)
    want = reference(ckpt, "model.layers.2.mlp.experts", tp, ep, t, e)
    for k in PARAMS:
        assert torch.equal(getattr(layer, k).data, want[k]), k
    # The plugin then prepacks these exactly as it prepacks what SGLang's loader put there.
    got, ref = (prepack_moe(*(src[k] for k in PARAMS), G) for src in ({k: getattr(layer, k).data for k in PARAMS},
                                                                       want))
    assert all(torch.equal(getattr(got, a), getattr(ref, a)) for a in ("w13_q", "w13_s", "w2_q", "w2_s"))
    # The MTP draft's decoder (SGLang: model.decoder) is the checkpoint's layer num_hidden_layers.
    assert rank_loader.find_for_layer(None, "model.decoder.mlp.experts", G)["layer"] == "model.layers.3.mlp.experts"
    # The iterator filter skips every routed-expert tensor of the full checkpoint, nothing else.
    skip = rank_loader.skip_predicate([str(ckpt / "model-00001-of-00002.safetensors")])
    assert skip("model.layers.2.mlp.experts.5.down_proj.weight_scale")
    assert skip("model.layers.3.mlp.experts.0.gate_proj.weight_shape")
    assert not skip("model.layers.2.mlp.shared_experts.down_proj.weight")
    # A rank whose layer has other shapes is refused with one line.
    with pytest.raises(ValueError, match=r"this rank's layer expects .*rerun `kq shard`"):
        rank_loader.fill_params(_Layer(E // ep, I // tp), info)
    # No files for the running layout: the checkpoint is loaded as usual.
    running(8, 4, 0, 0)
    assert rank_loader.find_for_layer(None, "model.layers.2.mlp.experts", G) is None


@pytest.mark.parametrize("change,message", [
    ({"format": "kq-rank-shards/1"}, "holds per-rank files of format 'kq-rank-shards/1', not 'kq-rank-shards/2' "
                                     "(the checkpoint layout); rerun `kq shard {ckpt} --tp 2 --ep 1` to rewrite them"),
    ({"source_manifest_sha256": "0" * 64}, "was not cut from this checkpoint; delete it or rerun `kq shard {ckpt} "
                                           "--tp 2 --ep 1`"),
])
def test_rank_files_of_another_format_or_checkpoint_are_refused_in_one_line(ckpt, running, change, message):
    from kq.errors import KqError
    from kq.sglang import rank_loader

    r = run_kq("shard", ckpt, "--tp", 2)
    assert r.returncode == 0, r.stderr
    mf = ckpt / "kq-shards" / "tp2-ep1" / "manifest.json"
    good = mf.read_text()
    try:
        mf.write_text(json.dumps({**json.loads(good), **change}))   # what an older kq shard left there
        running(2, 1, 0, 0)
        with pytest.raises(KqError) as err:
            rank_loader.find_for_layer(None, "model.layers.1.mlp.experts", G)
        assert str(err.value) == f"kq: {ckpt / 'kq-shards' / 'tp2-ep1'} " + message.format(ckpt=ckpt)
        assert "\n" not in str(err.value)
    finally:
        mf.write_text(good)
    # Rerunning kq shard over the old folder rewrites it.
    mf.write_text(json.dumps({**json.loads(good), **change}))
    assert run_kq("shard", ckpt, "--tp", 2).returncode == 0
    assert mf.read_text() == good


def test_shard_refuses_a_split_that_does_not_fit(ckpt):
    r = run_kq("shard", ckpt, "--tp", 16)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].startswith("kq: error:")
    assert "16 per rank, not a multiple of the group size 32" in r.stderr
    assert not (ckpt / "kq-shards" / "tp16-ep1").exists()


def test_shard_refuses_an_unfinished_folder(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    r = run_kq("shard", tmp_path, "--tp", 8)
    assert r.returncode == 2 and "not a finished kq checkpoint" in r.stderr


def test_shard_refuses_ep_not_dividing_tp(ckpt):
    r = run_kq("shard", ckpt, "--tp", 8, "--ep", 3)
    assert r.returncode == 2 and "must divide the TP degree" in r.stderr
