"""Building and validating the environments the trainer runs on."""

from __future__ import annotations

import dataclasses
import difflib
import importlib
import os
import sys
from typing import Any, Callable

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from gymnasium.envs.registration import EnvSpec

from ppokit.envs.backends import backend_names, get_backend, register_backend
from ppokit.envs.envpool_backend import make_envpool
from ppokit.envs.watchdog import async_kwargs

# The env_id recorded for a custom env without a registered spec: "custom:MyEnv" (MyEnv: its unwrapped class).
CUSTOM_PREFIX = "custom"


def _split_module(env_id: str) -> tuple[str | None, str]:
    """``"module:Env-v0"`` -> ``("module", "Env-v0")``; Gymnasium's own split allows exactly one colon."""
    module, sep, name = env_id.partition(":")
    return (module, name) if sep else (None, env_id)


def _import_env_module(env_id: str, module: str) -> None:
    """Import the module a ``"module:Env-v0"`` id names (it registers the env), with a one-line ValueError on failure.

    Only ids the user typed get here: a stored id (checkpoint, run dir) is refused before, in
    ``checkpoint.check_stored_env_id``, unless the user allowed its module.
    """
    if not module or ":" in env_id.partition(":")[2]:
        raise ValueError(f"env id {env_id!r} is malformed: the form is 'module:EnvName-v0' (one colon)")
    try:
        _import_from_cwd(module)
    except ModuleNotFoundError as exc:
        if exc.name and (module == exc.name or module.startswith(exc.name + ".")):
            hint = (f"; {env_id!r} may be the record of a run trained on an env passed to ppokit.train(env=...), "
                "which must be passed again") if module == CUSTOM_PREFIX else ""
        raise ValueError(f"env id {env_id!r}: there is no module named {module!r} to import "
                         "(the form 'module:EnvName-v0' imports module, which must register EnvName-v0)"
                         f"{hint}") from None
        raise ValueError(f"env id {env_id!r}: importing module {module!r} failed: {exc}") from None
    except Exception as exc:  # noqa: BLE001 - whatever the module raises, the user gets one line, not its traceback
        raise ValueError(f"env id {env_id!r}: importing module {module!r} failed: "
                         f"{type(exc).__name__}: {exc}") from None


def _import_from_cwd(module: str) -> None:
    """Import ``module`` the way ``python -m`` would find it: the current directory first.

    The installed ``ppokit`` console script puts its own bin directory on sys.path, not the current directory, so
    ``ppokit train --env mymod:MyEnv-v0`` next to ``mymod.py`` would not find it. The directory goes first only for
    this import (the module the user named is the one in the directory they work in), then stays at the end of
    sys.path, where the module's lazy imports (a registration's ``entry_point="mymod.envs:MyEnv"``, async workers
    started by spawn) still find it but nothing installed is shadowed later.
    """
    cwd = os.getcwd()
    if "" in sys.path or cwd in sys.path:
        importlib.import_module(module)
        return
    sys.path.insert(0, cwd)
    try:
        importlib.import_module(module)
    finally:
        sys.path.remove(cwd)
        sys.path.append(cwd)


def _ensure_registered() -> None:
    # The factory can be imported on its own (e.g. in a subprocess); the GridWorld must exist first.
    from ppokit.envs.registration import register_envs

    register_envs()


def check_env_id(env_id: str) -> None:
    """Raise ValueError naming the closest registered ids if ``env_id`` is not registered."""
    if not isinstance(env_id, str) or not env_id:
        raise ValueError(f"env_id must be a non-empty string, got {env_id!r}")
    _ensure_registered()
    from ppokit.envs.atari import register_ale

    register_ale(env_id)  # ALE/... ids exist once ale-py is imported (only Atari-looking ids import it)
    module, name = _split_module(env_id)
    if module is not None:
        # "module:Env-v0" registers Env-v0 by importing module (the user named it on the command line).
        _import_env_module(env_id, module)
        if name in gym.registry:
            return
        raise ValueError(f"Unknown environment id {name!r}: module {module!r} was imported but registered no env "
                         f"of that name. {_suggest(name)}")
    if env_id in gym.registry:
        quiet_mujoco(env_id)
        return
    raise ValueError(
        f"Unknown environment id {env_id!r}. {_suggest(env_id)} "
        "(Environments from other packages need that package imported, or an id of the form 'module:EnvName-v0'.)"
    )


# MuJoCo >= 3.4 warns on every compile of a model that sets compiler/settotalmass (HalfCheetah's XML in Gymnasium's
# assets), once per env built: a deprecation of the asset, nothing the user can act on. Only that message is
# dropped; every other MuJoCo warning is printed as MuJoCo's own handler prints it.
_MUJOCO_QUIET = ("compiler attribute 'settotalmass' is deprecated",)


def quiet_mujoco(env_id: str) -> None:
    """For a Gymnasium MuJoCo env id: install (once per process, before any model compiles; forked async workers
    inherit it) a MuJoCo warning handler that drops the messages of ``_MUJOCO_QUIET``."""
    global _mujoco_quieted
    if _mujoco_quieted:
        return
    entry = getattr(gym.registry.get(env_id), "entry_point", None)
    if not (isinstance(entry, str) and entry.startswith("gymnasium.envs.mujoco")):
        return
    try:
        import mujoco
    except ImportError:
        return  # building the env says what is missing
    previous = mujoco.get_mju_user_warning()

    def warning(message: str) -> None:
        if any(text in message for text in _MUJOCO_QUIET):
            return
        if previous is not None:
            previous(message)
        else:
            print(f"WARNING: {message}", file=sys.stderr)

    mujoco.set_mju_user_warning(warning)
    _mujoco_quieted = True


_mujoco_quieted = False


def _suggest(env_id: str) -> str:
    """"Did you mean ...?" with the closest registered ids, or how to list them."""
    ids = list(gym.registry.keys())
    # Compare case-insensitively so "cartpole-v1" still finds "CartPole-v1".
    by_lower: dict[str, str] = {}
    for i in ids:
        by_lower.setdefault(i.lower(), i)
    close = difflib.get_close_matches(env_id.lower(), list(by_lower), n=5, cutoff=0.6)
    suggestions = [by_lower[c] for c in close]
    if suggestions:
        return "Did you mean: " + ", ".join(repr(s) for s in suggestions) + "?"
    return "Run `python -c \"import gymnasium; gymnasium.pprint_registry()\"` to list the registered ids."


def _get_spec(env_id: str) -> EnvSpec:
    module, name = _split_module(env_id)
    if module is not None:
        _import_env_module(env_id, module)
    return gym.spec(name)


def autoreset_mode(env: Any) -> gym.vector.AutoresetMode:
    """Autoreset mode a vector env declares in ``env.metadata`` (NEXT_STEP when it declares none)."""
    mode = getattr(env, "metadata", {}).get("autoreset_mode", gym.vector.AutoresetMode.NEXT_STEP)
    if isinstance(mode, gym.vector.AutoresetMode):
        return mode
    try:
        return gym.vector.AutoresetMode(mode)
    except ValueError:
        # Also accept the member name, e.g. "SAME_STEP", which is what people tend to write by hand.
        try:
            return gym.vector.AutoresetMode[str(mode)]
        except KeyError:
            raise ValueError(f"unrecognised autoreset_mode {mode!r} in env.metadata") from None


def check_spaces(env: Any) -> str:
    """Return "discrete" | "continuous" | "multidiscrete" from the (single) action space; ValueError if unsupported."""
    # A vector env describes one sub-env in single_*; a plain gym.Env only has the unbatched spaces.
    act = getattr(env, "single_action_space", None)
    act = env.action_space if act is None else act
    obs = getattr(env, "single_observation_space", None)
    obs = env.observation_space if obs is None else obs

    if isinstance(obs, (spaces.Dict, spaces.Tuple)):
        from ppokit.envs.encoders import observation_encoder

        observation_encoder(obs)  # one encoder per entry (ppokit.envs.encoders); ValueError naming an unsupported one
    elif isinstance(obs, spaces.Discrete):
        # One-hot encoded on entry (ppokit.envs.encoders); a Discrete of no values has nothing to encode.
        if int(obs.n) < 1:
            raise ValueError(f"Unsupported observation space {obs}: it has no values.")
    elif not isinstance(obs, spaces.Box):
        raise ValueError(
            f"Unsupported observation space {obs}: ppokit supports Box observations (flat vectors or images) and "
            "Discrete ones (one-hot encoded)."
        )
    elif int(np.prod(obs.shape)) == 0:
        # A policy over zero inputs cannot be built (torch fails deep inside with an unrelated message).
        raise ValueError(f"Unsupported observation space {obs}: it has no elements (shape {obs.shape}).")

    if isinstance(act, spaces.Discrete):
        # The policy samples indices 0..n-1; a shifted start would silently send wrong actions.
        if int(act.start) != 0:
            raise ValueError(f"Unsupported action space {act}: Discrete spaces must start at 0.")
        if int(act.n) < 1:
            raise ValueError(f"Unsupported action space {act}: a Discrete space needs at least one action.")
        return "discrete"
    if isinstance(act, spaces.MultiDiscrete):
        if act.nvec.ndim != 1:
            raise ValueError(f"Unsupported action space {act}: MultiDiscrete must have a 1-D nvec.")
        if (act.start != 0).any():
            raise ValueError(f"Unsupported action space {act}: MultiDiscrete spaces must start at 0.")
        if act.nvec.size == 0 or (act.nvec < 1).any():
            raise ValueError(f"Unsupported action space {act}: every MultiDiscrete dimension needs >= 1 action.")
        return "multidiscrete"
    if isinstance(act, spaces.Box):
        if len(act.shape) != 1:
            raise ValueError(
                f"Unsupported action space {act}: continuous actions must be a 1-D Box, got shape {act.shape}."
            )
        if act.shape[0] == 0:
            raise ValueError(f"Unsupported action space {act}: a continuous action needs at least one dimension.")
        return "continuous"
    raise ValueError(
        f"Unsupported action space {type(act).__name__} ({act}): ppokit supports Discrete, "
        "MultiDiscrete and 1-D Box action spaces."
    )


class CustomEnv:
    """An env the caller passed as a Python object, not a registered id: a zero-arg factory or one instance.

    Calling it builds one env (the instance is handed out as it is). ``name`` is what the run records as its
    env_id: the env's registered spec id when it has one (``gym.make(...)`` wrapped by the caller), else
    ``"custom:<unwrapped class>"``; ``record()`` goes into the checkpoint so that a resume or an evaluation knows
    the same env must be passed again (the record alone never rebuilds it).
    """

    def __init__(self, env: Any):
        self.kind = "instance" if isinstance(env, gym.Env) else "factory"
        self._env = env
        # Until the first env exists, errors name the factory itself ("custom:make_env", "custom:<lambda>").
        self.name = _record_name(env) if self.kind == "instance" else (
            f"{CUSTOM_PREFIX}:{getattr(env, '__qualname__', None) or type(env).__name__}")

    def __call__(self) -> gym.Env:
        env = self._env if self.kind == "instance" else self._env()
        if not isinstance(env, gym.Env):
            raise ValueError(f"the env factory {self.name} returned {type(env).__name__}, not a gymnasium.Env "
                             "(it must be a zero-argument callable returning one env)")
        self.name = _record_name(env)
        return env

    def record(self) -> dict[str, str]:
        """What a checkpoint keeps: the kind and the recorded name (plain strings)."""
        return {"kind": self.kind, "name": self.name}

    def __getstate__(self) -> dict:
        # An async worker gets a pickled copy of the factory; an instance never travels (sync only).
        if self.kind == "instance":
            raise TypeError("an env instance cannot be sent to a subprocess")
        return dict(self.__dict__)


def _record_name(env: gym.Env) -> str:
    spec = getattr(env, "spec", None)
    if spec is not None and getattr(spec, "id", None):
        return str(spec.id)
    return f"{CUSTOM_PREFIX}:{type(env.unwrapped).__name__}"


def describe_custom(record: Any) -> str:
    """``"an env factory (recorded as 'custom:MyEnv')"`` for a checkpoint's custom-env record."""
    record = record if isinstance(record, dict) else {}
    kind = "an env instance" if record.get("kind") == "instance" else "an env factory"
    return f"{kind} passed to ppokit.train(env=...) (recorded as {str(record.get('name', '?'))!r})"


def resolve_env(env: Any, config: Any) -> tuple[Any, CustomEnv | None]:
    """``(config, custom)`` for ``train(config, env=...)``: ``env`` is None (the config's env_id), a registered id,
    a zero-arg factory or a ``gymnasium.Env`` instance (wrappers included).

    An id replaces ``config.env_id``; a factory or an instance gives a ``CustomEnv`` and a config whose env_id is
    its provisional name (the trainer records the final one once the env exists). The config is copied, never
    changed in place. Combinations a custom env cannot serve raise ``ConfigError`` naming the field.
    """
    from ppokit.core.errors import ConfigError

    if env is None:
        return config, None
    if isinstance(env, str):
        return dataclasses.replace(config, env_id=env), None
    if isinstance(env, gym.vector.VectorEnv):
        raise ValueError("env: a vector env instance is not supported; pass a zero-argument factory that returns "
                         "one env (ppokit builds num_envs of them) or a registered id")
    if not (isinstance(env, gym.Env) or callable(env)):
        raise ValueError(f"env must be a registered id, a zero-argument callable returning a gymnasium.Env, or a "
                         f"gymnasium.Env instance, got {type(env).__name__}")
    custom = CustomEnv(env)
    config = dataclasses.replace(config, env_id=custom.name)
    if config.env_kwargs:
        raise ConfigError("env_kwargs", f"is set ({config.env_kwargs}) but the env is a Python object, not an id "
                                        "built by gym.make; give those arguments to your factory instead")
    if get_backend(config.vector_mode).from_factories is None:
        modes = " or ".join(map(repr, factory_modes()))
        raise ConfigError("vector_mode", f"{config.vector_mode!r} builds envs from a registered id; an env passed "
                                         f"as a Python object runs with vector_mode {modes}")
    if custom.kind == "instance":
        # One object is one environment: N envs need N objects, and a deep copy of an arbitrary env (open files,
        # simulators, sockets, shared RNGs) is not safe to assume, so none is made.
        why = "an env instance is one environment and is not copied (deep-copying an env is not safe)"
        fix = "pass a factory instead, e.g. env=lambda: MyEnv()"
        if config.num_envs != 1:
            raise ConfigError("num_envs", f"is {config.num_envs}, but {why}; use num_envs = 1 or {fix}")
        if config.vector_mode != "sync":
            raise ConfigError("vector_mode", f"{config.vector_mode!r} would copy the instance into a subprocess; "
                                             f"use 'sync' or {fix}")
        if config.eval_every:
            raise ConfigError("eval_every", f"the evaluation gate needs envs of its own, but {why}; set "
                                            f"eval_every = 0 or {fix}")
    return config, custom


def _env_kwargs_error(env_id: str, kwargs: dict, exc: BaseException) -> ValueError:
    """The env's constructor refused ``env_kwargs``: one line naming the field (Gymnasium raises a TypeError for
    an unknown keyword; an env may raise a KeyError for a value it does not know, as FrozenLake for a map_name)."""
    from ppokit.core.errors import ConfigError

    text = str(exc).split(" was raised from the environment creator")[0]  # Gymnasium appends all the kwargs
    return ConfigError("env_kwargs", f"{env_id} refused {kwargs}: {type(exc).__name__}: {text}")


def make_vec_env(
    env_id: str,
    num_envs: int,
    seed: int | None,
    vector_mode: str = "sync",
    env_kwargs: dict[str, Any] | None = None,
    env_fn: Callable[[], gym.Env] | None = None,
) -> gym.vector.VectorEnv:
    """Build ``num_envs`` envs, un-reset, with the backend ``vector_mode`` names (``backends.py``): "sync"/"async"
    with SAME_STEP autoreset, "native" the env's own vector class, "envpool" the optional envpool package
    (NEXT_STEP autoreset), or any other registered one.

    ``env_kwargs`` go to the env's constructor (gym.make_vec / envpool.make); ``env_fn`` (a zero-arg callable,
    e.g. a ``CustomEnv``) builds each env instead of ``env_id``, which then only names it (a backend that builds
    from factories: "sync"/"async").
    """
    if int(num_envs) < 1:
        raise ValueError(f"num_envs must be >= 1, got {num_envs}")
    backend = get_backend(vector_mode)
    kwargs = dict(env_kwargs or {})

    try:
        if env_fn is not None:
            if backend.from_factories is None or kwargs:
                raise ValueError(f"an env factory runs with vector_mode {' or '.join(map(repr, factory_modes()))} "
                                 f"and no env_kwargs, got vector_mode={vector_mode!r}, env_kwargs={kwargs}")
            env = backend.from_factories([env_fn] * int(num_envs))
            if len({id(sub) for sub in getattr(env, "envs", [])}) not in (0, int(num_envs)):
                # `env=lambda: my_env` hands out one object N times: N "envs" stepping one state, silently.
                env.close()
                raise ValueError(f"the env factory {env_fn.name if hasattr(env_fn, 'name') else env_fn!r} returned "
                                 "the same env object more than once; it must build a new env on every call")
        else:
            if not backend.own_task_ids:
                check_env_id(env_id)
            env = backend.make(env_id, int(num_envs), seed, kwargs)
    except (TypeError, KeyError) as exc:
        if kwargs:
            raise _env_kwargs_error(env_id, kwargs, exc) from exc
        raise

    try:
        check_spaces(env)
    except ValueError:
        env.close()
        raise

    if seed is not None:
        # Only the spaces are seeded here: the trainer seeds the dynamics via env.reset(seed=seed).
        env.action_space.seed(seed)
        env.single_action_space.seed(seed)
    return env


def factory_modes() -> list[str]:
    """The registered vector modes that build envs from zero-argument factories (a custom env, the Atari stack)."""
    return [name for name in backend_names() if get_backend(name).from_factories is not None]


def _gym_vector(mode: str) -> Callable[[str, int, int | None, dict[str, Any]], gym.vector.VectorEnv]:
    """``gym.make_vec`` under ``vectorization_mode = mode`` ("sync"/"async"), SAME_STEP autoreset."""
    def make(env_id: str, num_envs: int, seed: int | None, kwargs: dict[str, Any]) -> gym.vector.VectorEnv:
        # make_vec hands sub-processes an EnvSpec whose entry point is an import string,
        # so workers import ppokit.envs.gridworld themselves and need no registry state.
        # Async workers die with the trainer, even when it is killed (envs.watchdog.orphan_proof_worker).
        return gym.make_vec(env_id, num_envs=num_envs, vectorization_mode=mode,
                            vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP,
                                           **async_kwargs(mode)}, **kwargs)
    return make


def _gym_vector_of(mode: str) -> Callable[[list[Callable[[], gym.Env]]], gym.vector.VectorEnv]:
    """A Sync/Async vector env of the given env factories, SAME_STEP autoreset."""
    vector_class = gym.vector.SyncVectorEnv if mode == "sync" else gym.vector.AsyncVectorEnv

    def make(env_fns: list[Callable[[], gym.Env]]) -> gym.vector.VectorEnv:
        return vector_class(env_fns, autoreset_mode=gym.vector.AutoresetMode.SAME_STEP, **async_kwargs(mode))
    return make


def _native(env_id: str, num_envs: int, seed: int | None, kwargs: dict[str, Any]) -> gym.vector.VectorEnv:
    """The env's own batched class (its spec's vector entry point)."""
    if _get_spec(env_id).vector_entry_point is None:
        raise ValueError(
            f"vector_mode='native' is not available for {env_id!r}: it has no vector entry point. "
            "Use vector_mode='sync' (or 'async')."
        )
    return gym.make_vec(env_id, num_envs=num_envs, vectorization_mode="vector_entry_point", **kwargs)


register_backend("sync", _gym_vector("sync"), from_factories=_gym_vector_of("sync"))
register_backend("async", _gym_vector("async"), from_factories=_gym_vector_of("async"))
register_backend("native", _native)
register_backend("envpool", make_envpool, own_task_ids=True, own_atari_wrappers=True)  # the optional package


def make_eval_env(
    env_id: str,
    render_mode: str | None = None,
    env_kwargs: dict[str, Any] | None = None,
    env_fn: Callable[[], gym.Env] | None = None,
) -> gym.Env:
    """Build one (un-reset) env for evaluation or rendering: ``gym.make(env_id, **env_kwargs)``, or ``env_fn()``
    (a custom env; a render_mode is then the factory's business)."""
    if env_fn is not None:
        return env_fn()
    check_env_id(env_id)
    kwargs = dict(env_kwargs or {})
    if render_mode is not None:
        kwargs["render_mode"] = render_mode
    try:
        return gym.make(env_id, **kwargs)
    except (TypeError, KeyError) as exc:
        if env_kwargs:
            raise _env_kwargs_error(env_id, dict(env_kwargs), exc) from exc
        raise


# ---------------------------------------------------------------------------------------- one env, lean stepping
# With one env (MuJoCo's usual setting) ``SyncVectorEnv.step`` costs ~20 us a step beyond the env itself on the
# machine measured (Hopper-v5: ~77 us the env, ~96 us the vector env): the per-key info batching (``_add_info``), the
# observation ``np.stack`` and ``deepcopy``, the copies of the reward and flag arrays. ``step_one_env`` does the step
# of Gymnasium 1.x's ``SyncVectorEnv.step`` (gymnasium/vector/sync_vector_env.py) for its single sub-env with the
# same autoreset (NEXT_STEP and SAME_STEP), writing the same state into the vector env (``_env_obs``, ``_rewards``,
# ``_terminations``, ``_truncations``, ``_observations``, ``_autoreset_envs``), so a later ``envs.step`` or a
# checkpoint of the env sees exactly what the vector env's own step would have left. What it does not build is the
# batched info dict: it returns only the final observation of an episode that ended (SAME_STEP), the one info entry
# the collector reads. ``tests/test_single_env_fastpath.py`` steps both side by side on real envs.
_ONE_ENV_ATTRS = ("envs", "autoreset_mode", "_env_obs", "_rewards", "_terminations", "_truncations", "_observations",
                  "_autoreset_envs")


def one_env_steppable(envs: Any) -> bool:
    """Whether ``step_one_env`` may step ``envs``: exactly a ``SyncVectorEnv`` (no subclass or wrapper, whose step
    may do more) of one env in NEXT_STEP or SAME_STEP autoreset, with a Box observation space (batched by one
    ``np.stack``) and a Box or Discrete action space (whose batched actions are iterated row by row)."""
    modes = (gym.vector.AutoresetMode.NEXT_STEP, gym.vector.AutoresetMode.SAME_STEP)
    return (type(envs) is gym.vector.SyncVectorEnv and envs.num_envs == 1
            and all(hasattr(envs, name) for name in _ONE_ENV_ATTRS) and envs.autoreset_mode in modes
            and type(envs.single_observation_space) is spaces.Box
            and isinstance(envs._observations, np.ndarray)
            and type(envs.single_action_space) in (spaces.Box, spaces.Discrete))


def step_one_env(self: Any, action: Any) -> tuple[np.ndarray, float, bool, bool, Any]:
    """``SyncVectorEnv.step`` of the one-env vector env ``self`` (see ``one_env_steppable``) given the sub-env's
    own ``action`` (row 0 of the batched actions): ``(observations [1, ...], reward, terminated, truncated,
    final_obs)``. ``observations`` is the vector env's own batch array, overwritten by the next step (copy or
    convert it first); ``final_obs`` is the sub-env's last observation of an episode that ended in SAME_STEP mode
    (as ``info["final_obs"][0]`` would hold), else None.

    The parameter is named ``self`` and the env index ``i``, as in ``SyncVectorEnv.step``, so an error's traceback
    names the failing sub-env the same way (``envs.errors._failing_index`` reads those frame locals).
    """
    i = 0
    env = self.envs[i]
    final_obs = None
    if self.autoreset_mode == gym.vector.AutoresetMode.NEXT_STEP:
        if self._autoreset_envs[i]:
            self._env_obs[i], _ = env.reset()
            self._rewards[i] = 0.0
            self._terminations[i] = False
            self._truncations[i] = False
        else:
            (self._env_obs[i], self._rewards[i], self._terminations[i], self._truncations[i], _) = env.step(action)
    else:  # SAME_STEP
        (self._env_obs[i], self._rewards[i], self._terminations[i], self._truncations[i], _) = env.step(action)
        if self._terminations[i] or self._truncations[i]:
            final_obs = self._env_obs[i]
            self._env_obs[i], _ = env.reset()
    obs, out = self._env_obs[i], self._observations
    if type(obs) is np.ndarray and obs.shape == out.shape[1:] and obs.dtype == out.dtype:
        out[0] = obs  # what np.stack([obs], out=out) writes, without its Python-level checks
    else:
        # Anything else goes through the vector env's own batching (a cast, or the error it raises).
        from gymnasium.vector.utils import concatenate

        self._observations = out = concatenate(self.single_observation_space, self._env_obs, out)
    terminated, truncated = bool(self._terminations[i]), bool(self._truncations[i])
    self._autoreset_envs = np.array([terminated or truncated])
    return out, float(self._rewards[i]), terminated, truncated, final_obs
