"""The supervised stages of the InstructGPT pipeline (Ouyang et al. 2022): SFT, then a reward model, then PPO.

``SFTTrainer``: supervised fine-tuning on ``(prompt, completion)`` rows (or conversational ``messages``, through
the chat template; ``data.to_sft_example``). The loss is the mean negative log-likelihood of the completion's
tokens and its EOS; the prompt's tokens weigh 0 (TRL's ``completion_only_loss``), so the model learns to answer,
not to write prompts.

``RewardModelTrainer``: a Bradley-Terry reward model from preference pairs (InstructGPT eq. 1): an
``AutoModelForSequenceClassification`` with one output, built from the policy's config and weights (a causal LM
is converted by ``reward_model_from``; its score head is new), trained on ``-log sigmoid(r(x, y_w) - r(x, y_l))``,
the score being the head's output at the last token of ``prompt + response`` (right-padded, so positions are
those of an unpadded sequence). A seeded share of the pairs is held out and their accuracy logged. The model is
saved with ``save_pretrained`` beside its tokenizer in ``RUN_DIR/reward_model``, a directory
``AutoModelForSequenceClassification.from_pretrained`` reads (and ``ppokit lm ppo --reward-model`` scores with).

Both run on the LM run machinery of ``base.LMTrainer``: the run dir's claim, the metrics logger and schema names,
checkpoints every ``save_every`` steps and an exact ``resume``. Each ``step()`` takes the next ``batch_prompts``
rows of a seeded permutation per pass (the position is checkpointed) and applies one optimizer step, skipped
(and counted) when the loss or the gradient is not finite.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any, Iterator

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ppokit.core import schema as S
from ppokit.lm.base import LMTrainer, adamw
from ppokit.lm.checks import check_pairs_context
from ppokit.lm.data import numbered_rows, read_rows, to_pair, to_sft_example
from ppokit.lm.dpo import encode_responses
from ppokit.lm.logprobs import micro_slices, token_logprobs
from ppokit.runtime.rundir import REWARD_MODEL_DIR

__all__ = ["SFTTrainer", "RewardModelTrainer", "reward_model_from", "REWARD_MODEL_DIR"]



def _where(source: Any, name: str) -> str:
    return f"{name} {source}" if isinstance(source, (str, os.PathLike)) else name


class _RowTrainer(LMTrainer):
    """What SFT and the reward model share: a list of rows served in a seeded order, one optimizer step each."""

    uses_reference = False

    def _init_rows(self, rows: list) -> None:
        self.rows = rows
        self.consumed = 0
        self._perm: tuple[int, Tensor] | None = None

    def _next_rows(self, n: int) -> list:
        out = []
        for _ in range(n):
            k, i = divmod(self.consumed, len(self.rows))
            if self._perm is None or self._perm[0] != k:
                g = torch.Generator().manual_seed(self.config.seed * 100_003 + k)
                self._perm = (k, torch.randperm(len(self.rows), generator=g))
            out.append(self.rows[int(self._perm[1][i])])
            self.consumed += 1
        return out

    def _cursor(self) -> dict[str, Any]:
        return {**super()._cursor(), "rows_consumed": self.consumed}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        self.consumed = int(state["rows_consumed"])

    def _base_metrics(self, grad_v: float, skipped: bool) -> dict[str, float]:
        return {S.GRAD_NORM: grad_v, S.SKIPPED_MINIBATCHES: float(skipped),
                S.LEARNING_RATE: float(self.optimizer.param_groups[0]["lr"])}


class SFTTrainer(_RowTrainer):
    """``SFTTrainer(model, tokenizer, data=[{"prompt": ..., "completion": ...}, ...], config=LMConfig(...))``."""

    algo = "sft"

    def __init__(self, model: nn.Module, tokenizer: Any, data: Any, config=None, run_dir=None, *,
                 overwrite: bool = False):
        where = _where(data, "data")
        self._init_rows([to_sft_example(row, n, tokenizer, where) for n, row in numbered_rows(data, where)])
        if not self.rows:
            raise ValueError(f"{where}: no rows")
        super().__init__(model, tokenizer, config, run_dir)
        self.overwrite = overwrite
        self.optimizer = adamw(self.trainable_parameters(), self.config.learning_rate, self.config.weight_decay)

    def _check_inputs(self, model: nn.Module, ref_model: nn.Module | None) -> None:
        p, r = check_pairs_context(self.tokenizer, model, [(q, c, c) for q, c in self.rows])
        n = self.config.batch_prompts
        self._check_memory(model, None, n, p, r, f"batch_prompts {n:,} SFT rows", update_rows=min(n, self.config.micro_batch_size or n))

    def completion_logprobs(self, examples: list[tuple[str, str]]) -> tuple[Tensor, Tensor]:
        """``([N, R] log-probs of the completion tokens and their EOS, [N, R] mask)`` under the policy (with
        gradient); the prompt's tokens are not among them."""
        ids, mask, R = encode_responses(self.tokenizer, [p for p, _ in examples], [c for _, c in examples],
                                        self.sampling.pad_token_id, self.sampling.eos_token_id, self.device)
        logp, _ = token_logprobs(self.policy, ids, mask, R, 1.0)
        return logp, mask[:, -R:].bool()

    def loss(self, examples: list[tuple[str, str]]) -> Tensor:
        """Mean NLL per completion token (EOS included) over ``examples``."""
        return sum(self._loss_parts(examples))

    def _loss_parts(self, examples: list[tuple[str, str]]) -> Iterator[Tensor]:
        """The mean NLL as micro-batches of rows: each part is its tokens' NLL sum over ALL the rows' tokens (its
        share of the token mean), so the parts sum to the loss."""
        ids, mask, R = encode_responses(self.tokenizer, [p for p, _ in examples], [c for _, c in examples],
                                        self.sampling.pad_token_id, self.sampling.eos_token_id, self.device)
        resp = mask[:, -R:].bool()
        tokens = resp.sum().clamp(min=1)
        for part in micro_slices(len(examples), self.config.micro_batch_size):
            logp, _ = token_logprobs(self.policy, ids[part], mask[part], R, 1.0)
            yield -torch.where(resp[part], logp, 0.0).sum() / tokens

    def step(self) -> dict[str, float]:
        started = time.perf_counter()
        self._schedule_lr()  # this iteration's learning rate (lr_scheduler, warmup_steps)
        rows = self.dist.shard(self._next_rows(self.config.batch_prompts))
        with self._training_mode():
            loss_v, grad_v, skipped = self._apply(self._loss_parts(rows))
        self.completions += len(rows) * self.dist.world_size
        return self._finish({S.SFT_NLL: loss_v, **self._base_metrics(grad_v, skipped)}, started, {})


def reward_model_from(model: nn.Module, tokenizer: Any, seed: int = 0) -> nn.Module:
    """An ``AutoModelForSequenceClassification`` with one output from a causal LM's config and weights (its
    transformer body; the score head is new, drawn from ``seed``); a classification model is returned as is.

    Built in memory (``from_config``, then the body's weights loaded), not by a ``save_pretrained`` /
    ``from_pretrained`` round trip: under torchrun transformers writes a model's files on rank 0 alone, so every
    other rank would read an empty directory."""
    import copy

    from transformers import AutoModelForSequenceClassification

    if getattr(getattr(model, "config", None), "num_labels", None) == 1 and hasattr(model, "score"):
        out = model
    else:
        config = copy.deepcopy(model.config)
        config.num_labels = 1
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            out = AutoModelForSequenceClassification.from_config(config)
        first = next(model.parameters())
        out.to(dtype=first.dtype, device=first.device).eval()  # as from_pretrained returns a model
        lm_head = {f"{name}.{p}" for name, m in model.named_modules() if m is model.get_output_embeddings()
                   for p, _ in m.named_parameters()}
        missing, unexpected = out.load_state_dict(model.state_dict(), strict=False)
        body_missing = [k for k in missing if not k.startswith("score.")]
        if body_missing or set(unexpected) - lm_head:
            raise ValueError(f"reward model from {type(model).__name__}: its weights do not map onto "
                             f"{type(out).__name__} (missing {body_missing[:3]}, unexpected "
                             f"{sorted(set(unexpected) - lm_head)[:3]})")
    # The classifier finds each row's last token from pad_token_id (transformers' *ForSequenceClassification).
    pad = getattr(tokenizer, "pad_token_id", None)
    out.config.pad_token_id = pad if pad is not None else getattr(tokenizer, "eos_token_id", None)
    return out


def score_texts(model: nn.Module, tokenizer: Any, texts: list[str], device: torch.device | str = "cpu") -> Tensor:
    """``[N]`` reward-model scores of ``texts``, right-padded (the score at each row's last real token)."""
    ids = [list(x) for x in tokenizer(list(texts), add_special_tokens=True)["input_ids"]]
    pad = model.config.pad_token_id
    T = max(len(r) for r in ids)
    input_ids = torch.tensor([r + [pad] * (T - len(r)) for r in ids], dtype=torch.long, device=device)
    mask = torch.tensor([[1] * len(r) + [0] * (T - len(r)) for r in ids], dtype=torch.long, device=device)
    logits = model(input_ids=input_ids, attention_mask=mask).logits  # [N, T?, 1] or [N, 1]
    if logits.dim() == 3:
        logits = logits[torch.arange(len(ids)), mask.sum(-1) - 1]
    return logits.reshape(-1).float()


class RewardModelTrainer(_RowTrainer):
    """``RewardModelTrainer(model, tokenizer, pairs=[(prompt, chosen, rejected), ...], config=...)``: ``model`` a
    causal LM (converted by ``reward_model_from``) or a one-output sequence classifier. ``eval_frac`` of the pairs
    (a seeded draw; at least one when there are two or more) is held out; ``eval_pairs`` gives them instead."""

    algo = "rm"
    model_dir = REWARD_MODEL_DIR

    def __init__(self, model: nn.Module, tokenizer: Any, pairs: Any, config=None, run_dir=None, *,
                 eval_pairs: Any = None, eval_frac: float = 0.1, overwrite: bool = False):
        where = _where(pairs, "pairs")
        rows = [to_pair(row, n, tokenizer, where) for n, row in numbered_rows(pairs, where)]
        if not rows:
            raise ValueError(f"{where}: no pairs")
        if not (isinstance(eval_frac, (int, float)) and 0 <= eval_frac < 1):
            raise ValueError(f"eval_frac must be in [0, 1), got {eval_frac!r}")
        from ppokit.lm.config import LMConfig

        cfg = (config if config is not None else LMConfig()).validate()
        if eval_pairs is not None:
            ew = _where(eval_pairs, "eval_pairs")
            held = [to_pair(row, n, tokenizer, ew) for n, row in numbered_rows(eval_pairs, ew)]
        else:
            k = min(len(rows) - 1, math.ceil(eval_frac * len(rows))) if eval_frac > 0 else 0
            order = torch.randperm(len(rows), generator=torch.Generator().manual_seed(cfg.seed + 2)).tolist()
            held, rows = [rows[i] for i in order[:k]], [rows[i] for i in sorted(order[k:])]
        self.eval_rows = held
        self._init_rows(rows)
        super().__init__(reward_model_from(model, tokenizer, cfg.seed), tokenizer, cfg, run_dir)
        self.overwrite = overwrite
        self.optimizer = adamw(self.trainable_parameters(), self.config.learning_rate, self.config.weight_decay)

    def _check_inputs(self, model: nn.Module, ref_model: nn.Module | None) -> None:
        p, r = check_pairs_context(self.tokenizer, model, self.rows + self.eval_rows)
        n = self.config.batch_prompts
        self._check_memory(model, None, 2 * n, p, r, f"batch_prompts {n:,} preference pairs, two sequences each",
                           update_rows=2 * min(n, self.config.micro_batch_size or n))

    def scores(self, pairs: list[tuple[str, str, str]]) -> tuple[Tensor, Tensor]:
        """``([N] r(prompt + chosen), [N] r(prompt + rejected))`` (with gradient)."""
        texts = [p + c for p, c, _ in pairs] + [p + r for p, _, r in pairs]
        out = score_texts(self.policy, self.tokenizer, texts, self.device)
        return out[:len(pairs)], out[len(pairs):]

    def accuracy(self, pairs: Any = None) -> float:
        """Fraction of ``pairs`` (default: the held-out ones) scored chosen over rejected; NaN for none."""
        if pairs is None:
            pairs = self.eval_rows
        else:
            pairs = [to_pair(row, i, self.tokenizer) for i, row in enumerate(read_rows(pairs, "pairs"))]
        if not pairs:
            return math.nan
        hits = 0
        self.policy.eval()
        with torch.no_grad():
            step = min(self.config.batch_prompts, self.config.micro_batch_size or self.config.batch_prompts)
            for i in range(0, len(pairs), step):
                chosen, rejected = self.scores(pairs[i:i + step])
                hits += int((chosen > rejected).sum())
        return hits / len(pairs)

    def step(self) -> dict[str, float]:
        started = time.perf_counter()
        self._schedule_lr()  # this iteration's learning rate (lr_scheduler, warmup_steps)
        rows = self.dist.shard(self._next_rows(self.config.batch_prompts))
        margins: list[Tensor] = []

        def parts() -> Iterator[Tensor]:
            # Micro-batches of pairs; the loss is a mean over the pairs, so each part weighs its share of them.
            for part in micro_slices(len(rows), self.config.micro_batch_size):
                chosen, rejected = self.scores(rows[part])
                margins.append((chosen - rejected).detach())
                yield -F.logsigmoid(chosen - rejected).sum() / len(rows)

        with self._training_mode():
            loss_v, grad_v, skipped = self._apply(parts())
        margin = torch.cat(margins)
        self.completions += 2 * len(rows) * self.dist.world_size
        # Each rank scored its share of the pairs (the loss is averaged with the gradients): the whole batch's.
        accuracy, mean_margin = self.dist.means([float((margin > 0).float().mean()), float(margin.mean())])
        metrics = {S.RM_LOSS: loss_v, S.RM_ACCURACY: accuracy, S.RM_MARGIN: mean_margin,
                   S.RM_EVAL_ACCURACY: self.accuracy(),
                   **self._base_metrics(grad_v, skipped)}
        return self._finish(metrics, started, {})

    def export(self, directory: str | Path) -> Path:
        """``save_pretrained`` of the reward model and its tokenizer into ``directory``."""
        directory = Path(directory)
        self.policy.save_pretrained(directory)
        self.tokenizer.save_pretrained(directory)
        return directory
