"""Calibration sources: Kimi's tiktoken.model through the real `tiktoken` package, and
`--calib org/name[@rev][:path]` Hub datasets through huggingface_hub against the loopback
stand-in (never the real network)."""

import gzip
import json
import sys
import textwrap

import pytest

from hub_standin import HubStandin, run_python
from kq.errors import KqError
from kq.quantize.calibration import calibration_ids, resolve_calib, token_stream
from kq.synth import generate

tiktoken = pytest.importorskip("tiktoken")  # the `kimi` extra; CI installs it with the test extra

# Moonshot's TikTokenTokenizer.pat_str, written out here on its own (not read from the
# recipe) so the test checks the recipe's copy rather than agreeing with itself.
KIMI_PAT = "|".join([
    r"[\p{Han}]+",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*"
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)?",
    r"\p{N}{1,3}",
    r" ?[^\s\p{L}\p{N}]+[\r\n]*",
    r"\s*[\r\n]+",
    r"\s+(?!\S)",
    r"\s+",
])

DOCS = [
    "In the beginning God created the heaven and the earth. And the earth was without form, and void; "
    "and darkness was upon the face of the deep. It's 12345 o'clock, THE END.\n\n",
    "你好，世界！Kimi 的分词器把汉字单独切开。 Mixed CamelCase words, numbers 3.14159 and\ttabs\r\nlines.",
    "They'll say we've done it; I'm sure you'd agree. " * 20,
]


@pytest.fixture(scope="module")
def kimi(tmp_path_factory):
    folder = generate("kimi_k2", tmp_path_factory.mktemp("kimi") / "ckpt", seed=0, num_layers=1)
    assert (folder / "tiktoken.model").is_file() and not (folder / "tokenizer.json").exists()
    return folder, json.loads((folder / "config.json").read_text())


def direct(folder) -> "tiktoken.Encoding":
    from tiktoken.load import load_tiktoken_bpe
    return tiktoken.Encoding(name="test-kimi", pat_str=KIMI_PAT,
                             mergeable_ranks=load_tiktoken_bpe(str(folder / "tiktoken.model")), special_tokens={})


def write_jsonl(path, docs):
    opener = gzip.open if path.name.endswith(".gz") else open
    with opener(path, "wt", encoding="utf-8") as f:
        for d in docs:
            f.write(json.dumps({"text": d}) + "\n")
    return path


def expected_stream(enc, docs, eos):
    out = []
    for i, d in enumerate(docs):
        if i:
            out.append(eos)
        out.extend(enc.encode_ordinary(d))
    return out


def test_recipe_pattern_is_moonshots():
    from kq.recipes import all_recipes
    assert all_recipes()["kimi_k2"].tiktoken_pattern == KIMI_PAT


def test_kimi_tiktoken_ids_equal_a_direct_encoding_with_eos_between(kimi, tmp_path):
    folder, config = kimi
    enc = direct(folder)
    eos = config["eos_token_id"]
    for name in ("calib.jsonl", "calib.jsonl.gz"):
        got = token_stream(folder, config, write_jsonl(tmp_path / name, DOCS))
        assert got == expected_stream(enc, DOCS, eos)
    # The synthetic ranks hold real merges: fewer tokens than bytes, all inside the vocabulary.
    one = token_stream(folder, config, write_jsonl(tmp_path / "one.jsonl", DOCS[:1]))
    assert len(one) < len(DOCS[0].encode()) and max(one) < config["vocab_size"]
    assert eos not in one
    # A .txt is one document: no EOS inside it (read in text mode: "\r\n" arrives as "\n").
    doc = DOCS[1].replace("\r\n", "\n") + DOCS[0]
    (tmp_path / "doc.txt").write_text(doc, encoding="utf-8")
    assert token_stream(folder, config, tmp_path / "doc.txt") == enc.encode_ordinary(doc)


def test_kimi_calibration_windows(kimi, tmp_path):
    folder, config = kimi
    path = write_jsonl(tmp_path / "c.jsonl", DOCS * 4)
    ids = calibration_ids(folder, config, path, samples=3, seqlen=16)
    stream = expected_stream(direct(folder), DOCS * 4, config["eos_token_id"])
    assert ids.shape == (3, 16)
    assert ids[0].tolist() == stream[:16] and ids[-1].tolist() == stream[-16:]


def test_long_runs_are_cut_as_moonshot_does(kimi):
    from kq.model import text
    s = "a" * 60_000 + " " * 30_001 + "b c"
    pieces = list(text._tiktoken_pieces(s))
    assert "".join(pieces) == s
    # Cut inside a run only: 25k a, 25k a, then 10k a + 25k spaces, then the rest.
    assert [len(p) for p in pieces] == [25_000, 25_000, 10_000 + 25_000, 5_001 + 3]
    folder, config = kimi
    tok = text.load_tokenizer(folder)
    enc = direct(folder)
    assert tok.encode(s) == [i for p in pieces for i in enc.encode_ordinary(p)]


def test_tiktoken_missing_is_one_line_with_the_extra(kimi, tmp_path, monkeypatch):
    folder, config = kimi
    monkeypatch.setitem(sys.modules, "tiktoken", None)
    monkeypatch.setitem(sys.modules, "tiktoken.load", None)
    with pytest.raises(KqError) as e:
        token_stream(folder, config, write_jsonl(tmp_path / "c.jsonl", DOCS))
    msg = str(e.value)
    assert "\n" not in msg and "pip install 'kq[kimi]'" in msg and "tiktoken.model" in msg


def test_no_tokenizer_at_all(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "kimi_k2"}')
    with pytest.raises(KqError, match="no tokenizer.json or tiktoken.model"):
        token_stream(tmp_path, {}, write_jsonl(tmp_path / "c.jsonl", DOCS))


def test_missing_local_path_that_is_no_hub_id():
    with pytest.raises(KqError, match="no such file"):
        resolve_calib("./nope/calib.txt")


# ---- Hub datasets -------------------------------------------------------------------

CLIENT = textwrap.dedent(
    """
    import json, sys
    from kq.errors import KqError
    from kq.quantize.calibration import token_stream
    folder, config = sys.argv[1], json.load(open(sys.argv[1] + "/config.json"))
    out = {{}}
    for spec in {specs!r}:
        try:
            out[spec] = token_stream(folder, config, spec)
        except KqError as err:
            out[spec] = str(err)
    print(json.dumps(out))
    """
)


def client(env, folder, specs, tmp_path):
    import subprocess
    r = subprocess.run([sys.executable, "-c", CLIENT.format(specs=specs), str(folder)], env=env,
                       capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


@pytest.fixture()
def datasets(tmp_path):
    one = tmp_path / "one"
    (one / "data").mkdir(parents=True)
    write_jsonl(one / "data" / "calib.jsonl", DOCS[:2])
    (one / "README.md").write_text("# one calibration file\n")
    many = tmp_path / "many"
    many.mkdir()
    (many / "b.txt").write_text(DOCS[2], encoding="utf-8")
    write_jsonl(many / "a.jsonl.gz", DOCS[:2])
    pq = tmp_path / "pq"
    pq.mkdir()
    (pq / "train-00000.parquet").write_bytes(b"PAR1 not really")
    with HubStandin(tmp_path / "hub") as h:
        h.add_repo_from_folder("org/one", one, repo_type="dataset")
        h.add_repo_from_folder("org/many", many, repo_type="dataset")
        h.add_repo_from_folder("org/pq", pq, repo_type="dataset")
        h.add_repo_from_folder("org/model-only", one)  # a model repo: not a dataset
        yield h


@pytest.mark.slow
def test_hub_dataset_calibration(kimi, datasets, tmp_path):
    folder, config = kimi
    enc, eos = direct(folder), config["eos_token_id"]
    home = tmp_path / "home"
    env = datasets.client_env(home=home)
    specs = ["org/one", "org/one@main:data/calib.jsonl", "org/many", "org/many:b.txt", "org/pq",
             "org/pq:train-00000.parquet", "org/nope", "org/one:data/missing.jsonl", "org/model-only",
             "org/one@v9:data/calib.jsonl"]
    got = client(env, folder, specs, tmp_path)
    two = expected_stream(enc, DOCS[:2], eos)
    assert got["org/one"] == two  # the one text file, README ignored
    assert got["org/one@main:data/calib.jsonl"] == two
    # Several files: all of them, sorted (a.jsonl.gz then b.txt), EOS between files as between documents.
    assert got["org/many"] == two + [eos] + enc.encode_ordinary(DOCS[2])
    assert got["org/many:b.txt"] == enc.encode_ordinary(DOCS[2])
    for spec in specs[4:]:
        assert isinstance(got[spec], str) and "\n" not in got[spec] and got[spec].startswith(f"--calib {spec}:"), got
    assert "Parquet is not supported" in got["org/pq"]
    assert "Parquet is not supported" in got["org/pq:train-00000.parquet"]
    assert "not found" in got["org/nope"] and "not found" in got["org/model-only"]
    assert "has no file 'data/missing.jsonl'" in got["org/one:data/missing.jsonl"]
    assert "revision 'v9' not found" in got["org/one@v9:data/calib.jsonl"]
    assert datasets.count("GET", "/datasets/org/one/resolve/") >= 1

    # Offline: a named file already in the HF cache still works; anything else says offline, one line.
    off = datasets.client_env(home=home, HF_HUB_OFFLINE="1")
    got = client(off, folder, ["org/one:data/calib.jsonl", "org/many:a.jsonl.gz", "org/one", "org/other:x.txt"],
                 tmp_path)
    assert got["org/one:data/calib.jsonl"] == two
    assert got["org/many:a.jsonl.gz"] == two
    for spec in ("org/one", "org/other:x.txt"):
        assert isinstance(got[spec], str) and "\n" not in got[spec] and "offline" in got[spec].lower(), got

    # Hub unreachable (the stand-in stopped), nothing cached: one line, says so.
    datasets.stop()
    got = client(datasets.client_env(home=tmp_path / "home2"), folder, ["org/one:data/calib.jsonl"], tmp_path)
    msg = got["org/one:data/calib.jsonl"]
    assert isinstance(msg, str) and "\n" not in msg and "cannot reach the Hub" in msg, msg
