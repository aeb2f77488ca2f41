"""PPO-RLHF (Ziegler et al. 2019; Ouyang et al. 2022): the Gymnasium trainer's PPO along a token axis.

Each iteration, in the order of PPO's loop (Schulman et al. 2017, Algorithm 1):

1. Rollout: ``batch_prompts`` prompts x ``group_size`` completions, sampled by pi_theta (= pi_old), with the
   log-probs under pi_old and pi_ref and the values V(prefix) of every response token (``rollout.sample``).
2. Rewards per token: ``-kl_coef * KL_t(pi_old || pi_ref)`` on every response token (``kl_estimator`` k1 or k3)
   and the score added on the last real token, the EOS included (``rollout.place_scores``).
3. Advantages: the core's ``advantages.gae`` over the response tokens with the response mask (gamma 1, lambda 0.95
   by default; the last real token ends the episode), whitened over the rollout's real tokens (``normalize`` with
   the mask).
4. K epochs of minibatches: ``epochs.ppo_epochs`` with a ``TokenStep`` (the same shuffle, non-finite skip and KL
   early stop as the Gymnasium trainer); the loss is the core's clipped surrogate with pi_old in the denominator,
   reduced by ``loss_reduction``, plus ``vf_coef`` x the core's clipped value loss, minus ``ent_coef`` x entropy.
5. Optionally the adaptive KL controller moves ``kl_coef`` towards ``kl_target`` (Ziegler et al. 2019, eq. 2).

``value_model=None``: a copy of the policy's trunk (``model.base_model``, the transformer without its LM head)
with a zero-initialised scalar head, so the first values are exactly 0 and the first advantages are the rewards'.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch
from torch import Tensor, nn

from ppokit.core import schema as S
from ppokit.core.advantages import gae, normalize
from ppokit.core.objectives import explained_variance, value_loss
from ppokit.core.reductions import reduce
from ppokit.lm.base import LMTrainer, adamw, masked_stats
from ppokit.lm.fsdp import full_state, load_full_state
from ppokit.lm.kernels import fuse_activations
from ppokit.lm.logprobs import in_micro_batches, kl_per_token, position_ids, token_logprobs
from ppokit.lm.losses import get_loss, reduce_tokens, settings_for
from ppokit.lm.precision import float32_master_weights
from ppokit.lm.rollout import TokenBatch, place_scores
from ppokit.lm.sharded_checkpoint import full_model_state
from ppokit.lm.step import WHOLE, Share, TokenStep, weigh_stats
from ppokit.update.epochs import UpdateSettings, ppo_epochs

__all__ = ["PPOTrainer", "ValueModel", "default_value_model", "rlhf_rewards", "token_advantages", "adaptive_kl_coef"]


class ValueModel(nn.Module):
    """A transformer trunk and a scalar head: ``[B, L]`` ids -> ``[B, L]`` values (one per position)."""

    def __init__(self, trunk: nn.Module, hidden_size: int):
        super().__init__()
        self.trunk = trunk
        self.head = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(self, input_ids: Tensor, attention_mask: Tensor) -> Tensor:
        out = self.trunk(input_ids=input_ids, attention_mask=attention_mask,
                         position_ids=position_ids(attention_mask), use_cache=False)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        return self.head(hidden.float()).squeeze(-1)


def default_value_model(policy: nn.Module) -> ValueModel:
    """A deep copy of ``policy``'s trunk (of the base model under a PEFT wrapper) with a zero scalar head."""
    model = policy.get_base_model() if hasattr(policy, "get_base_model") else policy
    trunk = copy.deepcopy(getattr(model, "base_model", model))
    trunk.requires_grad_(True)
    hidden = getattr(model.config, "hidden_size", None) or getattr(model.config, "n_embd")
    return ValueModel(trunk, int(hidden))


def response_values(value_model: nn.Module, input_ids: Tensor, attention_mask: Tensor, n_response: int) -> Tensor:
    """``[B, R]``: V of the prefix before each response token (the positions whose logits predict it).

    Like ``logprobs.sequence_forward``, the critic runs on ``[:, :-1]``: the last position's value is never read."""
    if n_response == 0:
        return input_ids.new_zeros(input_ids.shape[0], 0, dtype=torch.float32)
    values = value_model(input_ids[:, :-1], attention_mask[:, :-1])
    return values[:, -n_response:].float()  # float32 under autocast too: the value loss and GAE


def rlhf_rewards(scores: Tensor, logp_old: Tensor, logp_ref: Tensor | None, mask: Tensor, kl_coef: float,
                 estimator: str) -> tuple[Tensor, Tensor]:
    """Per-token rewards ``[B, R]`` (the KL penalty on every real token, the score on the last one) and the
    per-token KL ``[B, R]`` (0 on padding and without a reference)."""
    if logp_ref is None:
        kl = torch.zeros_like(logp_old)
    else:
        kl = torch.where(mask, kl_per_token(logp_old, logp_ref, estimator), 0.0)
    return place_scores(scores, mask) - kl_coef * kl, kl


def token_advantages(rewards: Tensor, values: Tensor, mask: Tensor, gamma: float, lam: float,
                     whiten: bool = True) -> tuple[Tensor, Tensor]:
    """GAE over ``[B, R]`` response tokens with the core's ``gae`` (token axis as its time axis); advantages
    whitened over the real tokens (``normalize`` with the mask); returns are the unwhitened ``A + V``."""
    if mask.shape[1] == 0:  # no response token in the whole rollout: nothing to estimate
        return torch.zeros_like(rewards), torch.zeros_like(rewards)
    values = torch.where(mask, values, 0.0)
    next_values = torch.cat([values[:, 1:], torch.zeros_like(values[:, :1])], 1)
    never = torch.zeros_like(mask)
    adv, returns = gae(rewards.T, values.T, next_values.T, never.T, never.T, gamma, lam, mask=mask.T)
    adv, returns = adv.T, returns.T
    if whiten:
        adv = normalize(adv, mask=mask)
    return adv, returns


def adaptive_kl_coef(kl_coef: float, kl: float, target: float, n: int, horizon: int) -> float:
    """Ziegler et al. (2019), eq. 2: ``beta *= 1 + clip(KL / target - 1, -0.2, 0.2) * n / horizon``."""
    error = min(max(kl / target - 1.0, -0.2), 0.2)
    return kl_coef * (1.0 + error * n / horizon)


class PPOTrainer(LMTrainer):
    """PPO-RLHF on a causal LM: ``PPOTrainer(model, tokenizer, reward=..., prompts=..., config=LMConfig(...))``."""

    algo = "ppo"
    has_critic = True

    def __init__(self, model: nn.Module, tokenizer: Any, reward: Any, prompts: Any, config=None, run_dir=None,
                 ref_model: nn.Module | None = None, value_model: nn.Module | None = None, *, overwrite: bool = False):
        self._given_value_model = value_model
        super().__init__(model, tokenizer, config, run_dir, ref_model, reward=reward, prompts=prompts)
        self.overwrite = overwrite
        cfg = self.config
        self.kl_coef = float(cfg.kl_coef)
        self._tokens_per_minibatch: float | None = None
        params = [{"params": self.trainable_parameters()},
                  {"params": [p for p in self.value_model.parameters() if p.requires_grad]}]
        self.optimizer = adamw(params, cfg.learning_rate, cfg.weight_decay)

    def _init_critic(self) -> None:
        """The value model (the base calls it before sharding: the default one is a copy of the whole policy)."""
        cfg = self.config
        value_model, self._given_value_model = self._given_value_model, None
        self.value_model = (value_model if value_model is not None else default_value_model(self.policy))
        self.value_model.to(self.device)
        if self.precision.enabled:  # autocast: its trainable weights are float32 master weights too
            float32_master_weights(self.value_model)
        from ppokit.lm.base import disable_dropout

        disable_dropout(self.value_model)
        if cfg.fused_activations:
            fuse_activations(self.value_model)
        self.value_model.eval()
        self.dist.prepare(self.value_model, None, [])  # data-parallel: rank 0's value head everywhere

    # ---------------------------------------------------------------- state
    def _checkpointed_modules(self) -> dict[str, nn.Module]:
        return {**super()._checkpointed_modules(), "value_model": self.value_model}

    def _extra_state(self) -> dict[str, Any]:
        # Sharded: the critic is in the shards beside the policy (``_checkpointed_modules``).
        return {**({} if self.sharded else {"value_model": full_state(self.value_model.state_dict())}),
                "kl_coef": self.kl_coef}

    def _finite_keys(self) -> list[str]:
        return ["value_model"]

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        if "value_model" in state:  # a consolidated checkpoint's (a sharded one's is loaded with the shards)
            load_full_state(self.value_model, state["value_model"])
        self.kl_coef = float(state["kl_coef"])

    def save(self, directory, cursor=None, export=True):
        directory = super().save(directory, cursor, export)
        if self.sharded and not export:  # a periodic sharded save: the critic is in the shards
            return directory
        whole = full_model_state(self.value_model) if self.sharded else None  # every rank takes part
        if not self.dist.is_main:  # rank 0 alone writes
            return directory
        from safetensors.torch import save_file, save_model

        # The whole critic (its trunk is trained too, so the head alone would be no use): ``trunk.*`` and
        # ``head.*``, loadable into ``default_value_model(policy)`` with ``safetensors.torch.load_model``.
        path = str(directory / "value_model.safetensors")
        if whole is None:
            save_model(self.value_model, path)
        else:
            save_file(whole, path)
        return directory

    # ---------------------------------------------------------------- one iteration
    def _values(self, input_ids: Tensor, attention_mask: Tensor, n_response: int) -> Tensor:
        with torch.no_grad():
            return in_micro_batches(lambda i, a: response_values(self.value_model, i, a, n_response),
                                    self.config.micro_batch_size, input_ids, attention_mask)

    def _loss(self, mb: TokenBatch, share: Share = WHOLE) -> tuple[Tensor, dict[str, Tensor]]:
        """The minibatch's (or, with ``share``, a micro-batch's weighted part of its) loss and diagnostics."""
        cfg, mask, R = self.config, mb.response_mask, mb.n_response
        logp_new, entropy = token_logprobs(self.policy, mb.input_ids, mb.attention_mask, R, cfg.temperature,
                                           with_entropy=True, entropy_grad=cfg.ent_coef > 0)
        # The KL to pi_ref is in the reward (``rlhf_rewards``), so the policy loss gets no reference term.
        settings = settings_for(cfg, 0.0, self._tokens_per_minibatch)
        loss_policy, stats = get_loss(cfg.policy_loss)(logp_new, mb.logp_old, None, mb.advantages, mask, settings)
        # Padding positions keep the rollout's value: no gradient through them (``where``).
        values = torch.where(mask, response_values(self.value_model, mb.input_ids, mb.attention_mask, R),
                             mb.values)
        loss_value = value_loss(values, mb.returns, mb.values, cfg.cliprange_value, mask=mask, mode="token_mean")
        loss = share.of(settings.reduction) * loss_policy + share.of("token_mean") * cfg.vf_coef * loss_value
        if cfg.ent_coef > 0:  # at 0 the entropy stays out of the graph: the backward skips it (same gradient)
            # Reduced as the policy loss is (loss_type, when set, replaces loss_reduction for both terms).
            loss_entropy = -reduce_tokens(entropy, mask, settings)
            loss = loss + share.of(settings.reduction) * cfg.ent_coef * loss_entropy
        stats["value_loss"] = loss_value.detach()
        stats["entropy"] = reduce(entropy.detach(), mask, "token_mean")
        return loss, weigh_stats(stats, share, settings.reduction)

    def step(self) -> dict[str, float]:
        cfg = self.config
        started = time.perf_counter()
        self._schedule_lr()  # this iteration's learning rate (lr_scheduler, warmup_steps)
        # 1. Rollout.
        # Data-parallel: every rank draws the same prompts and generates for its share.
        prompts = [p for p in self.dist.shard(self.prompts.take(cfg.batch_prompts)) for _ in range(cfg.group_size)]
        s = self._sample(prompts, with_ref=True, value_fn=self._values, storage=self.storage)
        b = s.batch
        t_rollout = time.perf_counter() - started
        # 2. Per-token rewards: KL penalty to pi_ref on every token, the score on the last real one.
        rewards, kl = rlhf_rewards(b.scores, b.logp_old, b.logp_ref, b.response_mask, self.kl_coef,
                                   cfg.kl_estimator)
        # 3. GAE over the response tokens, whitened over the real tokens.
        advantages, b.returns = token_advantages(rewards, b.values, b.response_mask, cfg.gamma, cfg.gae_lambda,
                                                 whiten=False)
        adv_std = masked_stats(advantages, b.response_mask)[1]
        # Whitened over every rank's real tokens (in one process: normalize(advantages, mask=...)).
        b.advantages = self.dist.whiten(advantages, b.response_mask) if cfg.whiten_advantages else advantages
        kl_k1 = (torch.zeros_like(b.logp_old) if b.logp_ref is None
                 else torch.where(b.response_mask, b.logp_old - b.logp_ref, 0.0))
        kl_seq = self.dist.mean(float(kl_k1.sum(-1).mean()))  # over every rank (equal shares): one kl_coef
        # 4. K epochs of minibatches (the shared loop: KL early stop, non-finite skip).
        t0 = time.perf_counter()
        settings = UpdateSettings(algo="ppo", update_epochs=cfg.update_epochs, num_minibatches=cfg.num_minibatches,
                                  clip_coef=cfg.clip_coef, clip_vloss=True, norm_adv=False, ent_coef=cfg.ent_coef,
                                  vf_coef=cfg.vf_coef, max_grad_norm=cfg.max_grad_norm, target_kl=cfg.target_kl)
        self._tokens_per_minibatch = max(float(b.response_mask.sum()), 1.0) / cfg.num_minibatches  # loss_type dapo
        step = TokenStep(self._loss, self.optimizer, self.device, cfg.max_grad_norm, cfg.micro_batch_size,
                         self.precision)
        with self._training_mode():
            update = ppo_epochs(b, settings, step, sync=self.sync, generator=self._shuffle)  # None: 1 process
        t_update = time.perf_counter() - t0
        self.iteration += 1
        self.completions += len(b) * self.dist.world_size
        kl_coef_used = self.kl_coef
        # 5. Adaptive KL.
        if cfg.adaptive_kl:
            self.kl_coef = adaptive_kl_coef(self.kl_coef, kl_seq, cfg.kl_target, len(b) * self.dist.world_size,
                                            cfg.kl_horizon)
        mask = b.response_mask
        metrics = {
            S.SCORE_MEAN: float(b.scores.mean()), S.SCORE_STD: float(b.scores.std(unbiased=False)),
            S.LM_REWARD_MEAN: float(s.raw_scores.mean()),
            **{S.reward_term(name): float(v.mean()) for name, v in s.reward_terms.items()},
            S.KL_REF: kl_seq, S.KL_COEF: kl_coef_used,
            S.RESPONSE_LENGTH: float(mask.sum(-1).float().mean()), S.EOS_FRAC: float(s.has_eos.float().mean()),
            S.DISTINCT_FRAC: len(set(s.completions)) / len(s.completions),
            S.LEARNING_RATE: float(self.optimizer.param_groups[0]["lr"]),
            S.POLICY_LOSS: update["policy_loss"], S.VALUE_LOSS: update["value_loss"],
            S.ENTROPY: update["entropy"], S.APPROX_KL: update["approx_kl"], S.APPROX_KL_K1: update["approx_kl_k1"],
            S.CLIPFRAC: update["clipfrac"], S.GRAD_NORM: update["grad_norm"],
            S.EXPLAINED_VARIANCE: float(explained_variance(b.values, b.returns, mask)),
            S.ADVANTAGE_STD: adv_std,
            S.EPOCHS_RUN: update["epochs_run"], S.EARLY_STOPPED: update["early_stopped"],
            S.MINIBATCHES: update["minibatches"], S.SKIPPED_MINIBATCHES: update["skipped_minibatches"],
        }
        return self._finish(metrics, started, {"rollout": t_rollout, "update": t_update})
