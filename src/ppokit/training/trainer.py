"""The PPO training loop: rollout -> GAE -> K epochs of minibatches -> discard, with diagnostics every update.

``train(config)`` is the public entry point. ``Trainer`` assembles the parts ``build.build(config)`` makes and
holds the train state (policy, optimizer, normalizers, environments, RNG, step counters) so that it can be
checkpointed and resumed; its ``run`` method reads top to bottom as Algorithm 1 of Schulman et al. 2017,
"Proximal Policy Optimization Algorithms". The rollout itself (env stepping, autoreset, NaN/Inf, episode
statistics, the truncation bootstrap) is ``collector.Collector``'s; the epochs are ``epochs.ppo_epochs``'s.
"""

from __future__ import annotations

import signal
import time
import weakref
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ppokit.config.ppo_config import PPOConfig
from ppokit.core import schema as S
from ppokit.core.advantages import gae
from ppokit.core.algos import Algo, adapt_kl_beta, get_algo  # noqa: F401  (adapt_kl_beta: ppo-kl's rule, importable from here)
from ppokit.core.objectives import explained_variance
from ppokit.core.schema import PERF_PHASES
from ppokit.envs.errors import EnvError
from ppokit.envs.masks import forget_probe_reset
from ppokit.envs.run_envs import make_eval_envs
from ppokit.kernels.fused_step import FusedStep
from ppokit.policies import ActorCritic, Policy
from ppokit.rollout.actors import vtrace_targets
from ppokit.rollout.collector import bootstrap_values
from ppokit.rollout.evaluation import evaluate_first_episodes
from ppokit.rollout.source import RolloutBackend, RolloutSource, policy_lag, policy_lag_mean
from ppokit.runtime import checkpoint as ckpt
from ppokit.runtime.interrupts import install_sigint as _install_sigint
from ppokit.training.build import build, claim_run_dir, default_run_dir, make_logger, write_run_files
from ppokit.training.lifecycle import TrainerLifecycle
from ppokit.training.state import CHECKPOINT_NAME, TrainerCheckpoint
from ppokit.update.autograd import AutogradStep
from ppokit.update.epochs import Batch, SequenceBatch, UpdateSettings, ppo_epochs

__all__ = ["train", "Run", "Trainer", "CHECKPOINT_NAME", "default_run_dir"]

@dataclass
class Run:
    """The result of ``train``: where it wrote, what it measured."""

    run_dir: Path
    config: PPOConfig
    metrics: list[dict[str, float]]
    policy: Policy  # an ActorCritic (flat observations) or an EncoderActorCritic (image, Dict, Tuple)
    global_step: int
    alerts: list[dict] = field(default_factory=list)
    interrupted: bool = False
    stopped_by_callback: str | None = None  # the callback whose on_update returned False (callbacks.py)

    @property
    def checkpoint(self) -> Path:
        """Path of the run's latest checkpoint."""
        return self.run_dir / CHECKPOINT_NAME


class Trainer(TrainerLifecycle, TrainerCheckpoint):
    """PPO train state plus the loop. Build with a validated config; ``run()`` trains to ``total_timesteps``."""

    collector: RolloutSource  # where every rollout comes from (``rollout.source``); the weights go back to it

    def __init__(self, config: PPOConfig, run_dir: str | Path | None = None, console: Any = None,
                 console_enabled: bool = True, resume_state: dict | None = None, overwrite: bool = False,
                 env: Any = None, callbacks: Any = None, rollout: Any = None, policy: Any = None):
        from ppokit.runtime import rundir
        from ppokit.training.callbacks import CallbackList

        self.callbacks = CallbackList(callbacks)  # checked before anything is built
        self._callback_stop: str | None = None  # the name of the callback that asked to stop
        self._stop_requested = self._solved = self._interrupt_noted = False  # _solved: the evaluation gate's
        self._eval_envs, self.metrics = None, []
        self.global_step, self.update_idx = 0, 0  # the per-env episode bookkeeping is the collector's
        # Envs, policy pi_theta, optimizer and update choice, acting, normalizers, monitor, rollout source: every
        # part is an attribute of the same name (the mixins, callbacks and tests read them).
        parts = build(config, env=env, policy=policy, rollout=rollout, stop_requested=lambda: self._stop_requested,
                      rollout_failed=self._rollout_failed)
        vars(self).update(vars(parts))
        cfg = self.config
        self.kl_beta = cfg.init_kl_beta
        # The update's epoch loop, ``loop(batch, settings, step, sync=...) -> stats``: an attribute so that a caller
        # can wrap it (see what each update is given) without patching this module.
        self.epoch_loop = ppo_epochs
        self.buffer, self.same_step = self.collector.buffer, self.collector.same_step
        self.run_dir, self._claim = claim_run_dir(parts, run_dir, resume_state is not None, overwrite)
        notes = list(self._claim.notes)
        try:
            write_run_files(cfg, self.run_dir)
            self._start_envs(resume_state)
            if resume_state is not None:
                notes += self._resume(resume_state)
            # Where the run ends: config.num_updates in one process; total_timesteps counts every rank's steps.
            self.num_updates, self.end_step = self.dist.schedule(cfg.total_timesteps, cfg.batch_size,
                                                                 self.update_idx, self.global_step)
            rundir.update_latest_link(self.run_dir)
            self.logger = make_logger(parts, self.run_dir, self.end_step, console=console,
                                      console_enabled=console_enabled,
                                      resume_step=self.global_step if resume_state is not None else None)
        except BaseException:
            self._claim.release()
            self._close_envs()  # an env hung in reset() is not waited on
            raise
        # A trainer dropped without run() (built only to inspect its state) must not leave its lock behind.
        weakref.finalize(self, self._claim.release)
        self._note_start(notes)

    def _resume(self, state: dict) -> list[str]:
        """Restore the checkpoint's train state and RNG; returns the run dir's notes on what was trimmed."""
        from ppokit.runtime import rundir

        self._load_state(self.dist.resume_state(state))
        self.dist.reseed_after_resume(self.config.seed, self.update_idx)
        # What the killed run logged after its checkpoint is logged again from here: drop the old copy.
        return rundir.trim_to_checkpoint(self.run_dir, self.update_idx, self.global_step)

    def _start_envs(self, resume_state: dict | None) -> None:
        """Env 0's video recorder (``capture_video``), then the first reset with the run's env seed."""
        cfg = self.config
        if cfg.capture_video and self.dist.is_main:
            from ppokit.envs.video import VIDEO_DIR, record_env0

            # Env 0 records into RUN_DIR/videos (before the first reset, so episode 0 is the first one).
            forget_probe_reset(self.envs)  # env 0 is rebuilt: the collector resets the envs itself
            record_env0(self.envs, cfg.env_id, cfg.env_kwargs, self.run_dir / VIDEO_DIR, cfg.video_every,
                        int(resume_state["global_step"]) if resume_state is not None else 0,
                        custom=self.custom_env is not None)
        env_seed = self.dist.env_seed(cfg.seed, cfg.num_envs)  # cfg.seed in one process
        with self.watchdog.running():
            self.collector.reset(env_seed)
        self.envs.action_space.seed(env_seed)

    def _note_start(self, notes: list[str]) -> None:
        """The run dir's notes on the console, every rank on rank 0's weights and merged normalizer statistics
        (a no-op in one process), and the --unsafe alert."""
        self.notes = notes
        if notes:
            from rich.text import Text  # plain text: paths may hold [brackets] that markup would eat

            for note in notes:
                self.logger.console.print(Text(f"note: {note}"))
        self.dist.prepare(self.policy, self.acting, [self.obs_norm, self.reward_scaler])
        if self.config.unsafe:
            broken = "; ".join(r for _, r in self.config.guard_rail_violations())
            self.logger.alert(self.global_step, "warn", "unsafe_run", f"run started with --unsafe: {broken}")

    # ================================================================== the loop
    def run(self) -> Run:
        """Train until ``total_timesteps`` (or Ctrl-C, which finishes the update, saves and returns)."""
        from ppokit.runtime.logger import SinkError

        cfg = self.config
        # With actors, SIGTERM too finishes the update, saves and stops the workers (rollout/actors.py).
        old_handler = _install_sigint(self, sigterm=bool(cfg.actors))
        self.watchdog.start()  # stopped once the envs are closed (_finish, _abandon)
        start_time = time.perf_counter()
        start_step = self.global_step
        saved_update = self.update_idx  # the update the run dir's checkpoint holds (none yet counts as current)
        self.collector.publish(self.policy, self.update_idx)  # the weights the first rollout acts with
        try:
            while (self.update_idx < self.num_updates and not self._stop_requested and not self._solved
                   and self._callback_stop is None):
                # By steps: the same fraction as update / num_updates, and continuous when a resume changes the
                # number of ranks (global_step counts every rank's steps).
                frac = 1.0 - self.global_step / self.end_step
                lr = cfg.learning_rate * frac if cfg.anneal_lr else cfg.learning_rate
                clip_coef = cfg.clip_coef * frac if cfg.anneal_clip else cfg.clip_coef
                for group in self.optimizer.param_groups:
                    group["lr"] = lr

                # 1. Collect rollout with pi_old (logp_old frozen into the buffer)
                episodes, nonfinite_env = self.collect_rollout()

                # 2. Advantages (GAE), bootstrapping time-limit truncations
                t0 = time.perf_counter()
                batch, advantages, returns = self.compute_advantages()
                self.perf["advantages"] += time.perf_counter() - t0

                # 3. K epochs of minibatch updates
                t0 = time.perf_counter()
                step = FusedStep(self.policy, self.optimizer) if self.fused else AutogradStep(self.policy, self.optimizer)
                update_batch = self.update_batch(batch, advantages, returns)  # rows, or env sequences
                settings = self.dist.agree_minibatches(self.update_settings(clip_coef), len(update_batch))
                stats = self.epoch_loop(update_batch, settings, step, sync=self.dist.sync)  # sync: None in 1 process
                kl_after = self.dist.mean(self.batch_kl(update_batch))  # how far this update moved pi_theta
                if self.algo.after_update is not None:  # ppo-kl: the adaptive penalty's beta rule
                    self.kl_beta = self.algo.after_update(self.kl_beta, kl_after, cfg)
                self.perf["update"] += time.perf_counter() - t0
                self.update_idx += 1
                self.dist.after_update(self.policy, self.update_idx)
                self.collector.publish(self.policy, self.update_idx)  # the next rollout's weights, numbered

                # 4. Log
                t0 = time.perf_counter()
                metrics = self._metrics(stats, episodes, nonfinite_env, batch, advantages, lr, clip_coef,
                                        start_step, start_time, kl_after)
                if self.collector.stale:  # in process every sample is of the current policy: no column
                    metrics[S.POLICY_LAG] = float(self.policy_lag)
                    metrics[S.POLICY_LAG_MEAN] = self.policy_lag_mean
                    metrics.update(getattr(self.collector, "diagnostics", dict)())  # the actors' (rollout/actors.py)
                if cfg.eval_every:
                    # Evaluation gate: a cheap evaluation (eval_deterministic: greedy or sampled) that ends the run
                    # once it is solved.
                    metrics[S.EVAL_RETURN] = float("nan")
                    if self.update_idx % cfg.eval_every == 0:
                        metrics[S.EVAL_RETURN] = self.dist.from_main(self.evaluate_gate)
                        if self.dist.is_main:
                            self.save_best(metrics[S.EVAL_RETURN])  # best.pt: the best evaluation so far
                        self._solved = metrics[S.EVAL_RETURN] >= cfg.eval_threshold
                self.metrics.append(metrics)
                self.logger.log(self.global_step, metrics)
                for alert in self.monitor.check(self.update_idx, metrics):
                    self.logger.alert(self.global_step, alert.level, alert.name, alert.message, alert.data)
                if self.callbacks:
                    self._run_update_callbacks(metrics)

                # 5. Checkpoint. The row above is written first; a run killed before this save logs the update
                # again when resumed, and the resume drops the old row (rundir.trim_to_checkpoint).
                # Read once: a Ctrl-C landing after this is handled below. Every rank stops when one is asked to.
                stopping = self._stop_requested = self.dist.any(self._stop_requested)
                if stopping:
                    self._note_interrupt()
                if self.dist.is_main and (stopping or self.update_idx % cfg.save_every == 0
                                          or self.update_idx == self.num_updates or self._solved
                                          or self._callback_stop is not None):
                    self.save()
                    saved_update = self.update_idx
                self.perf["logging"] += time.perf_counter() - t0
            if self._stop_requested:
                self._note_interrupt()
                if saved_update != self.update_idx and self.dist.is_main:
                    self.save()
        except SinkError as exc:
            # TensorBoard could not write (a full disk): this update's learner state is whole, save it first.
            error = self._sink_failed(exc)
            self._abandon()
            raise error from None
        except BaseException:
            # A crash or a second Ctrl-C: the last checkpoint stands (writes are atomic); free the run dir.
            self._abandon()
            raise
        finally:
            if old_handler is not None:
                signal.signal(signal.SIGINT, old_handler)
            if getattr(self, "_old_sigterm", None) is not None:
                signal.signal(signal.SIGTERM, self._old_sigterm)
        wall = time.perf_counter() - start_time
        self._finish(wall, start_step)
        return Run(self.run_dir, cfg, self.metrics, self.policy, self.global_step,
                   list(self.logger.alerts), self._stop_requested, self._callback_stop)

    def _run_update_callbacks(self, metrics: dict[str, float]) -> None:
        """Every callback's ``on_update``; one returning False ends the run after this update (callbacks.py)."""
        from ppokit.training.callbacks import UpdateInfo

        name = self.callbacks.on_update(UpdateInfo(self.update_idx, self.global_step, metrics, self.run_dir, self))
        if self.dist.any(name is not None) and self._callback_stop is None:  # every rank stops together
            self._callback_stop = name or "a callback on another rank"
            self.logger.alert(self.global_step, "info", "stopped_by_callback",
                              f"callback {self._callback_stop} returned False after update {self.update_idx}; "
                              "saving a checkpoint and ending the run")

    # ================================================================== 1. rollout
    def collect_rollout(self) -> tuple[list[tuple[float, int]], int]:
        """Fill the buffer with ``num_steps`` steps of every env from the rollout source; returns (finished
        episodes, non-finite steps). ``policy_lag``: how many updates behind the learner the oldest acting
        policy of the batch was."""
        source = self.collector
        episodes, nonfinite = source.collect(self.global_step)
        self.global_step += self.config.num_steps * self.config.num_envs * self.dist.world_size
        self.policy_lag = policy_lag(source.buffer, self.update_idx)
        self.policy_lag_mean = policy_lag_mean(source.buffer, self.update_idx)
        return episodes, nonfinite

    @property
    def next_obs_raw(self) -> np.ndarray:
        """The raw observation the next rollout starts from (the collector's)."""
        return self.collector.next_obs_raw

    def evaluate_gate(self) -> float:
        """Mean return of one episode in each of ``eval_episodes`` envs of a separate vector env, acting on the
        most likely action unless ``eval_deterministic`` is off."""
        cfg = self.config
        if self._eval_envs is None:
            self._eval_envs, self._eval_max_steps = make_eval_envs(cfg, self.custom_env)
        actor = self.acting.actor_head if self.fused else self.policy.actor  # no critic, no log-prob

        def failed(phase: str, exc: BaseException) -> EnvError:
            # The update just made is not saved yet (step 5 of the loop comes after the gate).
            return self._env_failed(phase, self.global_step, exc, unsaved=True, envs=self._eval_envs)

        return evaluate_first_episodes(self._eval_envs, self.policy, actor, self.collector.normalize,
                                       seed=cfg.seed + 7919 * (self.update_idx + 1), max_steps=self._eval_max_steps,
                                       env_id=cfg.env_id, global_step=self.global_step, fail=failed,
                                       watchdog=self.watchdog, deterministic=cfg.eval_deterministic)

    # ================================================================== 2. advantages
    def compute_advantages(self) -> tuple[Batch, torch.Tensor, torch.Tensor]:
        """GAE over the rollout, flattened to the batch of valid steps."""
        cfg, buf = self.config, self.buffer
        if cfg.actors:  # stale actors' chunks: V-trace under the current policy (rollout/actors.py)
            # A recurrent policy replays each env's chunk in the update's sequences, from the states it carries.
            advantages, returns = vtrace_targets(self.policy, buf, self.collector.last_obs, cfg.gamma, cfg.gae_lambda,
                                                 seq_len=cfg.recurrent_seq_len or cfg.num_steps,
                                                 last_state=self.collector.last_state,
                                                 proximal=cfg.actor_clip == "proximal")
            return buf.flat(advantages, returns), advantages, returns
        last_values = bootstrap_values(self.policy, self.collector)  # a stateful policy's from its live state
        next_values = buf.next_values(last_values)
        advantages, returns = gae(buf.rewards, buf.values, next_values, buf.terminated, buf.truncated,
                                  cfg.gamma, cfg.gae_lambda)
        # [T, N, ...] -> [B, ...] of the valid steps, every field the buffer carries to the minibatches
        return buf.flat(advantages, returns), advantages, returns

    def update_batch(self, batch: Batch, advantages: torch.Tensor, returns: torch.Tensor) -> Batch:
        """What the epoch loop draws minibatches from: ``batch`` (rows), or for a stateful policy whole env
        sequences (``RolloutBuffer.sequences``) in chunks of ``recurrent_seq_len`` steps (0: the whole rollout).
        Data-parallel, each rank chunks its own envs; every rank has the same number of chunks."""
        if self.buffer.policy_state is None:
            return batch
        seq = self.buffer.sequences(self.config.recurrent_seq_len or self.config.num_steps, advantages, returns)
        if not self.config.actors and not getattr(self.acting, "exact_logp", True):
            # The acting kernel's log-probs equal the replay's only to rounding: pi_old's are taken from one replay
            # of these chunks with the weights that acted, so the first ratio of the update is exactly 1.
            with torch.no_grad():
                logp, _, _ = self.policy.evaluate_sequence(seq.obs, seq.actions, seq.state0, seq.episode_start,
                                                           seq.action_mask)
            seq.logp_old = torch.where(seq.mask, logp, seq.logp_old)
        return seq

    def update_settings(self, clip_coef: float) -> UpdateSettings:
        """This update's settings, with the algo's schedule overrides (a2c: one gradient step on the whole batch)."""
        cfg, algo = self.config, self.algo
        return UpdateSettings(algo=cfg.algo, update_epochs=algo.update_epochs or cfg.update_epochs,
                              num_minibatches=algo.num_minibatches or cfg.num_minibatches, clip_coef=clip_coef,
                              clip_vloss=cfg.clip_vloss, norm_adv=cfg.norm_adv, ent_coef=cfg.ent_coef,
                              vf_coef=cfg.vf_coef, max_grad_norm=cfg.max_grad_norm,
                              target_kl=cfg.target_kl if algo.kl_stop else None, kl_beta=self.kl_beta)

    @property
    def algo(self) -> Algo:
        """The registered variant this run trains (``algos.ALGOS[config.algo]``)."""
        return get_algo(self.config.algo)

    def batch_kl(self, batch: Batch) -> float:
        """k3 approx KL(pi_old || pi_theta) on the whole batch after the update (``diag/approx_kl_after``; one
        forward pass without autograd, once per update)."""
        from ppokit.core.objectives import approx_kl_k3

        policy = self.policy
        with torch.inference_mode():
            if isinstance(batch, SequenceBatch):  # replayed as in the update, counted where mask
                logp_new = policy.evaluate_sequence(batch.obs, batch.actions, batch.state0, batch.episode_start,
                                                    batch.action_mask)[0]
                return float(approx_kl_k3(logp_new, batch.logp_old, batch.mask))
            if getattr(type(policy), "evaluate", None) is ActorCritic.evaluate:
                # ActorCritic.evaluate's log-probabilities without its critic pass, which the KL does not need.
                logp_new, _ = policy.log_prob_entropy(policy.masked_head(batch.obs, batch.action_mask),
                                                      batch.actions)
            else:
                logp_new, _, _ = policy.evaluate(batch.obs, batch.actions, action_mask=batch.action_mask)
            return float(approx_kl_k3(logp_new, batch.logp_old))

    # ================================================================== 4. metrics
    def _metrics(self, stats: dict[str, float], episodes: list[tuple[float, int]], nonfinite_env: int,
                 batch: Batch, advantages: torch.Tensor, lr: float, clip_coef: float, start_step: int,
                 start_time: float, kl_after: float) -> dict[str, float]:
        nan = float("nan")
        elapsed = max(time.perf_counter() - start_time, 1e-9)
        ev = float(explained_variance(batch.values_old, batch.returns)) if len(batch) > 1 else nan
        rewards = self.buffer.rewards[self.buffer.valid]
        m = {
            S.UPDATE: float(self.update_idx),
            S.EPISODIC_RETURN: float(np.mean([e[0] for e in episodes])) if episodes else nan,
            S.EPISODIC_LENGTH: float(np.mean([e[1] for e in episodes])) if episodes else nan,
            S.EPISODES: float(len(episodes)),
            S.LEARNING_RATE: lr,
            S.CLIP_COEF: clip_coef,
            S.KL_BETA: self.kl_beta,
            S.POLICY_LOSS: stats["policy_loss"],
            S.VALUE_LOSS: stats["value_loss"],
            S.ENTROPY_LOSS: -stats["entropy"],
            S.ENTROPY: stats["entropy"],
            S.APPROX_KL: stats["approx_kl"],
            S.APPROX_KL_K1: stats["approx_kl_k1"],
            # diag/approx_kl is measured on each minibatch's forward pass, before its step (0 for a2c's only
            # step); this one is the whole update's move: k3 of pi_theta after it vs pi_old, on the whole batch.
            S.APPROX_KL_AFTER: kl_after,
            S.CLIPFRAC: stats["clipfrac"],
            S.EXPLAINED_VARIANCE: ev,
            S.GRAD_NORM: stats["grad_norm"],
            S.EPOCHS_RUN: stats["epochs_run"],
            S.EARLY_STOPPED: stats["early_stopped"],
            S.MINIBATCHES: stats["minibatches"],
            S.SKIPPED_MINIBATCHES: stats["skipped_minibatches"],
            S.NONFINITE_ENV: float(nonfinite_env),
            S.ADVANTAGES_NONFINITE: float((~torch.isfinite(advantages)).sum()),
            S.REWARD_STD: float(rewards.std()) if rewards.numel() > 1 else nan,
            S.ADVANTAGE_STD: float(batch.advantages.std()) if len(batch) > 1 else nan,
            S.SPS: (self.global_step - start_step) / elapsed,
        }
        if getattr(self.collector, "whole_games", False):  # Atari: episodes are games; the lives trained on
            lives = self.collector.life_episodes
            m[S.LIFE_RETURN] = float(np.mean([e[0] for e in lives])) if lives else nan
        # Data-parallel: the episode and batch diagnostics over every rank's data ({} in one process).
        m.update(self.dist.diagnostics(episodes, batch.values_old, batch.returns, rewards, batch.advantages,
                                       nonfinite_env, m[S.ADVANTAGES_NONFINITE]))
        total = sum(self.perf.values()) or 1.0
        for phase in PERF_PHASES:
            m[S.perf_time(phase)] = self.perf[phase]
            m[S.perf_frac(phase)] = self.perf[phase] / total
        return m


def train(config: PPOConfig | str, run_dir: str | Path | None = None, console: Any = None,
          console_enabled: bool = True, overwrite: bool = False, env: Any = None, callbacks: Any = None,
          rollout: RolloutBackend | None = None, policy: Any = None, **overrides: Any) -> Run:
    """Train PPO with ``config``; returns a ``Run`` with the run dir, per-update metrics and the policy.

    ``config`` may be an env id: ``train("CartPole-v1")`` trains ``PPOConfig.for_env("CartPole-v1")``, the
    planner's tuned config that ``ppokit train --env CartPole-v1`` trains. ``overrides`` are config fields set
    over either (``train("CartPole-v1", total_timesteps=20_000)``).

    ``env`` (default: ``config.env_id``) is a registered id, a zero-argument factory returning a ``gymnasium.Env``
    (called once per env; ``vector_mode`` sync or async), or one ``gymnasium.Env`` instance, wrappers included
    (``num_envs = 1``, sync, no evaluation gate: an env is never copied). The run records a custom env's spec id,
    or ``"custom:<class>"``, as its env_id; ``resume`` and ``load`` need the same env passed again. ppokit closes
    the envs at the end of the run.

    A run dir that already holds a run is refused (``rundir.RunDirError``) unless ``overwrite=True``, which first
    removes the old run's files; continue a run with ``resume`` instead.

    ``callbacks``: objects with ``on_update(info)`` (returning False stops the run after that update, with a
    checkpoint) and/or ``on_checkpoint(path)``, or plain functions taken as ``on_update`` (see ``callbacks``).

    ``rollout``: a rollout backend instead of ``collector.Collector`` (a callable taking Collector's arguments and
    returning a ``rollout.source.RolloutSource``, the protocol documented there), e.g. remote rollout workers;
    the learner is unchanged.

    ``policy``: a factory ``(observation_space, action_space, config) -> Policy`` instead of
    ``policies.build_policy`` (e.g. a type registered with ``register_policy``, so ``load`` rebuilds it).
    """
    if isinstance(config, str):
        config = PPOConfig.for_env(config, **overrides)
    elif overrides:
        config = PPOConfig.from_dict(overrides, config)
    return Trainer(config, run_dir=run_dir, console=console, console_enabled=console_enabled,
                   overwrite=overwrite, env=env, callbacks=callbacks, rollout=rollout, policy=policy).run()


def resume(run_dir: str | Path, total_timesteps: int | None = None, console: Any = None,
           console_enabled: bool = True, allow_import: tuple[str, ...] | list[str] = (), env: Any = None,
           callbacks: Any = None, rollout: RolloutBackend | None = None, policy: Any = None) -> Run:
    """Continue the run in ``run_dir`` from its checkpoint (optionally to a new ``total_timesteps``).

    A stored env id of the form ``"module:Env-v0"`` is refused unless ``module`` is in ``allow_import``: the
    checkpoint alone never decides what code is imported. A run trained on a custom env (``train(env=factory)``)
    needs that env again as ``env``; ``env`` may also replace a stored id. A damaged, diverged or mismatched
    checkpoint raises ``CheckpointError``. ``callbacks``, ``rollout`` and ``policy`` as for ``train``.
    """
    from ppokit.training.agent import stored_config

    run_dir = Path(run_dir)
    path = run_dir / CHECKPOINT_NAME
    state = ckpt.load_checkpoint(path, require_finite=ckpt.LEARNER_KEYS, require_bounded=ckpt.BOUNDED_KEYS)
    config = stored_config(state, path, allow_import, env=env)
    if total_timesteps is not None:
        config.total_timesteps = total_timesteps
    trainer = Trainer(config, run_dir=run_dir, console=console, console_enabled=console_enabled, resume_state=state,
                      env=env, callbacks=callbacks, rollout=rollout, policy=policy)
    return trainer.run()
