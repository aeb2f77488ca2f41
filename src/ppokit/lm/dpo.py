"""DPO (Rafailov et al. 2023): PPO's KL-regularized objective solved in closed form, trained on preference pairs.

For a pair (prompt x, chosen y_w, rejected y_l) the implicit reward of a response is ``beta * log(pi(y|x) /
pi_ref(y|x))`` (sequence log-probs: sums over the response tokens, EOS included), and the loss is
``-log sigmoid(r(y_w) - r(y_l))`` (the paper's eq. 7), averaged over the pairs. The sequences are laid out and
scored by the same code as the RL trainers' (``rollout.encode_prompts``' left padding, ``logprobs``' position ids
and response masks); the reference log-probs are computed under ``torch.no_grad`` from pi_ref (a frozen copy, or
the PEFT base with the adapter disabled).

``step()`` takes the next ``batch_prompts`` pairs (a seeded permutation per pass over the pairs) and applies one
optimizer step, skipped (and counted) when the loss or the gradient is not finite.
"""

from __future__ import annotations

import os
import time
from typing import Any, Iterator

import torch
from torch import Tensor, nn

from ppokit.core import schema as S
from ppokit.lm.base import LMTrainer
from ppokit.lm.checks import check_pairs_context
from ppokit.lm.data import numbered_rows, to_pair
from ppokit.lm.logprobs import micro_slices, token_logprobs
from ppokit.lm.losses import LossSettings, get_loss
from ppokit.lm.rollout import encode_prompts

__all__ = ["DPOTrainer", "encode_pairs", "encode_responses"]


def _check_pairs(pairs: Any, tokenizer: Any = None) -> list[tuple[str, str, str]]:
    """``(prompt, chosen, rejected)`` text triples from a list of triples or rows, a ``datasets.Dataset``, a
    ``save_to_disk`` directory or a JSONL file, each column a string or conversational (``data.to_pair``)."""
    where = f"pairs {pairs}" if isinstance(pairs, (str, os.PathLike)) else "pairs"
    rows = numbered_rows(pairs, where)
    if not rows:
        raise ValueError("pairs must be a non-empty list of (prompt, chosen, rejected) string triples")
    return [to_pair(row, n, tokenizer, where) for n, row in rows]


def encode_pairs(tokenizer: Any, pairs: list[tuple[str, str, str]], pad_id: int, eos_id: int,
                 device: torch.device) -> tuple[Tensor, Tensor, int]:
    """``(input_ids [2N, P + R], attention_mask [2N, P + R], R)``: rows ``0..N-1`` are prompt + chosen, rows
    ``N..2N-1`` prompt + rejected; prompts left-padded, responses (their tokens + EOS) right-padded."""
    return encode_responses(tokenizer, [p for p, _, _ in pairs] * 2,
                            [c for _, c, _ in pairs] + [r for _, _, r in pairs], pad_id, eos_id, device)


def encode_responses(tokenizer: Any, prompts: list[str], responses: list[str], pad_id: int, eos_id: int,
                     device: torch.device) -> tuple[Tensor, Tensor, int]:
    """``(input_ids [N, P + R], attention_mask [N, P + R], R)``: each prompt left-padded, its response (tokens +
    EOS) right-padded after it."""
    prompt_ids, prompt_mask = encode_prompts(tokenizer, prompts, pad_id, device)
    resp = [list(x) + [eos_id] for x in tokenizer(responses, add_special_tokens=False)["input_ids"]]
    R = max(len(r) for r in resp)
    response_ids = torch.full((len(resp), R), pad_id, dtype=torch.long)
    response_mask = torch.zeros((len(resp), R), dtype=torch.long)
    for i, row in enumerate(resp):
        response_ids[i, :len(row)] = torch.tensor(row, dtype=torch.long)
        response_mask[i, :len(row)] = 1
    input_ids = torch.cat([prompt_ids, response_ids.to(device)], 1)
    return input_ids, torch.cat([prompt_mask, response_mask.to(device)], 1), R


class DPOTrainer(LMTrainer):
    """DPO on a causal LM: ``DPOTrainer(model, tokenizer, pairs=[(prompt, chosen, rejected), ...], config=...)``."""

    algo = "dpo"
    kl_knob = "beta"  # DPO's beta sets how far the implicit reward lets the policy leave pi_ref

    def __init__(self, model: nn.Module, tokenizer: Any, pairs: Any, config=None, run_dir=None,
                 ref_model: nn.Module | None = None, *, overwrite: bool = False):
        self.pairs = _check_pairs(pairs, tokenizer)  # before the base's input checks, which measure them
        super().__init__(model, tokenizer, config, run_dir, ref_model)
        self.overwrite = overwrite
        self.consumed = 0
        self._perm: tuple[int, Tensor] | None = None
        self.optimizer = torch.optim.AdamW(self.trainable_parameters(), lr=self.config.learning_rate,
                                           weight_decay=self.config.weight_decay)

    # ---------------------------------------------------------------- state
    def _cursor(self) -> dict[str, Any]:
        return {**super()._cursor(), "pairs_consumed": self.consumed}

    def _check_inputs(self, model: nn.Module, ref_model: nn.Module | None) -> None:
        longest_prompt, longest_response = check_pairs_context(self.tokenizer, model, self.pairs)
        n = self.config.batch_prompts
        # One backward over every pair's two sequences (no minibatches), or over a micro-batch of pairs.
        self._check_memory(model, ref_model, 2 * n, longest_prompt, longest_response,
                           f"batch_prompts {n:,} preference pairs, a chosen and a rejected sequence each",
                           update_rows=2 * min(n, self.config.micro_batch_size or n))

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        self.consumed = int(state["pairs_consumed"])

    def _next_pairs(self, n: int) -> list[tuple[str, str, str]]:
        out = []
        for _ in range(n):
            k, i = divmod(self.consumed, len(self.pairs))
            if self._perm is None or self._perm[0] != k:
                g = torch.Generator().manual_seed(self.config.seed * 100_003 + k)
                self._perm = (k, torch.randperm(len(self.pairs), generator=g))
            out.append(self.pairs[int(self._perm[1][i])])
            self.consumed += 1
        return out

    # ---------------------------------------------------------------- log-probs
    def token_logprobs(self, pairs: list[tuple[str, str, str]], reference: bool = False) -> tuple[Tensor, Tensor]:
        """``([2N, R] response-token log-probs, [2N, R] response mask)``, chosen rows over rejected, under pi (with
        gradient) or pi_ref."""
        ids, mask, R = encode_pairs(self.tokenizer, pairs, self.sampling.pad_token_id, self.sampling.eos_token_id,
                                    self.device)
        if reference:
            logp = self.ref_logprobs(ids, mask, R, temperature=1.0)
        else:
            logp, _ = token_logprobs(self.policy, ids, mask, R, 1.0)
        return logp, mask[:, -R:].bool()

    def sequence_logprobs(self, pairs: list[tuple[str, str, str]], reference: bool = False) -> Tensor:
        """``[2N]`` summed response log-probs (chosen rows, then rejected) under pi (with gradient) or pi_ref."""
        logp, resp_mask = self.token_logprobs(pairs, reference)
        return torch.where(resp_mask, logp, 0.0).sum(-1)

    def preference_accuracy(self, pairs: Any, implicit: bool = False) -> float:
        """Fraction of ``pairs`` the policy prefers the right way: ``log pi(chosen) > log pi(rejected)`` (the
        policy's own likelihoods; meaningful before any training too), or with ``implicit=True`` DPO's implicit
        reward ``log pi/pi_ref`` (0 for both at the start, so a tie; ties count as wrong)."""
        pairs = _check_pairs(pairs, self.tokenizer)
        hits = 0
        self.policy.eval()
        with torch.no_grad():
            step = min(self.config.batch_prompts, self.config.micro_batch_size or self.config.batch_prompts)
            for i in range(0, len(pairs), step):
                chunk = pairs[i:i + step]
                logp = self.sequence_logprobs(chunk)
                if implicit:
                    logp = logp - self.sequence_logprobs(chunk, reference=True)
                n = len(chunk)
                hits += int((logp[:n] > logp[n:]).sum())
        return hits / len(pairs)

    # ---------------------------------------------------------------- one step
    def step(self) -> dict[str, float]:
        cfg = self.config
        started = time.perf_counter()
        self._schedule_lr()  # this iteration's learning rate (lr_scheduler, warmup_steps)
        # Data-parallel: every rank draws the same pairs and trains on its share.
        pairs = self.dist.shard(self._next_pairs(cfg.batch_prompts))
        n = len(pairs)
        ids, mask, R = encode_pairs(self.tokenizer, pairs, self.sampling.pad_token_id, self.sampling.eos_token_id,
                                    self.device)
        with self.precision.autocast():
            ref = self.ref_logprobs(ids, mask, R, temperature=1.0)
        resp_mask = mask[:, -R:].bool()
        settings = LossSettings(beta=cfg.beta, dpo_loss=cfg.dpo_loss, label_smoothing=cfg.label_smoothing)
        stats: dict[str, Tensor] = {}

        def parts() -> Iterator[Tensor]:
            # Micro-batches of pairs (a pair's chosen row i and rejected row n + i stay together): the loss and
            # its statistics are means over the pairs, so each part weighs its share of them.
            for part in micro_slices(n, cfg.micro_batch_size):
                idx = torch.arange(n, device=self.device)[part]
                rows = torch.cat([idx, idx + n])
                share = len(idx) / n
                logp, _ = token_logprobs(self.policy, ids[rows], mask[rows], R, 1.0)
                loss, part_stats = get_loss("dpo")(logp, None, ref[rows], None, resp_mask[rows], settings)
                for name, v in part_stats.items():
                    stats[name] = stats.get(name, 0.0) + share * v
                yield share * loss

        with self._training_mode():
            loss_v, grad_v, skipped = self._apply(parts())
        self.completions += 2 * n * self.dist.world_size
        # Each rank measured its share of the pairs (the loss is averaged with the gradients): the whole batch's.
        accuracy, margin, chosen, rejected = self.dist.means(
            [float(stats[k]) for k in ("accuracy", "margin", "chosen_rewards", "rejected_rewards")])
        metrics = {
            S.POLICY_LOSS: loss_v, S.GRAD_NORM: grad_v, S.SKIPPED_MINIBATCHES: float(skipped),
            S.LEARNING_RATE: float(self.optimizer.param_groups[0]["lr"]),
            S.DPO_PREF_ACCURACY: accuracy, S.DPO_REWARD_MARGIN: margin,
            S.DPO_CHOSEN_REWARD: chosen, S.DPO_REJECTED_REWARD: rejected,
        }
        return self._finish(metrics, started, {})
