"""``ppokit.sb3.PPO``: Stable-Baselines3's PPO class (constructor, ``learn``, ``predict``, ``save``/``load``) on
ppokit's trainer, so that an SB3 script runs by changing its import.

The constructor's arguments become one ``PPOConfig`` through ``translate.TABLE`` (docs/sb3.md renders it); each
``learn`` is a ppokit run (a run dir: ``tensorboard_log/<tb_log_name>_<i>``, else a temporary one) that starts from
the previous one's checkpoint. ``save`` writes that checkpoint as one file (ppokit's checkpoint format: loaded with
``torch.load(weights_only=True)``, so a file can never run code), which ``PPO.load``, ``ppokit.load`` and
``ppokit eval`` read.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from ppokit.config.ppo_config import ConfigError, PPOConfig
from ppokit.runtime import checkpoint as ckpt
from ppokit.runtime.logger import ConsoleSink
from ppokit.sb3.callbacks import Bridge, as_callback
from ppokit.sb3.translate import TABLE, SB3Error, sb3_name, translate
from ppokit.sb3.vec_env import TrainEnv, make_vec_env, train_env

__all__ = ["PPO", "RecurrentPPO", "POLICIES", "RECURRENT_POLICIES"]

# SB3's policy names and the observation spaces each serves (ppokit picks its encoder from the space itself).
POLICIES = {"MlpPolicy": "a flat Box, Discrete or MultiDiscrete", "CnnPolicy": "an image Box (H, W, C)",
            "MultiInputPolicy": "a Dict"}
# sb3-contrib's RecurrentPPO names: the same encoders, then an LSTM core (ppokit's recurrent = "lstm").
RECURRENT_POLICIES = {"MlpLstmPolicy": "MlpPolicy", "CnnLstmPolicy": "CnnPolicy",
                      "MultiInputLstmPolicy": "MultiInputPolicy"}


class PPO:
    """SB3's ``PPO(policy, env, ...)``; the arguments are SB3's, with SB3's defaults (docs/sb3.md: how each maps
    to ppokit, and what is refused)."""

    _recurrent = False  # RecurrentPPO: an LSTM policy

    def __init__(self, policy: str, env: Any, learning_rate: Any = 3e-4, n_steps: int = 2048, batch_size: int = 64,
                 n_epochs: int = 10, gamma: float = 0.99, gae_lambda: float = 0.95, clip_range: Any = 0.2,
                 clip_range_vf: Any = None, normalize_advantage: bool = True, ent_coef: float = 0.0,
                 vf_coef: float = 0.5, max_grad_norm: float = 0.5, use_sde: bool = False, sde_sample_freq: int = -1,
                 rollout_buffer_class: Any = None, rollout_buffer_kwargs: Any = None, target_kl: float | None = None,
                 stats_window_size: int = 100, tensorboard_log: str | None = None, policy_kwargs: dict | None = None,
                 verbose: int = 0, seed: int | None = None, device: Any = "auto", _init_setup_model: bool = True):
        given = dict(locals())
        kwargs = {row.sb3: given[row.sb3] for row in TABLE}
        self._env = train_env(env)
        fields = {**translate(kwargs, self._env.n_envs, recurrent=self._recurrent), **self._env.fields}
        fields.pop("tensorboard", None)
        self.config = _config(fields, tensorboard=tensorboard_log is not None)
        self.policy_name = policy
        self.verbose, self.tensorboard_log, self.seed = verbose, tensorboard_log, self.config.seed
        self.n_steps, self.batch_size, self.n_epochs, self.n_envs = n_steps, batch_size, n_epochs, self._env.n_envs
        self.num_timesteps = 0
        obs_space, act_space = _spaces(self._env)
        _check_policy(policy, obs_space, self._recurrent)
        self.observation_space, self.action_space = obs_space, act_space
        self._setup(obs_space, act_space)

    # ------------------------------------------------------------------ state
    def _setup(self, obs_space: Any, act_space: Any) -> None:
        from ppokit.core.seeding import seed_everything
        from ppokit.policies import config_policy

        cfg = self.config
        # As the trainer does before it builds its policy, so a model's first learn starts from these weights.
        seed_everything(cfg.seed)
        policy = config_policy(obs_space, act_space, cfg)  # the MLP actor-critic, or the recurrent one
        self._state: dict | None = None  # the last learn's checkpoint (a loaded file's)
        self._trainer: Any = None  # while learn runs
        self._run_dir: Path | None = None
        self._tmp: Any = None
        self._from_file = False
        self._set_agent(policy, None, act_space)

    def _set_agent(self, policy: Any, obs_norm: Any, act_space: Any) -> None:
        from ppokit.training.agent import Agent

        low = high = None
        if hasattr(act_space, "low") and hasattr(act_space, "high"):
            low, high = np.asarray(act_space.low), np.asarray(act_space.high)
        training = policy.training
        self._agent = Agent(policy, self.config, copy.deepcopy(obs_norm), low, high, env_id=self.config.env_id)
        policy.train(training)
        self.policy = policy

    def _live(self, trainer: Any) -> None:
        """During learn (the callbacks): act and save with the trainer's current policy and statistics."""
        self._trainer = trainer
        self._set_agent(trainer.policy, trainer.obs_norm, trainer.envs.single_action_space)

    # ------------------------------------------------------------------ SB3's methods
    def learn(self, total_timesteps: int, callback: Any = None, log_interval: int = 1, tb_log_name: str = "PPO",
              reset_num_timesteps: bool = True, progress_bar: bool = False) -> "PPO":
        """Train for ``total_timesteps`` more env steps (from 0 when ``reset_num_timesteps``, as SB3 counts them:
        whole rollouts until ``num_timesteps >= total``); ``callback``: ``ppokit.sb3`` callbacks."""
        from ppokit.training.trainer import Trainer

        if self._env is None:
            self._env = self._stored_env()
        cb = as_callback(callback)
        start = 0 if reset_num_timesteps else self.num_timesteps
        batch = self.config.batch_size
        end = -(-(start + int(total_timesteps)) // batch) * batch  # SB3 collects whole rollouts past the total
        cfg = dataclasses.replace(self.config, total_timesteps=max(end, batch), log_every=max(1, int(log_interval)))
        resume, factory = None, None
        if self._state is not None and "optimizer" in self._state:
            resume = self._state
            if reset_num_timesteps:
                resume = {**resume, "global_step": 0, "update": 0, "perf": {}}
        elif self._from_file:  # a file saved before any learn: its weights, a fresh optimizer
            policy = self._agent.policy
            factory = lambda obs_space, act_space, config: policy.train()
        run_dir = self._next_run_dir(tb_log_name, reset_num_timesteps or resume is None)
        self.num_timesteps = start
        if cb is not None:
            cb.init_callback(self)
            cb.on_training_start(locals(), globals())
        bridge = [Bridge(cb, self, cfg.num_steps, cfg.num_envs)] if cb is not None else None
        progress = ConsoleSink.PROGRESS
        ConsoleSink.PROGRESS = progress or progress_bar  # a bar with an ETA on any terminal width
        try:
            trainer = Trainer(cfg, run_dir=run_dir, console_enabled=self.verbose >= 1 or progress_bar,
                              resume_state=resume, env=self._env.env, callbacks=bridge, policy=factory)
            run = trainer.run()
        finally:
            self._trainer = None
            ConsoleSink.PROGRESS = progress
        if cb is not None:
            cb.on_training_end()
        self._state = ckpt.load_checkpoint(run.checkpoint)
        self._run_dir, self.num_timesteps = run.run_dir, run.global_step
        self._set_agent(trainer.policy, trainer.obs_norm, trainer.envs.single_action_space)
        self._from_file = False
        return self

    def predict(self, observation: Any, state: Any = None, episode_start: Any = None,
                deterministic: bool = False) -> tuple[np.ndarray, Any]:
        """``(action, state)`` for one observation or a batch, as SB3's ``predict`` (observation normalization
        applied; continuous actions clipped to the bounds)."""
        return self._agent.predict(observation, state, episode_start, deterministic=deterministic)

    def save(self, path: str | Path, exclude: Any = None, include: Any = None) -> None:
        """Write the model as one file (``.zip`` added when ``path`` has no suffix, as SB3 does)."""
        if exclude is not None or include is not None:
            raise SB3Error("save: exclude/include are not supported; ppokit saves the whole model")
        path = _zip_path(path)
        if self._trainer is not None:
            state = self._trainer.state()
        elif self._state is not None:
            state = {k: v for k, v in self._state.items() if k not in ckpt._RESERVED}
        else:
            state = self._untrained_state()
        ckpt.save_checkpoint(path, state, finite=ckpt.LEARNER_KEYS, bounded=ckpt.BOUNDED_KEYS)

    @classmethod
    def load(cls, path: str | Path, env: Any = None, device: Any = "auto", custom_objects: Any = None,
             print_system_info: bool = False, force_reset: bool = True, **kwargs: Any) -> "PPO":
        """A model from ``save``'s file (or any ppokit checkpoint); ``env``: the env to continue learning on."""
        from ppokit.training.agent import load as load_agent

        if kwargs or custom_objects:
            raise SB3Error(f"PPO.load: overriding {', '.join(sorted({*kwargs, *(custom_objects or {})}))} is not "
                           "supported; load, then build a new PPO with the settings")
        path = Path(path)
        if not path.exists() and path.suffix == "" and _zip_path(path).exists():
            path = _zip_path(path)
        given = None if env is None else train_env(env)
        dev = "cuda" if str(device) == "auto" and _cuda() else ("cpu" if str(device) == "auto" else str(device))
        agent = load_agent(path, device=dev, env=None if given is None else given.env)
        state = ckpt.load_checkpoint(path, require_finite=("policy", "obs_norm"), require_bounded=ckpt.BOUNDED_KEYS)
        self = cls.__new__(cls)
        self.config = dataclasses.replace(agent.config, device=dev)
        if given is not None:
            self.config = dataclasses.replace(self.config, **{k: v for k, v in given.fields.items()
                                                              if k in ("env_id", "env_kwargs", "vector_mode")})
        self._env = given
        self.policy_name, self.verbose, self.tensorboard_log = None, 0, None
        self.seed, self.n_envs = self.config.seed, self.config.num_envs
        self.n_steps, self.n_epochs = self.config.num_steps, self.config.update_epochs
        self.batch_size = self.config.minibatch_size
        self.num_timesteps = int(state.get("global_step", 0))
        self._trainer, self._run_dir, self._tmp = None, None, None
        self._state, self._from_file = state, True
        self._agent, self.policy = agent, agent.policy
        self.observation_space = self.action_space = None
        if given is not None:
            self.observation_space, self.action_space = _spaces(given)
        return self

    def get_env(self) -> Any:
        """The vector env (SB3's interface) this model learns on; None for a model loaded without one."""
        if self._env is None:
            return None
        if self._env.vec is None:
            cfg = self.config
            self._env.vec = make_vec_env(cfg.env_id, cfg.num_envs, env_kwargs=dict(cfg.env_kwargs))
        return self._env.vec

    def set_env(self, env: Any, force_reset: bool = True) -> None:
        given = train_env(env)
        if given.n_envs != self.config.num_envs:
            raise SB3Error(f"set_env: the env has {given.n_envs} envs, the model was built for {self.config.num_envs} "
                           "(n_steps * n_envs fixes the minibatches)")
        self._env = given
        self.config = dataclasses.replace(self.config, **{k: v for k, v in given.fields.items() if k != "num_envs"})

    def get_parameters(self) -> dict:
        return {"policy": self.policy.state_dict()}

    # ------------------------------------------------------------------ helpers
    def _stored_env(self) -> TrainEnv:
        if self._state is not None and self._state.get("custom_env") is not None:
            raise SB3Error("learn: this model was trained on an env object, which a file cannot hold; load it with "
                           "PPO.load(path, env=...)")
        cfg = self.config
        return TrainEnv(cfg.env_id, {"num_envs": cfg.num_envs})

    def _next_run_dir(self, name: str, new: bool) -> Path:
        if not new and self._run_dir is not None:
            return self._run_dir
        if self.tensorboard_log is not None:
            base = Path(self.tensorboard_log)
        else:
            if self._tmp is None:
                self._tmp = tempfile.TemporaryDirectory(prefix="ppokit-sb3-")
            base = Path(self._tmp.name)
        # SB3's rule (common/utils.py get_latest_run_id): one more than the highest <name>_<i> there.
        ids = [int(m.group(1)) for p in base.glob(f"{name}_*") if (m := re.fullmatch(rf"{re.escape(name)}_(\d+)", p.name))]
        return base / f"{name}_{max(ids, default=0) + 1}"

    def _untrained_state(self) -> dict:
        from ppokit.training.agent import spaces_record

        return {"config": self.config.to_dict(), "policy_spec": self.policy.spec(),
                "policy": self.policy.state_dict(), "obs_norm": None,
                "spaces": spaces_record(self.observation_space, self.action_space)}


def _config(fields: dict, tensorboard: bool) -> PPOConfig:
    """The validated PPOConfig of translated ``fields``; a ConfigError names the SB3 argument."""
    try:
        return PPOConfig.from_dict({**fields, "tensorboard": tensorboard}).validate()
    except ConfigError as exc:
        text = "; ".join(f"{_named(name)}: {why}" for name, why in exc.problems.items())
        raise SB3Error(text) from None


def _named(field: str) -> str:
    name = sb3_name(field)
    return f"{name} (ppokit {field})" if name and name != field else field


def _spaces(env: TrainEnv) -> tuple[Any, Any]:
    vec = env.vec
    if vec is not None:
        return vec.observation_space, vec.action_space
    import gymnasium as gym

    probe = gym.make(env.fields["env_id"], **env.fields.get("env_kwargs", {}))
    try:
        return probe.observation_space, probe.action_space
    finally:
        probe.close()


def _check_policy(policy: Any, obs_space: Any, recurrent: bool = False) -> None:
    import gymnasium as gym

    names = RECURRENT_POLICIES if recurrent else POLICIES
    if not isinstance(policy, str) or policy not in names:
        shown = policy if isinstance(policy, str) else getattr(policy, "__name__", type(policy).__name__)
        other = "PPO" if recurrent else "RecurrentPPO"
        raise SB3Error(f"policy={shown!r}: {'RecurrentPPO' if recurrent else 'PPO'} has {', '.join(names)} "
                       f"(ppokit.sb3.{other} has {', '.join(POLICIES if recurrent else RECURRENT_POLICIES)})")
    if recurrent:
        policy = RECURRENT_POLICIES[policy]
    image = isinstance(obs_space, gym.spaces.Box) and len(obs_space.shape) == 3
    kind = ("MultiInputPolicy" if isinstance(obs_space, (gym.spaces.Dict, gym.spaces.Tuple))
            else "CnnPolicy" if image else "MlpPolicy")
    if policy != kind:
        raise SB3Error(f"policy={policy!r}: the observation space {obs_space} needs {kind} ({kind} serves "
                       f"{POLICIES[kind]} observations)")


def _zip_path(path: str | Path) -> Path:
    path = Path(path)
    return path if path.suffix else path.with_suffix(".zip")


def _cuda() -> bool:
    import torch

    return torch.cuda.is_available()


class RecurrentPPO(PPO):
    """sb3-contrib's ``RecurrentPPO(policy, env, ...)``: PPO with an LSTM policy (``MlpLstmPolicy``,
    ``CnnLstmPolicy``, ``MultiInputLstmPolicy``; ppokit's ``recurrent = "lstm"``), with sb3-contrib's defaults
    (128 steps, minibatches of 128) and its ``policy_kwargs`` (``lstm_hidden_size``, ``shared_lstm``); ``predict``
    takes and returns the LSTM state as sb3-contrib's does (``state``, ``episode_start``)."""

    _recurrent = True

    def __init__(self, policy: str, env: Any, learning_rate: Any = 3e-4, n_steps: int = 128, batch_size: int = 128,
                 n_epochs: int = 10, **kwargs: Any):
        super().__init__(policy, env, learning_rate=learning_rate, n_steps=n_steps, batch_size=batch_size,
                         n_epochs=n_epochs, **kwargs)
