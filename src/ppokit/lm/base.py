"""What the three LM trainers share: models and devices, pi_ref, seeded sampling, logging, save and resume.

The three policies are kept apart as in the Gymnasium trainer (``policies``): pi_theta is ``self.policy``, the
module being optimized; pi_old is never a module but the ``logp_old`` tensor frozen into each rollout; pi_ref is
``policies.frozen_copy`` of the initial policy, or, for a PEFT (LoRA) policy, the same module with its adapter
disabled, so no second copy of the base weights is held (and the base weights are frozen by PEFT itself).

Sampling draws from a private RNG state (swapped into torch's global generator around each ``generate`` call, as
``transformers`` samples from the global one), so a run's samples depend on its seed and its own history only;
``generate``/``evaluate`` draw from a separate fixed-seed state and do not move the training stream. Both states,
the minibatch shuffle's generator, the optimizer, the counters and the prompt position are in the checkpoint
(``save``), loaded with ``torch.load(weights_only=True)`` (``checkpoint.load_checkpoint``).
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import Tensor, nn

from ppokit.core import schema as S
from ppokit.diagnostics.monitor import Monitor
from ppokit.lm.alerts import LMAlerts
from ppokit.lm.backends import make_generator
from ppokit.lm.checks import check_context, check_lm_memory, check_tokenizer, warn_half_precision
from ppokit.lm.config import LMConfig
from ppokit.lm.durable import CHECKPOINT, LMRunLifecycle
from ppokit.lm.fsdp import full, full_state, gathered, load_full_state, shard, shard_optimizer_state
from ppokit.lm.generation import SamplingSettings, stop_token_ids
from ppokit.lm.kernels import fuse_activations
from ppokit.lm.logprobs import in_micro_batches, token_logprobs
from ppokit.lm.lr_schedule import lr_factor
from ppokit.lm.precision import Precision, float32_master_weights
from ppokit.lm.prompts import PromptSource
from ppokit.lm.rewards import make_reward
from ppokit.lm.rollout import Sampled, sample
from ppokit.lm.sharded_checkpoint import (
    full_model_state,
    gather_tensor,
    is_shards_name,
    load_shards,
    remove_old_shards,
    save_shards,
)
from ppokit.policies import frozen_copy
from ppokit.runtime import distributed
from ppokit.runtime.checkpoint import CheckpointError, load_checkpoint, rng_state, save_checkpoint, set_rng_state
from ppokit.runtime.rundir import POLICY_DIR

__all__ = ["LMTrainer", "is_peft_model", "disable_dropout", "adamw", "enable_checkpointing"]

_EVAL_SEED_OFFSET = 7_919  # evaluate()/generate() sample from seed + this, apart from training's stream


def is_peft_model(model: nn.Module) -> bool:
    """A PEFT-wrapped model (LoRA...): it can run as its own base with ``disable_adapter()``."""
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def disable_dropout(model: nn.Module) -> None:
    """Dropout off everywhere: pi_theta and pi_old must be the same function of the same weights, or the first
    minibatch's ratio is not 1 (TRL does the same)."""
    for m in model.modules():
        if isinstance(m, nn.Dropout):
            m.p = 0.0


def adamw(params: list, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW with torch's fused kernel where it has one (CPU since torch 2.4, CUDA): one kernel over all tensors
    instead of a Python loop of ~10 ops per tensor (measured on the tiny GPT-2, 28 tensors: 0.7 -> 0.2 ms a step).
    The same update rule as the loop (on the tiny GPT-2 the two give bit-identical weights); the loop elsewhere."""
    try:
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=True)
    except (RuntimeError, ValueError, TypeError):  # an older torch, or a device / dtype without the kernel
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)


def enable_checkpointing(model: nn.Module, use_reentrant: bool = False) -> None:
    """transformers' gradient checkpointing of every transformer block (its ``GradientCheckpointingLayer``s): a
    block's activations are dropped after its forward and recomputed in its backward (in training mode only).

    Under fsdp it composes with FSDP2 as it is, rather than torch's ``checkpoint_wrapper``, which would rename
    every parameter (``_checkpoint_wrapped_module.``) in the state dicts, the sharded checkpoints and
    ``save_pretrained``: transformers 5 checkpoints the block's ``forward``, inside the hooks ``fully_shard`` puts
    on its ``__call__`` (4.x checkpoints ``__call__``; FSDP2's hooks then return at once in the recomputation, in
    their pre-backward state), so the block's all-gather runs once in the forward and once (FSDP's pre-backward) before
    its recomputation, as with torchtitan's wrapper (tests/test_lm_fsdp_options.py counts the recomputation).
    Non-reentrant (``use_reentrant=False``, PyTorch's recommended kind): the recomputation is part of the one
    autograd graph whose hooks FSDP2 uses to reduce-scatter each block's gradient, where the reentrant kind runs the
    block's forward without a graph and its backward in a nested ``backward`` call."""
    kwargs = {"use_reentrant": use_reentrant}
    if hasattr(model, "activation_checkpointing_enable"):  # transformers 5's name; the old one warns it goes in v6
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def _fingerprint(model: nn.Module) -> str:
    """A cheap digest of a model's weights (shapes, sums and a few values of each tensor): tells a resume that it
    was given another starting model than the run's, without hashing gigabytes."""
    h = hashlib.sha256()
    with torch.no_grad():
        for name, p in model.state_dict().items():
            flat = p.detach().reshape(-1).float().cpu()
            h.update(f"{name}{tuple(p.shape)}{float(flat.double().sum()):.6e}".encode())
            h.update(flat[:16].numpy().tobytes())
    return h.hexdigest()


class LMTrainer(LMRunLifecycle):
    """Base of ``PPOTrainer``, ``GRPOTrainer`` and ``DPOTrainer`` (one level of subclassing)."""

    algo = "lm"
    kl_knob = "kl_coef"  # the config field that weighs the KL to pi_ref (named by the KL runaway alert)
    uses_reference = True
    has_critic = False  # a value model beside the policy (PPO-RLHF's): the memory check counts it
    model_dir = POLICY_DIR  # the run dir's save_pretrained directory of the trained model

    def __init__(self, model: nn.Module, tokenizer: Any, config: LMConfig | None = None,
                 run_dir: str | Path | None = None, ref_model: nn.Module | None = None,
                 reward: Any = None, prompts: Any = None):
        self.config = cfg = (config if config is not None else LMConfig()).validate()
        # Under torchrun: this rank's place in the job (distributed.py); the identity in one process.
        self.dist = distributed.current(device=cfg.device)
        torch.set_num_threads(cfg.torch_threads)
        self.device = torch.device(self.dist.device(cfg.device))
        self.storage = torch.device("cpu") if cfg.offload_rollout else self.device
        self.tokenizer = tokenizer
        eos = getattr(tokenizer, "eos_token_id", None)
        if eos is None:
            raise ValueError("tokenizer: has no eos_token_id; a completion must be able to end")
        pad = getattr(tokenizer, "pad_token_id", None)
        self.sampling = SamplingSettings(cfg.max_new_tokens, cfg.temperature, eos, eos if pad is None else pad,
                                         stop_token_ids(tokenizer, model))
        # The inputs against the model and the machine, before pi_ref or a critic is copied from it.
        check_tokenizer(tokenizer)
        self.prompts = None if prompts is None else PromptSource(prompts, cfg.seed, tokenizer)
        self._check_inputs(model, ref_model)
        self.policy = model.to(self.device)
        # bf16 / fp16: autocast forwards over float32 master weights (``precision``); fp32 with half-precision
        # trainable weights trains them in half precision, which stalls: warned.
        self.precision = Precision(cfg.dtype, self.device)
        if self.precision.enabled:
            float32_master_weights(self.policy)
        else:
            warn_half_precision([p for p in self.policy.parameters() if p.requires_grad])
        disable_dropout(self.policy)
        if cfg.fused_activations:  # before pi_ref and the value model are copied from it
            fuse_activations(self.policy)
        self.dist.prepare(self.policy, None, [])  # every rank starts from rank 0's weights (pi_ref included)
        if cfg.gradient_checkpointing:
            enable_checkpointing(self.policy)
        self._adapter_ref = False
        self.ref_model: nn.Module | None = None
        if self.uses_reference:
            self._init_reference(ref_model)
        self._ref_fingerprint = "" if self.ref_model is None else _fingerprint(self.ref_model)
        self._init_critic()  # PPO's value model, copied from the whole policy before it is sharded
        # fsdp under torchrun: the models sharded per block, now that every rank holds rank 0's weights (lm.fsdp).
        self.sharded = cfg.fsdp and self.dist.active
        if self.sharded:
            for m in (self.policy, self.ref_model, getattr(self, "value_model", None)):
                if m is not None:
                    shard(m, cfg.dtype, offload=cfg.fsdp_offload)
        self.reward = None if reward is None else make_reward(reward, tokenizer, cfg.micro_batch_size)
        # The sampling backend (a ``generation.Generator``); replaceable, e.g. by a test's scripted one.
        self.backend = make_generator(cfg.sampler)
        # Counters and random streams (all checkpointed).
        self.iteration = 0
        self.completions = 0
        self._lr_horizon: int | None = None  # the linear / cosine schedule's iterations (set by the first train())
        self._sample_state = torch.Generator().manual_seed(self.dist.seed(cfg.seed)).get_state()
        self._cuda_sample_state: Tensor | None = None
        self._shuffle = torch.Generator(device=self.storage).manual_seed(cfg.seed + 1)
        # Output.
        self.run_dir = None if run_dir is None else Path(run_dir)
        self.overwrite = False  # set by the subclasses' overwrite=: replace a run the run dir already holds
        self.logger = None
        self._claim = None  # the run dir's lock, taken by the first train() (durable.py)
        self._saved_iteration: int | None = None  # the iteration the run dir's checkpoint holds
        self.interrupted: str | None = None  # the signal that stopped the last train(), e.g. "SIGINT"
        self.run_info: dict[str, Any] = {}  # what lm_run.json records beside the config (the CLI's inputs)
        self.monitor = Monitor(action_kind="discrete", monitor_kl=cfg.monitor_kl, monitor_clipfrac=cfg.monitor_clipfrac)
        self.lm_alerts = LMAlerts(self.kl_knob)
        self.alerts: list[dict] = []
        self.history: list[dict[str, float]] = []
        self._resumed_at: int | None = None

    # ---------------------------------------------------------------- inputs
    def _check_inputs(self, model: nn.Module, ref_model: nn.Module | None) -> None:
        """Prompts (a list: every one; an iterable: each batch as it comes) and ``max_new_tokens`` against the
        model's context, and one iteration's memory against what the machine has (``checks``)."""
        cfg = self.config
        items = getattr(self.prompts, "items", None) or []
        longest = check_context(self.tokenizer, model, items, cfg.max_new_tokens)
        self._check_memory(model, ref_model, cfg.rollout_size, longest, cfg.max_new_tokens,
                           f"batch_prompts {cfg.batch_prompts:,} x group_size {cfg.group_size:,}")

    def _check_memory(self, model: nn.Module, ref_model: nn.Module | None, rows: int, prompt_len: int,
                      response_len: int, rows_text: str, update_rows: int | None = None) -> None:
        copies = int(self.uses_reference and ref_model is None and not is_peft_model(model))
        shards = self.dist.world_size if self.config.fsdp and self.dist.active else 1  # fsdp: 1/K per rank
        check_lm_memory(self.config, model, rows, prompt_len, response_len, extra_models=copies,
                        value_model=self.has_critic, rows_text=rows_text, update_rows=update_rows, shards=shards)

    # ---------------------------------------------------------------- models
    def _init_reference(self, ref_model: nn.Module | None) -> None:
        if ref_model is not None:
            self.ref_model = ref_model.to(self.device)
            self.ref_model.requires_grad_(False).eval()
            disable_dropout(self.ref_model)
            if self.config.fused_activations:
                fuse_activations(self.ref_model)
        elif is_peft_model(self.policy):
            self._adapter_ref = True  # the base model with the adapter disabled: no second copy
        else:
            self.ref_model = frozen_copy(self.policy)

    def _init_critic(self) -> None:
        """A trainer with a value model builds it here (``self.value_model``); none by default."""

    @property
    def sync(self):
        """The epoch loop's sync hook: gradients and statistics averaged over the ranks, or, with the models
        sharded, the statistics alone (FSDP reduce-scatters the gradients in the backward); None in one process."""
        return self.dist.stats_sync if self.sharded else self.dist.sync

    def trainable_parameters(self) -> list[nn.Parameter]:
        return [p for p in self.policy.parameters() if p.requires_grad]

    def ref_logprobs(self, input_ids: Tensor, attention_mask: Tensor, n_response: int,
                     temperature: float | None = None) -> Tensor:
        """``[B, R]`` log pi_ref of the response tokens (no gradient; over ``micro_batch_size`` rows at a time)."""
        t = self.config.temperature if temperature is None else temperature
        model = self.policy if self._adapter_ref else self.ref_model
        adapter_off = self.policy.disable_adapter() if self._adapter_ref else contextlib.nullcontext()
        with torch.no_grad(), adapter_off:
            return in_micro_batches(lambda i, a: token_logprobs(model, i, a, n_response, t)[0],
                                    self.config.micro_batch_size, input_ids, attention_mask)

    @contextlib.contextmanager
    def _training_mode(self) -> Iterator[None]:
        # Train mode only matters for gradient checkpointing (transformers checkpoints only in training mode);
        # dropout is off either way, so the forward is the same function as at the rollout.
        self.policy.train(self.config.gradient_checkpointing)
        try:
            yield
        finally:
            self.policy.eval()

    def _schedule_lr(self) -> None:
        """Every param group's LR for this iteration: ``learning_rate * lr_factor(...)`` (``lr_schedule``); called
        at the start of each ``step``. The iteration counter is the step, so a resumed run goes on where it was."""
        cfg = self.config
        total = cfg.schedule_iterations or self._lr_horizon
        if total is None and cfg.lr_scheduler != "constant":
            raise ValueError(f"lr_scheduler {cfg.lr_scheduler} decays over the run's iterations: set "
                             "schedule_iterations, or call train(n) rather than step()")
        lr = cfg.learning_rate * lr_factor(cfg.lr_scheduler, self.iteration, cfg.warmup_steps, total or 0)
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def _apply(self, parts: Iterator[Tensor]) -> tuple[float, float, bool]:
        """One optimizer step of the trainers without epochs (DPO, SFT, the reward model): the backward of each
        micro-batch's weighted loss as ``parts`` yields it (its forward under the autocast of ``dtype``; one
        micro-batch's graph alive at a time), the norm clip, the step, skipped when the loss or the gradient is
        not finite (the epoch loop's guard). Returns ``(loss, grad_norm, skipped)``, the loss the parts' sum."""
        cfg = self.config
        self.optimizer.zero_grad(set_to_none=False)
        loss = torch.zeros((), device=self.device)
        while True:
            with self.precision.autocast():
                part = next(parts, None)
            if part is None:
                break
            self.precision.backward(part)
            loss = loss + part.detach().float()
        params = self.trainable_parameters()
        if self.sync is not None:  # data-parallel: the gradient and loss averaged over the ranks
            self.sync([p.grad for p in params if p.grad is not None], [loss])
        self.precision.unscale(self.optimizer)
        grad_norm = full(torch.nn.utils.clip_grad_norm_(params, cfg.max_grad_norm))  # sharded: over every shard
        # fsdp_offload: the gradients, and so their norm, are in CPU memory.
        loss_v, grad_v = torch.stack([loss, grad_norm.float().to(loss.device)]).tolist()
        skipped = not (math.isfinite(loss_v) and math.isfinite(grad_v))
        if skipped:
            self.optimizer.zero_grad(set_to_none=False)
            self.precision.skipped()
        else:
            self.precision.step(self.optimizer)
        self.iteration += 1
        return loss_v, grad_v, skipped

    # ---------------------------------------------------------------- sampling
    @contextlib.contextmanager
    def _rng(self, which: str) -> Iterator[None]:
        """Torch's global RNG set to this trainer's sampling stream (``train``) or to a fixed evaluation seed
        (``eval``) for the block, and restored afterwards."""
        cuda = self.device.type == "cuda"
        devices = [self.device.index or 0] if cuda else []
        with torch.random.fork_rng(devices=devices):
            if which == "train":
                torch.set_rng_state(self._sample_state)
                if cuda:
                    if self._cuda_sample_state is None:
                        torch.cuda.manual_seed(self.dist.seed(self.config.seed))
                    else:
                        torch.cuda.set_rng_state(self._cuda_sample_state, self.device)
            else:
                torch.manual_seed(self.config.seed + _EVAL_SEED_OFFSET)
                if cuda:
                    torch.cuda.manual_seed(self.config.seed + _EVAL_SEED_OFFSET)
            yield
            if which == "train":
                self._sample_state = torch.get_rng_state()
                if cuda:
                    self._cuda_sample_state = torch.cuda.get_rng_state(self.device)

    def _sample(self, prompts: list[str], *, with_ref: bool, value_fn=None, rng: str = "train",
                reward: bool = True, storage: torch.device | None = None) -> Sampled:
        if self.prompts is not None and self.prompts.items is None:  # a one-shot iterable: checked as it comes
            check_context(self.tokenizer, self.policy, list(dict.fromkeys(prompts)), self.config.max_new_tokens,
                          where="this iteration's prompts")
        self.policy.eval()
        with self._rng(rng), self.precision.autocast(), gathered(self.policy):  # sharded: full weights to sample
            out = sample(self.policy, self.tokenizer, self.backend, prompts, self.sampling,
                         self.reward if reward else None, self.device,
                         ref_logprobs=self.ref_logprobs if with_ref and self.has_reference else None,
                         value_fn=value_fn, missing_eos_penalty=self.config.missing_eos_penalty,
                         storage=storage, micro_batch_size=self.config.micro_batch_size)
        if rng == "train":
            self._last_sampled = out  # the iteration's completions, for completions.jsonl (_finish)
        return out

    @property
    def has_reference(self) -> bool:
        return self._adapter_ref or self.ref_model is not None

    def generate(self, prompts: list[str]) -> list[str]:
        """One sampled completion per prompt (the training sampler's distribution, a fixed evaluation seed)."""
        out: list[str] = []
        for i in range(0, len(prompts), self.config.rollout_size):
            out += self._sample(list(prompts[i:i + self.config.rollout_size]), with_ref=False, rng="eval",
                                reward=False).completions
        return out

    def evaluate(self, prompts: list[str], n: int = 1) -> dict[str, Any]:
        """``n`` sampled completions per prompt, scored by the trainer's reward (fixed evaluation seed, so two
        calls on the same policy give the same numbers and training's random stream does not move).

        Returns ``reward_mean``/``reward_std`` (the reward alone), ``score_mean`` (minus any missing-EOS penalty),
        ``length_mean`` (completion tokens, EOS excluded), ``eos_frac``, ``n`` and ``completions`` (the texts).
        """
        if self.reward is None:
            raise ValueError("evaluate: this trainer has no reward; pass reward= when building it")
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"evaluate: n must be a positive integer (completions per prompt), got {n!r}")
        repeated = [p for p in prompts for _ in range(n)]
        raw, scores, lengths, eos, texts = [], [], [], [], []
        with self._rng("eval"), self.precision.autocast(), gathered(self.policy):
            for i in range(0, len(repeated), self.config.rollout_size):
                s = sample(self.policy.eval(), self.tokenizer, self.backend, repeated[i:i + self.config.rollout_size],
                           self.sampling, self.reward, self.device,
                           missing_eos_penalty=self.config.missing_eos_penalty,
                           micro_batch_size=self.config.micro_batch_size)
                raw.append(s.raw_scores)
                scores.append(s.batch.scores.cpu())
                lengths.append(s.batch.response_mask.sum(-1).cpu() - s.has_eos.long())
                eos.append(s.has_eos)
                texts += s.completions
        raw_t = torch.cat(raw)
        return {"reward_mean": float(raw_t.mean()), "reward_std": float(raw_t.std(unbiased=False)),
                "score_mean": float(torch.cat(scores).mean()), "length_mean": float(torch.cat(lengths).float().mean()),
                "eos_frac": float(torch.cat(eos).float().mean()), "n": len(texts), "completions": texts}

    # ---------------------------------------------------------------- the loop
    def step(self) -> dict[str, float]:  # pragma: no cover - each trainer defines it
        raise NotImplementedError

    def _finish(self, metrics: dict[str, float], started: float, phases: dict[str, float]) -> dict[str, float]:
        """Counters, timings, alerts and logging of one iteration; returns ``metrics`` completed."""
        metrics = {S.UPDATE: float(self.iteration), **metrics}
        for phase, seconds in phases.items():
            metrics[S.perf_time(phase)] = seconds
        now = time.perf_counter()
        metrics[S.perf_time("iteration")] = now - started
        origin = getattr(self, "_sps_origin", None) or (started, self.completions)
        # Completions per second (global_step counts completions), so the console's SPS column reads for LM runs too.
        metrics[S.SPS] = (self.completions - origin[1]) / (now - origin[0]) if now > origin[0] else math.nan
        self.history.append(metrics)
        alerts = self.monitor.check(self.iteration, metrics) + self.lm_alerts.check(self.iteration, metrics)
        self._open_logger()
        if self.logger is not None:
            self.logger.log(self.completions, metrics)
            self._log_samples()
        for a in alerts:
            record = {"update": self.iteration, "level": a.level, "name": a.name, "message": a.message}
            self.alerts.append(record)
            if self.logger is not None:
                self.logger.alert(self.completions, a.level, a.name, a.message, a.data)
        return metrics

    def _log_samples(self) -> None:
        """A few of the iteration's completions into completions.jsonl, TensorBoard and W&B (``samples``)."""
        sampled, self._last_sampled = getattr(self, "_last_sampled", None), None
        if sampled is None or self.run_dir is None:
            return
        from ppokit.lm.samples import append_samples, sample_rows, samples_markdown

        rows = sample_rows(sampled, self.tokenizer, self.iteration)
        append_samples(self.run_dir, rows)
        self.logger._to_tensorboard(lambda tb: tb.text(self.completions, "samples", samples_markdown(rows)))
        self.logger.table(self.completions, "samples", rows)  # W&B (track): a wandb.Table

    # ---------------------------------------------------------------- save / resume
    def _extra_state(self) -> dict[str, Any]:
        return {}

    def _load_extra_state(self, state: dict[str, Any]) -> None:
        pass

    def _cursor(self) -> dict[str, Any]:
        """Where the data and the random streams stand: the checkpoint's entries that an iteration moves before
        its update (``durable`` saves the ones from before a failed iteration)."""
        return {
            "rng": rng_state(),
            "sample_rng": self._sample_state.clone(),
            "cuda_sample_rng": None if self._cuda_sample_state is None else self._cuda_sample_state.clone(),
            "shuffle_rng": self._shuffle.get_state(),
            "prompts": None if self.prompts is None else self.prompts.state(),
        }

    def _checkpointed_modules(self) -> dict[str, nn.Module]:
        """The trained models a sharded checkpoint holds, by name (pi_ref is rebuilt from the starting model)."""
        return {"policy": self.policy}

    def save(self, directory: str | Path, cursor: dict[str, Any] | None = None, export: bool = True) -> Path:
        """``save_pretrained`` of the policy (and its tokenizer) into ``directory/policy`` and a resumable
        checkpoint ``directory/trainer_state.pt`` (trainable weights, optimizer, RNG states, counters).

        Both are replaced whole: the checkpoint atomically (``checkpoint.save_checkpoint``), ``policy/`` written
        beside it under a temp name and swapped in, so a kill mid-save leaves the previous ones readable.
        ``cursor``: the data position and random streams to store instead of the current ones (``_cursor``).

        Sharded (fsdp under torchrun; every rank must call it): each rank writes its shards of the weights and
        AdamW's states into ``directory/shards-*`` (``lm.sharded_checkpoint``), which ``trainer_state.pt`` names
        beside the host state; ``policy/`` (the whole weights, gathered to rank 0) only with ``export``, which the
        training loop asks for at the last save of each ``train`` call."""
        directory = Path(directory)
        whole = None
        if self.sharded:
            weights = {"shards": save_shards(directory, self._checkpointed_modules(), self.optimizer,
                                             self.iteration, self.dist),
                       # Every rank's sampling stream (each samples its own prompts), so a resume on as many
                       # ranks continues exactly; rank 0's is the cursor's sample_rng as in any run.
                       "rank_sample_rng": gather_tensor(self._sample_state, self.dist)}
            whole = full_model_state(self.policy) if export else None  # rank 0's alone: the others get {}
        else:  # data-parallel or one process: every rank holds the whole tensors; rank 0 writes them
            weights = {"policy": full_state({n: p for n, p in self.policy.named_parameters() if p.requires_grad}),
                       "optimizer": self.optimizer.state_dict()}
        extra = self._extra_state()
        if not self.dist.is_main:
            return directory
        directory.mkdir(parents=True, exist_ok=True)
        if hasattr(self.policy, "save_pretrained") and (export or not self.sharded):
            self._save_policy_dir(directory, whole)
        state = {
            "algo": self.algo,
            "config": self.config.to_dict(),
            "iteration": self.iteration,
            "completions": self.completions,
            **weights,
            **(self._cursor() if cursor is None else cursor),
            "ref_fingerprint": self._ref_fingerprint,
            "grad_scaler": self.precision.state_dict(),  # fp16's loss scale (None otherwise)
            "lr_horizon": self._lr_horizon,
            # The live alerts' cooldowns and windows, so that a resumed run alerts as an unbroken one would.
            "alerts": {"monitor": self.monitor.state_dict(), "lm": self.lm_alerts.state_dict()},
            **extra,
        }
        save_checkpoint(directory / CHECKPOINT, state, finite=[k for k in ("policy", "optimizer", *self._finite_keys())
                                                               if k in state])
        remove_old_shards(directory, weights.get("shards"))  # now that the checkpoint names the new ones, if any
        return directory

    def _save_policy_dir(self, directory: Path, state_dict: dict[str, Tensor] | None = None) -> None:
        """``directory/policy`` replaced by a fresh ``save_pretrained`` (written under a temp name beside it; a kill
        leaves temp names that ``rundir.claim`` removes, or, between the two renames, puts back)."""
        from ppokit.runtime.rundir import model_swap_paths

        tmp, aside, final = model_swap_paths(directory, uuid.uuid4().hex, self.model_dir)
        try:
            with _quiet_progress():  # no "Writing model shards" bar on stderr at every checkpoint
                self.policy.save_pretrained(tmp, state_dict=state_dict)  # None: the module's own
                if hasattr(self.tokenizer, "save_pretrained"):
                    self.tokenizer.save_pretrained(tmp)
            moved = final.is_dir() and not final.is_symlink()
            if moved:
                os.rename(final, aside)
            try:
                os.rename(tmp, final)
            except BaseException:
                if moved:
                    os.rename(aside, final)  # the previous policy/ back in place
                raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(aside, ignore_errors=True)

    def _finite_keys(self) -> list[str]:
        return []

    @classmethod
    def resume(cls, directory: str | Path, model: nn.Module, tokenizer: Any, **kwargs: Any) -> "LMTrainer":
        """A trainer that continues the run saved in ``directory``: the same numbers as if it had never stopped.

        It logs into ``directory`` and checkpoints there (``run_dir=`` another directory forks the run into it).
        ``model`` is the run's *starting* model (pi_ref is rebuilt from it, as at the start; a different one is
        refused); its trainable weights are then replaced by the saved ones. The config is the saved one; give the
        same ``reward``/``prompts``/``pairs`` (and ``ref_model``/``value_model`` if the run had them) as before.
        """
        directory = Path(directory)
        state = load_checkpoint(directory / CHECKPOINT, require_finite=["policy"])  # shards: checked as loaded
        kwargs.setdefault("run_dir", directory)  # the run goes on logging (and saving) where it was
        if state.get("algo") != cls.algo:
            raise ValueError(f"resume: {directory} holds a {state.get('algo')!r} run, not {cls.algo!r}")
        config = LMConfig.from_dict(state["config"])
        trainer = cls(model, tokenizer, config=config, **kwargs)
        if state["ref_fingerprint"] and trainer._ref_fingerprint != state["ref_fingerprint"]:
            raise ValueError("resume: the reference model differs from the run's; pass the model the run started "
                             "from (pi_ref is built from it), not the trained policy")
        if "shards" in state:  # a sharded run's: DCP reshards onto this run's ranks, or into whole tensors
            if not is_shards_name(state["shards"]):
                raise CheckpointError(f"{directory / CHECKPOINT} names no sharded checkpoint directory "
                                      f"({state['shards']!r}); it was damaged or not written by ppokit")
            load_shards(directory / state["shards"], trainer._checkpointed_modules(), trainer.optimizer,
                        trainer.dist)
        else:
            params = dict(trainer.policy.named_parameters())
            missing = [n for n in state["policy"] if n not in params]
            if missing:
                raise ValueError(f"resume: the model has no parameter {missing[0]!r} the checkpoint holds; pass "
                                 "the same architecture (and the same LoRA adapter) as the run's")
            load_full_state(trainer.policy, state["policy"], strict=False)  # sharded or not, any number of ranks
            trainer.optimizer.load_state_dict(state["optimizer"])
            shard_optimizer_state(trainer.optimizer)
        trainer.precision.load_state_dict(state.get("grad_scaler"))
        trainer._lr_horizon = state.get("lr_horizon")
        trainer.iteration, trainer.completions = int(state["iteration"]), int(state["completions"])
        set_rng_state(state["rng"])
        trainer._sample_state = state["sample_rng"].clone()
        if state.get("cuda_sample_rng") is not None:
            trainer._cuda_sample_state = state["cuda_sample_rng"].clone()
        streams = state.get("rank_sample_rng")  # a sharded run's: every rank's sampling stream
        if trainer.dist.active and isinstance(streams, list) and len(streams) == trainer.dist.world_size:
            # The same number of ranks: each goes on with its own stream, as if the run had never stopped.
            mine = streams[trainer.dist.rank]
            if not (isinstance(mine, Tensor) and mine.dtype == torch.uint8
                    and mine.shape == trainer._sample_state.shape):
                raise CheckpointError(f"{directory / CHECKPOINT} cannot be resumed: its rank_sample_rng entry is "
                                      "not a random generator's state")
            trainer._sample_state = mine.clone()
            if not trainer.dist.is_main:  # the CUDA stream of a rank > 0 is not gathered: seeded by rank again
                trainer._cuda_sample_state = None
        elif not trainer.dist.is_main:
            # Data-parallel: the file holds rank 0's sampling stream; this rank draws its own again (fresh for
            # this iteration), or both would sample their prompts with the same noise.
            seed = (trainer.dist.seed(config.seed) * 1_000_003 + trainer.iteration) % 2 ** 63
            trainer._sample_state = torch.Generator().manual_seed(seed).get_state()
            trainer._cuda_sample_state = None
        trainer._shuffle.set_state(state["shuffle_rng"])
        if trainer.prompts is not None and state.get("prompts") is not None:
            trainer.prompts.load_state(state["prompts"])
        trainer._load_extra_state(state)
        if state.get("alerts") is not None:  # a checkpoint of an older release starts the alerts afresh
            try:
                trainer.monitor.load_state_dict(state["alerts"]["monitor"])
                trainer.lm_alerts.load_state_dict(state["alerts"]["lm"])
            except (TypeError, ValueError, KeyError, AttributeError) as exc:
                raise CheckpointError(f"{directory / CHECKPOINT} cannot be resumed: its alerts entry is malformed "
                                      f"({type(exc).__name__}: {exc})") from None
        trainer._resumed_at = trainer.completions
        return trainer


@contextlib.contextmanager
def _quiet_progress() -> Iterator[None]:
    """transformers' progress bars off for the block (and back on after, if they were)."""
    from transformers.utils import logging as hf_logging

    was = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was:
            hf_logging.enable_progress_bar()


def masked_stats(x: Tensor, mask: Tensor) -> tuple[float, float]:
    """Mean and population std of the masked entries of ``x`` (NaN when none)."""
    vals = x[mask]
    if vals.numel() == 0:
        return math.nan, math.nan
    return float(vals.mean()), float(vals.std(unbiased=False))
