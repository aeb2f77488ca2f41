"""What went wrong inside an environment, said in one line: ``EnvError`` and the checks that raise it.

The trainer calls ``step()``/``reset()`` of a vector env and converts the results to arrays. When an env raises,
or returns something that is not what its spaces promise (a string or object observation, another shape, a
``None`` or array reward), numpy or Gymnasium fail several frames away with a message that names neither the env
nor the step. These helpers turn such failures into an ``EnvError`` naming the env id, the env index where it can
be found, the phase (``reset()``/``step()``), the global step, and what was expected against what came back.

Cost: the hot path only compares the shape and dtype kind of arrays the trainer converts anyway
(``batch_ok`` and its inline twin for observations); everything else runs once, after something has failed.
"""

from __future__ import annotations

import types
from typing import Any

import numpy as np

__all__ = ["EnvError", "batch_ok", "check_obs_batch", "check_step_batch", "checked_reset", "describe_step_result",
           "env_failure"]

# numpy dtype kinds an observation or reward may have: bool, signed/unsigned int, float.
_NUMERIC_KINDS = "biuf"


class EnvError(RuntimeError):
    """An environment raised or returned data that does not match its spaces, or did not return in time; the
    message says which and where. ``interrupted``: the run was ending on Ctrl-C when the env hung (exit 130)."""

    interrupted = False


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _describe_value(value: Any) -> str:
    """``'hello' (str)``, ``array of shape (5,) float32``: what an env returned, briefly."""
    if isinstance(value, np.ndarray):
        return f"array of shape {value.shape} and dtype {value.dtype}"
    return f"{_short(value)} ({type(value).__name__})"


def describe_obs(obs: Any, space: Any) -> str | None:
    """Why one sub-env's observation does not fit ``space`` (a Box or Discrete), or None when it does."""
    shape, dtype = getattr(space, "shape", None), getattr(space, "dtype", None)
    encoder = _value_checker(space)
    if encoder is not None and encoder.structured:  # one Dict/Tuple observation
        problem = encoder.problem(obs)
        return None if problem is None else f"{problem} ({space})"
    expected = f"expected a {dtype} array of shape {shape} ({space})"
    if isinstance(obs, (str, bytes)) or obs is None:
        return f"observation {_describe_value(obs)}, {expected}"
    try:
        arr = np.asarray(obs)
    except Exception:  # noqa: BLE001 - anything numpy cannot take is the answer itself
        return f"observation {_describe_value(obs)} is not array-like, {expected}"
    if arr.dtype.kind not in _NUMERIC_KINDS:
        return f"observation of dtype {arr.dtype} ({_short(obs)}), {expected}"
    if shape is not None and arr.shape != tuple(shape):
        return f"observation of shape {arr.shape}, {expected}"
    if encoder is not None:  # a Discrete observation: an integer in range (it is one-hot encoded); an image
        problem = encoder.problem(arr)
        return None if problem is None else f"{problem} ({space})"
    return None


def _value_checker(space: Any) -> Any:
    """The encoder of a Discrete (one-hot), image (uint8 CxHxW) or Dict/Tuple observation space, whose values
    are checked and encoded; None for a plain Box (a float32 flatten)."""
    from gymnasium import spaces

    from ppokit.envs.encoders import image_layout, observation_encoder

    if isinstance(space, (spaces.Discrete, spaces.Dict, spaces.Tuple)) or image_layout(space) is not None:
        # A Dict env's observations come through here every step: build its encoder once per space object (the
        # space is kept with it, so its id cannot be reused by another while cached).
        cached = _ENCODERS.get(id(space))
        if cached is None or cached[0] is not space:
            if len(_ENCODERS) > 64:
                _ENCODERS.clear()
            cached = _ENCODERS[id(space)] = (space, observation_encoder(space))
        return cached[1]
    return None


_ENCODERS: dict[int, tuple[Any, Any]] = {}


def describe_reward(reward: Any) -> str | None:
    """Why one sub-env's reward is not a real scalar, or None when it is (NaN is allowed: it is skipped)."""
    if reward is None or isinstance(reward, (str, bytes)):
        return f"reward {_describe_value(reward)}, expected a float"
    arr = np.asarray(reward) if not isinstance(reward, np.ndarray) else reward
    if arr.dtype.kind not in _NUMERIC_KINDS:
        return f"reward {_describe_value(reward)}, expected a float"
    if arr.shape != ():
        return f"reward {_describe_value(reward)}, expected a float scalar"
    return None


def describe_step_result(result: Any, obs_space: Any, stepping: bool = True) -> str | None:
    """Why one sub-env's ``step()`` (``stepping``: a 5-tuple) or ``reset()`` (a 2-tuple) result is malformed."""
    size, form = (5, "(obs, reward, terminated, truncated, info)") if stepping else (2, "(obs, info)")
    if not isinstance(result, tuple) or len(result) != size:
        return f"{_describe_value(result)}, expected a tuple {form}"
    problem = describe_obs(result[0], obs_space)
    if problem is None and stepping:
        problem = describe_reward(result[1])
        for name, flag in (("terminated", result[2]), ("truncated", result[3])):
            if problem is None and np.asarray(flag).shape != ():
                problem = f"{name} {_describe_value(flag)}, expected a bool"
    return problem


def _failing_index(envs: Any, tb: types.TracebackType | None) -> tuple[int | None, bool]:
    """(sub-env index, whether that sub-env itself raised) from the traceback of a vector env's failure.

    A Sync vector env loops ``for i, ...`` over its sub-envs; a frame of a ``VectorEnv`` method holding an int
    ``i`` gives the index when the exception came from that loop's body: from the sub-env's own call (its frame
    is next in the traceback) or from storing its result (raised in the loop frame itself). When the next frame
    is anything else (batching the observations after the loop), ``i`` is just the last index and means nothing.
    """
    import gymnasium as gym

    subs = getattr(envs, "envs", None)
    subs = subs if isinstance(subs, (list, tuple)) else []
    pipes = getattr(envs, "parent_pipes", None)
    if isinstance(pipes, list) and not subs:
        # An Async vector env closes (sets to None) the pipe of each worker that raised.
        failed = [i for i, pipe in enumerate(pipes) if pipe is None]
        return (failed[0] if len(failed) == 1 else None), True
    while tb is not None:
        local = tb.tb_frame.f_locals
        # Only a vector env that holds its sub-envs in a list (Sync) loops over them with ``i``.
        if (isinstance(local.get("self"), gym.vector.VectorEnv)
                and isinstance(getattr(local["self"], "envs", None), (list, tuple))
                and isinstance(local.get("i"), int)):
            i, callee = local["i"], tb.tb_next
            if callee is None:
                return i, False
            callee_self = callee.tb_frame.f_locals.get("self")
            if any(callee_self is sub for sub in subs):
                return i, True
        tb = tb.tb_next
    return None, False


def _probe(envs: Any, index: int | None, phase: str, raised_by_env: bool) -> tuple[int | None, str | None]:
    """After a failure, find which sub-env returned what (Sync vector envs only; the run is ending anyway).

    First the observations the vector env kept from each sub-env (``_env_obs``, Gymnasium 1.x), unless the
    sub-env itself raised (they are then the previous, good ones); then call the suspect sub-env's ``step()`` or
    ``reset()`` once more, through its wrappers and, if those raise (a 4-tuple breaks ``TimeLimit``), unwrapped,
    and look at what it returns. Only a malformed result counts: an env that just raises again tells nothing new.
    """
    subs = getattr(envs, "envs", None)
    space = getattr(envs, "single_observation_space", None)
    if not isinstance(subs, (list, tuple)) or space is None:
        return index, None
    kept = getattr(envs, "_env_obs", None)
    candidates = [index] if index is not None else list(range(len(subs)))
    if not raised_by_env and isinstance(kept, list) and len(kept) == len(subs):
        for i in candidates:
            # None is the placeholder of a sub-env that has not returned yet.
            problem = describe_obs(kept[i], space) if kept[i] is not None else None
            if problem is not None:
                return i, problem
    stepping = phase.endswith("step()")
    for i in candidates[:4]:
        for env in (subs[i], getattr(subs[i], "unwrapped", subs[i])):
            try:
                result = env.step(envs.single_action_space.sample()) if stepping else env.reset()
            except Exception:  # noqa: BLE001 - a probe that fails tells nothing more than the original error
                continue
            problem = describe_step_result(result, space, stepping)
            if problem is not None:
                return i, problem
            break
    return index, None


def env_failure(env_id: str, phase: str, global_step: int, exc: BaseException | None = None, envs: Any = None,
                detail: str | None = None) -> EnvError:
    """An ``EnvError`` for a failed ``phase`` ("reset()"/"step()") at ``global_step``; ``exc`` is what was raised.

    The message: ``env 'X' (env index 1) failed in step() at global step 1,234: returned observation 'hi' (str),
    expected a float32 array of shape (3,) (Box(...))``. The index and the expected-vs-got part are found where
    the vector env lets us (see ``_probe``); otherwise the original exception's type and message are given.
    ``detail`` (without ``exc``) is a problem found on the batched arrays; ``envs`` is then probed for more.
    """
    if isinstance(exc, EnvError):
        return exc
    from ppokit.envs.watchdog import EnvTimeout, pending_workers

    if isinstance(exc, EnvTimeout):
        # A hung env is never called again (a probe would hang too): the index is the sub-env whose frame the
        # interruption landed in (sync), or the worker that has not answered (async).
        index = _failing_index(envs, exc.__traceback__)[0] if getattr(envs, "envs", None) is not None else None
        pending = [index] if index is not None else pending_workers(envs, exc.__traceback__)
        where = f"env {env_id!r}" + (f" (env index {pending[0]})" if len(pending) == 1 else
                                     f" (env indices {', '.join(map(str, pending))})" if pending else "")
        error = EnvError(f"{where} failed in {phase} at global step {global_step:,}: {exc.reason}")
        error.interrupted = exc.interrupted
        return error
    index, raised_by_env = _failing_index(envs, exc.__traceback__) if exc is not None else (None, False)
    found = None
    if envs is not None:
        try:
            index, found = _probe(envs, index, phase, raised_by_env)
        except Exception:  # noqa: BLE001 - diagnosis must never hide the original error
            found = None
    if found is not None:
        problem = f"returned {found}" + (f" ({detail})" if detail else "")
    elif detail is not None:
        problem = detail
    else:
        message = " ".join(str(exc).split()) or "(no message)"
        problem = f"raised {type(exc).__name__}: {message}"
    where = f"env {env_id!r}" + (f" (env index {index})" if index is not None else "")
    return EnvError(f"{where} failed in {phase} at global step {global_step:,}: {problem}")


def check_obs_batch(obs: Any, num_envs: int, space: Any, env_id: str, phase: str, global_step: int) -> np.ndarray:
    """The batched observation encoded (a flat ``[N, obs_dim]`` float32 array for a Box; see ``ppokit.envs.encoders``
    for the others), or an ``EnvError`` saying what is wrong.

    The trainer calls this only when the cheap test (an ndarray of the expected shape and a numeric dtype) fails,
    so well-behaved envs never pay for it; a list or tensor of the right shape is still accepted. A Discrete
    observation must hold integers in the space's range and comes back one-hot encoded (``ppokit.envs.encoders``).
    """
    structured = _value_checker(space)
    if structured is not None and structured.structured:  # a Dict/Tuple: each entry checked, then encoded
        problem = structured.problem(obs, num_envs)
        if problem is not None:
            raise env_failure(env_id, phase, global_step, detail=f"returned {problem} ({num_envs} envs x {space})")
        return structured.encode(obs, num_envs)
    expected = (num_envs, *space.shape)
    try:
        arr = np.asarray(obs)
    except Exception as exc:  # noqa: BLE001
        raise env_failure(env_id, phase, global_step, detail=f"returned observations {_describe_value(obs)} that "
                          f"are not array-like ({exc}), expected shape {expected}") from None
    if arr.dtype.kind not in _NUMERIC_KINDS:
        raise env_failure(env_id, phase, global_step, detail=f"returned observations of dtype {arr.dtype} "
                          f"({_short(obs)}), expected {space.dtype} of shape {expected} ({space})")
    if arr.shape != expected:
        raise env_failure(env_id, phase, global_step, detail=f"returned observations of shape {arr.shape}, "
                          f"expected {expected}: {num_envs} envs x {space}")
    encoder = _value_checker(space)
    if encoder is not None:
        problem = encoder.problem(arr)
        if problem is not None:
            raise env_failure(env_id, phase, global_step, detail=f"returned {problem}")
        return encoder.encode(arr, num_envs)
    return arr.astype(np.float32, copy=False).reshape(num_envs, -1)


def check_step_batch(reward: Any, terminated: Any, truncated: Any, num_envs: int, env_id: str, global_step: int,
                     phase: str = "step()") -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rewards (float64) and terminated/truncated (bool), each ``[N]``, or an ``EnvError`` naming the bad one."""
    out = []
    for name, value, dtype in (("rewards", reward, np.float64), ("terminated", terminated, bool),
                               ("truncated", truncated, bool)):
        try:
            arr = np.asarray(value)
        except Exception:  # noqa: BLE001
            arr = np.asarray(None)
        if arr.dtype.kind not in _NUMERIC_KINDS or arr.shape != (num_envs,):
            raise env_failure(env_id, phase, global_step, detail=f"returned {name} {_describe_value(value)}, "
                              f"expected {num_envs} {'floats' if name == 'rewards' else 'bools'} (shape "
                              f"({num_envs},))")
        out.append(arr.astype(dtype, copy=False))
    return out[0], out[1], out[2]


def batch_ok(value: Any, num_envs: int) -> bool:
    """The hot-path test for rewards/terminated/truncated: a numeric ``[N]`` ndarray (anything else is checked)."""
    return type(value) is np.ndarray and value.shape == (num_envs,) and value.dtype.kind in _NUMERIC_KINDS


def checked_reset(envs: Any, env_id: str, num_envs: int, seed: int | None) -> np.ndarray:
    """``envs.reset(seed=seed)``'s observations as a flat ``[N, obs_dim]`` float32 array, or an ``EnvError``."""
    try:
        obs, _ = envs.reset(seed=seed)
    except Exception as exc:  # noqa: BLE001 - whatever the env raised, say which env and where
        raise env_failure(env_id, "reset()", 0, exc, envs) from exc
    return check_obs_batch(obs, num_envs, envs.single_observation_space, env_id, "reset()", 0)
