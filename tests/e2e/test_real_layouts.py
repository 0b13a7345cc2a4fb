"""The two real checkpoints' layouts at full size (GLM-5.2-FP8: 118,629 tensors, 756 GB; Kimi-K2-Instruct:
139,644 tensors, 1.03 TB) as sparse replicas: planned, inspected, preflighted, and (slow) partly converted.

The replicas' shard headers are the published ones (names, dtypes, shapes, offsets); their data are holes.
Every expectation below is recomputed from the layout files by this test's own arithmetic.
"""
from __future__ import annotations

import gzip
import hashlib
import json
import math
import re

import pytest

from kq_testutil import run_kq
from real_layouts import GLM, KIMI, LAYOUTS, MODELS, is_expert as _is_expert, layout, write_replica

SIZE = {"F8_E4M3": 1, "BF16": 2, "F32": 4}


@pytest.fixture(scope="session")
def replicas(tmp_path_factory):
    root = tmp_path_factory.mktemp("real-layouts")
    return {m: write_replica(layout(m), root / m) for m in MODELS}


@pytest.fixture(scope="session")
def sources(replicas):
    from kq.checkpoint.source import open_source
    return {m: open_source(str(p)) for m, p in replicas.items()}


@pytest.fixture(scope="session")
def plans(sources):
    from kq.quantize.plan import make_plan
    got = {}

    def plan(model, group):
        if (model, group) not in got:
            got[model, group] = make_plan(sources[model], group_size=group)
        return got[model, group]
    return plan


def _expected(model: str, group: int):
    """(output tensors {name: (dtype, shape)}, expert weights) from the layout alone."""
    t = layout(model).tensors
    experts = {n for n in t if _is_expert(n)}
    out = {}
    for n, (dt, shape, _) in t.items():
        if n in experts:
            o, i = shape
            b = n[: -len(".weight")]
            out[b + ".weight_packed"] = ("I32", (o, i // 8))
            out[b + ".weight_scale"] = ("BF16", (o, i // group))
            out[b + ".weight_shape"] = ("I64", (2,))
        elif n.endswith(".weight_scale_inv") and n[: -len("_scale_inv")] in experts:
            continue  # folded into the INT4 parts
        elif n.endswith(".weight_scale_inv"):
            out[n[: -len("_inv")]] = (dt, shape)  # same F32 bytes, compressed-tensors' name
        else:
            out[n] = (dt, shape)
    return out, experts


def test_bundled_layouts_are_the_published_files():
    from importlib import resources

    from kq.synth.real_layouts import bundled_repos
    assert bundled_repos() == sorted(layout(m).repo_id for m in MODELS)
    for m in MODELS:
        shipped = resources.files("kq.recipes") / "layouts" / m
        for f in ("config.json", "layout.json.gz"):
            assert (shipped / f).read_bytes() == (LAYOUTS / m / f).read_bytes(), (m, f)


@pytest.mark.slow
@pytest.mark.parametrize("model", list(MODELS))
def test_bundled_layout_is_the_published_index(model):
    from kq.synth.real_layouts import bundled_layout
    lay = bundled_layout(layout(model).repo_id)
    assert len(lay.tensors) == MODELS[model]["tensors"]
    # The layout's shard column is the published (Kimi) / derived (GLM) index, name for name.
    idx = next(p for p in (LAYOUTS / model).iterdir() if p.name.startswith("index"))
    wm = json.loads(gzip.decompress(idx.read_bytes()))["weight_map"]
    assert wm == {n: s for n, (_, _, s) in lay.tensors.items()}


def test_replica_headers_are_the_published_ones(replicas):
    # NOTES.md: Kimi's model-2-of-61 has a 293,368-byte header and no __metadata__.
    p = replicas[KIMI] / "model-2-of-61.safetensors"
    with open(p, "rb") as f:
        n = int.from_bytes(f.read(8), "little")
        head = json.loads(f.read(n))
    assert n == 293_368 and "__metadata__" not in head and len(head) == 2327
    lay = layout(KIMI)
    total = sum(math.prod(s) * SIZE[d] for d, s, sh in lay.tensors.values() if sh == p.name)
    assert p.stat().st_size == 8 + n + total
    assert p.stat().st_blocks * 512 < 1 << 20  # sparse: the 17 GB shard holds only its header
    # F32 first, then BF16, then FP8; by name within a dtype (the safetensors writer's order).
    order = sorted(head, key=lambda k: head[k]["data_offsets"][0])
    assert order == sorted(head, key=lambda k: (-SIZE[head[k]["dtype"]], k))


@pytest.mark.slow
@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("group", [32, 64, 128])
def test_plan_classifies_every_real_tensor(plans, sources, model, group):
    plan = plans(model, group)
    want, experts = _expected(model, group)
    got = {t.name: (t.dtype, t.shape) for sp in plan.shards for t in sp.tensors}
    assert got == want  # every tensor: INT4 parts for experts, the exact dtype and shape for the rest
    lay = layout(model)
    assert len(lay.tensors) == MODELS[model]["tensors"]
    assert plan.classes["routed expert -> int4"]["tensors"] == len(experts)
    assert sum(c["tensors"] for c in plan.classes.values()) == len(lay.tensors) - len(experts)  # + their scales
    # Kept tensors come from themselves, experts' three parts from their weight; one output shard per source shard.
    for sp in plan.shards:
        for t in sp.tensors:
            if t.action == "copy":
                assert t.src in (t.name, t.name + "_inv") and lay.tensors[t.src][:2] == (t.dtype, t.shape)
            else:
                assert t.src in experts
    assert [sp.name for sp in plan.shards] == sorted({s for _, _, s in lay.tensors.values()},
                                                     key=lambda s: int(re.search(r"model-(\d+)-of", s).group(1)))
    out_bytes = sum(math.prod(s) * {"I32": 4, "I64": 8, **SIZE}[d] for d, s in want.values())
    assert plan.source_bytes == sum(p.stat().st_size for p in sources[model].folder.glob("*.safetensors"))
    assert plan.per_gpu_bytes(8) == math.ceil(out_bytes / 8)
    assert [(v.tp, v.ok, v.reason) for v in plan.tp] == [
        (tp, True, f"I/TP = {MODELS[model]['inter'] // tp}") for tp in (1, 2, 4, 8)]
    assert (plan.experts, plan.expert_intermediate) == (MODELS[model]["experts"], MODELS[model]["inter"])
    if model == GLM and group == 128:
        assert plan.output_bytes / plan.source_bytes <= 0.60  # acceptance of the issue


@pytest.mark.slow
@pytest.mark.parametrize("model", list(MODELS))
def test_plan_from_bundled_layout_equals_plan_from_replica(plans, model):
    """What `kq inspect glm-5.2` says offline is what it says about the real shard files."""
    from kq.synth.real_layouts import LayoutSource, bundled_layout
    from kq.quantize.plan import make_plan
    group = MODELS[model]["group"]
    a = plans(model, group)
    b = make_plan(LayoutSource.open(bundled_layout(layout(model).repo_id)), group_size=group)
    assert (a.source_bytes, a.output_bytes, a.classes) == (b.source_bytes, b.output_bytes, b.classes)
    assert [(s.name, s.tensors) for s in a.shards] == [(s.name, s.tensors) for s in b.shards]


@pytest.mark.slow
@pytest.mark.parametrize("model", list(MODELS))
def test_inspect_prints_real_figures(replicas, plans, model):
    from kq.cli.common import human_bytes
    plan = plans(model, MODELS[model]["group"])
    r = run_kq("inspect", replicas[model], "--tp", "8", env={"COLUMNS": "200"})
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    ratio = plan.output_bytes / plan.source_bytes
    assert re.search(rf"│ total │ │ {re.escape(human_bytes(plan.source_bytes))} │ "
                     rf"{re.escape(human_bytes(plan.output_bytes))} \({ratio:.3f}x\) │", text), text
    assert re.search(rf"│ 8 │ {re.escape(human_bytes(math.ceil(plan.output_bytes / 8)))} │ yes │ I/TP = 256", text), text
    assert "bundled layout" not in text  # a local folder is planned from its own headers


@pytest.mark.slow
@pytest.mark.parametrize("model", list(MODELS))
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_quantize_preflight_on_the_full_replica(replicas, sources, plans, tmp_path, model, group, tp):
    """kq quantize's checks before the first byte, at every group and TP: the sparse shards pass the
    header and truncation checks (their apparent size is the real one), and the disk check asks for
    the real output size (what a 2-core CI machine cannot hold is refused, nothing written)."""
    import shutil

    from kq.errors import KqError
    from kq.quantize.plan import tp_verdicts
    from kq.quantize.run import Options, preflight

    plan = plans(model, group)
    assert tp_verdicts(plan.expert_intermediate, plan.experts, group, [tp])[0].ok  # make_plan's --tp check
    out = tmp_path / "out"
    free = shutil.disk_usage(tmp_path).free
    if free >= plan.output_bytes:
        assert preflight(sources[model], plan, out, Options(group_size=group)) == "new"
    else:
        with pytest.raises(KqError, match=r"not enough disk at .*: the run needs "
                                          rf"{plan.output_bytes / 1e9:.2f} GB more"):
            preflight(sources[model], plan, out, Options(group_size=group))
    assert not out.exists()


@pytest.mark.slow
def test_quantize_cli_refuses_before_writing(replicas, plans, tmp_path):
    import shutil
    plan = plans(GLM, 128)
    out = tmp_path / "glm-int4"
    if shutil.disk_usage(tmp_path).free >= plan.output_bytes:
        pytest.skip("this disk could hold the whole GLM-5.2 output")
    r = run_kq("quantize", replicas[GLM], "--out", out, "--tp", "8", "--device", "cpu")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"the run needs {plan.output_bytes / 1e9:.2f} GB more" in r.stderr
    assert not out.exists()
    # A group that does not fit at a TP degree is refused first, with the fix.
    r = run_kq("inspect", replicas[GLM], "--tp", "32", "--group-size", "128")
    assert r.returncode == 2 and "I/TP = 64 is not a multiple of group 128" in r.stderr
    assert "use --group-size 32 or 64" in r.stderr


@pytest.mark.slow
def test_truncated_sparse_shard_is_refused(tmp_path):
    lay = layout(KIMI)
    d = write_replica(lay, tmp_path / "k", shards={"model-1-of-61.safetensors"})
    p = d / "model-1-of-61.safetensors"
    size = p.stat().st_size
    with open(p, "r+b") as f:
        f.truncate(size - 1)
    r = run_kq("inspect", d)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert f"model-1-of-61.safetensors: truncated: header promises {size} bytes, file has {size - 1}" in r.stderr


# ---- offline: the bundled layout of a known alias ------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("model", [GLM])  # Kimi's bundled plan: test_plan_from_bundled_layout_equals_plan_from_replica
def test_inspect_alias_offline_reads_the_bundled_layout(plans, tmp_path, model):
    plan = plans(model, MODELS[model]["group"])
    env = {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf"), "KQ_CACHE": str(tmp_path / "kq")}
    r = run_kq("inspect", MODELS[model]["alias"], "--json", env=env)
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["planned_from"] == "bundled layout" and d["source"] == MODELS[model]["alias"]
    assert (d["source_bytes"], d["output_bytes"], d["classes"]) == (plan.source_bytes, plan.output_bytes, plan.classes)
    assert [t["per_gpu_bytes"] for t in d["tp"]] == [math.ceil(plan.output_bytes / tp) for tp in (1, 2, 4, 8)]
    assert not (tmp_path / "kq").exists() and not (tmp_path / "hf").exists()  # nothing downloaded or cached


@pytest.mark.slow
def test_inspect_offline_says_so_and_quantize_still_needs_the_checkpoint(tmp_path):
    env = {"HF_HOME": str(tmp_path / "hf"), "KQ_CACHE": str(tmp_path / "kq"),
           "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_ETAG_TIMEOUT": "2", "HF_HUB_DOWNLOAD_TIMEOUT": "2"}
    r = run_kq("inspect", "glm-5.2", "-g", "32", env=env)  # nothing listens on port 9: the Hub is unreachable
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    assert "cannot reach the Hub at http://127.0.0.1:9" in text
    assert "so planned from kq's bundled layout of zai-org/GLM-5.2-FP8" in text and "nothing was downloaded" in text
    assert "INT4 group 32" in text
    out = tmp_path / "out"
    r = run_kq("quantize", "glm-5.2", "--out", out, env={**env, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 2 and "Traceback" not in r.stderr and "offline (HF_HUB_OFFLINE=1)" in r.stderr
    # A revision other than the bundled one is not answered from the layout.
    r = run_kq("inspect", "glm-5.2", "--revision", "v2", env={**env, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 2 and "offline (HF_HUB_OFFLINE=1)" in r.stderr
    # An alias kq has no layout for fails as before.
    r = run_kq("inspect", "glm-4.7", env={**env, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 2 and "GLM-4.7-FP8" in r.stderr


# ---- real-layout slices converted for real ------------------------------------------------------------

def _ranges_equal(p1, e1, p2, e2, whole_up_to: int = 64 << 20) -> bool:
    """Same bytes at two file ranges; past `whole_up_to` (the embeddings and lm_head, holes in the
    source) three 4 MB windows, start, middle and end: kq verify has hashed the whole file already."""
    def read(p, e, off, n):
        with open(p, "rb") as f:
            f.seek(e.start + off)
            return hashlib.sha256(f.read(n)).digest()
    if e1.nbytes != e2.nbytes:
        return False
    n = e1.nbytes
    win = [(0, n)] if n <= whole_up_to else [(0, 4 << 20), (n // 2, 4 << 20), (n - (4 << 20), 4 << 20)]
    return all(read(p1, e1, o, k) == read(p2, e2, o, k) for o, k in win)


@pytest.mark.slow
@pytest.mark.parametrize("model", list(MODELS))
def test_real_slice_converts_and_verifies(real_slices, model):
    from kq.checkpoint.reader import CheckpointReader
    from kq.checkpoint.safetensors_io import read_header

    src, out, summary, written = real_slices(model)
    assert summary["status"] == "written"
    r = run_kq("verify", out)
    assert r.returncode == 0, r.stdout + r.stderr
    lay = layout(model)
    group = MODELS[model]["group"]
    src_wm = json.loads((src / "model.safetensors.index.json").read_text())["weight_map"]
    out_wm = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    want, experts = _expected(model, group)
    want_here = {}
    for n in src_wm:
        if n in experts:
            b = n[: -len(".weight")]
            want_here.update({k: want[k] for k in (b + ".weight_packed", b + ".weight_scale", b + ".weight_shape")})
        elif not (n.endswith("_scale_inv") and n[: -len("_scale_inv")] in experts):
            k = n[: -len("_inv")] if n.endswith(".weight_scale_inv") else n
            want_here[k] = want[k]
    heads = {s: read_header(out / s).tensors for s in set(out_wm.values())}
    assert {n: (heads[s][n].dtype, heads[s][n].shape) for n, s in out_wm.items()} == want_here
    assert set(out_wm.values()) == set(src_wm.values())  # one output shard per source shard, same names
    # Kept tensors: the source's bytes (real random data, or the holes of the big BF16 ones).
    src_heads = {s: read_header(src / s).tensors for s in set(src_wm.values())}
    for n, s in src_wm.items():
        if n in experts or (n.endswith("_scale_inv") and n[: -len("_scale_inv")] in experts):
            continue
        k = n[: -len("_inv")] if n.endswith(".weight_scale_inv") else n
        assert _ranges_equal(src / s, src_heads[s][n], out / out_wm[k], heads[out_wm[k]][k]), n
    # Experts: INT4 close to the FP8 source, dequantized independently of how they were written.
    a, b = CheckpointReader(src), CheckpointReader(out)
    for n in sorted(experts & set(src_wm))[:: max(1, len(experts & set(src_wm)) // 4)]:
        m = n[: -len(".weight")]
        w, q = a.weight(m), b.weight(m)
        assert q.shape == w.shape == lay.tensors[n][1]
        assert float((q - w).norm() / w.norm()) < 0.2, m
    # Names the real layouts bring: the MTP layer's experts are INT4, Kimi's inv_freq kept as it came.
    if model == GLM:
        assert any(k.startswith("model.layers.78.mlp.experts.") and k.endswith("weight_packed") for k in out_wm)
        assert heads[out_wm["model.layers.78.eh_proj.weight"]]["model.layers.78.eh_proj.weight"].dtype == "BF16"
        assert "model.layers.78.self_attn.indexer.wk.weight_scale" in out_wm
        assert want_here["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale"] == ("F32", (5, 48))  # ceil(576/128)
    else:
        assert want_here["model.layers.0.self_attn.rotary_emb.inv_freq"] == ("BF16", (56,))
        assert want_here["model.layers.1.self_attn.kv_a_proj_with_mqa.weight_scale"] == ("F32", (5, 56))
    print(f"{model}: {written / 1e9:.2f} GB random data written, quantized in {summary['seconds']} s")


@pytest.mark.slow
@pytest.mark.parametrize("model,layers", [(GLM, (0, 2, 3, 6, 77)), (KIMI, (0, 1, 60))])
def test_layerwise_runner_builds_real_layers_with_the_real_shapes(model, layers):
    """GPTQ and `kq eval` build each decoder layer from config.json with transformers' own classes: on
    the real configs (GLM-5.2's 192 head_dim and indexer_types, Kimi's kimi_k2 remote-code config) every
    parameter must have its real tensor's shape (on the meta device: nothing allocated)."""
    import torch

    from kq.model.families import arch_for, build_config, classes
    lay = layout(model)
    cfg = build_config(lay.config)
    Layer = classes(arch_for(lay.config))[0]
    for i in layers:
        with torch.device("meta"):
            sd = Layer(cfg, i).state_dict()
        pre = f"model.layers.{i}."
        n_exp = len({n.split(".")[5] for n in lay.tensors if n.startswith(pre + "mlp.experts.")})
        for k, v in sd.items():
            if k in ("mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
                o, inn = lay.tensors[pre + "mlp.experts.0." + k.split(".")[-1].replace("gate_up", "up") + ".weight"][1]
                assert tuple(v.shape) == (n_exp, o * (2 if "gate_up" in k else 1), inn), (i, k)
            else:
                assert tuple(v.shape) == lay.tensors[pre + k][1], (i, k)
        left = {n[len(pre):] for n in lay.tensors if n.startswith(pre) and ".experts." not in n[len(pre):].replace(
            "shared_experts", "") and not n.endswith("_scale_inv")} - set(sd)
        # Kimi's stale per-layer rotary buffer (BF16 [56], not rope_dim/2 = 32) is the one tensor no module reads.
        assert left == ({"self_attn.rotary_emb.inv_freq"} if model == KIMI else set()), (i, left)


@pytest.mark.slow
@pytest.mark.parametrize("model", list(MODELS))
def test_output_config_ignores_exactly_the_real_bf16_linears(sources, plans, model):
    """GLM-5.2's modules_to_not_convert names 120 modules that do not exist (`indexers_proj`, tensor
    names such as `...k_norm.bias`); the output's ignore list names only real BF16 Linears, plus the
    suffix rules for SGLang's MTP draft names."""
    from kq.checkpoint.ct_config import BF16_SUFFIX_TARGETS
    from kq.quantize.run import output_config
    lay = layout(model)
    qc = output_config(sources[model], plans(model, MODELS[model]["group"]))["quantization_config"]
    exact = {i for i in qc["ignore"] if not i.startswith("re:")}
    bf16_linears = {n[: -len(".weight")] for n, (dt, shape, _) in lay.tensors.items()
                    if n.endswith(".weight") and len(shape) == 2 and dt == "BF16" and n != "model.embed_tokens.weight"}
    assert exact == bf16_linears
    assert set(qc["ignore"]) - exact == set(BF16_SUFFIX_TARGETS)
    assert "modules_to_not_convert" not in json.dumps(qc)
    if model == GLM:
        named = set(lay.config["quantization_config"]["modules_to_not_convert"])
        real = {n.rsplit(".", 1)[0] for n in lay.tensors}
        assert len(named - real) == 120 and not (named - real) & exact
        assert "model.layers.78.eh_proj" in exact and "model.layers.0.self_attn.indexer.weights_proj" in exact
