"""Run a checkpoint one decoder layer at a time with the architecture's own modules.

Only one decoder layer's weights exist in memory at once: `load_layer(i)` builds the
transformers `<Family>DecoderLayer` on the meta device (no allocation, no random
init), then assigns the checkpoint's dequantized tensors to it. The caller holds the
hidden states of its sequences between layers and drops the layer when done.

The MTP layer (index num_hidden_layers) is not part of the causal-LM forward pass
(transformers ignores it too), so the runner never loads it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from transformers.masking_utils import create_causal_mask

from kq.errors import KqError
from kq.model.families import arch_for, build_config, classes
from kq.model.weights import ExpertOverride, Reader, load_tensor


@dataclass
class LayerInput:
    """What every decoder layer is called with, for one batch shape."""
    position_ids: torch.Tensor
    position_embeddings: tuple[torch.Tensor, torch.Tensor]
    mask: torch.Tensor | None


class LayerwiseModel:
    def __init__(self, reader: Reader, *, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", override: ExpertOverride | None = None,
                 on_load: Callable[["LayerwiseModel", torch.nn.Module, int], None] | None = None):
        self.reader = reader
        self.arch = arch_for(reader.config)
        self.config = build_config(reader.config)
        self.dtype = dtype
        self.device = torch.device(device)
        self.override = override
        self.on_load = on_load  # called with each loaded layer (kq eval's FP8-activation experts)
        self._Layer, rotary_cls, self._Norm, pretrained = classes(self.arch)
        # K2.5-style multimodal checkpoints keep the text model under `language_model.`.
        self.prefix = "language_model." if ("model.embed_tokens.weight" not in reader
                                            and "language_model.model.embed_tokens.weight" in reader) else ""
        self.num_layers = self.config.num_hidden_layers
        # Modules transformers keeps in float32 whatever the model dtype (router bias, DSA weights_proj).
        self._fp32 = tuple(list(getattr(pretrained, "_keep_in_fp32_modules", None) or [])
                           + list(getattr(pretrained, "_keep_in_fp32_modules_strict", None) or []))
        self.rotary = rotary_cls(self.config).to(self.device)
        self._inputs: dict[tuple[int, int], LayerInput] = {}
        self._head: tuple[torch.nn.Module, torch.Tensor] | None = None

    # -- layers ---------------------------------------------------------------------
    def layer_prefix(self, i: int) -> str:
        return f"{self.prefix}model.layers.{i}."

    def n_experts(self) -> int:
        c = self.config
        return getattr(c, "n_routed_experts", None) or getattr(c, "num_local_experts", 0)

    def load_layer(self, i: int, override: ExpertOverride | None = None, experts=None, *,
                   config=None) -> torch.nn.Module:
        """Decoder layer i on the device; with `experts`, only those routed experts are read (the
        others' slices of the fused expert parameters are left uninitialised); `config` builds a layer
        the causal forward has no entry for (the MTP layer, kq.eval.mtp)."""
        if config is None and not 0 <= i < self.num_layers:
            raise KqError(f"layer {i} is outside the model's {self.num_layers} decoder layers")
        with torch.device("meta"):
            layer = self._Layer(config or self.config, i)
        sd = {}
        for key, like in layer.state_dict().items():
            dt = torch.float32 if any(m in key for m in self._fp32) else self.dtype
            like = torch.empty(like.shape, dtype=dt, device="meta")
            t = load_tensor(self.reader, self.layer_prefix(i), key, like, self.n_experts(),
                            override if override is not None else self.override, experts)
            sd[key] = t.to(self.device)
        layer.load_state_dict(sd, strict=True, assign=True)
        left = [n for n, t in list(layer.named_parameters()) + list(layer.named_buffers()) if t.is_meta]
        if left:
            raise KqError(f"layer {i}: no checkpoint tensor for {left[:3]}")
        if self.on_load is not None:
            self.on_load(self, layer, i)
        return layer.eval()

    def layer_input(self, batch: int, seqlen: int) -> LayerInput:
        key = (batch, seqlen)
        if key not in self._inputs:
            pos = torch.arange(seqlen, device=self.device).unsqueeze(0).expand(batch, -1)
            probe = torch.empty(batch, seqlen, self.config.hidden_size, dtype=self.dtype, device=self.device)
            pe = self.rotary(probe, pos)
            # The same mask call the family's Model.forward makes (DSA forces an explicit mask).
            mask = create_causal_mask(config=self.config, inputs_embeds=probe, attention_mask=None,
                                      past_key_values=None, position_ids=pos,
                                      allow_is_causal_skip=not self.arch.explicit_mask)
            self._inputs = {key: LayerInput(pos, pe, mask)}  # one shape at a time: masks are S^2
        return self._inputs[key]

    @torch.no_grad()
    def forward_layer(self, layer: torch.nn.Module, hidden: torch.Tensor, carry=None):
        """hidden [B, S, H] -> (hidden [B, S, H], carry for the next layer)."""
        li = self.layer_input(hidden.shape[0], hidden.shape[1])
        kw = {"prev_topk_indices": carry} if self.arch.carries_topk else {}
        out = layer(hidden, attention_mask=li.mask, position_ids=li.position_ids,
                    position_embeddings=li.position_embeddings, **kw)
        if isinstance(out, tuple):
            return out[0], (out[1] if self.arch.carries_topk else None)
        return out, None

    # -- ends -----------------------------------------------------------------------
    @torch.no_grad()
    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, S] -> hidden [B, S, H]; reads only the embedding rows it needs (mmap)."""
        table = self.reader.raw(self.prefix + "model.embed_tokens.weight")
        if int(ids.max()) >= table.shape[0] or int(ids.min()) < 0:
            raise KqError(f"token id outside the embedding table of {table.shape[0]} rows")
        return table[ids.reshape(-1)].reshape(*ids.shape, -1).to(self.device, self.dtype)

    @torch.no_grad()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + lm_head: hidden [..., H] -> float32 logits [..., V]."""
        if self._head is None:
            norm = self._Norm(self.config.hidden_size, eps=self.config.rms_norm_eps)
            norm.weight.data = self.reader.raw(self.prefix + "model.norm.weight").to(self.device, self.dtype)
            if self.prefix + "lm_head.weight" in self.reader:
                head = self.reader.weight(self.prefix + "lm_head")
            else:  # tied embeddings
                head = self.reader.raw(self.prefix + "model.embed_tokens.weight")
            self._head = (norm, head.to(self.device, self.dtype))
        norm, head = self._head
        return F.linear(norm(hidden), head).float()
