"""MTP draft acceptance: how often the checkpoint's MTP layer proposes the token its target picks.

SGLang serves the MTP layer (index num_hidden_layers) as an EAGLE-style draft model
(models/deepseek_nextn.py, GlmMoeDsaForCausalLMNextN for GLM-5.x). For the first draft token at
position t it takes the embedding of token t+1 and the target's hidden state at t (the target's
output after its final norm: what SGLang's logits processor hands the draft), then
    x = eh_proj(cat(enorm(embed(tok[t+1])), hnorm(h[t])))
    x = shared_head.norm(decoder_layer(x))     # the MTP layer: attention over the draft's own
                                               # earlier positions, MoE, as any decoder layer
    draft[t] = argmax(lm_head(x))              # the target's lm_head (no shared_head.head stored)
which guesses token t+2. Greedy verification accepts it when it equals the target's own choice
at t+1, argmax(target logits[t+1]). Here both run teacher-forced over the eval windows (token t+1
is the text's), so
acceptance = mean over t in 0..S-2 of [draft[t] == target_argmax[t+1]]: the first draft token's
acceptance rate. Also reported: the draft's top-1 against the text's token t+2.

Memory and time: one more layer-by-layer pass of the model (the target's final hidden states),
plus the MTP layer.
"""
from __future__ import annotations

import copy
import gc
from typing import Callable

import torch
import torch.nn.functional as F

from kq.errors import KqError
from kq.model import LayerwiseModel


def mtp_layer_index(model: LayerwiseModel) -> int:
    n = model.num_layers
    if not int(model.reader.config.get("num_nextn_predict_layers") or 0) or \
            f"{model.layer_prefix(n)}eh_proj.weight" not in model.reader:
        raise KqError(f"{getattr(model.reader, 'folder', 'the checkpoint')}: no MTP layer (num_nextn_predict_layers "
                      f"and model.layers.{n}.eh_proj); --mtp needs one")
    return n


def mtp_config(model: LayerwiseModel, n: int):
    """The model's config with a per-layer entry for layer n: transformers' configs list layer kinds
    for the causal layers only. The MTP layer is a MoE layer; it runs its own DSA indexer when the
    checkpoint has one for it (GLM-5.2's layer 78 does)."""
    cfg = copy.deepcopy(model.config)
    for key in ("mlp_layer_types", "layer_types"):
        v = getattr(cfg, key, None)
        if isinstance(v, list) and len(v) == n:
            setattr(cfg, key, v + [("sparse" if key == "mlp_layer_types" else v[-1])])
    if isinstance(getattr(cfg, "indexer_types", None), list):
        has = f"{model.layer_prefix(n)}self_attn.indexer.wk.weight" in model.reader
        if not has:
            raise KqError(f"layer {n} (MTP) shares its DSA indexer; kq's MTP eval runs only MTP layers with their own")
        cfg.indexer_types = list(cfg.indexer_types) + ["full"]
    return cfg


@torch.no_grad()
def final_hidden(model: LayerwiseModel, ids: torch.Tensor, batch: int,
                 on_layer: Callable[[int, int], None] | None = None) -> list[torch.Tensor]:
    """The target's last decoder layer output per batch of windows, layer by layer."""
    hs = [model.embed(c) for c in ids.split(batch)]
    carry: list = [None] * len(hs)
    for i in range(model.num_layers):
        layer = model.load_layer(i)
        for b in range(len(hs)):
            hs[b], carry[b] = model.forward_layer(layer, hs[b], carry[b])
        del layer
        gc.collect()
        if on_layer:
            on_layer(i + 1, model.num_layers)
    return hs


@torch.no_grad()
def mtp_picks(model: LayerwiseModel, ids: torch.Tensor, targets: torch.Tensor, *, batch: int = 8,
              on_layer: Callable[[int, int], None] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """ids, targets [N, S] -> (draft [N, S-1]: the MTP layer's guess of token t+2 at t,
    target [N, S]: the model's own guess of token t+1 at t)."""
    n = mtp_layer_index(model)
    hs = final_hidden(model, ids, batch, on_layer)
    pre = model.layer_prefix(n)
    layer = model.load_layer(n, config=mtp_config(model, n))

    def norm(name):
        m = model._Norm(model.config.hidden_size, eps=model.config.rms_norm_eps)
        m.weight.data = model.reader.raw(pre + name).to(model.device, model.dtype)
        return m

    enorm, hnorm, head_norm = norm("enorm.weight"), norm("hnorm.weight"), norm("shared_head.norm.weight")
    eh = model.reader.weight(pre + "eh_proj").to(model.device, model.dtype)
    model.logits(hs[0][:1, :1])                       # builds the final norm + lm_head
    final_norm, head = model._head
    draft_head = head
    if pre + "shared_head.head.weight" in model.reader:
        draft_head = model.reader.weight(pre + "shared_head.head").to(model.device, model.dtype)
    drafts, picks = [], []
    for h, x_ids, t in zip(hs, ids.split(batch), targets.split(batch)):
        hn = final_norm(h)                                                           # [B, S, H]
        picks.append(F.linear(hn, head).argmax(-1))                                  # [B, S]: guesses t+1
        nxt = t[:, :-1]                                                              # [B, S-1]: token t+1
        x = F.linear(torch.cat([enorm(model.embed(nxt)), hnorm(hn[:, :-1])], -1), eh)
        x, _ = model.forward_layer(layer, x, None)
        drafts.append(F.linear(head_norm(x), draft_head).argmax(-1))                  # [B, S-1]: guesses t+2
    return torch.cat(drafts), torch.cat(picks)


def acceptance(draft: torch.Tensor, target: torch.Tensor, targets: torch.Tensor) -> dict:
    """Greedy first-token acceptance: draft[t] == target[t+1]; and the draft's top-1 on the text (token t+2)."""
    return {"acceptance": float((draft == target[:, 1:]).double().mean()),
            "draft_top1_text": float((draft == targets[:, 1:]).double().mean()), "positions": draft.numel()}


def mtp_acceptance(model: LayerwiseModel, ids: torch.Tensor, targets: torch.Tensor, *, batch: int = 8,
                   on_layer: Callable[[int, int], None] | None = None) -> dict:
    draft, target = mtp_picks(model, ids, targets, batch=batch, on_layer=on_layer)
    return {**acceptance(draft, target, targets), "mtp_layer": model.num_layers}


def mtp_report(source: LayerwiseModel, quantized: LayerwiseModel, ids: torch.Tensor, targets: torch.Tensor, *,
               batch: int = 8, on_layer: Callable[[int, int], None] | None = None) -> dict:
    """Acceptance of each checkpoint's draft against its own target (what serving it gives), and how
    often the quantized checkpoint's draft and target pick what the source's do."""
    ds, ts = mtp_picks(source, ids, targets, batch=batch, on_layer=on_layer)
    dq, tq = mtp_picks(quantized, ids, targets, batch=batch, on_layer=on_layer)
    return {"source": acceptance(ds, ts, targets), "quantized": acceptance(dq, tq, targets),
            "quantized_draft_vs_source_target": float((dq == ts[:, 1:]).double().mean()),
            "draft_agreement": float((dq == ds).double().mean()), "mtp_layer": source.num_layers}
