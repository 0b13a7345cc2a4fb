"""MTP draft acceptance (kq.eval.mtp) and `kq quantize --keep-mtp`."""
from __future__ import annotations

import json
import re
import shutil

import pytest
import torch
from safetensors import safe_open

from kq.checkpoint.ct_config import expert_target
from kq.checkpoint.reader import CheckpointReader
from kq.eval.mtp import acceptance, mtp_picks, mtp_report
from kq.eval.run import eval_ids
from kq.model import LayerwiseModel
from kq_testutil import SHARED, TINY_MODEL, run_kq

EVAL_TEXT = SHARED / "data" / "eval_text.txt.gz"


@pytest.fixture(scope="module")
def tiny():
    ids, targets = eval_ids(TINY_MODEL, EVAL_TEXT, 2, 48)
    return LayerwiseModel(CheckpointReader(TINY_MODEL)), ids, targets


def test_acceptance_is_draft_at_t_against_target_at_t_plus_1():
    draft = torch.tensor([[5, 6, 7]])
    target = torch.tensor([[1, 5, 0, 7]])          # target[t+1] == draft[t] at t = 0 and 2
    text = torch.tensor([[9, 9, 7, 9]])            # token t+2 == draft[t] at t = 1... none; t=1: 7 != 6
    r = acceptance(draft, target, text)
    assert r == {"acceptance": 2 / 3, "draft_top1_text": 0.0, "positions": 3}
    assert acceptance(draft, target, torch.tensor([[0, 5, 6, 7]]))["draft_top1_text"] == 1.0


def test_draft_is_causal_and_reads_token_t_plus_1(tiny):
    model, ids, targets = tiny
    draft, target = mtp_picks(model, ids, targets)
    assert draft.shape == (2, 47) and target.shape == (2, 48)
    # The target's own pick is compare()'s argmax of the logits.
    assert target.tolist() == model.logits(_final(model, ids)).argmax(-1).tolist()
    # A window cut after position 20 gives the same drafts at positions < 20: nothing reads ahead ...
    cut, _ = mtp_picks(model, ids[:, :21], targets[:, :21])
    assert torch.equal(cut, draft[:, :20])
    # ... except token t+1, which the draft at t takes as input: changing it changes that draft's
    # input (and here its pick at some positions), not earlier ones.
    ids2, t2 = ids.clone(), targets.clone()
    t2[:, 10] = (t2[:, 10] + 1) % 4096           # token 11 as the text's successor of position 10
    ids2[:, 11] = t2[:, 10]
    d2, _ = mtp_picks(model, ids2, t2)
    assert torch.equal(d2[:, :10], draft[:, :10])


def _final(model, ids):
    from kq.eval.mtp import final_hidden
    return final_hidden(model, ids, 8)[0]


def test_report_of_a_checkpoint_against_itself(tiny):
    model, ids, targets = tiny
    r = mtp_report(model, LayerwiseModel(CheckpointReader(TINY_MODEL)), ids, targets)
    assert r["draft_agreement"] == 1.0 and r["source"] == r["quantized"]
    assert r["quantized_draft_vs_source_target"] == r["source"]["acceptance"]
    assert r["mtp_layer"] == 4 and r["source"]["positions"] == 2 * 47


def test_keep_mtp_leaves_the_mtp_experts_as_they_came(tmp_path, small_glm5):
    out = tmp_path / "out"
    r = run_kq("quantize", small_glm5, "--out", out, "--group-size", "32", "--device", "cpu", "--keep-mtp", "--json")
    assert r.returncode == 0, r.stderr
    assert run_kq("verify", out).returncode == 0
    man = json.loads((out / "kq-manifest.json").read_text())
    assert man["options"]["mtp_experts"] == "kept as in the source (--keep-mtp)"
    src_idx = json.loads((small_glm5 / "model.safetensors.index.json").read_text())["weight_map"]
    out_idx = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    mtp = [n for n in src_idx if n.startswith("model.layers.3.mlp.experts.")]
    assert mtp
    for n in mtp:   # same bytes; the block scale under the name SGLang reads, like every kept FP8 weight
        o = n[: -len("_inv")] if n.endswith("_scale_inv") else n
        with safe_open(str(small_glm5 / src_idx[n]), "pt") as a, safe_open(str(out / out_idx[o]), "pt") as b:
            assert torch.equal(a.get_tensor(n).view(torch.uint8), b.get_tensor(o).view(torch.uint8)), n
    assert any(n.startswith("model.layers.2.mlp.experts.") and n.endswith("weight_packed") for n in out_idx)
    target = json.loads((out / "config.json").read_text())["quantization_config"]["config_groups"][
        "int4_experts"]["targets"]
    assert target == [expert_target(3)]
    rx = re.compile(target[0][3:])
    for name, want in [("model.layers.2.mlp.experts.0.gate_proj", True), ("model.layers.13.mlp.experts.1.up_proj", True),
                       ("model.layers.3.mlp.experts.0.gate_proj", False),
                       ("model.decoder.mlp.experts.0.down_proj", False)]:   # SGLang's name for the draft's experts
        assert bool(rx.match(name)) == want, name


def test_mtp_from_the_command_line_and_refusals(tmp_path, small_glm5, small_glm5_out):
    out = shutil.copytree(small_glm5_out, tmp_path / "out")
    r = run_kq("eval", out, "--against", small_glm5, "--text", EVAL_TEXT, "--seqs", "2", "--seqlen", "32", "--mtp",
               "--json")
    assert r.returncode == 0, r.stderr
    m = json.loads(r.stdout)["mtp"]
    assert m["mtp_layer"] == 3 and m["source"]["positions"] == 2 * 31 and 0 <= m["draft_agreement"] <= 1
    no_mtp = shutil.copytree(small_glm5, tmp_path / "no-mtp")
    cfg = json.loads((no_mtp / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 0
    (no_mtp / "config.json").write_text(json.dumps(cfg))
    r = run_kq("quantize", no_mtp, "--out", tmp_path / "x", "--keep-mtp", "--device", "cpu")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "--keep-mtp" in r.stderr, r.stderr
    assert not (tmp_path / "x").exists()
