"""Disaggregated-pair eval: the source prefills the prompt, the quantized model decodes on its cache.

A decode-pool rank receives, for every layer, the KV cache of the prompt tokens from an FP8
prefill rank (for MLA the latent `kv_a` output and rope key; for GLM-5.x's DSA also the
indexer's key cache: SGLang transfers it as `StateType.DSA`) and computes every later token
itself with its own weights. So at layer L the continuation positions attend over
[source KV of the prompt ; quantized KV of the continuation].

How the splice is done, one decoder layer at a time. A position's cached keys and values at
layer L (and its indexer key) are a function of that position's layer-L input alone, through
the layer's attention weights. kq leaves every non-expert tensor byte for byte, so the
source's and the quantized layer's attention weights are the same tensors (checked at every
layer; refused otherwise). Running the quantized layer on the spliced input
    x_L = [source's layer-L input at the prompt positions ; pair stream's own input after]
therefore computes, at the prompt positions, exactly the source's KV cache, and, at the
continuation positions, the quantized model's queries, keys, values and experts. Attention is
causal, so the continuation outputs are the decode rank's; the prompt outputs are dropped
(the next layer's prompt input is the source's again). No cache object is needed and the
computation is the plain layer call, so the identities hold bit for bit: source against
itself gives the plain figures, prompt length 0 gives the quantized model alone.

Memory: the plain eval's two hidden-state streams plus the pair stream's continuation part.
"""
from __future__ import annotations

import time
from typing import Callable

import torch

from kq.errors import KqError
from kq.eval.compare import EvalResult, _check_same_model
from kq.eval.metrics import Totals
from kq.model import LayerwiseModel


def _not_experts(layer: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in layer.state_dict().items() if not k.startswith("mlp.experts.")}


def check_same_attention(src_layer: torch.nn.Module, q_layer: torch.nn.Module, i: int) -> None:
    """The splice above needs the prompt KV made with the quantized layer's attention weights to
    be the source's: true when only the routed experts differ."""
    a, b = _not_experts(src_layer), _not_experts(q_layer)
    for k in a:
        if k not in b or a[k].shape != b[k].shape or not torch.equal(a[k], b[k]):
            raise KqError(f"--pair: layer {i} {k} differs between the source and the quantized checkpoint; pair "
                          "eval needs every tensor but the routed experts unchanged, as kq quantize leaves them")


@torch.no_grad()
def compare_pair(source: LayerwiseModel, quantized: LayerwiseModel, ids: torch.Tensor, targets: torch.Tensor, *,
                 prompt: int, batch: int = 8, on_layer: Callable[[int, int], None] | None = None) -> EvalResult:
    """The plain figures over every position (as compare() gives them), and, over the continuation
    positions prompt..S-1 of each window, the quantized model alone and the pair (source prefill
    of positions < prompt, quantized decode after)."""
    _check_same_model(quantized, source)
    S = ids.shape[1]
    if not 0 <= prompt < S:
        raise KqError(f"--prompt {prompt}: must be at least 0 and below the window length {S}")
    t0 = time.time()
    chunks = list(ids.split(batch))
    hs = [source.embed(c) for c in chunks]
    hq = [quantized.embed(c) for c in chunks]
    hp = [h[:, prompt:].clone() for h in hq]        # pair stream: continuation positions only
    cs: list = [None] * len(chunks)
    cq: list = [None] * len(chunks)
    cp: list = [None] * len(chunks)
    n = source.num_layers
    for i in range(n):
        s_layer = source.load_layer(i)
        s_in = [h[:, :prompt] for h in hs]          # the source's layer-i input at the prompt positions
        for b in range(len(chunks)):
            hs[b], cs[b] = source.forward_layer(s_layer, hs[b], cs[b])
        q_layer = quantized.load_layer(i)
        check_same_attention(s_layer, q_layer, i)
        del s_layer
        for b in range(len(chunks)):
            hq[b], cq[b] = quantized.forward_layer(q_layer, hq[b], cq[b])
            out, cp[b] = quantized.forward_layer(q_layer, torch.cat([s_in[b], hp[b]], 1), cp[b])
            hp[b] = out[:, prompt:]
        del q_layer, s_in
        if on_layer:
            on_layer(i + 1, n)
    plain, alone, pair = Totals(), Totals(), Totals()
    for t, a, b, p in zip(targets.split(batch), hs, hq, hp):
        ls, lq = source.logits(a), quantized.logits(b)
        plain.add(ls, lq, t)
        alone.add(ls[:, prompt:], lq[:, prompt:], t[:, prompt:])
        pair.add(ls[:, prompt:], quantized.logits(p), t[:, prompt:])
    notes = {"pair": {"prompt": prompt, "continuation": S - prompt,
                      "alone": alone.summary(), "pair": pair.summary()}}
    return EvalResult(plain.summary(), plain.as_dict(), ids.shape[0], S, time.time() - t0, n, notes)
