"""The env-stepping loop: a vector env stepped with a policy, the one place that decides what a step means.

``EnvLoop`` is what the rollout (``collector.Collector``), the evaluation gate (``evaluate_first_episodes``) and
``Agent.evaluate`` step their envs with; the one-env rollout (``one_env.py``) runs the same decisions on scalars
(``one_env_step``, beside the vector ones here). What it decides:

* both Gymnasium autoreset modes: under NEXT_STEP the step after an episode end only resets that env and is no
  transition (``valid`` False); under SAME_STEP every step is one (a truncation's bootstrap is the rollout's);
* NaN/Inf from the env: counted (``nonfinite``), zeroed, no transition, kept out of the statistics;
* the env output checks of ``envs.errors``, run in full only when a cheap shape/dtype test fails;
* action masks, when the env provides them (``envs.masks``): read after every reset and step;
* the episode statistics on raw rewards over the valid steps (an episode counts when it ends on a valid step);
* the policy's state (``policies.Policy``): ``policy.initial_state(num_envs)`` after a reset, passed to each act
  with ``episode_start`` (True where the observation is an episode's first: the previous step's done flags under
  SAME_STEP, the flags of the step before it under NEXT_STEP, where the step between only resets).

What differs between its users are two callables given to ``run``: ``act(t)`` returns the env's actions (pi_old's
sample written into the buffer, a deterministic action, ``Agent.predict``), ``record(t, step)`` takes the step's
results (the buffer writes, or counting each env's first episode) and says whether to go on.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from ppokit.envs.encoders import observation_encoder
from ppokit.envs.errors import EnvError, batch_ok, check_obs_batch, check_step_batch
from ppokit.envs.masks import action_masks_available, read_action_masks
from ppokit.envs.watchdog import NO_WATCHDOG, EnvTimeout

__all__ = ["EnvLoop", "Step", "one_env_step"]


@dataclass
class Step:
    """What one step of every env returned, as ``EnvLoop.step`` decided it (``[N]`` arrays, obs encoded)."""

    obs: Any  # the next observation, encoded, non-finite values zeroed
    reward: np.ndarray  # float64 raw rewards, non-finite ones zeroed
    terminated: np.ndarray
    truncated: np.ndarray
    done: np.ndarray
    valid: np.ndarray  # a transition (not a NEXT_STEP reset step, nothing non-finite)
    bad: np.ndarray  # NaN/Inf in the observation or reward
    info: Any
    final_returns: np.ndarray | None  # where ``done``: the return of the episode that ended here (else None:
    final_lengths: np.ndarray | None  # no episode ended, or ``EnvLoop.keep_final_returns`` is off); its length


class EnvLoop:
    """``envs`` stepped with ``policy``, and the per-env state carried from one step (and rollout) to the next.

    ``fail(phase, step, exc, detail)`` builds the error an env failure raises (``step``: the env steps so far);
    ``phase_prefix`` names the loop in those phases (``"evaluation "``). ``masked``: whether the env sends action
    masks, when the caller has decided it (default: ``action_masks_available``).
    """

    # What bounds each reset()/step() (envs.watchdog; the trainer sets its own): nothing, by default.
    watchdog: Any = NO_WATCHDOG

    # Whether ``Step.final_returns`` is filled (the evaluations read it; a rollout needs no copy per episode end).
    keep_final_returns = False

    def __init__(self, envs: Any, policy: Any, *, env_id: str, fail: Callable[..., BaseException],
                 masked: bool | None = None, phase_prefix: str = ""):
        import gymnasium as gym

        from ppokit.envs.factory import autoreset_mode

        self.envs, self.policy, self.env_id, self.num_envs = envs, policy, env_id, envs.num_envs
        self.loop_fail = fail
        self.step_phase = f"{phase_prefix}step()"
        # Observations enter through the space's encoder (a Box: the plain float32 flatten; Discrete: one-hot;
        # an image: uint8 CxHxW; Dict/Tuple: a dict of those).
        self.encoder = observation_encoder(envs.single_observation_space)
        # Gymnasium's autoreset mode decides which steps are transitions and where a truncation bootstraps from.
        self.same_step = autoreset_mode(envs) == gym.vector.AutoresetMode.SAME_STEP
        self.action_bounds: tuple[np.ndarray, np.ndarray] | None = None  # (low, high) of a Box action space
        if policy.kind == "continuous":
            space = envs.single_action_space
            self.action_bounds = (np.asarray(space.low, dtype=np.float32), np.asarray(space.high, dtype=np.float32))
        # Masks only for categorical heads.
        self.masked = policy.kind != "continuous" and (action_masks_available(envs) if masked is None else masked)
        self.mask_dim = sum(policy.action_dims) if self.masked else None
        self.next_mask: np.ndarray | None = None  # [N, n_logits] bool: the actions allowed at next_obs_raw
        N = self.num_envs
        self.next_obs_raw: Any = None  # [N, obs_dim] float32, encoded (Discrete: one-hot; image: uint8; Dict: dict)
        self.ep_return = np.zeros(N, dtype=np.float64)  # raw, unscaled rewards
        self.ep_length = np.zeros(N, dtype=np.int64)
        self.prev_done = np.zeros(N, dtype=bool)
        self.fresh_policy_state()
        self.begin_statistics()
        obs_space = envs.single_observation_space
        self._obs_shape = (N, *obs_space.shape) if obs_space.shape is not None else None  # None: a Dict/Tuple

    def fresh_policy_state(self) -> None:
        """Every env's policy state started afresh (``policy.initial_state``), each marked as an episode start."""
        self.policy_state = self.policy.initial_state(self.num_envs)  # None for a stateless policy
        self.episode_start = np.ones(self.num_envs, dtype=bool)  # [N] read by act, never written in place

    def start(self, obs: Any, info: Any, phase: str, step: int = 0) -> None:
        """Begin from the observations (and info) a reset returned: checked (``EnvError``), masks read
        (``ValueError`` for a bad one), every env's policy state fresh."""
        self.next_obs_raw = check_obs_batch(obs, self.num_envs, self.envs.single_observation_space, self.env_id,
                                            phase, step)
        self.fresh_policy_state()
        if self.masked:
            self.next_mask = read_action_masks(self.envs, info, self.mask_dim, obs=obs)

    def env_actions(self, actions: Any) -> np.ndarray:
        """The policy's ``actions`` (a tensor) as the env takes them: numpy, a Box's clipped to its bounds."""
        env_actions = actions.numpy() if actions.device.type == "cpu" else actions.cpu().numpy()
        if self.action_bounds is not None:
            # The log-prob is of the unclipped sample; only the env sees the clipped action.
            # np.clip's values (NaN included) by two ufuncs, without its Python-level dispatch.
            env_actions = np.minimum(np.maximum(env_actions, self.action_bounds[0]), self.action_bounds[1])
        return env_actions

    def run(self, num_steps: int, act: Callable[[int], np.ndarray], record: Callable[[int, Step], bool],
            step: int = 0, stride: int | None = None) -> tuple[int, float]:
        """Up to ``num_steps`` steps: ``act(t)`` (reading ``next_obs_raw``, ``next_mask``, ``policy_state``,
        ``episode_start``) gives the env actions, ``step`` decides what came back, ``record(t, result)`` takes
        it and returns whether to go on. ``step`` is the step count the failure messages name, advanced by
        ``stride`` (default: every env's step) each step; returns it, and the seconds spent in ``act``."""
        stride = self.num_envs if stride is None else stride
        t_act = 0.0
        for t in range(num_steps):
            t0 = time.perf_counter()
            actions = act(t)
            t_act += time.perf_counter() - t0
            result = self.step(actions, step)
            step += stride
            if not record(t, result):
                break
        return step, t_act

    def step(self, env_actions: np.ndarray, step: int) -> Step:
        """Step every env once and decide what came back (``step``: the env steps before this one)."""
        N, phase, fail, watchdog = self.num_envs, self.step_phase, self.loop_fail, self.watchdog
        try:
            watchdog.arm(phase)
            next_obs, reward, terminated, truncated, info = self.envs.step(env_actions)
            watchdog.disarm()
        except (Exception, EnvTimeout) as exc:  # noqa: BLE001 - any env failure ends the run in one line
            watchdog.disarm()
            raise fail(phase, step, exc, None) from exc
        raw_obs = next_obs  # a Dict observation may carry the action mask (read below, after the checks)
        # The hot path only tests shape and dtype kind of arrays converted anyway; the checks that say what is
        # wrong (a str/object observation, another shape, an array reward) run only when that test fails.
        encoder, checked = self.encoder, False
        try:
            if not (type(next_obs) is np.ndarray and next_obs.shape == self._obs_shape
                    and next_obs.dtype.kind in "biuf"
                    and (encoder.check_values is None or encoder.check_values(next_obs))):
                next_obs = check_obs_batch(next_obs, N, self.envs.single_observation_space, self.env_id, phase,
                                           step)  # encoded
                checked = True
            if not (batch_ok(reward, N) and batch_ok(terminated, N) and batch_ok(truncated, N)):
                reward, terminated, truncated = check_step_batch(reward, terminated, truncated, N, self.env_id,
                                                                 step, phase)
        except EnvError as exc:
            raise fail(phase, step, exc, None) from None
        if self.masked:
            try:
                self.next_mask = read_action_masks(self.envs, info, self.mask_dim, obs=raw_obs)
            except Exception as exc:  # noqa: BLE001 - a bad mask (or a failing action_masks()) ends the run
                raise fail(phase, step, exc, f"action mask: {exc}") from None
        if not checked:
            next_obs = encoder.encode(next_obs, N)  # a Box: np.asarray(next_obs, dtype=np.float32).reshape(N, -1)
        reward = np.asarray(reward, dtype=np.float64)
        terminated = np.asarray(terminated, dtype=bool)
        truncated = np.asarray(truncated, dtype=bool)
        # NEXT_STEP autoreset: a step right after an episode end only resets that env; it is no transition.
        valid = ~self.prev_done if not self.same_step else np.ones(N, dtype=bool)
        bad = encoder.nonfinite(next_obs) | ~np.isfinite(reward)  # a Box: ~np.isfinite(next_obs).all(1)
        if bad.any():
            # NaN/Inf from the env is detected and never trained on.
            self.nonfinite += int(bad.sum())
            next_obs = encoder.zero_nonfinite(next_obs)
            reward = np.where(np.isfinite(reward), reward, 0.0)
            valid = valid & ~bad
        done = terminated | truncated

        # Episode statistics on raw rewards (vectorized over envs: no per-env Python loop).
        self.ep_return += np.where(valid, reward, 0.0)
        self.ep_length += valid
        final_returns = final_lengths = None
        if done.any():
            ended = done & valid
            if ended.any():
                self.ep_returns.append(self.ep_return[ended])
                self.ep_lengths.append(self.ep_length[ended])
            if self.keep_final_returns:
                final_returns, final_lengths = self.ep_return.copy(), self.ep_length.copy()
            self.ep_return[done] = 0.0
            self.ep_length[done] = 0
        # The next observation starts an episode where this step ended one (SAME_STEP), or where this step was
        # the reset that follows an end (NEXT_STEP).
        self.episode_start = done if self.same_step else self.prev_done
        self.prev_done = done
        self.next_obs_raw = next_obs
        return Step(next_obs, reward, terminated, truncated, done, valid, bad, info, final_returns, final_lengths)

    def begin_statistics(self) -> None:
        """Start counting finished episodes and non-finite steps afresh (one rollout's, one evaluation's)."""
        self.ep_returns: list[np.ndarray] = []
        self.ep_lengths: list[np.ndarray] = []
        self.nonfinite = 0

    def episodes(self) -> list[tuple[float, int]]:
        """(raw return, length) of each episode counted since ``begin_statistics``."""
        if not self.ep_returns:
            return []
        return list(zip(np.concatenate(self.ep_returns).tolist(), np.concatenate(self.ep_lengths).tolist()))


def one_env_step(encoder: Any, same_step: bool, prev_done: bool, ep_ret: float, ep_len: int, reward: float,
                 raw: np.ndarray, terminated: bool, truncated: bool) -> tuple:
    """``EnvLoop.step``'s decisions for one env on Python scalars (the one-env rollout, ``one_env.py``, where
    ``[1]`` arrays cost more than the env): ``(valid, bad, done, reward, raw, ep_ret, ep_len, finished,
    episode_start)`` with ``raw`` (``[1, D]`` float32) and ``reward`` zeroed where non-finite, the episode
    statistics advanced (``finished``: the ended episode's (return, length), or None) and ``episode_start`` the
    flag of the next observation."""
    # NEXT_STEP autoreset: a step right after an episode end only resets the env; it is no transition.
    valid = same_step or not prev_done
    bad = False
    # A finite sum proves a finite row; an infinite one may be overflow, hence the exact test.
    if not (math.isfinite(reward) and math.isfinite(float(raw.sum()))) and (
            not math.isfinite(reward) or not np.isfinite(raw).all()):
        # NaN/Inf from the env is detected and never trained on.
        raw = encoder.zero_nonfinite(raw)
        reward = reward if math.isfinite(reward) else 0.0
        valid, bad = False, True
    done = terminated or truncated
    finished = None
    # Episode statistics on raw rewards (the same IEEE-754 double additions as the float64 arrays above).
    if valid:
        ep_ret += reward
        ep_len += 1
        if done:
            finished = (ep_ret, ep_len)
    if done:
        ep_ret, ep_len = 0.0, 0
    # As above: this step ended an episode (SAME_STEP) or was the reset after one (NEXT_STEP).
    return valid, bad, done, reward, raw, ep_ret, ep_len, finished, (done if same_step else prev_done)
