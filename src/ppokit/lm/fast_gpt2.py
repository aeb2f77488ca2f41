"""A lean incremental forward for ``transformers``' ``GPT2LMHeadModel``, used by ``sampling.CachedSampler``.

Why: on a small GPT-2 a decoding step through the model's own ``forward`` spends most of its time in per-call
machinery (mask building, cache objects, output dataclasses, hooks), not in arithmetic (measured on the demo's 2x64
GPT-2, 64 rows, one thread: ~1 ms a step, of which ~0.3 ms are tensor ops). This module runs the same blocks with
the model's own submodules and weights (``ln_1``, ``c_attn``, ``c_proj``, ``ln_2``, the ``mlp`` with its own
activation module, ``ln_f``, ``lm_head``; the prefill calls the modules, a decoding ``step`` reads their weights
into ``addmm``/``layer_norm`` on ``[B, d]`` rows) and does only the attention and the KV cache itself: keys and
values go into a preallocated ``[B, H, P + N, D]`` buffer per layer, and attention is
``scaled_dot_product_attention`` with the model's ``scaling`` and a boolean mask (a key is visible when it is a real
token at or before the query; a left-padding query sees only itself, so no row of the softmax is empty).

Only the plain architecture is taken (self-attention only, no ``reorder_and_upcast_attn``, eval mode, plain
``Conv1D``/``LayerNorm``/``Linear`` modules without hooks, so a LoRA-wrapped or instrumented model is not), and a
model is checked once against its own ``forward`` on the prompts it is first asked to extend (the last position's
logits must agree within 1e-4); anything else decodes through the model's ``forward`` (``CachedSampler``'s generic
loop). The log-probs the learner uses are recomputed by ``logprobs.token_logprobs`` with the model's own forward
either way; this path only has to sample the same distribution.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F
from torch import Tensor, nn

__all__ = ["GPT2Decoder", "gpt2_decoder"]

_CHECK_TOL = 1e-4


def _plain_gpt2(model: nn.Module) -> bool:
    cfg = getattr(model, "config", None)
    if type(model).__name__ != "GPT2LMHeadModel" or cfg is None or getattr(cfg, "model_type", None) != "gpt2":
        return False
    if getattr(cfg, "add_cross_attention", False) or getattr(cfg, "reorder_and_upcast_attn", False):
        return False
    t = getattr(model, "transformer", None)
    if t is None or not all(hasattr(t, n) for n in ("wte", "wpe", "h", "ln_f")) or model.training:
        return False
    # ``step`` reads the weights straight from these modules: they must be the plain ones, with no hooks.
    for block in t.h:
        convs = (block.attn.c_attn, block.attn.c_proj, block.mlp.c_fc, block.mlp.c_proj)
        if any(type(c).__name__ != "Conv1D" for c in convs):
            return False
    layer_norms = [t.ln_f] + [m for b in t.h for m in (b.ln_1, b.ln_2)]
    if any(type(m) is not nn.LayerNorm for m in layer_norms) or type(model.lm_head) is not nn.Linear:
        return False
    return not any(m._forward_hooks or m._forward_pre_hooks for m in model.modules())


class GPT2Decoder:
    """Prefill + one-token steps over a preallocated KV cache, for ``B`` rows and up to ``capacity`` positions."""

    def __init__(self, model: nn.Module, batch: int, capacity: int):
        self.model, self.t = model, model.transformer
        p = next(model.parameters())
        cfg = model.config
        self.H = cfg.n_head
        self.D = cfg.n_embd // cfg.n_head
        shape = (batch, self.H, capacity, self.D)
        self.keys = [torch.empty(shape, dtype=p.dtype, device=p.device) for _ in self.t.h]
        self.values = [torch.empty(shape, dtype=p.dtype, device=p.device) for _ in self.t.h]
        self.length = 0

    def _scaling(self, attn: nn.Module, layer: int) -> float:
        scaling = getattr(attn, "scaling", None)
        if scaling is not None:
            return float(scaling)
        cfg = self.model.config  # transformers before the precomputed ``scaling`` attribute
        s = self.D ** -0.5 if cfg.scale_attn_weights else 1.0
        return s / float(layer + 1) if cfg.scale_attn_by_inverse_layer_idx else s

    def forward(self, input_ids: Tensor, position_ids: Tensor, visible: Tensor) -> Tensor:
        """``input_ids``/``position_ids`` ``[B, L]`` (the next ``L`` positions), ``visible`` ``[B, 1, L, S]`` bool
        with ``S = length + L``; returns the last position's logits ``[B, V]``."""
        B, L = input_ids.shape
        start, end = self.length, self.length + L
        h = self.t.wte(input_ids) + self.t.wpe(position_ids)
        for i, block in enumerate(self.t.h):
            attn = block.attn
            q, k, v = attn.c_attn(block.ln_1(h)).split(attn.split_size if hasattr(attn, "split_size")
                                                      else h.shape[-1], dim=2)
            q = q.view(B, L, self.H, self.D).transpose(1, 2)
            self.keys[i][:, :, start:end] = k.view(B, L, self.H, self.D).transpose(1, 2)
            self.values[i][:, :, start:end] = v.view(B, L, self.H, self.D).transpose(1, 2)
            out = F.scaled_dot_product_attention(q, self.keys[i][:, :, :end], self.values[i][:, :, :end],
                                                 attn_mask=visible, scale=self._scaling(attn, i))
            h = h + attn.c_proj(out.transpose(1, 2).reshape(B, L, -1))
            h = h + block.mlp(block.ln_2(h))
        self.length = end
        return self.model.lm_head(self.t.ln_f(h[:, -1]))

    def step(self, token: Tensor, position: Tensor, visible: Tensor) -> Tensor:
        """One new token per row: ``token``/``position`` ``[B]``, ``visible`` ``[B, 1, 1, length + 1]`` bool;
        returns its logits ``[B, V]``. The same arithmetic as ``forward`` on ``[B, d]`` rows, with the weights
        read straight from the modules (one decoding step is ~60 small ops; the module calls around them were a
        third of its time)."""
        B, t, at = token.shape[0], self.t, self.length
        h = F.embedding(token, t.wte.weight) + F.embedding(position, t.wpe.weight)  # [B, d]
        for i, block in enumerate(t.h):
            attn, mlp, ln_1, ln_2 = block.attn, block.mlp, block.ln_1, block.ln_2
            x = F.layer_norm(h, ln_1.normalized_shape, ln_1.weight, ln_1.bias, ln_1.eps)
            q, k, v = torch.addmm(attn.c_attn.bias, x, attn.c_attn.weight).view(B, 3, self.H, self.D).unbind(1)
            self.keys[i][:, :, at] = k
            self.values[i][:, :, at] = v
            out = F.scaled_dot_product_attention(q[:, :, None], self.keys[i][:, :, :at + 1],
                                                 self.values[i][:, :, :at + 1], attn_mask=visible,
                                                 scale=self._scaling(attn, i))  # [B, H, 1, D]
            h = h + torch.addmm(attn.c_proj.bias, out.reshape(B, -1), attn.c_proj.weight)
            x = F.layer_norm(h, ln_2.normalized_shape, ln_2.weight, ln_2.bias, ln_2.eps)
            h = h + torch.addmm(mlp.c_proj.bias, mlp.act(torch.addmm(mlp.c_fc.bias, x, mlp.c_fc.weight)),
                                mlp.c_proj.weight)
        self.length = at + 1
        ln_f = t.ln_f
        return self.model.lm_head(F.layer_norm(h, ln_f.normalized_shape, ln_f.weight, ln_f.bias, ln_f.eps))


def prefill_visibility(prompt_mask: Tensor) -> Tensor:
    """``[B, 1, P, P]`` bool: query ``i`` sees key ``j <= i`` when ``j`` is a real token; a padding query sees
    itself (its output is never read, and an all-False row would make the softmax NaN)."""
    P = prompt_mask.shape[1]
    causal = torch.ones(P, P, dtype=torch.bool, device=prompt_mask.device).tril()
    visible = causal[None] & prompt_mask.bool()[:, None, :]
    visible |= torch.eye(P, dtype=torch.bool, device=prompt_mask.device)[None]
    return visible[:, None]


_checked: "weakref.WeakKeyDictionary[nn.Module, bool]" = weakref.WeakKeyDictionary()


def gpt2_decoder(model: nn.Module, prompt_ids: Tensor, prompt_mask: Tensor, positions: Tensor,
                 capacity: int) -> tuple[GPT2Decoder, Tensor] | None:
    """A ``GPT2Decoder`` after its prefill and the prefill's last logits ``[B, V]``, or None when the model is not
    a plain GPT-2 or (checked once per model) does not agree with its own forward."""
    if not _plain_gpt2(model):
        return None
    decoder = GPT2Decoder(model, prompt_ids.shape[0], capacity)
    logits = decoder.forward(prompt_ids, positions, prefill_visibility(prompt_mask))
    key = model
    if key not in _checked:
        reference = model(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=positions,
                          use_cache=False).logits[:, -1]
        scale = float(reference.abs().max().clamp(min=1.0))
        _checked[key] = bool(((logits - reference).abs().max() <= _CHECK_TOL * scale).item())
    return (decoder, logits) if _checked[key] else None
