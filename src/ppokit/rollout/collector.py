"""Step 1 of the PPO loop: collect one rollout of ``num_steps`` steps of every env with pi_old into the buffer.

``Collector`` is the in-process ``RolloutSource`` (``source.py``): an ``EnvLoop`` (``loop.py``: stepping, both
autoreset modes, NaN/Inf, the env checks, action masks, episode statistics, the policy's state and
``episode_start``) whose steps it writes into the buffer; it knows nothing of the update, the logger or
checkpoints. What it adds to the loop:

* pi_old's actions, log-probs and values, the observations as the policy saw them, the masks acted on, and the
  policy version that acted, written into the buffer step by step; rewards and flags moved in one transfer;
* for a stateful policy, the state passed into each act and its ``episode_start``, stored per step
  (``RolloutBuffer.record_state``, from which the update replays each chunk); nothing for a stateless one;
* the normalizers: observation statistics updated on the finite steps, rewards scaled as they arrive;
* under SAME_STEP autoreset a truncated episode's value bootstrapped from ``info["final_obs"]``, since the
  observation returned is already the next episode's (a stateful policy's from the state its env had there);
* what carries from one rollout to the next, for a checkpoint (``loop_state``), a stateful policy's live state
  per env included;
* every second of the rollout booked to ``perf``: acting to "inference", stepping and result handling to "env";
* one in-process env on the CPU (MuJoCo's setting): the same loop on scalars, ``one_env.py``, bit for bit.

An env failure ends the run: ``fail(step, rollout_start, exc, detail)`` (the trainer's, which saves the learner
state first) builds the ``EnvError`` that is raised.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import numpy as np
import torch

from ppokit.core.errors import ConfigError
from ppokit.envs.atari import finished_games, records_games
from ppokit.envs.encoders import obs_copy_, obs_index, obs_map, obs_to_tensor
from ppokit.envs.errors import EnvError, env_failure
from ppokit.envs.masks import take_probe_reset
from ppokit.envs.watchdog import EnvTimeout
from ppokit.rollout import one_env
from ppokit.rollout.buffer import RolloutBuffer
from ppokit.rollout.hostnorm import HostNormalizers
from ppokit.rollout.loop import EnvLoop, Step
from ppokit.rollout.normalize import ObsNormalizer, RewardScaler
from ppokit.rollout.source import Episodes

__all__ = ["Collector", "allocate_buffer", "bootstrap_values"]


class Collector(EnvLoop):
    """Rollouts of ``envs`` into ``buffer``, acting with ``acting.act`` (the policy, or its ``ActingKernel``).

    ``acting.act`` and ``policy.value`` are looked up at each use, so a wrapped or replaced one is seen.
    ``perf`` is the trainer's timer dict (updated in place). The loop state (``next_obs_raw``, ``ep_return``,
    ``ep_length``, ``prev_done``) is what a checkpoint holds (``loop_state`` / ``load_loop_state``).
    """

    def __init__(self, envs: Any, policy: Any, acting: Any, *, num_steps: int, device: torch.device, env_id: str,
                 obs_norm: ObsNormalizer | None, reward_scaler: RewardScaler | None, perf: dict[str, float],
                 fail: Callable[..., EnvError]):
        super().__init__(envs, policy, env_id=env_id, fail=self._loop_failed)
        self.acting, self.fail = acting, fail
        self.obs_norm, self.reward_scaler, self.perf = obs_norm, reward_scaler, perf
        self.num_steps, self.device = num_steps, device
        self.obs_dim = policy.obs_dim
        if obs_norm is not None and not self.encoder.normalizable:
            envs.close()  # the run ends before it starts (as the trainer does for its own config errors)
            raise ConfigError("normalize_obs", f"observation normalization applies to float vector observations; "
                              f"{envs.single_observation_space} is {self.encoder.what}: set normalize_obs = false")
        self.buffer = allocate_buffer(policy, num_steps, self.num_envs, device, self.mask_dim,
                                      obs_layout=self.encoder.layout(),
                                      policy_state=policy.initial_state(self.num_envs))
        # One env on the CPU: the normalizers' per-step arithmetic runs on the host, bit for bit (hostnorm).
        self.host_norm = HostNormalizers(obs_norm, reward_scaler) \
            if HostNormalizers.applies(self.num_envs, device, obs_norm, reward_scaler) else None
        # Atari: the episodes reported are whole games (score, length) from the env's info (envs/atari.py); the
        # training episodes (one life, clipped rewards) go to ``life_episodes``.
        self.whole_games = records_games(envs, env_id)
        self.life_episodes: Episodes = []
        self.last_obs: torch.Tensor | None = None  # [N, obs_dim] the normalized obs after the rollout (GAE's bootstrap)
        self.policy_version = 0  # the version of the weights that act (``publish``)
        # Called with the step index before each step acts, where newer weights may arrive mid-rollout (a decoupled
        # worker's, rollout/actors.py); it records their version in ``buffer.policy_version[t:]``.
        self.refresh: Callable[[int], None] | None = None
        self._rollout_start = 0
        self._one_env = self.one_env_path and one_env.applies(self)

    # The one-env loop (one_env.py) where it applies; False forces the general loop (tests compare the two).
    one_env_path = True
    # It acts with the trainer's live policy: every sample is of the version just published.
    stale = False

    def _loop_failed(self, phase: str, step: int, exc: BaseException | None, detail: str | None) -> EnvError:
        return self.fail(step, self._rollout_start, exc, detail=detail)

    # ------------------------------------------------------------------ the source's side of the learner
    def publish(self, weights: Any, version: int) -> None:
        """The learner's weights after update ``version``: in process, ``weights`` is the live policy the
        collector already acts with, so only the version is kept (what the buffer's ``policy_version`` says)."""
        self.policy_version = version

    # ------------------------------------------------------------------ loop state
    def reset(self, seed: int) -> None:
        """Reset every env (seeded) and check what it returned."""
        probed = take_probe_reset(self.envs, seed)
        if probed is not None:
            obs, info = probed  # action_masks_available's probe was this reset: the env is not reset twice
        else:
            try:
                with self.watchdog.guard("reset()"):
                    obs, info = self.envs.reset(seed=seed)
            except (Exception, EnvTimeout) as exc:  # noqa: BLE001 - whatever the env raised, say which and where
                raise env_failure(self.env_id, "reset()", 0, exc, self.envs) from exc
        try:
            self.start(obs, info, "reset()")
        except ValueError as exc:  # a bad mask
            raise env_failure(self.env_id, "reset()", 0, exc, self.envs) from None

    def loop_state(self) -> dict[str, torch.Tensor]:
        """The state carried between rollouts, as a checkpoint's ``loop`` entry (copies; with masks, the mask of
        the next observation too)."""
        state = {
            "next_obs_raw": obs_map(lambda a: torch.from_numpy(a.copy()), self.next_obs_raw),
            "ep_return": torch.from_numpy(self.ep_return.copy()),
            "ep_length": torch.from_numpy(self.ep_length.copy()),
            "prev_done": torch.from_numpy(self.prev_done.copy()),
        }
        if self.masked:
            state["next_mask"] = torch.from_numpy(self.next_mask.copy())
        if self.policy_state is not None:  # a stateful policy: each env's live state and its episode-start flag
            state["policy_state"] = _state_copy(self.policy_state)
            state["episode_start"] = torch.from_numpy(np.array(self.episode_start, dtype=bool))
        return state

    def load_loop_state(self, loop: dict[str, torch.Tensor]) -> None:
        """Restore ``loop_state()`` (only together with the env's own state: the two describe the same episodes),
        a stateful policy's live state with it (a loop state without one starts every env's afresh)."""
        self.fresh_policy_state()
        if self.policy_state is not None and "policy_state" in loop:
            self.policy_state = _state_load(loop["policy_state"], self.policy_state)
            self.episode_start = loop["episode_start"].numpy().astype(bool)
        self.next_obs_raw = obs_map(lambda t: t.numpy().copy(), loop["next_obs_raw"])
        self.ep_return = loop["ep_return"].numpy().copy()
        self.ep_length = loop["ep_length"].numpy().copy()
        self.prev_done = loop["prev_done"].numpy().copy()
        if self.masked and "next_mask" in loop:
            self.next_mask = loop["next_mask"].numpy().astype(bool)

    def normalize(self, obs: torch.Tensor) -> torch.Tensor:
        """``obs`` as the policy sees it (the running observation statistics, not updated here)."""
        return obs if self.obs_norm is None else self.obs_norm.normalize(obs)

    # ------------------------------------------------------------------ one rollout
    def collect(self, global_step: int) -> tuple[Episodes, int]:
        """Fill the buffer with ``num_steps`` steps of every env, starting at ``global_step``; returns (finished
        episodes, non-finite steps). The caller advances its step count by ``num_steps * num_envs``."""
        self.buffer.policy_version.fill_(self.policy_version)  # every step acts with the live, published policy
        if self._one_env:
            # One in-process env on the CPU: the same loop on scalars (one_env.py), bit for bit.
            result = one_env.collect_one_env(self, global_step)
            if result is not None:
                return result
        buf, dev, N = self.buffer, self.device, self.num_envs
        t_start = time.perf_counter()
        self.begin_statistics()
        self._rollout_start = global_step  # the step count the last update's state belongs to
        games: Episodes = []
        act = self.acting.act
        hn = self.host_norm if self.host_norm is not None and self.host_norm.load() else None
        buf.has_final.zero_()
        # Per-step scalars the update needs only after the rollout are gathered on the host and moved to the
        # device in one transfer at the end: rewards, terminated, truncated, valid.
        host = np.zeros((4, self.num_steps, N), dtype=np.float32)
        # Per-step views made once (a tensor __setitem__ per field and step costs more than the copy itself).
        step_views = list(zip(buf.actions.unbind(0), buf.logp.unbind(0), buf.values.unbind(0)))
        obs_views = [obs_index(buf.obs, t) for t in range(self.num_steps)]  # each part's [N, ...] view of step t
        # One inference-mode context object, entered at each step: building one per step costs more than a
        # one-env step's acting ops.
        inference = torch.inference_mode()
        obs = self.normalize(obs_to_tensor(self.next_obs_raw, dev))  # what the policy acts on at step t
        env_actions_of = self.env_actions
        stateful = buf.policy_state is not None

        refresh = self.refresh

        def act_and_store(t: int) -> np.ndarray:
            # pi_old acts; the observation it saw, its action, log-prob and value (and the mask) go to row t.
            if refresh is not None:
                refresh(t)
            if stateful:  # what act is given: a sequence minibatch replays each chunk from it
                buf.record_state(t, self.policy_state, self.episode_start)
            if self.masked:
                mask = torch.as_tensor(self.next_mask, device=dev)
                buf.masks[t].copy_(mask)
                with inference:
                    actions, logp, values, self.policy_state = act(obs, self.policy_state, self.episode_start,
                                                                   mask)
            else:
                with inference:
                    actions, logp, values, self.policy_state = act(obs, self.policy_state, self.episode_start)
            obs_copy_(obs_views[t], obs)
            for dest, src in zip(step_views[t], (actions, logp, values)):
                dest.copy_(src)
            return env_actions_of(actions)

        def store(t: int, r: Step) -> bool:
            nonlocal obs
            reward, done = r.reward, r.done
            host[0, t], host[1, t], host[2, t], host[3, t] = reward, r.terminated, r.truncated, r.valid
            if self.whole_games and done.any():
                games.extend(finished_games(r.info))
            if hn is not None and self.reward_scaler is not None:
                host[0, t] = hn.scale(reward[0], done[0])  # moved to the buffer with the raw rewards' transfer
            elif self.reward_scaler is not None:
                # The running return is sequential in time, so scaled rewards are written step by step.
                buf.rewards[t] = self.reward_scaler.scale(torch.as_tensor(reward, dtype=torch.float32, device=dev),
                                                          torch.as_tensor(done, device=dev))
            bad = r.bad
            if hn is not None and self.obs_norm is not None:
                if not bad[0]:
                    hn.update_obs(r.obs)
                obs = torch.from_numpy(hn.normalize(r.obs))
            else:
                # One host-to-device transfer per step: the next observation, which the policy needs to act.
                next_obs_t = obs_to_tensor(r.obs, dev)
                if self.obs_norm is not None:
                    self.obs_norm.update(obs_index(next_obs_t, torch.as_tensor(~bad, device=dev)) if bad.any()
                                         else next_obs_t)
                obs = self.normalize(next_obs_t)
            if self.same_step and r.truncated.any():
                self._bootstrap_truncated(t, r.truncated, r.info, global_step + (t + 1) * N, global_step,
                                          self.policy_state)
            return True

        step, t_inference = self.run(self.num_steps, act_and_store, store, step=global_step)
        nonfinite = self.nonfinite
        if nonfinite and not host[3].any():
            # Every step was NaN/Inf (a None reward becomes NaN in a vector env): nothing to train on.
            raise self.fail(step, global_step, detail=(
                f"every step of this rollout had a NaN/Inf/None reward or observation ({nonfinite} steps); "
                "nothing to train on"))
        host_t = torch.as_tensor(host, device=dev)
        if self.reward_scaler is None or hn is not None:
            buf.rewards.copy_(host_t[0])
        buf.terminated.copy_(host_t[1])
        buf.truncated.copy_(host_t[2])
        buf.valid.copy_(host_t[3])
        self.last_obs = obs
        self.perf["inference"] += t_inference
        self.perf["env"] += time.perf_counter() - t_start - t_inference
        episodes = self.episodes()
        if self.whole_games:
            self.life_episodes, episodes = episodes, games
        return episodes, nonfinite

    def _bootstrap_truncated(self, t: int, truncated: np.ndarray, info: dict, step: int, rollout_start: int,
                             state: Any = None) -> None:
        """SAME_STEP autoreset: the returned obs is already the new episode's; store V(true final obs) for the
        truncated envs of step ``t`` (``buffer.next_values`` reads it in place of V(next obs)), a stateful
        policy's from ``state``, the state its step-``t`` action left (the episode's, not yet reset)."""
        buf, dev = self.buffer, self.device
        idx = np.flatnonzero(truncated)
        final_obs = info["final_obs"]
        try:
            if isinstance(final_obs, np.ndarray) and final_obs.dtype != object:
                final = self.encoder.encode(final_obs[idx], len(idx))  # a batched env's array
            else:
                final = self.encoder.encode_rows([final_obs[i] for i in idx])
            if not self.encoder.structured and final.reshape(len(idx), -1).shape[1] != self.obs_dim:
                raise ValueError(f"final observations of {final.reshape(len(idx), -1).shape[1]} values, expected "
                                 f"{self.obs_dim}")
        except Exception as exc:  # noqa: BLE001
            raise self.fail(step, rollout_start, exc,
                            detail=f"info['final_obs'] of a truncated episode is unusable: {exc}")
        final = self.encoder.zero_nonfinite(final)
        final_t = self.normalize(obs_to_tensor(final, dev))
        idx_t = torch.as_tensor(idx, device=dev)
        with torch.inference_mode():
            fv = self.policy.value(final_t) if state is None else self.policy.value(final_t, state[idx_t])
        buf.final_values[t, idx_t] = fv
        buf.has_final[t, idx_t] = True


def bootstrap_values(policy: Any, source: Any) -> torch.Tensor:
    """V ``[N]`` of the observation after the rollout (GAE's bootstrap), a stateful policy's from the state the
    rollout left (``source.policy_state``, reset where ``source.episode_start``)."""
    state = getattr(source, "policy_state", None)
    with torch.inference_mode():
        if state is None:
            return policy.value(source.last_obs)
        return policy.value(source.last_obs, state, source.episode_start)


def _state_copy(state: Any) -> Any:
    """A policy state (a tensor, or a tuple/list/dict of tensors) copied to the CPU, as a checkpoint holds it."""
    if isinstance(state, torch.Tensor):
        return state.detach().cpu().clone()
    if isinstance(state, dict):
        return {k: _state_copy(v) for k, v in state.items()}
    return [_state_copy(v) for v in state]


def _state_load(saved: Any, like: Any) -> Any:
    """``saved`` (``_state_copy``'s) moved to the device, dtype and structure of ``like`` (a fresh state);
    ValueError when its shapes are not those of ``like``."""
    if isinstance(like, torch.Tensor):
        if not isinstance(saved, torch.Tensor) or saved.shape != like.shape:
            raise ValueError(f"the saved policy state has shape {getattr(saved, 'shape', type(saved).__name__)}, "
                             f"this policy's is {tuple(like.shape)}")
        return saved.to(device=like.device, dtype=like.dtype).clone()
    if isinstance(like, dict):
        return {k: _state_load(saved[k], v) for k, v in like.items()}
    return type(like)(_state_load(s, v) for s, v in zip(saved, like))


def allocate_buffer(policy: Any, num_steps: int, num_envs: int, device: torch.device,
                    mask_dim: int | None = None, obs_layout: Any = None, policy_state: Any = None) -> RolloutBuffer:
    """The rollout buffer for ``policy``'s observations and actions: ``[T, N]`` long actions (discrete),
    ``[T, N, k]`` long (multidiscrete, k sub-actions), ``[T, N, D]`` float32 (continuous); observations in the
    encoder's ``obs_layout`` (default: ``policy.obs_dim`` float32 features); a stateful policy's state and episode
    starts where ``policy_state`` (its ``initial_state(num_envs)``) is not None."""
    if policy.kind == "continuous":
        action_shape: tuple[int, ...] = (policy.action_dims[0],)
    else:
        action_shape = () if policy.kind == "discrete" else (len(policy.action_dims),)
    action_dtype = torch.float32 if policy.kind == "continuous" else torch.long
    return RolloutBuffer.allocate(num_steps, num_envs, policy.obs_dim if obs_layout is None else obs_layout,
                                  action_shape, action_dtype, device, mask_dim, policy_state)


