"""Environment state in checkpoints: every dtype and container survives save/load, every Gymnasium classic-control,
toy-text and box2d env round-trips, and NaN/Inf an env emits is stored rather than killing the run at save."""

from __future__ import annotations

import warnings

import gymnasium as gym
import numpy as np
import pytest
import torch

from ppokit.config.ppo_config import PPOConfig
from ppokit.envs.state import capture_env_state, restore_env_state
from ppokit.runtime.checkpoint import load_checkpoint, save_checkpoint
from ppokit.training.trainer import CHECKPOINT_NAME, resume, train

torch.set_num_threads(1)

FAMILIES = ("classic_control", "toy_text", "box2d")


def _family(spec) -> str | None:
    ep = spec.entry_point
    module = ep.split(":")[0] if isinstance(ep, str) else getattr(ep, "__module__", "")
    for fam in FAMILIES:
        if module.startswith(f"gymnasium.envs.{fam}"):
            return fam
    return None


# Every registered id of the three families, found from the registry so that a new env is tested automatically.
ENV_IDS = sorted((eid, fam) for eid, spec in gym.registry.items() if (fam := _family(spec)) is not None)


def test_the_registry_holds_all_three_families():
    ids = {eid for eid, _ in ENV_IDS}
    assert {fam for _, fam in ENV_IDS} == set(FAMILIES)
    assert {"CartPole-v1", "MountainCar-v0", "Blackjack-v1", "FrozenLake-v1", "LunarLander-v3"} <= ids


class _Holder:
    pass


def _round_trip(tmp_path, obj):
    holder = _Holder()
    holder.__dict__.update(obj)
    state = {"vector": [], "envs": [[{}]]}
    from ppokit.envs.state import _capture_obj, _restore_obj

    state["envs"][0][0] = _capture_obj(holder)
    save_checkpoint(tmp_path / "c.pt", {"env_state": state}, finite=())
    loaded = load_checkpoint(tmp_path / "c.pt")["env_state"]["envs"][0][0]
    out = _Holder()
    _restore_obj(out, loaded)
    return out.__dict__


def _same(a, b) -> bool:
    """Equal in value AND type (an np.float64 must come back an np.float64, not a float)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (np.ndarray, np.generic)):
        # By value, not bytes: longdouble carries undefined padding bytes.
        nan_ok = a.dtype.kind in "fc"
        return a.dtype == b.dtype and a.shape == b.shape and np.array_equal(a, b, equal_nan=nan_ok)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    return a == b or (a != a and b != b)


DTYPES = ["bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16", "float32",
          "float64", "longdouble", "complex64", "complex128", "U3", "S2", "datetime64[s]", "timedelta64[ms]"]


@pytest.mark.parametrize("dtype", DTYPES)
def test_numpy_scalars_and_arrays_of_every_dtype_round_trip_exactly(tmp_path, dtype):
    arr = np.arange(6).reshape(2, 3).astype(dtype)
    obj = {"arr": arr, "scalar": arr.reshape(-1)[-1], "zero_d": np.array(arr.reshape(-1)[1]),
           "strided": arr.T, "empty": np.zeros((0, 2), dtype=dtype)}
    out = _round_trip(tmp_path, obj)
    for key, value in obj.items():
        assert _same(value, out[key]), key
    assert out["strided"].shape == (3, 2)


def test_nested_containers_with_numpy_values_round_trip(tmp_path):
    # MountainCar's state is a tuple of np.float64; toy-text envs hold dicts of lists of tuples.
    obj = {"state": (np.float64(-0.5), np.float64(0.01)),
           "P": {0: {1: [(1.0, np.int64(3), -1, False)]}, "k": [np.arange(3), {"x": np.float32(np.nan)}]},
           "mixed": [1, 2.5, "s", None, True, [np.uint32(7), (np.bool_(True),)]],
           "rng": np.random.default_rng(5)}
    expected_draw = np.random.default_rng(5).random()
    out = _round_trip(tmp_path, obj)
    for key in ("state", "P", "mixed"):
        assert _same(obj[key], out[key]), key
    assert out["rng"].random() == expected_draw


def test_unencodable_values_are_skipped_not_fatal(tmp_path):
    obj = {"fn": len, "objarr": np.array([object()], dtype=object), "nested": [1, object()],
           "badkey": {(1, 2): 3}, "ok": np.float64(2.0)}
    out = _round_trip(tmp_path, obj)
    assert set(out) == {"ok"} and _same(out["ok"], np.float64(2.0))


def _make(env_id: str) -> gym.vector.VectorEnv:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return gym.make_vec(env_id, num_envs=2, vectorization_mode="sync",
                            vector_kwargs={"autoreset_mode": gym.vector.AutoresetMode.SAME_STEP})


def _assert_tree_equal(a, b, what):
    if isinstance(a, (tuple, list)):
        assert len(a) == len(b), what
        for x, y in zip(a, b):
            _assert_tree_equal(x, y, what)
    else:
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=what)


@pytest.mark.parametrize("env_id, family", ENV_IDS, ids=[e for e, _ in ENV_IDS])
def test_every_gymnasium_env_round_trips_through_a_checkpoint(tmp_path, env_id, family):
    if family == "box2d":
        pytest.importorskip("Box2D", reason="box2d envs need pip install -e '.[box2d]'")
    env, fresh = _make(env_id), _make(env_id)
    try:
        env.reset(seed=3)
        env.action_space.seed(3)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for _ in range(7):
                env.step(env.action_space.sample())
        state = capture_env_state(env)
        # Env state may hold anything an env produced, so only its types are checked at save.
        save_checkpoint(tmp_path / "c.pt", {"env_state": state}, finite=())
        loaded = load_checkpoint(tmp_path / "c.pt")["env_state"]
        fresh.reset(seed=99)
        restored = restore_env_state(fresh, loaded)
        if family == "box2d":
            # Box2D keeps its physics in C++ objects: not capturable, so resume starts from a reset instead of
            # restoring a few floats onto a different world.
            assert state is None and restored is False
            return
        assert restored is True
        actions = [env.action_space.sample() for _ in range(30)]
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for t, action in enumerate(actions):
                a, b = env.step(action), fresh.step(action)
                for name, x, y in zip(("obs", "reward", "terminated", "truncated"), a[:4], b[:4]):
                    _assert_tree_equal(x, y, f"{env_id} step {t} {name}")
    finally:
        env.close()
        fresh.close()


def test_mountaincar_train_finishes_with_checkpoint_and_curves(tmp_path):
    from ppokit.cli import main

    run_dir = tmp_path / "mc"
    rc = main(["train", "--env", "MountainCar-v0", "--total-timesteps", "2048", "--run-dir", str(run_dir),
               "--quiet", "--no-tensorboard"])
    assert rc == 0
    assert (run_dir / "curves.png").is_file()
    state = load_checkpoint(run_dir / CHECKPOINT_NAME)
    assert state["global_step"] > 0
    # MountainCar's state (a tuple of np.float64) is captured, not refused or dropped.
    assert state["env_state"] is not None
    assert all("state" in sub[-1] for sub in state["env_state"]["envs"])


# ------------------------------------------------------------------ NaN/Inf from the env (stored, not refused)
class _NaNEnv(gym.Env):
    """Emits a NaN observation every 7th step and an infinite reward every 11th; remembers its last bad obs."""

    observation_space = gym.spaces.Box(-np.inf, np.inf, (3,), np.float32)
    action_space = gym.spaces.Discrete(2)
    last_bad_obs = None

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(3, dtype=np.float32), {}

    def step(self, action):
        self.t += 1
        obs = self.np_random.normal(size=3).astype(np.float32)
        reward = 1.0 + float(action)
        if self.t % 7 == 0:
            obs[1] = np.nan
            self.last_bad_obs = obs.copy()  # part of the env's own state from now on
        if self.t % 11 == 0:
            reward = float("inf")
        return obs, reward, False, self.t >= 25, {}


NAN_ENV_ID = "ppokit-test/NaNEnv-v0"
if NAN_ENV_ID not in gym.registry:
    gym.register(NAN_ENV_ID, entry_point=_NaNEnv, disable_env_checker=True)


def _has_nan(obj) -> bool:
    if isinstance(obj, torch.Tensor):
        return obj.is_floating_point() and bool(torch.isnan(obj).any())
    if isinstance(obj, dict):
        return any(_has_nan(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_has_nan(v) for v in obj)
    return False


def test_nan_from_the_env_survives_saves_and_resume(tmp_path):
    cfg = PPOConfig(env_id=NAN_ENV_ID, num_envs=2, num_steps=32, num_minibatches=2, update_epochs=2,
                    total_timesteps=2 * 32 * 4, save_every=1, tensorboard=False, run_dir=str(tmp_path / "nan"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        run = train(cfg, console_enabled=False)
    assert len(run.metrics) == 4  # four updates, four saves, none refused
    assert sum(m["diag/nonfinite_env"] for m in run.metrics) > 0
    state = load_checkpoint(run.checkpoint)
    assert state["update"] == 4
    # The env's own buffers keep the NaN it produced (stored as-is); the learner is finite.
    assert _has_nan(state["env_state"])
    assert not _has_nan(state["policy"]) and not _has_nan(state["optimizer"])

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        resumed = resume(run.run_dir, total_timesteps=2 * 32 * 8, console_enabled=False)
    assert resumed.global_step == 2 * 32 * 8
    assert [m["update"] for m in resumed.metrics] == [5.0, 6.0, 7.0, 8.0]
    assert sum(m["diag/nonfinite_env"] for m in resumed.metrics) > 0
    assert load_checkpoint(resumed.checkpoint)["update"] == 8
