"""The PPO training loop: rollout -> GAE -> K epochs of minibatches -> discard, with diagnostics every update.

``train(config)`` is the public entry point. ``Trainer`` holds the train state (policy, optimizer, normalizers,
environments, RNG, step counters) so that it can be checkpointed and resumed; its ``run`` method reads top to
bottom as the lesson's algorithm. The rollout itself (env stepping, autoreset, NaN/Inf, episode statistics, the
truncation bootstrap) is ``collector.Collector``'s; the epochs are ``epochs.ppo_epochs``'s.
"""

from __future__ import annotations

import math
import signal
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import checkpoint as ckpt
from . import distributed
from .advantages import gae
from .algos import Algo, adapt_kl_beta, get_algo  # adapt_kl_beta: ppo-kl's rule, importable from here as before
from .acting import ActingKernel
from .collector import Collector, action_masks_available, evaluate_first_episodes, make_eval_envs, make_train_envs
from .envs.errors import EnvError, env_failure
from .config import ConfigError, PPOConfig
from . import schema as S
from .monitor import Monitor, episode_time_limit
from .normalize import ObsNormalizer, RewardScaler
from .objectives import explained_variance
from .resources import check_memory, layout_bytes, usable_threads
from .encoders import obs_index, obs_map, observation_encoder
from .normalize import make_obs_normalizer
from .policies import ActorCritic, Policy, build_policy, spec_type
from .epochs import Batch, UpdateSettings, ppo_epochs
from .flat_adam import FlatAdam
from .fused_step import FusedStep
from .mlp_backward import supports as fused_supports
from .update import AutogradStep

__all__ = ["train", "Run", "Trainer", "CHECKPOINT_NAME", "default_run_dir"]

CHECKPOINT_NAME = "checkpoint.pt"
PERF_PHASES = ("env", "inference", "advantages", "update", "logging")


@dataclass
class Run:
    """The result of ``train``: where it wrote, what it measured."""

    run_dir: Path
    config: PPOConfig
    metrics: list[dict[str, float]]
    policy: Policy  # an ActorCritic (flat observations) or networks.EncoderActorCritic (image, Dict, Tuple)
    global_step: int
    alerts: list[dict] = field(default_factory=list)
    interrupted: bool = False
    stopped_by_callback: str | None = None  # the callback whose on_update returned False (callbacks.py)

    @property
    def checkpoint(self) -> Path:
        """Path of the run's latest checkpoint."""
        return self.run_dir / CHECKPOINT_NAME


def default_run_dir(config: PPOConfig) -> Path:
    """``runs/<env>__<algo>__s<seed>__<YYYYmmdd-HHMMSS>``, unique within the second."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    # '/' (namespaced ids) and ':' ("module:Env", "custom:MyEnv") make no good directory names.
    env = config.env_id.replace("/", "-").replace(":", "-")
    base = Path("runs") / f"{env}__{config.algo}__s{config.seed}__{stamp}"
    path, i = base, 1
    while path.exists():
        path, i = Path(f"{base}-{i}"), i + 1
    return path


def seed_everything(seed: int) -> None:
    """Seed python, numpy and torch global RNGs."""
    import random

    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


class Trainer:
    """PPO train state plus the loop. Build with a validated config; ``run()`` trains to ``total_timesteps``."""

    def __init__(self, config: PPOConfig, run_dir: str | Path | None = None, console: Any = None,
                 console_enabled: bool = True, resume_state: dict | None = None, overwrite: bool = False,
                 env: Any = None, callbacks: Any = None, rollout: Any = None):
        from .callbacks import CallbackList
        from .envs import check_env_id, check_spaces, resolve_env
        from .logger import MetricsLogger

        self.callbacks = CallbackList(callbacks)  # checked before anything is built
        self._callback_stop: str | None = None  # the name of the callback that asked to stop

        # env: None (config.env_id), a registered id, a zero-arg factory or a gymnasium.Env (see train()).
        config, self.custom_env = resolve_env(env, config)
        self.config = cfg = config.validate()
        if cfg.track:
            from .wandb_sink import require_wandb

            require_wandb()  # one line naming the extra, before anything is built
        if cfg.capture_video:
            from .video import require_video

            require_video()
        # Under torchrun: this rank's place in the job (rank 0 alone writes the run dir); else the identity.
        self.dist = distributed.current(cfg.dist_timeout, cfg.device)
        # Per process, so per rank: torchrun sets OMP_NUM_THREADS only when it starts several ranks per node.
        torch.set_num_threads(usable_threads(cfg.torch_threads))  # capped at the core count, with a warning
        self.device = torch.device(self.dist.device(cfg.device))
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ConfigError("device", "CUDA was requested but torch.cuda.is_available() is False; use --device cpu")
        if cfg.vector_mode != "envpool" and self.custom_env is None:  # envpool checks its own task list
            check_env_id(cfg.env_id)
        seed_everything(self.dist.seed(cfg.seed))

        # Environments and the policy pi_theta.
        self.envs = make_train_envs(cfg, self.custom_env)
        self.action_kind = check_spaces(self.envs)
        self.policy = build_policy(self.envs.single_observation_space, self.envs.single_action_space,
                                   cfg.hidden_sizes, cfg.activation).to(self.device)
        self.obs_dim = self.policy.obs_dim
        try:  # validate() assumed one float per observation; now the real size is known
            stored = layout_bytes(observation_encoder(self.envs.single_observation_space).layout())
            check_memory(cfg, self.obs_dim, stored)  # images are stored as uint8 bytes, not floats
        except ConfigError:
            self.envs.close()
            raise
        # The fused update (hand-derived backward, one flat parameter buffer) where it applies, else autograd.
        # An env with action masks trains by autograd: the fused kernel (and its acting kernel) has no masks.
        self.masked = self.policy.kind != "continuous" and action_masks_available(self.envs)
        self.fused = cfg.fused_update and fused_supports(self.policy, cfg.algo) and not self.masked
        if self.fused:
            self.optimizer = FlatAdam(self.policy, lr=cfg.learning_rate, eps=1e-5)
        else:
            self.optimizer = torch.optim.Adam(self.policy.parameters(), lr=cfg.learning_rate, eps=1e-5,
                                              **_adam_kwargs(self.device))
        # Normalization statistics (saved in checkpoints, frozen at evaluation).
        # Observation normalization standardizes the float vector parts (images and one-hot codes are left alone).
        self.obs_norm = self._obs_normalizer() if cfg.normalize_obs else None
        self.reward_scaler = RewardScaler(cfg.num_envs, cfg.gamma, device=self.device) if cfg.normalize_reward else None

        # Counters (the per-env episode bookkeeping is the collector's).
        self.global_step = 0
        self.update_idx = 0
        self.kl_beta = cfg.init_kl_beta
        self.monitor = Monitor(action_kind=self.action_kind, action_dim=self.policy.action_dims[0],
                               time_limit=episode_time_limit(cfg.env_id, cfg.env_kwargs),
                               monitor_kl=cfg.monitor_kl, monitor_clipfrac=cfg.monitor_clipfrac)
        self.perf = dict.fromkeys(PERF_PHASES, 0.0)
        # Acting (rollouts, the evaluation gate): the acting kernel where the fused update applies (the same
        # network on cached weights, the same random draws), else the eager policy.
        self.acting = ActingKernel(self.policy, self.optimizer) if self.fused else None
        # The rollout: env stepping, both autoreset modes, NaN/Inf, episode statistics, truncation bootstrap;
        # it fills its buffer (``[T, N, ...]`` tensors on the device) with pi_old's steps.
        # ``rollout``: another rollout backend (rollout_source.RolloutSource), built with Collector's arguments.
        self.collector = (rollout or Collector)(self.envs, self.policy, self.acting or self.policy,
                                                num_steps=cfg.num_steps, device=self.device, env_id=cfg.env_id,
                                                obs_norm=self.obs_norm, reward_scaler=self.reward_scaler,
                                                perf=self.perf, fail=self._rollout_failed)
        self.buffer, self.same_step = self.collector.buffer, self.collector.same_step
        self._stop_requested = False
        self._solved = False  # set by the evaluation gate (eval_every / eval_threshold)
        self._eval_envs = None

        # The run dir is claimed before anything is written to it: locked against a second process, refused if
        # it holds another run (unless overwrite), cleared of a killed checkpoint write's temp files.
        from . import rundir

        self.run_dir = Path(run_dir or cfg.run_dir or default_run_dir(cfg))
        if not self.dist.is_main:
            self.run_dir, console_enabled = self.dist.scratch_dir(), False
        try:
            self._claim = rundir.claim(self.run_dir, resume=resume_state is not None and self.dist.is_main,
                                       overwrite=overwrite)
        except BaseException:
            self.envs.close()
            raise
        notes = list(self._claim.notes)
        try:
            cfg.save_toml(self.run_dir / "config.toml")
            if cfg.unsafe:
                (self.run_dir / "UNSAFE").write_text(
                    "This run was started with --unsafe; it breaks these guard rails:\n"
                    + "".join(f"- {n}: {r}\n" for n, r in cfg.guard_rail_violations()))

            if cfg.capture_video and self.dist.is_main:
                from .video import VIDEO_DIR, record_env0

                # Env 0 records into RUN_DIR/videos (before the first reset, so episode 0 is the first one).
                record_env0(self.envs, cfg.env_id, cfg.env_kwargs, self.run_dir / VIDEO_DIR, cfg.video_every,
                            int(resume_state["global_step"]) if resume_state is not None else 0,
                            custom=self.custom_env is not None)
            env_seed = self.dist.env_seed(cfg.seed, cfg.num_envs)  # cfg.seed in one process
            self.collector.reset(env_seed)
            self.envs.action_space.seed(env_seed)
            if resume_state is not None:
                self._load_state(self.dist.resume_state(resume_state))
                self.dist.reseed_after_resume(cfg.seed, self.update_idx)
                # What the killed run logged after its checkpoint is logged again from here: drop the old copy.
                notes += rundir.trim_to_checkpoint(self.run_dir, self.update_idx, self.global_step)
            # Where the run ends: config.num_updates in one process; total_timesteps counts every rank's steps.
            self.num_updates, self.end_step = self.dist.schedule(cfg.total_timesteps, cfg.batch_size,
                                                                 self.update_idx, self.global_step)
            rundir.update_latest_link(self.run_dir)
            # The bar's end is the last update's step, which total_timesteps need not be a multiple of.
            self.logger = MetricsLogger(self.run_dir, self.end_step, log_every=cfg.log_every,
                                        tensorboard=cfg.tensorboard and self.dist.is_main, console=console_enabled,
                                        console_obj=console,
                                        hparams=cfg.to_dict() if resume_state is None else None,
                                        resume_step=self.global_step if resume_state is not None else None,
                                        sinks=self._tracking_sinks())
        except BaseException:
            self._claim.release()
            self.envs.close()
            raise
        # A trainer dropped without run() (built only to inspect its state) must not leave its lock behind.
        import weakref

        weakref.finalize(self, self._claim.release)
        self._interrupt_noted = False
        self.notes = notes
        if notes:
            from rich.text import Text  # plain text: paths may hold [brackets] that markup would eat

            for note in notes:
                self.logger.console.print(Text(f"note: {note}"))
        self.metrics: list[dict[str, float]] = []
        # Every rank starts from rank 0's weights and merges the normalizers' statistics (no-op in one process).
        self.dist.prepare(self.policy, self.acting, [self.obs_norm, self.reward_scaler])
        if cfg.unsafe:
            self.logger.alert(self.global_step, "warn", "unsafe_run",
                              "run started with --unsafe: " + "; ".join(r for _, r in cfg.guard_rail_violations()))

    # ================================================================== the loop
    def run(self) -> Run:
        """Train until ``total_timesteps`` (or Ctrl-C, which finishes the update, saves and returns)."""
        cfg = self.config
        old_handler = _install_sigint(self)
        start_time = time.perf_counter()
        start_step = self.global_step
        saved_update = self.update_idx  # the update the run dir's checkpoint holds (none yet counts as current)
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
                step = FusedStep(self.optimizer) if self.fused else AutogradStep(self.policy, self.optimizer)
                settings = self.dist.agree_minibatches(self.update_settings(clip_coef), len(batch))
                stats = ppo_epochs(batch, settings, step, sync=self.dist.sync)  # sync: None in one process
                kl_after = self.dist.mean(self.batch_kl(batch))  # how far this update moved pi_theta from pi_old
                if self.algo.after_update is not None:  # ppo-kl: the adaptive penalty's beta rule
                    self.kl_beta = self.algo.after_update(self.kl_beta, kl_after, cfg)
                self.perf["update"] += time.perf_counter() - t0
                self.update_idx += 1
                self.dist.after_update(self.policy, self.update_idx)

                # 4. Log
                t0 = time.perf_counter()
                metrics = self._metrics(stats, episodes, nonfinite_env, batch, advantages, lr, clip_coef,
                                        start_step, start_time, kl_after)
                if cfg.eval_every:
                    # Evaluation gate: a cheap deterministic evaluation that ends the run once it is solved.
                    metrics[S.EVAL_RETURN] = float("nan")
                    if self.update_idx % cfg.eval_every == 0:
                        metrics[S.EVAL_RETURN] = self.dist.from_main(self.evaluate_gate)
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

    def _tracking_sinks(self) -> list:
        """The metric sinks beyond CSV/TensorBoard/console: W&B under ``track`` (rank 0 only)."""
        cfg = self.config
        if not (cfg.track and self.dist.is_main):
            return []
        from .wandb_sink import WandbSink

        return [WandbSink(self.run_dir, cfg.to_dict(), cfg.wandb_project, cfg.wandb_entity)]

    def _run_update_callbacks(self, metrics: dict[str, float]) -> None:
        """Every callback's ``on_update``; one returning False ends the run after this update (callbacks.py)."""
        from .callbacks import UpdateInfo

        name = self.callbacks.on_update(UpdateInfo(self.update_idx, self.global_step, metrics, self.run_dir, self))
        if self.dist.any(name is not None) and self._callback_stop is None:  # every rank stops together
            self._callback_stop = name or "a callback on another rank"
            self.logger.alert(self.global_step, "info", "stopped_by_callback",
                              f"callback {self._callback_stop} returned False after update {self.update_idx}; "
                              "saving a checkpoint and ending the run")

    # ================================================================== 1. rollout
    def collect_rollout(self) -> tuple[list[tuple[float, int]], int]:
        """Fill the buffer with ``num_steps`` steps of every env (``collector.Collector``); returns (finished
        episodes, non-finite steps)."""
        episodes, nonfinite = self.collector.collect(self.global_step)
        self.global_step += self.config.num_steps * self.config.num_envs * self.dist.world_size
        return episodes, nonfinite

    @property
    def next_obs_raw(self) -> np.ndarray:
        """The raw observation the next rollout starts from (the collector's)."""
        return self.collector.next_obs_raw

    def _rollout_failed(self, step: int, rollout_start: int, exc: BaseException | None = None,
                        detail: str | None = None) -> EnvError:
        """The collector's ``fail``: an env failure at ``step`` of the rollout that began at ``rollout_start``."""
        self.global_step = step
        return self._env_failed("step()", rollout_start, exc, detail)

    def _env_failed(self, phase: str, rollout_start: int, exc: BaseException | None = None,
                    detail: str | None = None, unsaved: bool | None = None, envs: Any = None) -> EnvError:
        """The EnvError that ends the run, after saving the learner state the last checkpoint lacks.

        The learner (policy, optimizer, normalizers, counters) is as the last update left it; the env is not
        trusted, so its state is left out (a resume starts fresh episodes) and the step count is the one at the
        start of the failed rollout, so the checkpoint's update and step agree. If that save fails for any
        reason, the previous checkpoint stays as it is.
        """
        cfg = self.config
        error = env_failure(cfg.env_id, phase, self.global_step, exc, self.envs if envs is None else envs, detail)
        if unsaved is None:  # after an update, step 5 of the loop saved it when update % save_every == 0
            unsaved = self.update_idx > 0 and self.update_idx % cfg.save_every != 0
        path = self.run_dir / CHECKPOINT_NAME
        if unsaved and self.dist.is_main:
            failed_step = self.global_step
            self.global_step = rollout_start  # the step count this learner state belongs to
            try:
                # The env's state is left out: a resume starts fresh episodes.
                self.save({**self.state(), "env_state": None})
                note = f"saved the learner state of update {self.update_idx} to {path}"
            except Exception as save_exc:  # noqa: BLE001 - the env error is the one to report
                note = f"could not save the learner state ({type(save_exc).__name__}); the previous checkpoint stays"
            finally:
                self.global_step = failed_step
        elif self.update_idx == 0:
            note = "no update had finished, so there is no checkpoint"
        elif path.exists():
            note = f"the checkpoint of update {self.update_idx} in {path} is up to date"
        else:
            note = "no checkpoint could be written"
        error = EnvError(f"{error}; {note}")
        # On record for doctor/report; closing the logger and envs is left to run()'s exception path.
        try:
            self.logger.alert(self.global_step, "alert", "env_error", str(error))
        except Exception:  # noqa: BLE001 - the env error is the news, not a failed alert write
            pass
        return error

    def evaluate_gate(self) -> float:
        """Mean return of one deterministic episode in each of ``eval_episodes`` envs of a separate vector env."""
        cfg = self.config
        if self._eval_envs is None:
            self._eval_envs, self._eval_max_steps = make_eval_envs(cfg, self.custom_env)
        actor = self.acting.actor_head if self.fused else self.policy.actor  # no critic, no log-prob

        def failed(phase: str, exc: BaseException) -> EnvError:
            # The update just made is not saved yet (step 5 of the loop comes after the gate).
            return self._env_failed(phase, self.global_step, exc, unsaved=True, envs=self._eval_envs)

        return evaluate_first_episodes(self._eval_envs, self.policy, actor, self.collector.normalize,
                                       seed=cfg.seed + 7919 * (self.update_idx + 1), max_steps=self._eval_max_steps,
                                       env_id=cfg.env_id, global_step=self.global_step,
                                       action_bounds=self.collector.action_bounds, fail=failed)

    # ================================================================== 2. advantages
    def compute_advantages(self) -> tuple[Batch, torch.Tensor, torch.Tensor]:
        """GAE over the rollout, flattened to the batch of valid steps."""
        cfg, buf = self.config, self.buffer
        with torch.inference_mode():
            last_values = self.policy.value(self.collector.last_obs)
        next_values = buf.next_values(last_values)
        advantages, returns = gae(buf.rewards, buf.values, next_values, buf.terminated, buf.truncated,
                                  cfg.gamma, cfg.gae_lambda)
        B = cfg.batch_size
        # [T, N, ...] -> [B, ...] (every part of a Dict observation; a flat one: [B, obs_dim])
        flat = dict(obs=obs_map(lambda x: x.reshape(B, *x.shape[2:]), buf.obs),
                    actions=buf.actions.reshape(B, *buf.actions.shape[2:]),
                    logp_old=buf.logp.reshape(B), values_old=buf.values.reshape(B),
                    advantages=advantages.reshape(B), returns=returns.reshape(B))
        if buf.masks is not None:
            flat["action_mask"] = buf.masks.reshape(B, buf.masks.shape[-1])
        valid = buf.valid.reshape(B)
        if not bool(valid.all()):
            keep = valid.nonzero().squeeze(-1)
            flat = {k: obs_index(v, keep) for k, v in flat.items()}
        return Batch(**flat), advantages, returns

    def _obs_normalizer(self) -> Any:
        """The observation normalizer for this env's observations; ConfigError when none of it is a float vector."""
        space = self.envs.single_observation_space
        encoder = observation_encoder(space)
        if not encoder.normalizable:
            self.envs.close()  # the run ends before it starts
            raise ConfigError("normalize_obs", f"observation normalization applies to float vector observations; "
                              f"{space} is {encoder.what}: set normalize_obs = false")
        return make_obs_normalizer(encoder, self.device)

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
        from .objectives import approx_kl_k3

        policy = self.policy
        with torch.inference_mode():
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
        # Data-parallel: the episode and batch diagnostics over every rank's data ({} in one process).
        m.update(self.dist.diagnostics(episodes, batch.values_old, batch.returns, rewards, batch.advantages,
                                       nonfinite_env, m[S.ADVANTAGES_NONFINITE]))
        total = sum(self.perf.values()) or 1.0
        for phase in PERF_PHASES:
            m[S.perf_time(phase)] = self.perf[phase]
            m[S.perf_frac(phase)] = self.perf[phase] / total
        return m

    def _finish(self, wall: float, start_step: int) -> None:
        last = self.metrics[-10:]
        returns = [m[S.EPISODIC_RETURN] for m in last if not math.isnan(m[S.EPISODIC_RETURN])]
        lines = {
            "run dir": str(self.run_dir),
            "env steps": f"{self.global_step:,}",
            "final return (last 10 updates)": f"{np.mean(returns):.2f}" if returns else "no episode finished",
            "wall time": f"{wall:.1f} s",
            "SPS": f"{(self.global_step - start_step) / max(wall, 1e-9):,.0f}",
            "time split": ", ".join(f"{p} {self.perf[p]:.1f}s" for p in PERF_PHASES),
            "alerts": self.logger.alerts_overview(),
        }
        if self.dist.active:
            lines["ranks"] = (f"{self.dist.world_size} data-parallel ranks x {self.config.num_envs} envs (env steps "
                              "and SPS count every rank; time split: rank 0's)")
        if self.config.unsafe:
            lines["UNSAFE"] = "this run broke the trust-region guard rails (--unsafe)"
        if self._stop_requested:
            lines["stopped"] = f"interrupted; resume with: ppokit train --resume {self.run_dir}"
        if self._callback_stop is not None:
            lines["stopped"] = f"by callback {self._callback_stop} after update {self.update_idx}"
        if self._solved:
            lines["solved"] = (f"evaluation return {self.metrics[-1][S.EVAL_RETURN]:.1f} >= "
                               f"{self.config.eval_threshold} at update {self.update_idx}; stopped early")
        try:
            if self.metrics and self.dist.is_main:
                from .plots import plot_curves

                # Titled by plots.run_title: env id, algo, seed and run dir name ("UNSAFE run:" first if unsafe).
                plot_curves(self.run_dir / "metrics.csv", self.run_dir / "curves.png", alerts=self.logger.alerts)
        finally:
            try:
                self.logger.summary(lines)
                self.logger.close()
                self._close_envs()
            finally:
                self._claim.release()

    def _close_envs(self) -> None:
        """Close the training and evaluation envs; an env whose close() raises costs a warning, not the run."""
        for envs in (self.envs, self._eval_envs):
            if envs is None:
                continue
            try:
                envs.close()
            except Exception as exc:  # noqa: BLE001 - the run's files are written; nothing is lost
                import sys

                print(f"warning: env {self.config.env_id!r} raised in close(): {type(exc).__name__}: {exc}",
                      file=sys.stderr)

    def _note_interrupt(self) -> None:
        """Log the Ctrl-C alert once. Here, in the loop, never in the signal handler: the interrupted code may hold
        a sink's lock (TensorBoard's writer), and an alert written from the handler would wait on it forever."""
        if self._interrupt_noted:
            return
        self._interrupt_noted = True
        self.logger.alert(self.global_step, "warn", "interrupted",
                          f"Ctrl-C: finished update {self.update_idx}, saving a checkpoint and exiting "
                          "(press again to abort without saving)")

    def _abandon(self) -> None:
        """After an exception in the loop: flush what was logged, close the envs, release the run dir's lock."""
        try:
            try:
                self.logger.close()
            finally:
                self._close_envs()
        except Exception:
            pass  # the exception in flight is the one to report
        finally:
            self._claim.release()

    # ================================================================== checkpoints
    def state(self) -> dict[str, Any]:
        """The full train state in checkpoint-safe types."""
        from .agent import spaces_record
        from .envs.state import capture_env_state

        return {
            "config": self.config.to_dict(),
            "policy_spec": self.policy.spec(),
            "policy": self.policy.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "obs_norm": self.obs_norm.state_dict() if self.obs_norm is not None else None,
            "reward_scaler": self.reward_scaler.state_dict() if self.reward_scaler is not None else None,
            "rng": ckpt.rng_state(),
            "global_step": self.global_step,
            "update": self.update_idx,
            "kl_beta": self.kl_beta,
            "perf": dict(self.perf),
            "loop": self.collector.loop_state(),  # next_obs_raw, ep_return, ep_length, prev_done
            "env_state": capture_env_state(self.envs),
            # A custom env (factory or instance) cannot be rebuilt from its record: resume and eval need it again.
            "custom_env": self.custom_env.record() if self.custom_env is not None else None,
            # What the policy was built for, so that evaluating it elsewhere can name both sides of a mismatch
            # and acting needs no env to find its bounds.
            "spaces": spaces_record(self.envs.single_observation_space, self.envs.single_action_space),
        }

    def save(self, state: dict[str, Any] | None = None) -> Path:
        """Write ``state`` (default: the full train state) atomically into the run dir; a failed write raises
        CheckpointError and keeps the old file."""
        path = self.run_dir / CHECKPOINT_NAME
        # NaN/Inf is refused in the learner only: env buffers may hold what the env emitted (those steps are
        # skipped in training), and refusing them would lose the run at its next save.
        ckpt.save_checkpoint(path, self.state() if state is None else state, finite=ckpt.LEARNER_KEYS)
        self.callbacks.on_checkpoint(path)
        return path

    def _load_state(self, state: dict[str, Any]) -> None:
        from .agent import describe_policy_spec
        from .envs.state import restore_env_state

        path = self.run_dir / CHECKPOINT_NAME
        if "policy_spec" not in state:
            raise ckpt.CheckpointError(f"{path} cannot be resumed: it has no 'policy_spec' entry")
        saved_spec, spec = state["policy_spec"], self.policy.spec()
        if isinstance(saved_spec, dict):  # a spec without "type" (before the registry) is an ActorCritic's
            saved_spec = {"type": spec_type(saved_spec), **saved_spec}
        if saved_spec != spec:
            raise ckpt.CheckpointError(
                f"{path} holds a policy for {describe_policy_spec(saved_spec)}, but {self.config.env_id} with this "
                f"config needs one for {describe_policy_spec(spec)}; it cannot be resumed here")
        try:
            self.policy.load_state_dict(state["policy"])
            self.optimizer.load_state_dict(state["optimizer"])
            if self.obs_norm is not None and state.get("obs_norm") is not None:
                self.obs_norm.load_state_dict(state["obs_norm"])
            if self.reward_scaler is not None and state.get("reward_scaler") is not None:
                self.reward_scaler.load_state_dict(state["reward_scaler"])
            self.global_step = int(state["global_step"])
            self.update_idx = int(state["update"])
            self.kl_beta = float(state["kl_beta"])
            self.perf.update(state.get("perf", {}))
            loop = state["loop"]
            if restore_env_state(self.envs, state.get("env_state")):
                self.collector.load_loop_state(loop)
            ckpt.set_rng_state(state["rng"])
        except KeyError as exc:
            raise ckpt.CheckpointError(f"{path} cannot be resumed: it has no {exc.args[0]!r} entry") from exc
        except (TypeError, ValueError, RuntimeError, AttributeError, IndexError) as exc:
            raise ckpt.CheckpointError(f"{path} cannot be resumed: {ckpt.one_line(exc)}") from exc


def _adam_kwargs(device: torch.device) -> dict:
    # fused Adam runs the whole step as one kernel per dtype/device; it exists for CPU in torch >= 2.4.
    try:
        torch.optim.Adam([torch.zeros(1, device=device, requires_grad=True)], fused=True)
        return {"fused": True}
    except (RuntimeError, TypeError, ValueError):
        return {"foreach": True}


def _install_sigint(trainer: Trainer):
    """First Ctrl-C: finish the current update, save, exit cleanly. Second Ctrl-C: default behaviour."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum, frame):
        # Only a flag: the loop logs the alert and saves. Anything more (I/O, a lock) could deadlock on what the
        # interrupted code holds. The second Ctrl-C aborts; a checkpoint write it lands in leaves the old file.
        if trainer._stop_requested:
            raise KeyboardInterrupt
        trainer._stop_requested = True

    if getattr(trainer, "dist", distributed.LOCAL).active:
        # A data-parallel rank is stopped by SIGTERM (torchrun passes its own on, as Slurm and Kubernetes send it,
        # and kills ~30 s later): finish the update and save, as for Ctrl-C; every rank agrees to stop.
        trainer._old_sigterm = signal.signal(signal.SIGTERM, handler)
    return signal.signal(signal.SIGINT, handler)


def train(config: PPOConfig, run_dir: str | Path | None = None, console: Any = None,
          console_enabled: bool = True, overwrite: bool = False, env: Any = None, callbacks: Any = None,
          rollout: Any = None) -> Run:
    """Train PPO with ``config``; returns a ``Run`` with the run dir, per-update metrics and the policy.

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
    returning a ``rollout_source.RolloutSource``), e.g. remote rollout workers; the learner is unchanged.
    """
    return Trainer(config, run_dir=run_dir, console=console, console_enabled=console_enabled,
                   overwrite=overwrite, env=env, callbacks=callbacks, rollout=rollout).run()


def resume(run_dir: str | Path, total_timesteps: int | None = None, console: Any = None,
           console_enabled: bool = True, allow_import: tuple[str, ...] | list[str] = (), env: Any = None,
           callbacks: Any = None, rollout: Any = None) -> Run:
    """Continue the run in ``run_dir`` from its checkpoint (optionally to a new ``total_timesteps``).

    A stored env id of the form ``"module:Env-v0"`` is refused unless ``module`` is in ``allow_import``: the
    checkpoint alone never decides what code is imported. A run trained on a custom env (``train(env=factory)``)
    needs that env again as ``env``; ``env`` may also replace a stored id. A damaged, diverged or mismatched
    checkpoint raises ``CheckpointError``. ``callbacks`` and ``rollout`` as for ``train``.
    """
    from .agent import stored_config

    run_dir = Path(run_dir)
    path = run_dir / CHECKPOINT_NAME
    state = ckpt.load_checkpoint(path, require_finite=ckpt.LEARNER_KEYS)
    config = stored_config(state, path, allow_import, env=env)
    if total_timesteps is not None:
        config.total_timesteps = total_timesteps
    trainer = Trainer(config, run_dir=run_dir, console=console, console_enabled=console_enabled, resume_state=state,
                      env=env, callbacks=callbacks, rollout=rollout)
    return trainer.run()
