"""kq's default RTN (per-group MSE clipping) against plain absmax RTN on the trained tiny model:
lower KL to the source and higher top-1 agreement, at group 32 and 128, measured with
`kq eval` on real kq outputs (48 x 256 tokens of the held-out eval text)."""
import json

import pytest

from kq_testutil import SHARED, TINY_MODEL, run_kq

EVAL_TEXT = SHARED / "data" / "eval_text.txt.gz"


@pytest.mark.slow
@pytest.mark.parametrize("group", [32, 128])
def test_default_rtn_beats_absmax(group, trained_output):
    res = {}
    for clip in ("mse", "absmax"):
        r = run_kq("eval", trained_output(group, clip), "--against", TINY_MODEL, "--text", EVAL_TEXT, "--json")
        assert r.returncode == 0, r.stderr
        res[clip] = json.loads(r.stdout)
        assert res[clip]["positions"] == 48 * 256
    assert res["mse"]["kl"] < res["absmax"]["kl"], res
    assert res["mse"]["top1"] > res["absmax"]["top1"], res
    # both close to the source: perplexity moves by well under 1 %
    for r in res.values():
        assert abs(r["ppl_quantized"] / r["ppl_source"] - 1) < 0.01
