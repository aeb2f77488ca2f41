"""GRPO (Shao et al. 2024, DeepSeekMath section 4.1): PPO without a critic, the baseline from a group of samples.

Each iteration:

1. Rollout: ``batch_prompts`` prompts x G = ``group_size`` completions each (rows ``p*G .. p*G + G-1`` are
   prompt ``p``'s group), log-probs under pi_old and, when ``beta > 0``, pi_ref (``beta = 0`` loads no reference).
   With ``drop_zero_std_groups`` and ``max_resample_rounds``, more rounds of prompts are sampled until the batch
   holds ``batch_prompts`` groups whose rewards differ (DAPO's dynamic sampling, ``dynamic_sampling``).
2. Advantages per completion: ``(r - mean_group) / (std_group + eps)`` (``scale_rewards="group"``), the batch's
   std instead (``"batch"``; Dr. GRPO's argument against the per-group std, Liu et al. 2025), or not scaled
   (``"none"``), the same advantage on every token of the completion. A group whose rewards are all equal has
   advantage exactly 0 on every token: no policy gradient, which is why "GRPO loss is 0" (trl#3857);
   ``lm/frac_reward_zero_std`` logs how many groups that is.
3. K epochs of minibatches (``epochs.ppo_epochs`` with a ``TokenStep``): per token the core's clipped surrogate
   (pi_old in the denominator) minus ``beta`` x the k3 KL(pi_theta || pi_ref), reduced by ``loss_reduction``
   (``reductions.reduce``: token_mean, seq_mean_token_mean = the original GRPO, seq_mean_token_sum_norm = Dr.
   GRPO with the generation budget as the constant).
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch
from torch import Tensor, nn

from ppokit.core import schema as S
from ppokit.core.advantages import SPREAD_ULPS
from ppokit.core.reductions import reduce
from ppokit.lm.base import LMTrainer, adamw
from ppokit.lm.config import ConfigError, LMConfig
from ppokit.lm.dynamic_sampling import fill_groups
from ppokit.lm.logprobs import token_logprobs
from ppokit.lm.losses import get_loss, reduce_tokens, settings_for
from ppokit.lm.rollout import Sampled, TokenBatch
from ppokit.lm.step import WHOLE, Share, TokenStep, weigh_stats
from ppokit.update.epochs import UpdateSettings, ppo_epochs

__all__ = ["GRPOTrainer", "group_advantages"]


def group_advantages(rewards: Tensor, group_size: int, scale: str = "group", eps: float = 1e-4,
                     batch_std: float | None = None, estimator: str = "grpo",
                     ddof: int = 0) -> tuple[Tensor, Tensor]:
    """``[B]`` rewards in consecutive groups of ``group_size`` -> ``([B] advantages, [B // G] zero-std flags)``.

    The centred reward by ``estimator``: ``grpo`` ``r - mean_g`` (Shao et al. 2024); ``rloo`` ``r_i`` minus the
    mean of the other ``G - 1`` rewards of its group, ``= G / (G - 1) (r_i - mean_g)`` (Ahmadian et al. 2024);
    ``reinforce++`` ``r - mean_batch`` (Hu et al. 2025, the batch as the baseline). Then divided by ``scale``:
    ``group`` ``std_g + eps``, ``batch`` ``std_batch + eps``, ``none`` nothing. Stds with ``ddof`` (0: population;
    1: Bessel's, as TRL's ``torch.std``). A group whose spread is within rounding error of its mean (every
    constant group; ``advantages.normalize``'s rule) is centred to exactly 0 by grpo and rloo, not to the rounding
    noise of ``r - mean``. ``batch_std`` replaces the batch's std (data-parallel: the std over every rank's rewards).
    """
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"group_advantages: {tuple(rewards.shape)} rewards do not split into groups of {group_size}")
    if rewards.numel() == 0:  # every group dropped (drop_zero_std_groups): nothing to centre
        return rewards.float(), torch.zeros(0, dtype=torch.bool)
    r = rewards.float().view(-1, group_size)  # [P, G]
    std_g, mean_g = torch.std_mean(r, dim=1, correction=ddof, keepdim=True)
    spread = std_g if ddof == 0 else r.std(dim=1, correction=0, keepdim=True)
    zero_std = spread <= SPREAD_ULPS * torch.finfo(r.dtype).eps * mean_g.abs()  # [P, 1]
    if estimator == "grpo":
        centred = torch.where(zero_std, 0.0, r - mean_g)
    elif estimator == "rloo":
        centred = torch.where(zero_std, 0.0, (r - mean_g) * (group_size / (group_size - 1)))
    elif estimator == "reinforce++":
        centred = r - rewards.float().mean()
    else:
        raise ValueError(f"group_advantages: unknown estimator {estimator!r}; choose grpo, rloo or reinforce++")
    if scale == "group":
        adv = centred / (std_g + eps)
    elif scale == "batch":
        adv = centred / ((rewards.float().std(correction=ddof) if batch_std is None else batch_std) + eps)
    elif scale == "none":
        adv = centred
    else:
        raise ValueError(f"group_advantages: unknown scale {scale!r}; choose group, batch or none")
    return adv.reshape(-1), zero_std.reshape(-1)


class GRPOTrainer(LMTrainer):
    """GRPO on a causal LM: ``GRPOTrainer(model, tokenizer, reward=..., prompts=..., config=LMConfig(...))``."""

    algo = "grpo"
    kl_knob = "beta"  # GRPO weighs beta * k3 in the loss, not a reward penalty

    def __init__(self, model: nn.Module, tokenizer: Any, reward: Any, prompts: Any, config=None, run_dir=None,
                 ref_model: nn.Module | None = None, *, overwrite: bool = False):
        # beta = 0: no KL term, so no reference is built (no copy of the model in memory).
        config = (config if config is not None else LMConfig()).validate()
        if config.drop_zero_std_groups and int(os.environ.get("WORLD_SIZE", "1")) > 1:
            raise ConfigError("drop_zero_std_groups", "is single-process only: the ranks would keep different "
                              "numbers of rows and their minibatch counts would differ")
        if config.group_size < 2:
            raise ConfigError("group_size", f"GRPO needs at least 2 completions per prompt (the group is the "
                              f"baseline; one completion always has advantage 0), got {config.group_size}")
        self.uses_reference = config.beta > 0
        self._tokens_per_minibatch: float | None = None  # loss_type dapo's normalizer, set by each step
        super().__init__(model, tokenizer, config, run_dir, ref_model, reward=reward, prompts=prompts)
        self.overwrite = overwrite
        cfg = self.config
        self.optimizer = adamw(self.trainable_parameters(), cfg.learning_rate, cfg.weight_decay)

    def _loss(self, mb: TokenBatch, share: Share = WHOLE) -> tuple[Tensor, dict[str, Tensor]]:
        """The minibatch's (or, with ``share``, a micro-batch's weighted part of its) loss and diagnostics."""
        cfg, mask, R = self.config, mb.response_mask, mb.n_response
        logp_new, entropy = token_logprobs(self.policy, mb.input_ids, mb.attention_mask, R, cfg.temperature,
                                           with_entropy=True, entropy_grad=cfg.ent_coef > 0)
        # The policy loss carries the beta * KL(pi_theta || pi_ref) term (``LossSettings.beta``).
        settings = settings_for(cfg, beta=cfg.beta, tokens_per_minibatch=self._tokens_per_minibatch)
        loss, stats = get_loss(cfg.policy_loss)(logp_new, mb.logp_old, mb.logp_ref, mb.advantages, mask, settings)
        if cfg.ent_coef > 0:  # at 0 the entropy stays out of the graph: the backward skips it (same gradient)
            loss_entropy = -reduce_tokens(entropy, mask, settings)
            loss = loss + cfg.ent_coef * loss_entropy
        stats["value_loss"] = torch.zeros((), device=logp_new.device)  # no critic
        stats["entropy"] = reduce(entropy.detach(), mask, "token_mean")
        return share.of(settings.reduction) * loss, weigh_stats(stats, share, settings.reduction)

    def _update_batch(self, b: TokenBatch, has_eos: Tensor, zero_std: Tensor) -> TokenBatch:
        """The rows and tokens the update trains on: without the constant groups (``drop_zero_std_groups``), with
        truncated completions masked out (``mask_truncated_completions``); sets dapo's tokens per minibatch."""
        cfg = self.config
        if cfg.mask_truncated_completions:
            b = b.replace(response_mask=b.response_mask & has_eos.to(b.response_mask.device)[:, None])
        if cfg.drop_zero_std_groups:
            keep = torch.nonzero(~zero_std.repeat_interleave(cfg.group_size)).squeeze(-1)
            b = b.index(keep)
        minibatches = max(1, min(cfg.num_minibatches, len(b)))
        self._tokens_per_minibatch = max(float(b.response_mask.sum()), 1.0) / minibatches
        return b

    def _rollout(self) -> tuple[Sampled, Sampled, int, int]:
        """One iteration's rollout: ``(sampled, generated, rounds, dropped)``, the completions the advantages and
        the update use, every completion sampled, the extra rounds and the zero-std groups dropped. With
        ``max_resample_rounds`` it is DAPO's dynamic sampling (``dynamic_sampling.fill_groups``); without, one round.
        """
        cfg = self.config

        def one_round() -> Sampled:
            # Data-parallel: every rank draws the same prompts and generates for its share (whole groups).
            prompts = [p for p in self.dist.shard(self.prompts.take(cfg.batch_prompts)) for _ in range(cfg.group_size)]
            return self._sample(prompts, with_ref=self.has_reference, storage=self.storage)

        first = one_round()
        if not (cfg.drop_zero_std_groups and cfg.max_resample_rounds):
            return first, first, 0, 0
        out = fill_groups(first, one_round, lambda r: group_advantages(r, cfg.group_size, "none")[1],
                          cfg.group_size, cfg.max_resample_rounds, self.sampling.pad_token_id)
        self._last_sampled = out.generated  # completions.jsonl shows what was sampled, every round
        return out.train, out.generated, out.rounds, out.dropped

    def step(self) -> dict[str, float]:
        cfg = self.config
        started = time.perf_counter()
        self._schedule_lr()  # this iteration's learning rate (lr_scheduler, warmup_steps)
        # 1. Rollout: G completions per prompt, consecutive rows (several rounds with dynamic sampling).
        s, g, rounds, dropped = self._rollout()
        b = s.batch
        t_rollout = time.perf_counter() - started
        # 2. Group-relative advantages, the same on every token of a completion.
        batch_std = self.dist.global_std(b.scores) if cfg.scale_rewards == "batch" and cfg.std_ddof == 0 else None
        adv, zero_std = group_advantages(b.scores.cpu(), cfg.group_size, cfg.scale_rewards, cfg.adv_eps, batch_std,
                                         cfg.advantage_estimator, cfg.std_ddof)
        b.advantages = adv.to(b.logp_old.device)[:, None].expand_as(b.logp_old).contiguous()
        mask = b.response_mask
        train = self._update_batch(b, s.has_eos, zero_std)
        if cfg.drop_zero_std_groups and not cfg.max_resample_rounds:
            dropped = int(zero_std.sum())
        kl_seq = (float("nan") if b.logp_ref is None
                  else float(torch.where(mask, b.logp_old - b.logp_ref, 0.0).sum(-1).mean()))
        # 3. K epochs of minibatches.
        t0 = time.perf_counter()
        settings = UpdateSettings(algo="ppo", update_epochs=cfg.update_epochs,
                                  num_minibatches=max(1, min(cfg.num_minibatches, len(train))),
                                  clip_coef=cfg.clip_coef, clip_vloss=False, norm_adv=False, ent_coef=cfg.ent_coef,
                                  vf_coef=0.0, max_grad_norm=cfg.max_grad_norm, target_kl=cfg.target_kl)
        step = TokenStep(self._loss, self.optimizer, self.device, cfg.max_grad_norm, cfg.micro_batch_size,
                         self.precision)
        with self._training_mode():
            if len(train):
                update = ppo_epochs(train, settings, step, sync=self.sync, generator=self._shuffle)  # None: 1 process
            else:  # every group was dropped (drop_zero_std_groups): nothing to learn from this rollout
                update = {name: float("nan") for name in ("policy_loss", "entropy", "approx_kl", "approx_kl_k1",
                                                          "clipfrac", "grad_norm")}
                update.update(epochs_run=0.0, early_stopped=0.0, minibatches=0.0, skipped_minibatches=0.0)
        extra = step.extra_means()
        t_update = time.perf_counter() - t0
        self.iteration += 1
        self.completions += len(g.completions) * self.dist.world_size
        # The rollout's own numbers describe every completion sampled (all rounds of dynamic sampling), not only
        # the groups kept for the update, which are biased towards the prompts the policy is unsure of.
        gb, n_groups = g.batch, len(g.completions) // cfg.group_size
        metrics = {
            S.SCORE_MEAN: float(gb.scores.mean()), S.SCORE_STD: float(gb.scores.std(unbiased=False)),
            S.LM_REWARD_MEAN: float(g.raw_scores.mean()),
            **{S.reward_term(name): float(v.mean()) for name, v in g.reward_terms.items()},
            S.KL_REF: kl_seq, S.KL_REF_TOKEN: extra.get("kl_ref_token", float("nan")),
            S.RESPONSE_LENGTH: float(gb.response_mask.sum(-1).float().mean()),
            S.EOS_FRAC: float(g.has_eos.float().mean()),
            S.DISTINCT_FRAC: len(set(g.completions)) / len(g.completions),
            S.FRAC_REWARD_ZERO_STD: (dropped / n_groups if cfg.max_resample_rounds
                                     else float(zero_std.float().mean())),
            S.RESAMPLE_ROUNDS: float(rounds), S.DROPPED_GROUPS: float(dropped),
            S.TRAIN_GROUPS: float(len(train) // cfg.group_size),
            S.LEARNING_RATE: float(self.optimizer.param_groups[0]["lr"]),
            S.POLICY_LOSS: update["policy_loss"], S.ENTROPY: update["entropy"], S.APPROX_KL: update["approx_kl"],
            S.APPROX_KL_K1: update["approx_kl_k1"], S.CLIPFRAC: update["clipfrac"], S.GRAD_NORM: update["grad_norm"],
            S.ADVANTAGE_STD: float(adv.std(unbiased=False)) if len(adv) else float("nan"),
            S.EPOCHS_RUN: update["epochs_run"], S.EARLY_STOPPED: update["early_stopped"],
            S.MINIBATCHES: update["minibatches"], S.SKIPPED_MINIBATCHES: update["skipped_minibatches"],
        }
        return self._finish(metrics, started, {"rollout": t_rollout, "update": t_update})
