"""The one-env rollout on a CPU device: ``Collector.collect``'s loop, bit for bit, with scalar bookkeeping.

It is the env-stepping loop's one-env strategy: what a step means (transition or not, NaN/Inf, the episode
statistics, ``episode_start``) is decided by ``loop.one_env_step``, the scalar twin of ``loop.EnvLoop.step``.

With one environment (MuJoCo's usual setting, the ``mujoco`` preset) the general loop handles every step's
results as ``[1]``-shaped numpy arrays and ``[1, ...]`` tensors: some thirty array ops, four tensor copies into
the buffer and the vector env's own batching, each a microsecond or more for one value. Measured on Hopper-v5
that came to more than the env's own step (see ``benchmarks/bench_step_overhead.py``). This loop computes the
same things on Python scalars:

* the env is stepped by ``envs.factory.step_one_env`` (``SyncVectorEnv.step`` for its one sub-env, the vector
  env's state written as its own step writes it, no info dict built);
* the acting kernel writes actions, log-prob and value straight into the buffer's rows (``ActingKernel.act``'s
  ``out``), and acts on the buffer's observation row, where the normalized observation was written;
* rewards, flags and episode statistics are Python floats and bools (the same IEEE-754 double arithmetic as the
  general loop's float64 arrays), written into numpy views of the buffer;
* the normalizers are the host ones (``hostnorm``), as in the general loop with one env;
* the policy's state and ``episode_start`` are carried as there, ``episode_start`` one of two read-only ``[1]``
  arrays (no array made per step).

What it handles is what the general loop handles for such an env: both autoreset modes, NaN/Inf from the env
(counted, zeroed, not trained on), the SAME_STEP truncation bootstrap, the env checks (a malformed result fails
in the vector env's own batching, as there) and the loop state a checkpoint holds, written back before any
failure is raised. ``applies`` says when it runs; ``Collector.one_env_path = False`` forces the general loop.
``tests/test_single_env_fastpath.py`` compares whole runs of both.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from ppokit.envs.encoders import BoxEncoder
from ppokit.envs.factory import one_env_steppable, step_one_env
from ppokit.envs.watchdog import EnvTimeout
from ppokit.rollout.loop import one_env_step

__all__ = ["applies", "collect_one_env"]

# ``episode_start`` of the one env, indexed by the flag: the arrays are shared, so nobody may write them.
_EPISODE_START = (np.zeros(1, dtype=bool), np.ones(1, dtype=bool))
for _flag in _EPISODE_START:
    _flag.flags.writeable = False


def applies(c: Any) -> bool:
    """Whether collector ``c`` can run this loop: one in-process env (``one_env_steppable``) with Box observations
    encoded as plain float32 rows, on a CPU device, no action masks, and the normalizers (if any) on the host."""
    return (c.num_envs == 1 and c.device.type == "cpu" and not c.masked and type(c.encoder) is BoxEncoder
            and c.policy.kind in ("continuous", "discrete") and one_env_steppable(c.envs)
            and (c.host_norm is not None or (c.obs_norm is None and c.reward_scaler is None)))


def collect_one_env(c: Any, global_step: int) -> tuple[list[tuple[float, int]], int] | None:
    """``Collector.collect(global_step)`` of the one-env collector ``c`` (``applies(c)``), or None (nothing done)
    when the host normalizers cannot be used for this rollout (``HostNormalizers.load``)."""
    hn = c.host_norm
    if hn is not None and not hn.load():
        return None
    buf, envs, T = c.buffer, c.envs, c.num_steps
    obs_norm, scaler = (c.obs_norm, c.reward_scaler) if hn is not None else (None, None)
    t_start = time.perf_counter()
    rollout_start = step = global_step
    act = c.acting.act
    state, episode_start = c.policy_state, c.episode_start
    watchdog = c.watchdog
    kernel = getattr(c.acting, "writes_into_out", False)  # an acting object that takes ``out=`` says so
    # numpy views of the buffer (CPU tensors share their memory); the rows the step-t results go to.
    obs_np = buf.obs.numpy()[:, 0]  # [T, D]: step t's row is what the policy acts on at step t
    obs_rows = buf.obs.unbind(0)  # [1, D] tensor views of the same rows
    act_rows, logp_rows, value_rows = buf.actions.unbind(0), buf.logp.unbind(0), buf.values.unbind(0)
    act_np = buf.actions.numpy()
    rew_np, term_np, trunc_np, valid_np = (x.numpy()[:, 0] for x in (buf.rewards, buf.terminated, buf.truncated,
                                                                    buf.valid))
    buf.has_final.zero_()
    last = torch.empty_like(obs_rows[0])  # the observation after the rollout (GAE's bootstrap), not a buffer row
    last_np = last.numpy()[0]
    bounds = c.action_bounds
    low, high = bounds if bounds is not None else (None, None)
    same_step, encoder = c.same_step, c.encoder
    inference = torch.inference_mode()
    # The loop state as scalars; written back to the collector at the end and before any failure is raised.
    ep_ret, ep_len, prev_done = float(c.ep_return[0]), int(c.ep_length[0]), bool(c.prev_done[0])
    next_raw = c.next_obs_raw
    ep_returns: list[float] = []
    ep_lengths: list[int] = []
    nonfinite, any_valid = 0, False
    t_inference = 0.0

    def write_back() -> None:
        c.ep_return[0], c.ep_length[0], c.prev_done[0] = ep_ret, ep_len, prev_done
        c.next_obs_raw, c.policy_state, c.episode_start = next_raw, state, episode_start

    def normalized_into(dest: np.ndarray, raw: np.ndarray, update: bool) -> None:
        if obs_norm is None:
            dest[...] = raw[0]
            return
        if update:
            hn.update_obs(raw)
        dest[...] = hn.normalize(raw)[0]

    # Step 0 acts on the observation the last rollout (or the reset) left, normalized by the current statistics.
    normalized_into(obs_np[0], next_raw, update=False)
    stateful = buf.policy_state is not None
    refresh = c.refresh
    for t in range(T):
        t0 = time.perf_counter()
        if refresh is not None:
            refresh(t)
        if stateful:  # what act is given: a sequence minibatch replays each chunk from it
            buf.record_state(t, state, episode_start)
        if kernel:
            with inference:
                state = act(obs_rows[t], state, episode_start, out=(act_rows[t], logp_rows[t], value_rows[t]))[3]
        else:
            with inference:
                actions, logp, values, state = act(obs_rows[t], state, episode_start)
            act_rows[t].copy_(actions)
            logp_rows[t].copy_(logp)
            value_rows[t].copy_(values)
        env_action = act_np[t]
        if low is not None:
            # The log-prob is of the unclipped sample; only the env sees the clipped action.
            env_action = np.minimum(np.maximum(env_action, low), high)
        t1 = time.perf_counter()
        t_inference += t1 - t0
        try:
            watchdog.arm("step()")
            batch_obs, reward, terminated, truncated, final_obs = step_one_env(envs, env_action[0])
            watchdog.disarm()
        except (Exception, EnvTimeout) as exc:  # noqa: BLE001 - any env failure ends the run in one line
            watchdog.disarm()
            write_back()
            raise c.fail(step, rollout_start, exc) from exc
        step += 1
        raw = batch_obs.astype(np.float32).reshape(1, -1)  # the encoder's conversion; a fresh array
        # The loop's decisions (loop.py): transition or not, NaN/Inf, the episode statistics, episode_start.
        valid, bad, done, reward, raw, ep_ret, ep_len, finished, start = one_env_step(
            encoder, same_step, prev_done, ep_ret, ep_len, reward, raw, terminated, truncated)
        if bad:
            nonfinite += 1
        elif valid:
            any_valid = True
        if finished is not None:
            ep_returns.append(finished[0])
            ep_lengths.append(finished[1])
        episode_start = _EPISODE_START[start]
        prev_done = done
        rew_np[t] = hn.scale(reward, done) if scaler is not None else reward
        term_np[t], trunc_np[t], valid_np[t] = terminated, truncated, valid
        normalized_into(obs_np[t + 1] if t + 1 < T else last_np, raw, update=not bad)
        if same_step and truncated:
            info = envs._add_info({}, {"final_obs": final_obs}, 0)  # the vector env's own info["final_obs"]
            write_back()  # an unusable final observation fails (and saves) from here, as in the general loop
            c._bootstrap_truncated(t, np.ones(1, dtype=bool), info, step, rollout_start, state)
        next_raw = raw
    write_back()
    if nonfinite and not any_valid:
        # Every step was NaN/Inf (a None reward becomes NaN in a vector env): nothing to train on.
        raise c.fail(step, rollout_start, detail=(
            f"every step of this rollout had a NaN/Inf/None reward or observation ({nonfinite} steps); "
            "nothing to train on"))
    c.last_obs = last
    c.perf["inference"] += t_inference
    c.perf["env"] += time.perf_counter() - t_start - t_inference
    return list(zip(ep_returns, ep_lengths)), nonfinite
