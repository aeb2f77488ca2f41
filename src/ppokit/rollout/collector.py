"""Step 1 of the PPO loop: collect one rollout of ``num_steps`` steps of every env with pi_old into the buffer.

``Collector`` owns the vector env's stepping and what the trainer must carry from one rollout to the next (the
next observation, the per-env episode bookkeeping on raw rewards, the previous step's dones); it knows nothing of
the update, the logger or checkpoints. What it handles:

* both Gymnasium autoreset modes: under NEXT_STEP the step after an episode end only resets that env and is no
  transition (``valid`` False); under SAME_STEP a truncated episode's value is bootstrapped from
  ``info["final_obs"]``, since the observation returned is already the next episode's;
* NaN/Inf from the env: counted, zeroed, kept out of the statistics and never trained on;
* the env output checks of ``envs.errors``, run in full only when a cheap shape/dtype test fails;
* action masks, when the env provides them (``action_masks_available``, which also looks at the first reset's
  info): read after every reset and step from
  ``info["action_mask"]`` (Gymnasium's Taxi convention; a vector env batches it, ``info["_action_mask"]`` flags
  the envs that sent one) or else from each sub-env's ``action_masks()`` method (SB3-contrib's convention), acted
  on and stored in the buffer; an env without masks stores and computes nothing more;
* the policy's state (``policies.Policy``): ``policy.initial_state(num_envs)`` after a reset, passed to each
  ``act`` with ``episode_start`` (True where the observation is an episode's first: the previous step's done
  flags under SAME_STEP, the flags of the step before it under NEXT_STEP, where the step between only resets),
  and carried from one rollout to the next (None for a stateless policy: nothing is computed for it);
* every second of the rollout booked to ``perf``: acting to "inference", stepping and result handling to "env";
* one in-process env on the CPU (MuJoCo's setting): the same loop on scalars, ``one_env.py``, bit for bit.

An env failure ends the run: ``fail(step, rollout_start, exc, detail)`` (the trainer's, which saves the learner
state first) builds the ``EnvError`` that is raised.
"""

from __future__ import annotations

import time
import weakref
from typing import Any, Callable

import numpy as np
import torch

from ppokit.core.errors import ConfigError
from ppokit.envs.encoders import MASK_KEY, obs_copy_, obs_index, obs_map, obs_to_tensor, observation_encoder
from ppokit.envs.errors import EnvError, batch_ok, check_obs_batch, check_step_batch, env_failure
from ppokit.envs.watchdog import NO_WATCHDOG, EnvTimeout
from ppokit.policies import mask_logits
from ppokit.rollout import one_env
from ppokit.rollout.buffer import RolloutBuffer
from ppokit.rollout.hostnorm import HostNormalizers
from ppokit.rollout.normalize import ObsNormalizer, RewardScaler

__all__ = ["Collector", "Episodes", "action_masks_available", "allocate_buffer", "forget_probe_reset", "read_action_masks", "evaluate_first_episodes", "make_eval_envs",
           "make_train_envs"]

Episodes = list[tuple[float, int]]  # (raw return, length) of each episode finished in the rollout


class Collector:
    """Rollouts of ``envs`` into ``buffer``, acting with ``acting.act`` (the policy, or its ``ActingKernel``).

    ``acting.act`` and ``policy.value`` are looked up at each use, so a wrapped or replaced one is seen.
    ``perf`` is the trainer's timer dict (updated in place). The loop state (``next_obs_raw``, ``ep_return``,
    ``ep_length``, ``prev_done``) is what a checkpoint holds (``loop_state`` / ``load_loop_state``).
    """

    def __init__(self, envs: Any, policy: Any, acting: Any, *, num_steps: int, device: torch.device, env_id: str,
                 obs_norm: ObsNormalizer | None, reward_scaler: RewardScaler | None, perf: dict[str, float],
                 fail: Callable[..., EnvError]):
        import gymnasium as gym

        from ppokit.envs.factory import autoreset_mode

        self.envs, self.policy, self.acting, self.env_id = envs, policy, acting, env_id
        self.obs_norm, self.reward_scaler, self.perf, self.fail = obs_norm, reward_scaler, perf, fail
        self.num_steps, self.num_envs, self.device = num_steps, envs.num_envs, device
        self.obs_dim = policy.obs_dim
        # Observations enter through the space's encoder (a Box: the plain float32 flatten; Discrete: one-hot;
        # an image: uint8 CxHxW; Dict/Tuple: a dict of those), and the buffer stores them in its layout.
        self.encoder = observation_encoder(envs.single_observation_space)
        if obs_norm is not None and not self.encoder.normalizable:
            envs.close()  # the run ends before it starts (as the trainer does for its own config errors)
            raise ConfigError("normalize_obs", f"observation normalization applies to float vector observations; "
                              f"{envs.single_observation_space} is {self.encoder.what}: set normalize_obs = false")
        # Gymnasium's autoreset mode decides which steps are transitions and where a truncation bootstraps from.
        self.same_step = autoreset_mode(envs) == gym.vector.AutoresetMode.SAME_STEP
        self.action_bounds: tuple[np.ndarray, np.ndarray] | None = None  # (low, high) of a Box action space
        if policy.kind == "continuous":
            space = envs.single_action_space
            self.action_bounds = (np.asarray(space.low, dtype=np.float32), np.asarray(space.high, dtype=np.float32))
        # Masks only for categorical heads: the trainer then runs the autograd update (the fused kernel has none).
        self.masked = policy.kind != "continuous" and action_masks_available(envs)
        self.mask_dim = sum(policy.action_dims) if self.masked else None
        self.buffer = allocate_buffer(policy, num_steps, self.num_envs, device, self.mask_dim,
                                      obs_layout=self.encoder.layout())
        # One env on the CPU: the normalizers' per-step arithmetic runs on the host, bit for bit (hostnorm).
        self.host_norm = HostNormalizers(obs_norm, reward_scaler) \
            if HostNormalizers.applies(self.num_envs, device, obs_norm, reward_scaler) else None
        self.next_mask: np.ndarray | None = None  # [N, n_logits] bool: the actions allowed at next_obs_raw
        N = self.num_envs
        self.next_obs_raw: Any = None  # [N, obs_dim] float32, encoded (Discrete: one-hot; image: uint8; Dict: dict)
        self.ep_return = np.zeros(N, dtype=np.float64)  # raw, unscaled rewards
        self.ep_length = np.zeros(N, dtype=np.int64)
        self.prev_done = np.zeros(N, dtype=bool)
        self.fresh_policy_state()
        self.last_obs: torch.Tensor | None = None  # [N, obs_dim] the normalized obs after the rollout (GAE's bootstrap)
        self._one_env = self.one_env_path and one_env.applies(self)

    # The one-env loop (one_env.py) where it applies; False forces the general loop (tests compare the two).
    one_env_path = True
    # What bounds each reset()/step() (envs.watchdog; the trainer sets its own): nothing, by default.
    watchdog: Any = NO_WATCHDOG

    # ------------------------------------------------------------------ loop state
    def fresh_policy_state(self) -> None:
        """Every env's policy state started afresh (``policy.initial_state``), each marked as an episode start."""
        self.policy_state = self.policy.initial_state(self.num_envs)  # None for a stateless policy
        self.episode_start = np.ones(self.num_envs, dtype=bool)  # [N] read by act, never written in place

    def reset(self, seed: int) -> None:
        """Reset every env (seeded) and check what it returned."""
        probed = _PROBE_RESETS.pop(self.envs, None)
        if probed is not None and probed[0] == seed:
            obs, info = probed[1]  # action_masks_available's probe was this reset: the env is not reset twice
        else:
            try:
                with self.watchdog.guard("reset()"):
                    obs, info = self.envs.reset(seed=seed)
            except (Exception, EnvTimeout) as exc:  # noqa: BLE001 - whatever the env raised, say which and where
                raise env_failure(self.env_id, "reset()", 0, exc, self.envs) from exc
        self.next_obs_raw = check_obs_batch(obs, self.num_envs, self.envs.single_observation_space, self.env_id,
                                            "reset()", 0)
        self.fresh_policy_state()
        if self.masked:
            try:
                self.next_mask = read_action_masks(self.envs, info, self.mask_dim, obs=obs)
            except ValueError as exc:
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
        return state

    def load_loop_state(self, loop: dict[str, torch.Tensor]) -> None:
        """Restore ``loop_state()`` (only together with the env's own state: the two describe the same episodes).
        The policy's state is not in it: every env's starts afresh."""
        self.fresh_policy_state()
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
        if self._one_env:
            # One in-process env on the CPU: the same loop on scalars (one_env.py), bit for bit.
            result = one_env.collect_one_env(self, global_step)
            if result is not None:
                return result
        buf, dev, N, env_id = self.buffer, self.device, self.num_envs, self.env_id
        t_start = time.perf_counter()
        ep_returns: list[np.ndarray] = []
        ep_lengths: list[np.ndarray] = []
        nonfinite = 0
        obs_space = self.envs.single_observation_space
        obs_shape = (N, *obs_space.shape) if obs_space.shape is not None else None  # None: a Dict/Tuple
        encode, check_values = self.encoder.encode, self.encoder.check_values  # check_values: None for a Box
        rollout_start = step = global_step  # the step count the last update's state belongs to
        act = self.acting.act
        state, episode_start, same_step = self.policy_state, self.episode_start, self.same_step
        watchdog = self.watchdog
        obs = self.normalize(obs_to_tensor(self.next_obs_raw, dev))
        hn = self.host_norm if self.host_norm is not None and self.host_norm.load() else None
        buf.has_final.zero_()
        t_inference = 0.0
        # Per-step scalars the update needs only after the rollout are gathered on the host and moved to the
        # device in one transfer at the end: rewards, terminated, truncated, valid.
        host = np.zeros((4, self.num_steps, N), dtype=np.float32)
        # Per-step views made once (a tensor __setitem__ per field and step costs more than the copy itself).
        step_views = list(zip(buf.actions.unbind(0), buf.logp.unbind(0), buf.values.unbind(0)))
        obs_views = [obs_index(buf.obs, t) for t in range(self.num_steps)]  # each part's [N, ...] view of step t
        # One inference-mode context object, entered at each step: building one per step costs more than a
        # one-env step's acting ops.
        inference = torch.inference_mode()
        on_cpu = dev.type == "cpu"  # the actions are numpy views then, without a .cpu() dispatch per step
        for t in range(self.num_steps):
            t0 = time.perf_counter()
            if self.masked:
                mask = torch.as_tensor(self.next_mask, device=dev)
                buf.masks[t].copy_(mask)
                with inference:
                    actions, logp, values, state = act(obs, state, episode_start, mask)
            else:
                with inference:
                    actions, logp, values, state = act(obs, state, episode_start)
            obs_copy_(obs_views[t], obs)
            for dest, src in zip(step_views[t], (actions, logp, values)):
                dest.copy_(src)
            env_actions = actions.numpy() if on_cpu else actions.cpu().numpy()
            if self.action_bounds is not None:
                # The log-prob is of the unclipped sample; only the env sees the clipped action.
                # np.clip's values (NaN included) by two ufuncs, without its Python-level dispatch.
                env_actions = np.minimum(np.maximum(env_actions, self.action_bounds[0]), self.action_bounds[1])
            t1 = time.perf_counter()
            t_inference += t1 - t0
            try:
                watchdog.arm("step()")
                next_obs, reward, terminated, truncated, info = self.envs.step(env_actions)
                watchdog.disarm()
            except (Exception, EnvTimeout) as exc:  # noqa: BLE001 - any env failure ends the run in one line
                watchdog.disarm()
                raise self.fail(step, rollout_start, exc) from exc
            raw_obs = next_obs  # a Dict observation may carry the action mask (read below, after the checks)
            # The hot path only tests shape and dtype kind of arrays converted anyway; the checks that say what
            # is wrong (a str/object observation, another shape, an array reward) run only when that test fails.
            checked = False
            try:
                if not (type(next_obs) is np.ndarray and next_obs.shape == obs_shape
                        and next_obs.dtype.kind in "biuf" and (check_values is None or check_values(next_obs))):
                    next_obs = check_obs_batch(next_obs, N, obs_space, env_id, "step()", step)  # encoded
                    checked = True
                if not (batch_ok(reward, N) and batch_ok(terminated, N) and batch_ok(truncated, N)):
                    reward, terminated, truncated = check_step_batch(reward, terminated, truncated, N, env_id, step)
            except EnvError as exc:
                raise self.fail(step, rollout_start, exc) from None
            if self.masked:
                try:
                    self.next_mask = read_action_masks(self.envs, info, self.mask_dim, obs=raw_obs)
                except Exception as exc:  # noqa: BLE001 - a bad mask (or a failing action_masks()) ends the run
                    raise self.fail(step, rollout_start, exc, detail=f"action mask: {exc}") from None
            step += N

            if not checked:
                next_obs = encode(next_obs, N)  # a Box: np.asarray(next_obs, dtype=np.float32).reshape(N, -1)
            reward = np.asarray(reward, dtype=np.float64)
            terminated = np.asarray(terminated, dtype=bool)
            truncated = np.asarray(truncated, dtype=bool)
            # NEXT_STEP autoreset: a step right after an episode end only resets that env; it is no transition.
            valid = ~self.prev_done if not self.same_step else np.ones(N, dtype=bool)
            bad = self.encoder.nonfinite(next_obs) | ~np.isfinite(reward)  # a Box: ~np.isfinite(next_obs).all(1)
            if bad.any():
                # NaN/Inf from the env is detected and never trained on.
                nonfinite += int(bad.sum())
                next_obs = self.encoder.zero_nonfinite(next_obs)
                reward = np.where(np.isfinite(reward), reward, 0.0)
                valid = valid & ~bad
            done = terminated | truncated

            # Episode statistics on raw rewards (vectorized over envs: no per-env Python loop).
            self.ep_return += np.where(valid, reward, 0.0)
            self.ep_length += valid
            ended = done & valid
            if ended.any():
                ep_returns.append(self.ep_return[ended])
                ep_lengths.append(self.ep_length[ended])
            self.ep_return[done] = 0.0
            self.ep_length[done] = 0
            # The next observation starts an episode where this step ended one (SAME_STEP), or where this step
            # was the reset that follows an end (NEXT_STEP).
            episode_start = done if same_step else self.prev_done
            self.prev_done = done

            host[0, t], host[1, t], host[2, t], host[3, t] = reward, terminated, truncated, valid
            if hn is not None and self.reward_scaler is not None:
                host[0, t] = hn.scale(reward[0], done[0])  # moved to the buffer with the raw rewards' transfer
            elif self.reward_scaler is not None:
                # The running return is sequential in time, so scaled rewards are written step by step.
                buf.rewards[t] = self.reward_scaler.scale(torch.as_tensor(reward, dtype=torch.float32, device=dev),
                                                          torch.as_tensor(done, device=dev))

            if hn is not None and self.obs_norm is not None:
                if not bad[0]:
                    hn.update_obs(next_obs)
                obs = torch.from_numpy(hn.normalize(next_obs))
            else:
                # One host-to-device transfer per step: the next observation, which the policy needs to act.
                next_obs_t = obs_to_tensor(next_obs, dev)
                if self.obs_norm is not None:
                    self.obs_norm.update(obs_index(next_obs_t, torch.as_tensor(~bad, device=dev)) if bad.any()
                                         else next_obs_t)
                obs = self.normalize(next_obs_t)
            if self.same_step and truncated.any():
                self._bootstrap_truncated(t, truncated, info, step, rollout_start)
            self.next_obs_raw = next_obs
        self.policy_state, self.episode_start = state, episode_start
        if nonfinite and not host[3].any():
            # Every step was NaN/Inf (a None reward becomes NaN in a vector env): nothing to train on.
            raise self.fail(step, rollout_start, detail=(
                f"every step of this rollout had a NaN/Inf/None reward or observation ({nonfinite} steps); "
                "nothing to train on"))
        host_t = torch.as_tensor(host, device=dev)
        if self.reward_scaler is None or hn is not None:
            buf.rewards.copy_(host_t[0])
        buf.terminated.copy_(host_t[1])
        buf.truncated.copy_(host_t[2])
        buf.valid.copy_(host_t[3])
        self.last_obs = obs
        episodes = list(zip(np.concatenate(ep_returns).tolist(), np.concatenate(ep_lengths).tolist())) \
            if ep_returns else []
        self.perf["inference"] += t_inference
        self.perf["env"] += time.perf_counter() - t_start - t_inference
        return episodes, nonfinite

    def _bootstrap_truncated(self, t: int, truncated: np.ndarray, info: dict, step: int, rollout_start: int) -> None:
        """SAME_STEP autoreset: the returned obs is already the new episode's; store V(true final obs) for the
        truncated envs of step ``t`` (``buffer.next_values`` reads it in place of V(next obs))."""
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
        with torch.inference_mode():
            fv = self.policy.value(final_t)
        idx_t = torch.as_tensor(idx, device=dev)
        buf.final_values[t, idx_t] = fv
        buf.has_final[t, idx_t] = True


def make_train_envs(cfg: Any, custom_env: Any = None) -> Any:
    """The training vector env of ``cfg`` (``custom_env``: a resolved factory or instance); sets ``cfg.env_id``
    to a custom env's record name once it exists. A constructor that raises is one EnvError line."""
    from ppokit.envs import check_spaces, make_vec_env
    from ppokit.envs.atari import is_atari_id, make_atari_vec_env
    from ppokit.envs.backends import get_backend

    try:
        if custom_env is None and not get_backend(cfg.vector_mode).own_atari_wrappers and is_atari_id(cfg.env_id):
            # An ALE game gets the 9 Atari details (atari.py): the training stack clips rewards and ends an
            # episode at a life loss.
            envs = make_atari_vec_env(cfg.env_id, cfg.num_envs, cfg.vector_mode, cfg.env_kwargs, train=True)
            check_spaces(envs)
            envs.action_space.seed(cfg.seed)
            envs.single_action_space.seed(cfg.seed)
            return envs
        envs = make_vec_env(cfg.env_id, cfg.num_envs, cfg.seed, cfg.vector_mode, cfg.env_kwargs, env_fn=custom_env)
        if custom_env is not None:
            cfg.env_id = custom_env.name  # the record now that the env exists (spec id or custom:Class)
    except (ValueError, EnvError):
        raise  # an unknown id or unsupported spaces: already one clear line
    except Exception as exc:  # noqa: BLE001 - an env whose constructor raises: one line, not its traceback
        raise env_failure(cfg.env_id, "make()", 0, exc) from exc
    return envs


def make_eval_envs(cfg: Any, custom_env: Any = None) -> tuple[Any, int]:
    """The evaluation gate's vector env (``eval_episodes`` envs, unseeded until reset) and its step cap."""
    from ppokit.envs import make_vec_env
    from ppokit.envs.atari import is_atari_id, make_atari_vec_env
    from ppokit.envs.backends import get_backend
    from ppokit.envs.factory import _get_spec

    if custom_env is None and not get_backend(cfg.vector_mode).own_atari_wrappers and is_atari_id(cfg.env_id):
        # The game score: unclipped rewards over a whole game, across lives (atari.WholeGame); 108,000 frames cap
        # an ALE game (v5's max_num_frames_per_episode), 4 frames a step.
        return make_atari_vec_env(cfg.env_id, cfg.eval_episodes, "sync", cfg.env_kwargs, train=False), 27_000
    spec = _get_spec(cfg.env_id) if custom_env is None else None
    # Batched (native) where the env has one: an evaluation then costs about as much as a rollout step.
    mode = "native" if spec is not None and spec.vector_entry_point is not None else "sync"
    envs = make_vec_env(cfg.env_id, cfg.eval_episodes, None, mode, cfg.env_kwargs, env_fn=custom_env)
    return envs, (spec.max_episode_steps if spec is not None else None) or 100_000


def action_masks_available(envs: Any, probe_seed: int | None = None, env_id: str = "?",
                           watchdog: Any = NO_WATCHDOG) -> bool:
    """Whether ``envs`` provides action masks: a sub-env (or the vector env itself) with an ``action_masks()``
    method (SB3-contrib's convention) or with an ``action_mask`` attribute (Gymnasium's Taxi), a Dict observation
    with an ``"action_mask"`` key (PettingZoo's convention), or ``info["action_mask"]`` from the first reset.

    Decided before the collector's first reset, so the trainer can choose its update path: the attributes are
    looked up, and when none is found and ``probe_seed`` is given, the envs are reset once with that seed (the
    collector's first reset, which repeats it with the same seed, then starts from the same observations) to see
    whether the info carries a mask: the only way to learn it from an env that sends masks in ``info`` alone, or
    from an async vector env (its sub-envs live in other processes). The answer is kept per vector env, so the
    collector built on the same envs agrees, and so is the reset's result, which ``Collector.reset`` with the
    same seed takes as its own (the envs are reset once; ``forget_probe_reset`` when they change in between). A
    probe that fails is the run's ``reset()`` failure."""
    if MASK_KEY in getattr(getattr(envs, "single_observation_space", None), "spaces", ()):  # a gymnasium Dict
        return True
    if hasattr(envs, "action_masks") or _sub_env_has(envs, "action_masks") or _sub_env_has(envs, "action_mask"):
        return True
    known = _INFO_MASKS.get(envs)
    if known is not None or probe_seed is None:
        return bool(known)
    try:
        with watchdog.guard("reset()"):
            obs, info = envs.reset(seed=probe_seed)
    except (Exception, EnvTimeout) as exc:  # noqa: BLE001 - the first reset's failure, said as such
        raise env_failure(env_id, "reset()", 0, exc, envs) from exc
    _INFO_MASKS[envs] = found = isinstance(info, dict) and "action_mask" in info
    _PROBE_RESETS[envs] = (probe_seed, (obs, info))
    return found


def forget_probe_reset(envs: Any) -> None:
    """The envs changed after ``action_masks_available``'s probe (a sub-env replaced): the collector resets them."""
    _PROBE_RESETS.pop(envs, None)


# Vector env -> whether its first reset's info held "action_mask" (action_masks_available's probe).
_INFO_MASKS: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()
# Vector env -> (seed, (obs, info)) of that probe reset, until the collector takes it as its first reset.
_PROBE_RESETS: "weakref.WeakKeyDictionary[Any, tuple]" = weakref.WeakKeyDictionary()


def _sub_env_has(envs: Any, name: str) -> bool:
    subs = getattr(envs, "envs", None)  # a SyncVectorEnv's sub-envs (wrappers included)
    return bool(subs) and subs[0].has_wrapper_attr(name)


def read_action_masks(envs: Any, info: dict, mask_dim: int, obs: Any = None) -> np.ndarray:
    """The ``[N, mask_dim]`` bool masks of the observations a reset or step just returned: ``info["action_mask"]``
    where the envs sent it (rows flagged False by ``info["_action_mask"]`` ask the method or allow every action),
    else each sub-env's ``action_masks()``; a Dict observation's ``"action_mask"`` entry (``obs``, the batch the
    env returned) comes first. ValueError for a mask of another shape or one that allows no action."""
    n = envs.num_envs
    masks = None
    if hasattr(obs, "keys") and MASK_KEY in obs:
        raw = np.asarray(obs[MASK_KEY])
        if raw.size != n * mask_dim:
            raise ValueError(f"observation['{MASK_KEY}'] has shape {raw.shape}, expected ({n}, {mask_dim})")
        masks = raw.reshape(n, mask_dim) != 0
    elif isinstance(info, dict) and "action_mask" in info:
        raw = info["action_mask"]
        if isinstance(raw, np.ndarray) and raw.dtype != object:
            masks = raw.reshape(n, -1) != 0 if raw.size == n * mask_dim else None
            if masks is None:
                raise ValueError(f"info['action_mask'] has shape {raw.shape}, expected ({n}, {mask_dim})")
        else:  # per-env objects (envs whose masks differ in type): each row on its own
            masks = np.ones((n, mask_dim), dtype=bool)
            for i, row in enumerate(raw):
                if row is not None:
                    masks[i] = _one_mask(row, mask_dim, i)
        present = info.get("_action_mask")
        if present is not None and not np.asarray(present, dtype=bool).all():
            masks = masks.copy()
            masks[~np.asarray(present, dtype=bool)] = True
    elif hasattr(envs, "action_masks"):
        masks = np.asarray(envs.action_masks()).reshape(n, -1) != 0
    elif _sub_env_has(envs, "action_masks"):
        masks = np.stack([_one_mask(m, mask_dim, i) for i, m in enumerate(envs.call("action_masks"))])
    else:  # an info-mask env whose step sent none this time: every action allowed
        masks = np.ones((n, mask_dim), dtype=bool)
    if masks.shape != (n, mask_dim):
        raise ValueError(f"action masks of shape {masks.shape}, expected ({n}, {mask_dim})")
    empty = ~masks.any(1)
    if empty.any():
        raise ValueError(f"the action mask of env {int(np.flatnonzero(empty)[0])} allows no action")
    return masks


def _one_mask(row: Any, mask_dim: int, i: int) -> np.ndarray:
    m = np.asarray(row).reshape(-1)
    if m.shape != (mask_dim,):
        raise ValueError(f"the action mask of env {i} has {m.size} entries, expected {mask_dim}")
    return m != 0


def allocate_buffer(policy: Any, num_steps: int, num_envs: int, device: torch.device,
                    mask_dim: int | None = None, obs_layout: Any = None) -> RolloutBuffer:
    """The rollout buffer for ``policy``'s observations and actions: ``[T, N]`` long actions (discrete),
    ``[T, N, k]`` long (multidiscrete, k sub-actions), ``[T, N, D]`` float32 (continuous); observations in the
    encoder's ``obs_layout`` (default: ``policy.obs_dim`` float32 features)."""
    if policy.kind == "continuous":
        action_shape: tuple[int, ...] = (policy.action_dims[0],)
    else:
        action_shape = () if policy.kind == "discrete" else (len(policy.action_dims),)
    action_dtype = torch.float32 if policy.kind == "continuous" else torch.long
    return RolloutBuffer.allocate(num_steps, num_envs, policy.obs_dim if obs_layout is None else obs_layout,
                                  action_shape, action_dtype, device, mask_dim)


def evaluate_first_episodes(envs: Any, policy: Any, actor: Callable, normalize: Callable, *, seed: int,
                            max_steps: int, env_id: str, global_step: int,
                            action_bounds: tuple[np.ndarray, np.ndarray] | None,
                            fail: Callable[[str, BaseException], EnvError], watchdog: Any = NO_WATCHDOG) -> float:
    """Mean return of the first episode of each env of ``envs``, acting deterministically on ``actor``'s output
    (logits or Gaussian mean: no critic, no log-prob), or on ``policy.act`` with its state for a stateful policy.
    ``fail(phase, exc)`` builds the error an env failure raises; ``watchdog`` bounds each reset and step
    (``envs.watchdog``)."""
    import gymnasium as gym

    from ppokit.envs.factory import autoreset_mode

    n, space = envs.num_envs, envs.single_observation_space
    masked = policy.kind != "continuous" and action_masks_available(envs)
    mask_dim = sum(policy.action_dims)
    try:
        with watchdog.guard("evaluation reset()"):
            obs, info = envs.reset(seed=seed)
        # Separate envs from the training ones: a mask sent only in info is seen here, at their first reset.
        masked = masked or (policy.kind != "continuous" and isinstance(info, dict) and "action_mask" in info)
        mask = read_action_masks(envs, info, mask_dim, obs=obs) if masked else None
        obs = check_obs_batch(obs, n, space, env_id, "evaluation reset()", global_step)
    except (Exception, EnvTimeout) as exc:  # noqa: BLE001
        raise fail("evaluation reset()", exc) from exc
    device = next(policy.parameters()).device
    total, running = np.zeros(n), np.ones(n, dtype=bool)
    state, episode_start, prev_done = policy.initial_state(n), np.ones(n, dtype=bool), np.zeros(n, dtype=bool)
    same_step = autoreset_mode(envs) == gym.vector.AutoresetMode.SAME_STEP
    for _ in range(max_steps):
        obs_t = obs_to_tensor(obs, device)
        mask_t = None if mask is None else torch.as_tensor(mask, device=device)
        with torch.inference_mode():
            if state is None:
                actions = policy.sample(mask_logits(actor(normalize(obs_t)), mask_t), deterministic=True)
            else:
                actions, _, _, state = policy.act(normalize(obs_t), state, episode_start, mask_t, deterministic=True)
        actions = actions.cpu().numpy()
        if action_bounds is not None:
            actions = np.clip(actions, *action_bounds)
        try:
            with watchdog.guard("evaluation step()"):
                obs, reward, terminated, truncated, info = envs.step(actions)
            mask = read_action_masks(envs, info, mask_dim, obs=obs) if masked else None
            obs = check_obs_batch(obs, n, space, env_id, "evaluation step()", global_step)
            reward, terminated, truncated = check_step_batch(reward, terminated, truncated, n, env_id, global_step,
                                                             "evaluation step()")
        except (Exception, EnvTimeout) as exc:  # noqa: BLE001
            raise fail("evaluation step()", exc) from exc
        # Only each env's first episode counts; whatever follows an autoreset is ignored.
        total += np.where(running, np.asarray(reward, dtype=np.float64), 0.0)
        done = np.asarray(terminated, dtype=bool) | np.asarray(truncated, dtype=bool)
        running &= ~done
        episode_start, prev_done = (done if same_step else prev_done), done
        if not running.any():
            break
    return float(total.mean())
