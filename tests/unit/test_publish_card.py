"""`kq card`: the model card says only what the run recorded, and never eats a user's README."""

import json
import re
import shutil
import sys
import subprocess
from pathlib import Path

import pytest
import yaml


@pytest.fixture()
def out(small_glm5_out, tmp_path) -> Path:
    return Path(shutil.copytree(small_glm5_out, tmp_path / "ckpt"))


def kq(*args):
    return subprocess.run([sys.executable, "-m", "kq", *map(str, args)], capture_output=True, text=True, timeout=300)


def front_matter(card: str) -> dict:
    m = re.match(r"^---\n(.*?)\n---\n", card, re.S)
    assert m, card[:200]
    return yaml.safe_load(m[1])


def test_card_numbers_come_from_the_manifest(out):
    from kq.publish.card import render_card

    m = json.loads((out / "kq-manifest.json").read_text())
    m["source"]["repo_id"] = "zai-org/GLM-5.2-FP8"  # as a Hub-sourced run records it
    (out / "kq-manifest.json").write_text(json.dumps(m))
    card = render_card(out, "me/GLM-INT4")
    meta = front_matter(card)
    assert meta["base_model"] == "zai-org/GLM-5.2-FP8" and meta["base_model_relation"] == "quantized"
    assert meta["library_name"]
    assert {"compressed-tensors", "int4", "w4a16", m["source"]["family"]} <= set(meta["tags"])
    sizes = m["sizes"]
    for key in ("source_bytes", "output_bytes", "per_gpu_bytes_tp8"):
        assert f"({sizes[key]:,} bytes)" in card
    assert f"group size {m['options']['group_size']}" in card and f"method: {m['options']['method']}" in card
    for cls, c in m["classes"].items():
        assert f"| {cls} | {c['tensors']} |" in card
    assert "python -m sglang.launch_server --model-path me/GLM-INT4 --tp 8 --disable-shared-experts-fusion" in card
    inter = json.loads((out / "config.json").read_text())["moe_intermediate_size"]
    assert f"| 8 | {inter // 8} |" in card
    assert "## Evaluation" not in card  # no kq-eval.json: no eval table, and no made-up numbers


def test_eval_table_only_from_kq_eval_json(out):
    from kq.publish.card import render_card

    record = {"kq_version": "0.1.0", "created": "2026-11-30T04:00:00+00:00", "text": "/data/eval_text.txt.gz",
              "source": "/models/src", "dtype": "float32", "device": "cpu", "kl": 0.0123456789, "top1": 0.936,
              "ppl_source": 50.8, "ppl_quantized": 51.2, "seqs": 48, "seqlen": 256, "totals": {"kl": 151.7}}
    (out / "kq-eval.json").write_text(json.dumps(record))
    card = render_card(out)
    assert "## Evaluation" in card
    for row in ("| KL(source ‖ quantized), nats/token | 0.0123457 |", "| top-1 agreement with the source | 0.936 |",
                "| perplexity, source | 50.8 |", "| perplexity, this checkpoint | 51.2 |"):
        assert row in card
    assert "48 windows of 256 tokens" in card and "eval_text.txt.gz" in card
    assert "151.7" not in card  # raw accumulators are not metrics


def test_eval_table_of_another_layout_lists_recorded_numbers(out):
    from kq.publish.card import render_card

    (out / "kq-eval.json").write_text(json.dumps({"gsm8k": {"acc": 0.91}, "note": "x", "ok": True}))
    card = render_card(out)
    assert "| gsm8k.acc | 0.91 |" in card and "| ok |" not in card


def test_local_source_has_no_base_model(out):
    from kq.publish.card import render_card

    meta = front_matter(render_card(out))
    assert "base_model" not in meta and "base_model_relation" not in meta


@pytest.mark.slow
def test_kq_card_cli_writes_keeps_user_card_and_overwrites_on_request(out):
    r = kq("card", out)
    assert r.returncode == 0, r.stderr
    first = (out / "README.md").read_text()
    assert first.startswith("---\n") and "kq-card sha256:" in first
    # An unedited kq card is regenerated freely (e.g. for the repo id at publish time).
    r = kq("card", out, "--repo-id", "me/x")
    assert r.returncode == 0 and "--model-path me/x" in (out / "README.md").read_text()
    # Once edited, it is the user's.
    edited = (out / "README.md").read_text().replace("# me/x", "# my model")
    (out / "README.md").write_text(edited)
    r = kq("card", out)
    assert r.returncode == 0 and "kept" in r.stdout and (out / "README.md").read_text() == edited
    r = kq("card", out, "--overwrite-card")
    assert r.returncode == 0 and (out / "README.md").read_text() == first


def test_card_on_unfinished_folder_is_one_line(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    r = kq("card", tmp_path)
    assert r.returncode == 2 and "not a finished kq checkpoint" in r.stderr and "Traceback" not in r.stderr


def test_calibration_is_shown_as_recorded(out):
    from kq.publish.card import render_card

    m = json.loads((out / "kq-manifest.json").read_text())
    assert "calibration data: none (RTN uses the weights only)" in render_card(out)
    m["options"].update(method="gptq", calibration={"file": "calib.jsonl", "samples": 512, "tokens": 1048576})
    (out / "kq-manifest.json").write_text(json.dumps(m))
    card = render_card(out)
    assert "- method: gptq" in card and "calibration data: file: calib.jsonl, samples: 512, tokens: 1048576" in card
