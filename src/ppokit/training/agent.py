"""A trained policy loaded from a run dir, for acting and evaluation (numpy in, numpy out)."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ppokit.config.ppo_config import PPOConfig
from ppokit.envs.encoders import (
    BoxEncoder,
    DictEncoder,
    ImageEncoder,
    encoder_from_spec,
    obs_to_tensor,
    observation_encoder,
)
from ppokit.policies import ActorCritic, PolicySpecError, mask_logits, policy_from_spec
from ppokit.rollout.normalize import ObsNormalizer, make_obs_normalizer
from ppokit.runtime import checkpoint as ckpt

__all__ = ["Agent", "load", "evaluate", "stored_config"]


class Agent:
    """pi_theta from a checkpoint with its saved observation normalization applied (frozen)."""

    def __init__(self, policy: ActorCritic, config: PPOConfig, obs_norm: ObsNormalizer | None = None,
                 action_low: np.ndarray | None = None, action_high: np.ndarray | None = None,
                 env_id: str | None = None, spaces: dict | None = None, env_fn: Any = None,
                 custom_env: dict | None = None):
        self.policy = policy.eval()
        self.config = config
        # The env the agent acts in by default (the run's, unless load() was given another) and the run's spaces.
        self.env_id = env_id or config.env_id
        # A custom env given to load() (a CustomEnv), or the checkpoint's record of one that was not: then env_id
        # is only a name, and evaluate() needs the env passed again.
        self.env_fn = env_fn
        self.custom_env = custom_env
        self.spaces = spaces
        self.obs_norm = obs_norm
        if obs_norm is not None:
            obs_norm.frozen = True
        self.action_low, self.action_high = action_low, action_high
        self.device = next(policy.parameters()).device
        # How observations become the policy's inputs, as in training (a Box: flattened; Discrete: one-hot).
        self.encoder = encoder_from_spec(getattr(policy, "obs_encoding", None), policy.obs_dim)
        self.stateful = policy.initial_state(1) is not None  # a recurrent policy acts through predict()

    def _obs(self, obs: Any) -> tuple[Any, bool]:
        if isinstance(self.encoder, (ImageEncoder, DictEncoder)):
            # An image is one observation as (H, W, C) / (C, H, W), a batch with a leading axis; a Dict/Tuple is
            # one observation when its first entry has the space's shape.
            if isinstance(self.encoder, ImageEncoder):
                arr = np.asarray(obs)
                if arr.ndim not in (3, 4) or arr.shape[-3:] != self.encoder.shape:
                    raise ValueError(f"image observation of shape {arr.shape}, the policy expects "
                                     f"{self.encoder.shape} or a batch [B, {', '.join(map(str, self.encoder.shape))}]")
                n = None if arr.ndim == 3 else arr.shape[0]
                batch = arr if n is not None else arr[None]
            else:
                n = self.encoder.batch_size(obs)
                batch = obs if n is not None else _add_batch_axis(obs, self.encoder)
            x = obs_to_tensor(self.encoder.encode(batch, 1 if n is None else n), self.device)
            if self.obs_norm is not None:
                x = self.obs_norm.normalize(x)
            return x, n is None
        if not isinstance(self.encoder, BoxEncoder):
            # A Discrete observation: one int (or a 0-d array) is one observation, a 1-D array a batch.
            arr = np.asarray(obs)
            single = arr.ndim == 0
            x = torch.as_tensor(self.encoder.encode(arr, 1 if single else arr.shape[0]), device=self.device)
            return x, single
        x = torch.as_tensor(np.asarray(obs, dtype=np.float32), device=self.device)
        # One observation is [obs_dim] (or the env's unflattened shape); anything with a leading batch axis is a batch.
        single = x.dim() == 1 or (x.numel() == self.policy.obs_dim and x.shape[0] != 1)
        x = x.reshape(1, -1) if single else x.reshape(x.shape[0], -1)
        if x.shape[1] != self.policy.obs_dim:
            raise ValueError(f"observation has {x.shape[1]} features, the policy expects {self.policy.obs_dim}")
        if self.obs_norm is not None:
            x = self.obs_norm.normalize(x)
        return x, single

    def act(self, obs: Any, deterministic: bool = True, action_mask: Any = None) -> np.ndarray:
        """Actions for one observation or a batch ``[B, ...]``; continuous actions clipped to the env bounds.
        ``action_mask`` (``[n_actions]`` or ``[B, n_actions]``, bool or 0/1, True = allowed; e.g. the env's
        ``info["action_mask"]``) keeps masked actions from being chosen, as in training. A stateful policy acts
        through ``predict``, which carries its state."""
        if self.stateful:
            raise ValueError("this policy keeps a state between steps: act with agent.predict(obs, state, "
                             "episode_start), passing back the state it returns")
        x, single = self._obs(obs)
        mask = self._mask(obs, x, action_mask)
        with torch.inference_mode():
            head = mask_logits(self.policy.actor(x), mask)
            actions = self.policy.sample(head, deterministic).cpu().numpy()
        return self._env_actions(actions, single)

    def _mask(self, obs: Any, x: Any, action_mask: Any) -> torch.Tensor | None:
        """``action_mask`` (or a Dict observation's own) as a bool ``[B, n_logits]`` tensor; None without one."""
        if action_mask is None and isinstance(self.encoder, DictEncoder):
            action_mask = self.encoder.mask(obs)  # a Dict observation's "action_mask" entry (PettingZoo)
        if action_mask is None:
            return None
        if self.policy.kind == "continuous":
            raise ValueError("action_mask applies to Discrete and MultiDiscrete actions, not continuous ones")
        mask = torch.as_tensor(np.asarray(action_mask) != 0, device=self.device).reshape(_rows(x), -1)
        if mask.shape[1] != sum(self.policy.action_dims):
            raise ValueError(f"action_mask has {mask.shape[1]} entries per observation, expected "
                             f"{sum(self.policy.action_dims)}")
        return mask

    def _env_actions(self, actions: np.ndarray, single: bool) -> np.ndarray:
        if self.policy.kind == "continuous" and self.action_low is not None:
            actions = np.clip(actions, self.action_low, self.action_high)
        return actions[0] if single else actions

    def predict(self, obs: Any, state: Any = None, episode_start: Any = None, deterministic: bool = False,
                action_mask: Any = None) -> tuple[np.ndarray, Any]:
        """``(actions, state)`` in Stable-Baselines3's shape (``model.predict(obs, state, episode_start,
        deterministic)``), so SB3 evaluation loops run unchanged. A stateful policy (``Policy.act``) starts from
        its initial state when ``state`` is None; pass back the state it returned, with ``episode_start`` (``[B]``,
        True where ``obs`` is an episode's first; None: no episode starts). A feed-forward policy returns ``state``
        as given (None) and ignores ``episode_start``. Unlike ``act``, ``deterministic`` defaults to False, as in
        SB3."""
        if not self.stateful:
            return self.act(obs, deterministic=deterministic, action_mask=action_mask), state
        x, single = self._obs(obs)
        rows = _rows(x)
        mask = self._mask(obs, x, action_mask)
        starts = np.zeros(rows, dtype=bool) if episode_start is None \
            else np.asarray(episode_start, dtype=bool).reshape(-1)
        if starts.shape != (rows,):
            raise ValueError(f"episode_start has {starts.size} entries, expected {rows} (one per observation)")
        if state is None:
            state = self.policy.initial_state(rows)
        with torch.inference_mode():
            actions, _, _, state = self.policy.act(x, state, starts, mask, deterministic)
        return self._env_actions(actions.cpu().numpy(), single), state

    def value(self, obs: Any) -> np.ndarray | float:
        """V(obs) for one observation (a float) or a batch (``[B]`` array)."""
        x, single = self._obs(obs)
        with torch.inference_mode():
            v = self.policy.value(x).cpu().numpy()
        return float(v[0]) if single else v


def _rows(x: Any) -> int:
    """The batch size of an encoded observation batch (a tensor, or a dict of parts)."""
    return len(next(iter(x.values()))) if isinstance(x, dict) else x.shape[0]


def _add_batch_axis(obs: Any, encoder: DictEncoder) -> Any:
    """One Dict/Tuple observation as a batch of one (each entry gets a leading axis)."""
    if encoder.tuple_space:
        return tuple(np.asarray(v)[None] for v in obs)
    return {k: np.asarray(v)[None] for k, v in obs.items()}


def stored_config(state: dict, path: str | Path, allow_import: Any = (), env: Any = None,
                  need_env: bool = True) -> PPOConfig:
    """The run's config from a loaded checkpoint, refusing what the checkpoint must not decide on its own.

    A ``"module:Env-v0"`` env id would make Gymnasium import ``module`` (running its code); unless ``module`` is in
    ``allow_import`` that is refused before anything is built. A run trained on a custom env (a factory or an
    instance) records only its name: without ``env`` it is refused when ``need_env`` (a resume builds envs). When
    ``env`` is given, or the id is such a record, the stored id is never built, so it needs no permission. A
    missing or invalid config (an unknown key, a bad value) raises ``CheckpointError`` naming the field.
    """
    from ppokit.core.errors import ConfigError
    from ppokit.envs.factory import describe_custom

    raw = state.get("config")
    if not isinstance(raw, dict):
        raise ckpt.CheckpointError(f"{path} is not a valid ppokit training checkpoint: it has no 'config' entry")
    custom = state.get("custom_env")
    if custom is not None and env is None and need_env:
        raise ckpt.CheckpointError(f"{path} was trained on {describe_custom(custom)}, which cannot be rebuilt from "
                                   "the checkpoint; pass the same env again: ppokit.resume(run_dir, env=...)")
    if env is None and custom is None:
        ckpt.check_stored_env_id(raw.get("env_id"), allow_import, path)
    try:
        return PPOConfig.from_dict(raw)
    except ConfigError as exc:
        raise ckpt.CheckpointError(f"{path} has an invalid stored config: {exc}") from exc


def spaces_record(obs_space: Any, act_space: Any) -> dict[str, Any]:
    """What a checkpoint keeps of the run's spaces: their text (cut to a readable length), their signatures
    (``space_signature``) and Box action bounds."""
    record: dict[str, Any] = {"observation": str(obs_space)[:300], "action": str(act_space)[:300],
                              "observation_signature": space_signature(obs_space),
                              "action_signature": space_signature(act_space)}
    if hasattr(act_space, "low") and hasattr(act_space, "high"):
        record["action_low"] = torch.as_tensor(np.asarray(act_space.low, dtype=np.float32))
        record["action_high"] = torch.as_tensor(np.asarray(act_space.high, dtype=np.float32))
    return record


def space_signature(space: Any) -> Any:
    """What a policy depends on in a space, in checkpoint-safe types: its kind and sizes (a Box's shape and dtype,
    a Discrete's n and start, a MultiDiscrete's nvec), nested for Dict and Tuple. An observation Box's bounds are
    left out (the policy never reads them; a library upgrade may tighten them); action bounds are compared
    separately, as numbers."""
    import gymnasium as gym

    spaces = gym.spaces
    if isinstance(space, spaces.Dict):
        return {"type": "Dict", "spaces": {str(k): space_signature(v) for k, v in space.spaces.items()}}
    if isinstance(space, spaces.Tuple):
        return {"type": "Tuple", "spaces": [space_signature(v) for v in space.spaces]}
    signature: dict[str, Any] = {"type": type(space).__name__,
                                 "shape": list(space.shape) if space.shape is not None else None,
                                 "dtype": str(space.dtype) if space.dtype is not None else None}
    if isinstance(space, spaces.Discrete):
        signature.update(n=int(space.n), start=int(space.start))
    elif isinstance(space, spaces.MultiDiscrete):
        signature["nvec"] = [int(n) for n in np.asarray(space.nvec).reshape(-1)]
    return signature


def check_stored_spaces(spaces: Any, obs_space: Any, act_space: Any, env_id: str, source: Any) -> None:
    """CheckpointError naming both sides when ``env_id``'s spaces are not those the checkpoint's ``spaces`` record
    says the policy was trained on (signatures and Box action bounds; a record without them, from before they
    were stored, is checked through the policy's own shapes instead)."""
    if spaces is None:
        return
    if not isinstance(spaces, dict):
        raise ckpt.CheckpointError(f"{source} has a malformed 'spaces' entry ({type(spaces).__name__})")
    same = True
    for key, space in (("observation_signature", obs_space), ("action_signature", act_space)):
        if key in spaces and spaces[key] != space_signature(space):
            same = False
    if "action_low" in spaces and hasattr(act_space, "low"):
        for key, bound in (("action_low", act_space.low), ("action_high", act_space.high)):
            stored = np.asarray(torch.as_tensor(spaces[key]).cpu().numpy(), dtype=np.float32)
            now = np.asarray(bound, dtype=np.float32)
            if stored.shape != now.shape or not np.allclose(stored, now, rtol=1e-6, atol=0.0):
                same = False
    if not same:
        raise ckpt.CheckpointError(
            f"{source} holds a policy trained on observation space {_one_line(spaces.get('observation'))} and action "
            f"space {_one_line(spaces.get('action'))}, but its config's env {env_id} has observation space "
            f"{_one_line(obs_space)} and action space {_one_line(act_space)}; the config does not belong to this policy")


def _one_line(space: Any) -> str:
    """A space (or its stored text) on one line: numpy wraps a long Box's bounds over several."""
    return " ".join(str(space).split())


def describe_policy_spec(spec: Any) -> str:
    """``"4 observation features, discrete actions [2]"`` for a policy spec (or what is wrong with it)."""
    if not isinstance(spec, dict):
        return f"an unreadable policy spec {spec!r}"
    text = f"{spec.get('obs_dim')} observation features, {spec.get('kind')} actions {spec.get('action_dims')}"
    encoding = spec.get("obs_encoding")
    if spec.get("type", "actor_critic") != "actor_critic" and isinstance(encoding, dict):
        text += f" ({encoding.get('type')} observations, {spec.get('type')})"  # an image or Dict/Tuple policy
    if "cell" in spec:  # a recurrent policy
        text += f", {spec.get('cell')} core of {spec.get('recurrent_hidden')} ({spec.get('critic')} critic core)"
    return text


def _check_env_fits(policy: ActorCritic, env: Any, env_id: str, spaces: dict | None) -> None:
    """ValueError naming both sides when ``env``'s spaces are not the ones ``policy`` was trained for."""
    from ppokit.envs import check_spaces
    from ppokit.policies import action_spec

    obs_space, act_space = env.observation_space, env.action_space
    try:
        check_spaces(env)
        kind, dims = action_spec(act_space)
        obs_dim = observation_encoder(obs_space).flat_dim
    except ValueError as exc:
        raise ValueError(f"{env_id} cannot be used with this policy: {exc}") from None
    encoding = observation_encoder(obs_space).spec()
    if (obs_dim, kind, list(dims), encoding) == (policy.obs_dim, policy.kind, list(policy.action_dims),
                                                 getattr(policy, "obs_encoding", None)):
        return
    if spaces and "observation" in spaces and "action" in spaces:
        run = f"observation space {_one_line(spaces['observation'])} and action space {_one_line(spaces['action'])}"
    else:  # checkpoints from before the spaces were stored
        run = describe_policy_spec(policy.spec())
    raise ValueError(f"{env_id} does not match the trained policy: the run was trained on {run}, but {env_id} has "
                     f"observation space {_one_line(obs_space)} and action space {_one_line(act_space)}")


def _check_own_env(policy: ActorCritic, config: PPOConfig, spaces: Any, path: Path,
                   need_bounds: bool) -> tuple[np.ndarray | None, np.ndarray | None]:
    """Build the config's env and refuse a checkpoint whose policy or stored spaces do not match it (a config
    edited to name another env); returns its action bounds for a continuous policy, else ``(None, None)``.

    An env this process cannot build (not registered here, an extra not installed) is a warning: acting needs no
    env, ``evaluate`` then says what is missing. Old checkpoints without stored bounds need the env to act.
    """
    try:
        env = _make_eval_env(config.env_id, env_kwargs=dict(config.env_kwargs))
    except Exception as exc:  # noqa: BLE001 - any failure to build leaves only the check undone, and says so
        if need_bounds and policy.kind == "continuous":
            raise
        import warnings

        warnings.warn(f"{path}: could not build its env {config.env_id!r} to check the policy against it "
                      f"({ckpt.one_line(exc, 160)}); loaded without that check", ckpt.CheckpointWarning, stacklevel=3)
        return None, None
    try:
        try:
            _check_env_fits(policy, env, config.env_id, spaces if isinstance(spaces, dict) else None)
        except ValueError as exc:
            raise ckpt.CheckpointError(f"{path}: its config's env {exc}; the config does not belong to this "
                                       "policy") from None
        check_stored_spaces(spaces, env.observation_space, env.action_space, config.env_id, path)
        if policy.kind == "continuous":
            return np.asarray(env.action_space.low), np.asarray(env.action_space.high)
        return None, None
    finally:
        try:
            env.close()
        except Exception:  # noqa: BLE001 - this env was built only to read its spaces; evaluate() reports a close
            pass           # that raises on the env it steps (one warning naming it)


def _custom(env: Any, env_id: str | None) -> tuple[str | None, Any]:
    """``(env_id, env_fn)`` from load/evaluate's ``env`` (an id, a factory or an instance) and ``env_id``."""
    if env is None:
        return env_id, None
    if env_id is not None:
        raise ValueError("give the env as env= or env_id=, not both")
    if isinstance(env, str):
        return env, None
    import gymnasium as gym

    from ppokit.envs.factory import CustomEnv

    if not (isinstance(env, gym.Env) or callable(env)):
        raise ValueError(f"env must be a registered id, a zero-argument callable returning a gymnasium.Env, or a "
                         f"gymnasium.Env instance, got {type(env).__name__}")
    return None, CustomEnv(env)


def _run_kwargs(config: PPOConfig, env_id: str, env_fn: Any) -> dict:
    """The run's env_kwargs apply to the run's own env id; another id (or a custom env) gets none."""
    return dict(config.env_kwargs) if env_fn is None and env_id == config.env_id else {}


def load(run_dir: str | Path, device: str = "cpu", *, env_id: str | None = None, env: Any = None,
         allow_import: Any = ()) -> Agent:
    """Load the agent saved in ``run_dir`` (or a checkpoint file path).

    ``env_id`` (or ``env``: an id, a zero-arg factory or a ``gymnasium.Env``) is the env the agent will act in
    (default: the run's, built with the run's env_kwargs); it must have the run's spaces. A stored
    ``"module:Env-v0"`` id is refused unless ``module`` is in ``allow_import`` or an env replaces it: loading
    never imports a module that only the checkpoint names. A run trained on a custom env loads without one (to
    act on observations), but ``evaluate`` then needs the env. A damaged, diverged or inconsistent checkpoint
    raises :class:`~ppokit.runtime.checkpoint.CheckpointError`; an env with other spaces raises ``ValueError``.
    """
    env_id, env_fn = _custom(env, env_id)
    path = Path(run_dir)
    if path.is_dir():
        path = path / ckpt.CHECKPOINT_NAME
    # The policy and normalizer must be finite whatever the writer claimed ("finite" is part of the file).
    state = ckpt.load_checkpoint(path, map_location=device, require_finite=("policy", "obs_norm"),
                                 require_bounded=ckpt.BOUNDED_KEYS)
    # The caller named the env to act in: the stored id stays a record and is never built, so its module
    # part imports nothing and needs no permission.
    given = env_id if env_fn is None else env_fn
    config = stored_config(state, path, allow_import, env=given, need_env=False)
    custom = state.get("custom_env") if isinstance(state.get("custom_env"), dict) else None
    try:
        policy = policy_from_spec(state["policy_spec"]).to(device)  # the registered type ("type"; none: MLP)
        policy.load_state_dict(state["policy"])
        if encoder_from_spec(policy.obs_encoding, policy.obs_dim).flat_dim != policy.obs_dim:
            raise ValueError(f"its observation encoding {policy.obs_encoding} does not give {policy.obs_dim} inputs")
    except KeyError as exc:
        raise ckpt.CheckpointError(f"{path} is not a valid ppokit training checkpoint: it has no {exc.args[0]!r} "
                                   "entry") from exc
    except PolicySpecError as exc:
        raise ckpt.CheckpointError(f"{path} cannot be loaded: {exc}") from exc
    except (TypeError, ValueError, RuntimeError) as exc:
        raise ckpt.CheckpointError(f"{path} holds a policy that does not fit its policy_spec "
                                   f"({describe_policy_spec(state.get('policy_spec'))}): {ckpt.one_line(exc)}") from exc
    obs_norm = None
    if state.get("obs_norm") is not None:
        try:
            obs_norm = make_obs_normalizer(encoder_from_spec(policy.obs_encoding, policy.obs_dim), device)
            obs_norm.load_state_dict(state["obs_norm"])
        except (KeyError, TypeError, ValueError, RuntimeError) as exc:
            raise ckpt.CheckpointError(f"{path} has an unusable observation normalizer: {ckpt.one_line(exc)}") from exc
    ckpt.check_counters(state, config.batch_size, path)
    spaces = state.get("spaces") if isinstance(state.get("spaces"), dict) else None
    act_env = env_fn.name if env_fn is not None else env_id or config.env_id
    low = high = None
    given = env_id is not None or env_fn is not None
    stored_only = not given and custom is not None  # a record: nothing to build
    stored_bounds = bool(spaces and "action_low" in spaces)
    if given:
        # The caller's env: it must fit the policy (its bounds are the ones to act in).
        env = _make_eval_env(act_env, env_kwargs=_run_kwargs(config, act_env, env_fn), env_fn=env_fn)
        act_env = env_fn.name if env_fn is not None else act_env
        try:
            _check_env_fits(policy, env, act_env, spaces)
            if policy.kind == "continuous":
                low, high = np.asarray(env.action_space.low), np.asarray(env.action_space.high)
        finally:
            if env_fn is None or env_fn.kind == "factory":  # the caller's instance stays usable for evaluate()
                env.close()
    elif not stored_only:
        low, high = _check_own_env(policy, config, state.get("spaces"), path, need_bounds=not stored_bounds)
    if policy.kind == "continuous" and low is None and stored_bounds:
        low, high = spaces["action_low"].numpy(), spaces["action_high"].numpy()
    return Agent(policy, config, obs_norm, low, high, env_id=act_env, spaces=spaces, env_fn=env_fn,
                 custom_env=None if env_id is not None or env_fn is not None else custom)


def evaluate(agent: Agent, env_id: str | None = None, episodes: int = 10, deterministic: bool = True,
             seed: int = 10_000, video_dir: str | Path | None = None, *, env: Any = None,
             env_kwargs: dict | None = None, progress: Any = None) -> dict[str, Any]:
    """Run ``episodes`` full episodes; returns ``{"mean", "std", "returns", "lengths"}`` of raw returns (over the
    finite steps: the rollout's loop, ``rollout.loop``, steps the env, so a NaN/Inf step counts nothing).
    ``progress(done, return)``, when given, is called after each episode.

    ``env_id`` (or ``env``: an id, a zero-arg factory or a ``gymnasium.Env``) defaults to the env the agent was
    loaded for; another env must have the run's spaces. ``env_kwargs`` default to the run's for the run's own
    env id (none for another id). A run trained on a custom env needs that env again unless load() was given it.
    """
    env_id, env_fn = _custom(env, env_id)
    if env_id is None and env_fn is None:
        env_id, env_fn = agent.env_id, agent.env_fn
        if env_fn is None and agent.custom_env is not None:
            from ppokit.envs.factory import describe_custom

            raise ValueError(f"this run was trained on {describe_custom(agent.custom_env)}, which cannot be rebuilt "
                             "from the checkpoint; pass it again: ppokit.evaluate(agent, env=...) or "
                             "ppokit.load(run_dir, env=...) (on the command line, --env names a registered env "
                             "with the run's spaces)")
    if env_kwargs is None:
        env_kwargs = _run_kwargs(agent.config, env_id, env_fn)
    elif env_fn is not None and env_kwargs:
        raise ValueError("env_kwargs are for an env id built by gym.make; give them to your factory instead")
    else:
        from ppokit.config.ppo_config import _coerce

        env_kwargs = _coerce("env_kwargs", env_kwargs, strict=True)
    env = _make_eval_env(env_id, render_mode="rgb_array" if video_dir else None, env_kwargs=env_kwargs,
                         env_fn=env_fn)
    env_id = env_fn.name if env_fn is not None else env_id
    try:
        _check_env_fits(agent.policy, env, env_id, agent.spaces)
    except ValueError:
        env.close()
        raise
    import gymnasium as gym

    if video_dir:
        env = gym.wrappers.RecordVideo(env, str(video_dir), episode_trigger=lambda i: True, disable_logger=True)
    from ppokit.envs.errors import env_failure
    from ppokit.rollout.evaluation import first_episodes, policy_actor

    returns: list[float] = []
    lengths: list[int] = []
    steps = 0

    def failed(phase: str, at: int, exc: BaseException) -> Exception:
        # An env that raises is one EnvError line naming it (``ppokit eval`` prints it), not its traceback.
        return env_failure(str(env_id), phase, at, exc)

    # The env as a vector env of one, stepped by the rollout's loop (NaN/Inf, checks, masks, policy state as
    # there); NEXT_STEP autoreset, so nothing is reset after an episode ends before the next seeded reset.
    try:
        vec = gym.vector.SyncVectorEnv([lambda: env], autoreset_mode=gym.vector.AutoresetMode.NEXT_STEP)
    except Exception:
        env.close()
        raise
    policy = agent.policy
    normalize = agent.obs_norm.normalize if agent.obs_norm is not None else (lambda x: x)
    act = policy_actor(policy, policy.actor, normalize, agent.device, deterministic)
    try:
        for ep in range(episodes):
            ret, length, steps = first_episodes(vec, policy, act, seed=seed + ep, max_steps=sys.maxsize,
                                                env_id=str(env_id), fail=failed, step=steps, stride=1)
            returns.append(float(ret[0]))
            lengths.append(int(length[0]))
            if progress is not None:
                progress(ep + 1, returns[-1])
    finally:
        try:
            vec.close()
        except Exception as exc:  # noqa: BLE001 - the episodes are done; a close() that raises costs one line
            print(f"warning: {env_failure(str(env_id), 'close()', steps, exc)}", file=sys.stderr)
    return {"mean": float(np.mean(returns)), "std": float(np.std(returns)), "returns": returns, "lengths": lengths}


def _make_eval_env(env_id: str | None, render_mode: str | None = None, env_kwargs: dict | None = None,
                   env_fn: Any = None) -> Any:
    """One env to evaluate in: ``envs.make_eval_env``, except that an ALE game gets ppokit's Atari stack in its
    evaluation form (atari.py: the agent sees what it trained on; an episode is one whole game and its return the
    unclipped game score)."""
    from ppokit.envs import make_eval_env
    from ppokit.envs.atari import is_atari_id, make_atari_env

    if env_fn is None and is_atari_id(env_id):
        return make_atari_env(env_id, env_kwargs, train=False, render_mode=render_mode)
    return make_eval_env(env_id, render_mode=render_mode, env_kwargs=env_kwargs, env_fn=env_fn)
