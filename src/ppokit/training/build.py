"""A config becomes the parts a run is made of: ``build(config)`` -> ``Parts`` (envs, policy, optimizer and update
choice, acting kernel, normalizers, monitor, rollout source), then ``claim_run_dir`` and ``make_logger`` for the
run dir and its loggers. ``trainer.Trainer`` assembles them and runs the loop.

Each part is one small function. A failure after the envs exist closes them (bounded by the watchdog) before the
error goes on, so that a refused run leaves no env process behind.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from ppokit.config.ppo_config import ConfigError, PPOConfig
from ppokit.config.resources import check_memory, layout_bytes, usable_threads
from ppokit.core.seeding import seed_everything
from ppokit.diagnostics.monitor import Monitor, episode_time_limit
from ppokit.envs import check_env_id, check_spaces, get_backend, resolve_env
from ppokit.envs.encoders import observation_encoder
from ppokit.envs.masks import action_masks_available
from ppokit.envs.run_envs import make_train_envs
from ppokit.envs.watchdog import EnvWatchdog, close_vector_env
from ppokit.kernels.acting import ActingKernel
from ppokit.kernels.flat_adam import FlatAdam
from ppokit.kernels.mlp_backward import supports as fused_supports
from ppokit.kernels.recurrent_acting import RecurrentActingKernel, recurrent_kernel_supports
from ppokit.policies import Policy, config_policy
from ppokit.policies.build import policy_parameters
from ppokit.rollout.collector import Collector
from ppokit.rollout.normalize import RewardScaler, make_obs_normalizer
from ppokit.runtime import distributed

__all__ = ["Parts", "build", "claim_run_dir", "make_logger", "default_run_dir"]


@dataclass
class Parts:
    """What ``build`` makes; each field becomes the ``Trainer`` attribute of the same name."""

    config: PPOConfig  # validated; a custom env's record name as env_id
    custom_env: Any  # envs.CustomEnv (a factory or instance passed as env=) or None
    dist: Any  # this rank's place in a torchrun job (distributed.current), the identity in one process
    device: torch.device
    envs: Any  # the training vector env, un-reset
    action_kind: str
    watchdog: EnvWatchdog
    policy: Policy
    obs_dim: int
    masked: bool  # the env sends action masks
    fused: bool  # the fused update (kernels/) instead of autograd
    optimizer: Any  # FlatAdam (fused) or torch.optim.Adam
    acting: ActingKernel | None  # the fused path's acting kernel; None: the eager policy acts
    obs_norm: Any
    reward_scaler: RewardScaler | None
    monitor: Monitor
    perf: dict[str, float]  # seconds per phase (core.schema.PERF_PHASES), shared with the collector
    collector: Any  # the rollout source (rollout.source.RolloutSource)


def build(config: PPOConfig, *, env: Any = None, policy: Any = None, rollout: Any = None,
          stop_requested: Callable[[], bool] = lambda: False, rollout_failed: Any = None) -> Parts:
    """The parts of a run of ``config``. ``env``, ``policy``, ``rollout`` as for ``trainer.train``;
    ``stop_requested`` ends a hung env call's wait (the watchdog's), ``rollout_failed`` is the collector's ``fail``."""
    from ppokit.core.schema import PERF_PHASES

    config, custom_env = resolve_env(env, config)
    cfg = config.validate()
    require_extras(cfg)
    dist, device = placement(cfg)
    if cfg.actors:
        rollout = actor_rollout(cfg, dist, custom_env, policy, rollout)
    if not get_backend(cfg.vector_mode).own_task_ids and custom_env is None:  # e.g. envpool checks its own
        check_env_id(cfg.env_id)
    seed_everything(dist.seed(cfg.seed))

    envs = make_train_envs(cfg, custom_env)
    # Every reset()/step()/close() bounded by env_timeout, and by a grace period after Ctrl-C (envs.watchdog).
    watchdog = EnvWatchdog(cfg.env_timeout, stop_requested)
    with closed_on_failure(envs, watchdog):
        action_kind = check_spaces(envs)
        check_real_memory(cfg, envs)
        pi = make_policy(cfg, envs, device, policy)
        with watchdog.running():  # masks sent only in info: seen at a first reset with the run's env seed
            masked = pi.kind != "continuous" and action_masks_available(
                envs, dist.env_seed(cfg.seed, cfg.num_envs), cfg.env_id, watchdog)
        # An env with action masks trains by autograd: the fused kernel (and its acting kernel) has no masks.
        fused = cfg.fused_update and fused_supports(pi, cfg.algo) and not masked
        optimizer = make_optimizer(cfg, pi, fused, device)
        # Acting (rollouts, the evaluation gate): the acting kernel where the fused update applies (the same
        # network on cached weights, the same random draws), a recurrent policy's cell kernel (fused_update off:
        # the eager reference), else the eager policy.
        acting = ActingKernel(pi, optimizer) if fused else RecurrentActingKernel(pi, optimizer) \
            if cfg.fused_update and recurrent_kernel_supports(pi) else None
        # Normalization statistics (saved in checkpoints, frozen at evaluation).
        obs_norm = make_obs_norm(envs.single_observation_space, device) if cfg.normalize_obs else None
        reward_scaler = RewardScaler(cfg.num_envs, cfg.gamma, device=device) if cfg.normalize_reward else None
        monitor = Monitor(action_kind=action_kind, action_dim=pi.action_dims[0],
                          time_limit=episode_time_limit(cfg.env_id, cfg.env_kwargs),
                          monitor_kl=cfg.monitor_kl, monitor_clipfrac=cfg.monitor_clipfrac)
        perf = dict.fromkeys(PERF_PHASES, 0.0)
        # The rollout: env stepping, both autoreset modes, NaN/Inf, episode statistics, truncation bootstrap;
        # it fills its buffer (``[T, N, ...]`` tensors on the device) with pi_old's steps.
        # ``rollout``: another rollout backend (``rollout.source.RolloutSource``), built with Collector's arguments.
        collector = (rollout or Collector)(envs, pi, acting or pi, num_steps=cfg.num_steps, device=device,
                                           env_id=cfg.env_id, obs_norm=obs_norm, reward_scaler=reward_scaler,
                                           perf=perf, fail=rollout_failed)
        collector.watchdog = watchdog
    return Parts(cfg, custom_env, dist, device, envs, action_kind, watchdog, pi, pi.obs_dim, masked, fused,
                 optimizer, acting, obs_norm, reward_scaler, monitor, perf, collector)


def actor_rollout(cfg: PPOConfig, dist: Any, custom_env: Any, policy: Any, rollout: Any) -> Any:
    """The rollout backend of ``cfg.actors`` workers (``rollout/actors.py``); what they cannot do yet is refused."""
    from ppokit.rollout.actors import actor_backend

    for given, what in ((dist.active, "data-parallel ranks (--nproc)"), (custom_env is not None, "a custom env "
                        "object or factory (a worker rebuilds its envs from env_id)"), (policy is not None,
                        "a policy factory (a worker rebuilds the default policy)"),
                        (rollout is not None, "another rollout backend")):
        if given:
            raise ConfigError("actors", f"is not supported with {what} yet: set actors = 0")
    if cfg.ray_address is not None:
        from ppokit.rollout.ray_actors import ray_backend

        return ray_backend(cfg)
    return actor_backend(cfg)


@contextlib.contextmanager
def closed_on_failure(envs: Any, watchdog: Any) -> Iterator[None]:
    """Close ``envs`` (a hung async env's workers killed, not waited on) if the block raises; the block's error is
    the one that goes on."""
    try:
        yield
    except BaseException:
        with contextlib.suppress(Exception):
            close_vector_env(envs, watchdog)
        raise


def require_extras(cfg: PPOConfig) -> None:
    """One line naming the missing extra (wandb for ``track``, video for ``capture_video``), before anything is
    built."""
    if cfg.track:
        from ppokit.runtime.wandb_sink import require_wandb

        require_wandb()
    if cfg.capture_video:
        from ppokit.envs.video import require_video

        require_video()


def placement(cfg: PPOConfig) -> tuple[Any, torch.device]:
    """This rank's place in the job (rank 0 alone writes the run dir; the identity in one process) and its device;
    sets torch's thread count."""
    dist = distributed.current(cfg.dist_timeout, cfg.device)
    # Per process, so per rank: torchrun sets OMP_NUM_THREADS only when it starts several ranks per node.
    torch.set_num_threads(usable_threads(cfg.torch_threads))  # capped at the core count, with a warning
    device = torch.device(dist.device(cfg.device))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device", "CUDA was requested but torch.cuda.is_available() is False; use --device cpu")
    return dist, device


def check_real_memory(cfg: PPOConfig, envs: Any) -> None:
    """``validate()`` assumed one float per observation; now the real sizes are known, before anything big."""
    obs_space, act_space = envs.single_observation_space, envs.single_action_space
    encoder = observation_encoder(obs_space)
    check_memory(cfg, encoder.flat_dim, layout_bytes(encoder.layout()),  # images are stored as bytes
                 policy_parameters(obs_space, act_space, cfg.hidden_sizes, cfg.activation, cfg))


def make_policy(cfg: PPOConfig, envs: Any, device: torch.device, factory: Any = None) -> Policy:
    """pi_theta on ``device``: ``factory(observation space, action space, config)`` (e.g. a registered type), else
    the default policy (the one the memory check counted)."""
    obs_space, act_space = envs.single_observation_space, envs.single_action_space
    policy = (config_policy(obs_space, act_space, cfg) if factory is None  # recurrent: policies/recurrent.py
              else factory(obs_space, act_space, cfg))
    if policy.initial_state(1) is not None and not hasattr(policy, "evaluate_sequence"):
        raise ConfigError("policy", f"{type(policy).__name__} is stateful (initial_state is not None) but has no "
                          "evaluate_sequence; a stateful policy trains on sequences (policies.StatefulPolicy)")
    return policy.to(device)


def make_optimizer(cfg: PPOConfig, policy: Policy, fused: bool, device: torch.device) -> Any:
    """FlatAdam (one flat parameter buffer, for the fused update's hand-derived backward) or torch's Adam."""
    if fused:
        return FlatAdam(policy, lr=cfg.learning_rate, eps=1e-5)
    return torch.optim.Adam(policy.parameters(), lr=cfg.learning_rate, eps=1e-5, **_adam_kwargs(device))


def _adam_kwargs(device: torch.device) -> dict:
    # fused Adam runs the whole step as one kernel per dtype/device; it exists for CPU in torch >= 2.4.
    try:
        torch.optim.Adam([torch.zeros(1, device=device, requires_grad=True)], fused=True)
        return {"fused": True}
    except (RuntimeError, TypeError, ValueError):
        return {"foreach": True}


def make_obs_norm(space: Any, device: torch.device) -> Any:
    """The observation normalizer for ``space``: it standardizes the float vector parts (images and one-hot codes
    are left alone); ConfigError when none of it is a float vector."""
    encoder = observation_encoder(space)
    if not encoder.normalizable:
        raise ConfigError("normalize_obs", f"observation normalization applies to float vector observations; "
                          f"{space} is {encoder.what}: set normalize_obs = false")
    return make_obs_normalizer(encoder, device)


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


def claim_run_dir(parts: Parts, run_dir: str | Path | None, resume: bool, overwrite: bool) -> tuple[Path, Any]:
    """``(run dir, claim)``: claimed before anything is written to it (locked against a second process, refused if
    it holds another run unless ``overwrite``, cleared of a killed checkpoint write's temp files); a rank other
    than 0 gets a private scratch dir. The envs are closed if the claim is refused."""
    from ppokit.runtime import rundir

    cfg, dist = parts.config, parts.dist
    path = Path(run_dir or cfg.run_dir or default_run_dir(cfg)) if dist.is_main else dist.scratch_dir()
    with closed_on_failure(parts.envs, parts.watchdog):
        return path, rundir.claim(path, resume=resume and dist.is_main, overwrite=overwrite)


def write_run_files(cfg: PPOConfig, run_dir: Path) -> None:
    """``config.toml`` and, for an ``--unsafe`` run, ``UNSAFE`` naming the guard rails it breaks."""
    cfg.save_toml(run_dir / "config.toml")
    if cfg.unsafe:
        (run_dir / "UNSAFE").write_text(
            "This run was started with --unsafe; it breaks these guard rails:\n"
            + "".join(f"- {n}: {r}\n" for n, r in cfg.guard_rail_violations()))


def make_logger(parts: Parts, run_dir: Path, end_step: int, *, console: Any, console_enabled: bool,
                resume_step: int | None) -> Any:
    """The metrics logger (CSV, TensorBoard on rank 0, the console, W&B under ``track`` on rank 0); its bar ends
    at ``end_step``, the last update's step (which total_timesteps need not be a multiple of)."""
    from ppokit.runtime.logger import MetricsLogger

    cfg, dist = parts.config, parts.dist
    sinks = []
    if cfg.track and dist.is_main:
        from ppokit.runtime.wandb_sink import WandbSink

        sinks.append(WandbSink(run_dir, cfg.to_dict(), cfg.wandb_project, cfg.wandb_entity))
    return MetricsLogger(run_dir, end_step, log_every=cfg.log_every, tensorboard=cfg.tensorboard and dist.is_main,
                         console=console_enabled and dist.is_main, console_obj=console,
                         hparams=cfg.to_dict() if resume_step is None else None, resume_step=resume_step,
                         sinks=sinks)
