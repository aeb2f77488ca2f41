"""Evaluation on the env-stepping loop: the first episode of each env, acting without a critic or a log-prob.

The evaluation gate (``evaluate_first_episodes``, the trainer's ``eval_every``) and ``Agent.evaluate`` (one env,
an episode per seed) step their envs with ``loop.EnvLoop``, so autoreset, NaN/Inf, the env checks, masks and the
policy's state are handled as in the rollout; what is theirs is the acting strategy (``policy_actor``: the
deterministic action, or a sample) and counting each env's first episode (``first_episodes``).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np
import torch

from ppokit.envs.encoders import obs_to_tensor
from ppokit.envs.errors import EnvError
from ppokit.envs.masks import action_masks_available
from ppokit.envs.watchdog import NO_WATCHDOG, EnvTimeout
from ppokit.policies import mask_logits
from ppokit.rollout.loop import EnvLoop, Step

__all__ = ["evaluate_first_episodes", "first_episodes", "policy_actor"]


def policy_actor(policy: Any, actor: Callable, normalize: Callable, device: torch.device,
                 deterministic: bool = True) -> Callable[[EnvLoop], np.ndarray]:
    """The acting strategy of an evaluation: ``act(loop)`` -> the env's actions for ``loop``'s observations, from
    ``actor``'s output (logits or Gaussian mean: no critic, no log-prob), or from ``policy.act`` with its state for
    a stateful policy; ``normalize`` is the frozen observation normalization."""

    def act(loop: EnvLoop) -> np.ndarray:
        obs_t = normalize(obs_to_tensor(loop.next_obs_raw, device))
        mask_t = None if loop.next_mask is None else torch.as_tensor(loop.next_mask, device=device)
        with torch.inference_mode():
            if loop.policy_state is None:
                actions = policy.sample(mask_logits(actor(obs_t), mask_t), deterministic=deterministic)
            else:
                actions, _, _, loop.policy_state = policy.act(obs_t, loop.policy_state, loop.episode_start, mask_t,
                                                              deterministic=deterministic)
        return loop.env_actions(actions)

    return act


def first_episodes(envs: Any, policy: Any, act: Callable[[EnvLoop], np.ndarray], *, seed: int | None,
                   max_steps: int, env_id: str, fail: Callable[[str, int, BaseException], BaseException],
                   watchdog: Any = NO_WATCHDOG, step: int = 0, stride: int | None = None,
                   phase_prefix: str = "") -> tuple[np.ndarray, np.ndarray, int]:
    """``(returns, lengths, step)`` of the first episode of each env of ``envs`` (reset with ``seed``), at most
    ``max_steps`` steps (an env still running then: its return so far). Returns are over the valid steps
    (``EnvLoop``: a NaN/Inf step counts nothing); ``step`` is the step count the failure messages name, advanced by ``stride``
    (``EnvLoop.run``). ``fail(phase, step, exc)`` builds the error an env failure raises."""
    reset_phase = f"{phase_prefix}reset()"
    try:
        with watchdog.guard(reset_phase):
            obs, info = envs.reset(seed=seed)
        # Separate envs from the training ones: a mask sent only in info is seen here, at their first reset.
        masked = policy.kind != "continuous" and (action_masks_available(envs)
                                                  or (isinstance(info, dict) and "action_mask" in info))
        loop = EnvLoop(envs, policy, env_id=env_id, fail=lambda phase, at, exc, detail: fail(phase, at, exc),
                       masked=masked, phase_prefix=phase_prefix)
        loop.start(obs, info, reset_phase, step)
    except (Exception, EnvTimeout) as exc:  # noqa: BLE001
        raise fail(reset_phase, step, exc) from exc
    loop.watchdog, loop.keep_final_returns = watchdog, True
    n = envs.num_envs
    returns, lengths, running = np.zeros(n), np.zeros(n, dtype=np.int64), np.ones(n, dtype=bool)

    def count(t: int, r: Step) -> bool:
        # Only each env's first episode counts; whatever follows an autoreset is ignored.
        if r.final_returns is not None:
            ended = r.done & running
            returns[ended], lengths[ended] = r.final_returns[ended], r.final_lengths[ended]
            running[ended] = False
        return bool(running.any())

    step, _ = loop.run(max_steps, lambda t: act(loop), count, step, stride)
    returns[running], lengths[running] = loop.ep_return[running], loop.ep_length[running]
    return returns, lengths, step


def evaluate_first_episodes(envs: Any, policy: Any, actor: Callable, normalize: Callable, *, seed: int,
                            max_steps: int, env_id: str, global_step: int,
                            fail: Callable[[str, BaseException], EnvError], watchdog: Any = NO_WATCHDOG,
                            deterministic: bool = True) -> float:
    """The evaluation gate: mean return of the first episode of each env of ``envs``, acting on the most likely
    action / the mean, or (``deterministic=False``) on a sample drawn in a forked RNG seeded with ``seed``, so that
    the training run's random stream is the same either way (``policy_actor``). ``fail(phase, exc)`` builds the
    error an env failure raises; ``watchdog`` bounds each reset and step (``envs.watchdog``)."""
    device = next(policy.parameters()).device

    def run() -> float:
        returns, _, _ = first_episodes(envs, policy, policy_actor(policy, actor, normalize, device, deterministic),
                                       seed=seed, max_steps=max_steps, env_id=env_id,
                                       fail=lambda phase, at, exc: fail(phase, exc), watchdog=watchdog,
                                       step=global_step, stride=0,  # the messages name the training step
                                       phase_prefix="evaluation ")
        return float(returns.mean())

    if deterministic:
        return run()
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        return run()
