"""SB3-shaped callbacks (``BaseCallback`` and the ones SB3 ships that PPO users rely on), run by ppokit's per-update
callbacks (``ppokit.training.callbacks``).

ppokit calls its callbacks once per update, after it; ``Bridge`` turns that into SB3's sequence for the rollout the
update used: ``on_rollout_start``, ``on_step`` ``n_steps`` times (``n_calls`` and ``num_timesteps`` advance as SB3
counts them: +1 and +n_envs per call), ``on_rollout_end``. SB3 makes the ``on_step`` calls during the rollout,
with the policy before the update; here they come after it, with the updated policy, and ``locals`` holds no
per-step data (``rewards``, ``dones``, ``infos``). An ``_on_step`` returning False ends ``learn`` after this
update, with its checkpoint.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["BaseCallback", "CallbackList", "CheckpointCallback", "EvalCallback", "StopTrainingOnRewardThreshold",
           "EveryNTimesteps", "Bridge", "as_callback"]


class BaseCallback:
    """SB3's ``BaseCallback``: subclass it and override ``_on_step`` (return False to stop) and the other hooks."""

    def __init__(self, verbose: int = 0):
        self.verbose = verbose
        self.model: Any = None
        self.training_env: Any = None
        self.n_calls = 0
        self.num_timesteps = 0
        self.locals: dict[str, Any] = {}
        self.globals: dict[str, Any] = {}
        self.parent: BaseCallback | None = None

    def init_callback(self, model: Any) -> None:
        self.model = model
        self.training_env = model.get_env()
        self._init_callback()

    def _init_callback(self) -> None:
        pass

    def on_training_start(self, locals_: dict, globals_: dict) -> None:
        self.locals, self.globals = locals_, globals_
        self.num_timesteps = self.model.num_timesteps
        self._on_training_start()

    def _on_training_start(self) -> None:
        pass

    def on_rollout_start(self) -> None:
        self._on_rollout_start()

    def _on_rollout_start(self) -> None:
        pass

    def on_step(self) -> bool:
        self.n_calls += 1
        self.num_timesteps = self.model.num_timesteps
        return self._on_step()

    def _on_step(self) -> bool:
        return True

    def on_rollout_end(self) -> None:
        self._on_rollout_end()

    def _on_rollout_end(self) -> None:
        pass

    def on_training_end(self) -> None:
        self._on_training_end()

    def _on_training_end(self) -> None:
        pass

    def update_locals(self, locals_: dict) -> None:
        self.locals.update(locals_)


class CallbackList(BaseCallback):
    """Several callbacks run in order; ``on_step`` is False when any of them returned False."""

    def __init__(self, callbacks: list[BaseCallback]):
        super().__init__()
        self.callbacks = list(callbacks)

    def _init_callback(self) -> None:
        for cb in self.callbacks:
            cb.init_callback(self.model)
            cb.parent = self.parent

    def _on_training_start(self) -> None:
        for cb in self.callbacks:
            cb.on_training_start(self.locals, self.globals)

    def _on_rollout_start(self) -> None:
        for cb in self.callbacks:
            cb.on_rollout_start()

    def _on_step(self) -> bool:
        go = True
        for cb in self.callbacks:
            go = cb.on_step() and go  # every callback sees every step, as in SB3
        return go

    def _on_rollout_end(self) -> None:
        for cb in self.callbacks:
            cb.on_rollout_end()

    def _on_training_end(self) -> None:
        for cb in self.callbacks:
            cb.on_training_end()


class CheckpointCallback(BaseCallback):
    """Every ``save_freq`` calls, ``model.save(save_path/<name_prefix>_<num_timesteps>_steps.zip)``."""

    def __init__(self, save_freq: int, save_path: str, name_prefix: str = "rl_model", save_replay_buffer: bool = False,
                 save_vecnormalize: bool = False, verbose: int = 0):
        super().__init__(verbose)
        self.save_freq, self.save_path, self.name_prefix = save_freq, save_path, name_prefix
        # ppokit's checkpoint holds the normalizers' statistics: SB3's separate VecNormalize file is not needed.
        self.save_vecnormalize = save_vecnormalize

    def _init_callback(self) -> None:
        os.makedirs(self.save_path, exist_ok=True)

    def _on_step(self) -> bool:
        if self.n_calls % self.save_freq == 0:
            path = os.path.join(self.save_path, f"{self.name_prefix}_{self.num_timesteps}_steps.zip")
            self.model.save(path)
            if self.verbose >= 2:
                print(f"Saving model checkpoint to {path}")
        return True


class EvalCallback(BaseCallback):
    """Every ``eval_freq`` calls, ``n_eval_episodes`` episodes on ``eval_env``; keeps ``best_model.zip`` in
    ``best_model_save_path`` when the mean return is a new best, and ``evaluations.npz`` in ``log_path``."""

    def __init__(self, eval_env: Any, callback_on_new_best: BaseCallback | None = None,
                 callback_after_eval: BaseCallback | None = None, n_eval_episodes: int = 5, eval_freq: int = 10000,
                 log_path: str | None = None, best_model_save_path: str | None = None, deterministic: bool = True,
                 render: bool = False, verbose: int = 1, warn: bool = True):
        super().__init__(verbose)
        self.eval_env = eval_env
        self.callback_on_new_best, self.callback_after_eval = callback_on_new_best, callback_after_eval
        self.n_eval_episodes, self.eval_freq = n_eval_episodes, eval_freq
        self.deterministic, self.render = deterministic, render
        self.best_model_save_path = best_model_save_path
        self.log_path = os.path.join(log_path, "evaluations") if log_path is not None else None
        self.best_mean_reward, self.last_mean_reward = -np.inf, -np.inf
        self.evaluations_timesteps: list[int] = []
        self.evaluations_results: list[list[float]] = []
        self.evaluations_length: list[list[int]] = []

    def _init_callback(self) -> None:
        for cb in (self.callback_on_new_best, self.callback_after_eval):
            if cb is not None:
                cb.init_callback(self.model)
                cb.parent = self
        if self.best_model_save_path is not None:
            os.makedirs(self.best_model_save_path, exist_ok=True)

    def _on_step(self) -> bool:
        if self.eval_freq <= 0 or self.n_calls % self.eval_freq != 0:
            return True
        returns, lengths = evaluate_policy(self.model, self.eval_env, self.n_eval_episodes, self.deterministic)
        mean = float(np.mean(returns))
        self.last_mean_reward = mean
        if self.log_path is not None:
            self.evaluations_timesteps.append(self.num_timesteps)
            self.evaluations_results.append(returns)
            self.evaluations_length.append(lengths)
            Path(self.log_path).parent.mkdir(parents=True, exist_ok=True)
            np.savez(self.log_path, timesteps=self.evaluations_timesteps, results=self.evaluations_results,
                     ep_lengths=self.evaluations_length)
        if self.verbose >= 1:
            print(f"Eval num_timesteps={self.num_timesteps}, episode_reward={mean:.2f} +/- {np.std(returns):.2f}")
        go = True
        if mean > self.best_mean_reward:
            self.best_mean_reward = mean
            if self.best_model_save_path is not None:
                self.model.save(os.path.join(self.best_model_save_path, "best_model.zip"))
            if self.callback_on_new_best is not None:
                go = self.callback_on_new_best.on_step()
        if self.callback_after_eval is not None:
            go = self.callback_after_eval.on_step() and go
        return go


class StopTrainingOnRewardThreshold(BaseCallback):
    """For ``EvalCallback(callback_on_new_best=...)``: stop once the best mean return reaches ``reward_threshold``."""

    def __init__(self, reward_threshold: float, verbose: int = 0):
        super().__init__(verbose)
        self.reward_threshold = reward_threshold

    def _on_step(self) -> bool:
        return not (self.parent is not None and self.parent.best_mean_reward >= self.reward_threshold)


class EveryNTimesteps(BaseCallback):
    """Runs ``callback.on_step()`` every ``n_steps`` env steps."""

    def __init__(self, n_steps: int, callback: BaseCallback):
        super().__init__()
        self.n_steps, self.callback, self._last = n_steps, callback, 0

    def _init_callback(self) -> None:
        self.callback.init_callback(self.model)
        self.callback.parent = self

    def _on_step(self) -> bool:
        if self.num_timesteps - self._last >= self.n_steps:
            self._last = self.num_timesteps
            return self.callback.on_step()
        return True


def evaluate_policy(model: Any, env: Any, n_eval_episodes: int, deterministic: bool) -> tuple[list[float], list[int]]:
    """Returns and lengths of ``n_eval_episodes`` whole episodes of ``model.predict`` on ``env`` (a
    ``gymnasium.Env``, or a vector env with SB3's interface: its first episodes to finish)."""
    import gymnasium as gym

    returns: list[float] = []
    lengths: list[int] = []
    if isinstance(env, gym.Env):
        for _ in range(n_eval_episodes):
            obs, _ = env.reset()
            total, n, done = 0.0, 0, False
            while not done:
                action, _ = model.predict(obs, deterministic=deterministic)
                obs, reward, terminated, truncated, _ = env.step(action)
                total, n, done = total + float(reward), n + 1, terminated or truncated
            returns.append(total)
            lengths.append(n)
        return returns, lengths
    obs = env.reset()
    totals, counts = np.zeros(env.num_envs), np.zeros(env.num_envs, dtype=np.int64)
    while len(returns) < n_eval_episodes:
        action, _ = model.predict(obs, deterministic=deterministic)
        obs, rewards, dones, _ = env.step(action)
        totals += rewards
        counts += 1
        for i in np.flatnonzero(dones):
            if len(returns) < n_eval_episodes:
                returns.append(float(totals[i]))
                lengths.append(int(counts[i]))
            totals[i], counts[i] = 0.0, 0
    return returns, lengths


def as_callback(callback: Any) -> BaseCallback | None:
    """SB3's ``callback`` argument (None, a callback, a list of them) as one ``BaseCallback``."""
    if callback is None:
        return None
    if isinstance(callback, (list, tuple)):
        return CallbackList([as_callback(c) for c in callback])
    if not isinstance(callback, BaseCallback):
        raise TypeError(f"callback: expected a ppokit.sb3 BaseCallback or a list of them, got {type(callback).__name__} "
                        "(SB3's own callbacks: import them from ppokit.sb3 instead)")
    return callback


class Bridge:
    """A ppokit callback (``on_update``) that runs an SB3 callback's hooks for the update's rollout."""

    def __init__(self, callback: BaseCallback, model: Any, steps_per_rollout: int, n_envs: int):
        self.callback, self.model = callback, model
        self.steps, self.n_envs = steps_per_rollout, n_envs

    def on_update(self, info: Any) -> bool:
        model = self.model
        model._live(info.trainer)  # predict() and save() see the trainer's current policy
        start = info.global_step - self.steps * self.n_envs
        self.callback.on_rollout_start()
        go = True
        for k in range(1, self.steps + 1):
            model.num_timesteps = start + k * self.n_envs
            if not self.callback.on_step():
                go = False
                break
        model.num_timesteps = info.global_step
        if go:
            self.callback.on_rollout_end()
        return go
