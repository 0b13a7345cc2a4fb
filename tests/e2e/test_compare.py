"""`kq compare` against real servers on loopback: `transformers serve` serving the trained tiny GLM-5.2
model (its FP8 checkpoint through transformers' FP8 loader) and kq's INT4 output of it (through
compressed-tensors in transformers: a second consumer loading kq's checkpoints). transformers serve
returns no logprobs, so the servers show the text-only path, the errors and lm-eval; the top-k KL is
checked against the full-vocabulary KL of the same two models run in-process."""
import json
import math

import pytest
import torch

from kq_testutil import TINY_MODEL, run_kq
from openai_servers import TransformersServer, free_port, serve_available

PROMPTS = ["The quick brown fox", "In the beginning", "Once upon a time", "The sage of the",
           "And the word was", "Said the preacher"]
needs_serve = pytest.mark.skipif(not serve_available(), reason="transformers serve needs fastapi, uvicorn, openai "
                                 "and accelerate (the test extra)")


@pytest.fixture(scope="module")
def int4_out(trained_output):
    return trained_output(32)


@pytest.fixture(scope="module")
def models(int4_out):
    """Both checkpoints loaded in-process by transformers, as the servers load them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    tok = AutoTokenizer.from_pretrained(TINY_MODEL)
    return tok, AutoModelForCausalLM.from_pretrained(TINY_MODEL), AutoModelForCausalLM.from_pretrained(int4_out)


@pytest.fixture(scope="module")
def servers(int4_out, tmp_path_factory):
    if not serve_available():
        pytest.skip("transformers serve extras not installed")
    logs = tmp_path_factory.mktemp("serve-logs")
    a = TransformersServer(TINY_MODEL, logs / "a.log")
    try:
        b = TransformersServer(int4_out, logs / "b.log")
    except BaseException:
        a.stop()
        raise
    yield a, b
    a.stop()
    b.stop()


def _greedy(model, tok, prompt, n):
    ids = tok(prompt, return_tensors="pt").input_ids
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


@pytest.mark.slow
def test_topk_kl_is_a_lower_bound_of_the_full_kl(models):
    from kq.eval.endpoints import topk_kl
    tok, a, b = models
    ids = tok(" ".join(PROMPTS), return_tensors="pt").input_ids
    with torch.no_grad():
        la = torch.log_softmax(a(ids).logits[0].float(), -1)
        lb = torch.log_softmax(b(ids).logits[0].float(), -1)
    full = (la.exp() * (la - lb)).sum(-1)
    vocab = tok.convert_ids_to_tokens(list(range(la.shape[-1])))

    def top(lp, k):
        v, i = lp.topk(k)
        return {vocab[j]: float(x) for j, x in zip(i.tolist(), v.tolist())}

    for pos in range(ids.shape[1]):
        f = float(full[pos])
        approx = {k: topk_kl(top(la[pos], k), top(lb[pos], k)) for k in (1, 5, 20)}
        for k, v in approx.items():
            assert v <= f + 1e-5, (pos, k, v, f)
        exact = topk_kl(top(la[pos], la.shape[-1]), top(lb[pos], lb.shape[-1]))
        assert math.isclose(exact, f, rel_tol=1e-3, abs_tol=1e-6), (pos, exact, f)
    k20 = sum(topk_kl(top(la[p], 20), top(lb[p], 20)) for p in range(ids.shape[1])) / ids.shape[1]
    assert 0.5 * float(full.mean()) < k20 <= float(full.mean()) + 1e-6


@pytest.mark.slow
@needs_serve
def test_text_only_flip_rate_matches_in_process_greedy(servers, models, tmp_path):
    tok, ma, mb = models
    a, b = servers
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    r = run_kq("compare", a.url, b.url, "--prompts", prompts, "--text-only", "--tokenizer", TINY_MODEL,
               "--max-tokens", 12, "--json", timeout=600)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)["tokens"]
    # Independent reference: both models' greedy token ids in-process, first differing position.
    positions = flips = 0
    for p in PROMPTS:
        ga, gb = _greedy(ma, tok, p, 12), _greedy(mb, tok, p, 12)
        common = next((i for i, (x, y) in enumerate(zip(ga, gb)) if x != y), min(len(ga), len(gb)))
        flipped = ga != gb
        positions += common + flipped
        flips += flipped
    assert (got["positions"], got["flips"]) == (positions, flips)
    assert got["prompts"] == len(PROMPTS) and got["identical_continuations"] == (len(PROMPTS) - flips) / len(PROMPTS)
    assert 0 < flips < len(PROMPTS)  # the INT4 model agrees on some prompts, not on all



@pytest.mark.slow
@needs_serve
def test_server_without_logprobs_is_one_clear_error(servers, tmp_path):
    a, b = servers
    prompts = tmp_path / "p.txt"
    prompts.write_text("The quick brown fox\n")
    r = run_kq("compare", a.url, b.url, "--prompts", prompts, "--max-tokens", 4)
    assert r.returncode == 2
    assert "returned no top-k logprobs" in r.stderr and "--text-only" in r.stderr
    assert "Traceback" not in r.stderr


@pytest.mark.slow
@needs_serve
def test_lm_eval_side_by_side(servers, models, tmp_path):
    pytest.importorskip("lm_eval")
    tok, ma, mb = models
    a, b = servers
    # A task of our own on local data: targets are the source model's 8 greedy tokens (in-process), and
    # the stop string never occurs, so only the generation limit ends a generation: A scores 1.0 only if
    # --max-gen-toks reached the harness (its default is 256).
    rows, agree = [], 0
    for p in PROMPTS[:4]:
        ga, gb = _greedy(ma, tok, p, 8), _greedy(mb, tok, p, 8)
        rows.append({"q": p, "a": tok.decode(ga)})
        agree += tok.decode(ga) == tok.decode(gb)
    (tmp_path / "docs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "kq_continue.yaml").write_text(
        "task: kq_continue\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
        f"    test: {tmp_path / 'docs.jsonl'}\ntest_split: test\noutput_type: generate_until\n"
        "doc_to_text: '{{q}}'\ndoc_to_target: '{{a}}'\ngeneration_kwargs:\n  until: ['@@never@@']\n"
        "  do_sample: false\nmetric_list:\n  - metric: exact_match\n    aggregation: mean\n"
        "    higher_is_better: true\n")
    r = run_kq("compare", a.url, b.url, "--lm-eval", "kq_continue", "--lm-eval-include", tmp_path,
               "--tokenizer", TINY_MODEL, "--max-gen-toks", 8, env={"HF_DATASETS_OFFLINE": "1",
                                                                     "HF_HUB_OFFLINE": "1"}, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    row = next(line for line in r.stdout.splitlines() if "kq_continue" in line).split("│")
    assert [c.strip() for c in row[1:6]] == ["kq_continue", "exact_match", "1.0000", f"{agree / len(rows):.4f}",
                                             f"{agree / len(rows) - 1:+.4f}"]
    assert "max_gen_toks 8" in r.stdout


def test_unreachable_server_is_one_clear_error(tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    port = free_port()  # nothing listens there
    r = run_kq("compare", f"http://127.0.0.1:{port}", f"http://127.0.0.1:{port}/v1", "--prompts", prompts,
               "--retries", 1, "--timeout", 5)
    assert r.returncode == 2
    assert f"http://127.0.0.1:{port}: cannot connect" in r.stderr and "after 2 tries" in r.stderr
    assert "Traceback" not in r.stderr


def test_bad_arguments_are_clear_errors(tmp_path):
    url = "http://127.0.0.1:1"
    for args, msg in [((url, url), "needs --prompts FILE and/or --lm-eval"),
                      ((url, url, "--prompts", tmp_path / "missing.txt", "--text-only"), "need --tokenizer"),
                      (("localhost:8000", url, "--prompts", __file__), "not a server URL")]:
        r = run_kq("compare", *args)
        assert r.returncode == 2 and msg in r.stderr, (args, r.stderr)
        assert "Traceback" not in r.stderr


def test_prompt_files(tmp_path):
    from kq.errors import KqError
    from kq.eval.endpoints import read_prompts
    (tmp_path / "p.txt").write_text("one\n\n two \n")
    assert read_prompts(tmp_path / "p.txt") == ["one", " two "]
    (tmp_path / "p.jsonl").write_text('{"prompt": "a"}\n{"text": "b"}\n{"prompt": "c"}\n')
    assert read_prompts(tmp_path / "p.jsonl", limit=2) == ["a", "b"]
    for name, body, msg in [("missing.txt", None, "no such file"), ("empty.jsonl", "\n", "no prompts in the file"),
                            ("bad.jsonl", '{"question": "x"}\n', "line 1 is not a JSON object")]:
        if body is not None:
            (tmp_path / name).write_text(body)
        with pytest.raises(KqError, match=msg):
            read_prompts(tmp_path / name)
