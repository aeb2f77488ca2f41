"""GridWorld dynamics, native/gymnasium vector parity, and the env factory."""

from __future__ import annotations

import warnings

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium import spaces

torch.set_num_threads(1)

from ppokit.envs import (  # noqa: E402
    GRIDWORLD_ID,
    GridWorldEnv,
    GridWorldVectorEnv,
    autoreset_mode,
    check_env_id,
    check_spaces,
    make_eval_env,
    make_vec_env,
    register_envs,
)

UP, RIGHT, DOWN, LEFT = 0, 1, 2, 3
SAME_STEP = gym.vector.AutoresetMode.SAME_STEP
NEXT_STEP = gym.vector.AutoresetMode.NEXT_STEP


def cell(obs: np.ndarray) -> int:
    assert obs.dtype == np.float32
    assert obs.sum() == 1.0 and set(np.unique(obs)) <= {0.0, 1.0}, "observation must be one-hot"
    return int(np.argmax(obs))


# --------------------------------------------------------------------------- tiny test envs


class _TinyEnv(gym.Env):
    """One-step env whose spaces are chosen by the test."""

    def __init__(self, action_space=None, observation_space=None):
        self.action_space = action_space
        self.observation_space = observation_space or spaces.Box(-1.0, 1.0, (2,), np.float32)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        return self.observation_space.sample(), {}

    def step(self, action):
        return self.observation_space.sample(), 0.0, True, False, {}


def _multibinary_env():
    return _TinyEnv(spaces.MultiBinary(3))


def _dict_action_env():
    return _TinyEnv(spaces.Dict({"a": spaces.Discrete(2), "b": spaces.Box(-1, 1, (1,), np.float32)}))


def _multidiscrete_env():
    return _TinyEnv(spaces.MultiDiscrete([3, 2]))


def _discrete_obs_env():
    return _TinyEnv(spaces.Discrete(2), spaces.Discrete(5))


def _dict_obs_env():
    # Dict observations are encoded per key (tests/test_dict_obs.py); one with an entry ppokit cannot encode is not.
    return _TinyEnv(spaces.Discrete(2), spaces.Dict({"a": spaces.Box(-1, 1, (2,), np.float32),
                                                     "bits": spaces.MultiBinary(3)}))


_TEST_ENVS = {
    "ppokit_test/MultiBinaryAction-v0": _multibinary_env,
    "ppokit_test/DictAction-v0": _dict_action_env,
    "ppokit_test/MultiDiscreteAction-v0": _multidiscrete_env,
    "ppokit_test/DiscreteObs-v0": _discrete_obs_env,
    "ppokit_test/DictObs-v0": _dict_obs_env,
}
for _id, _fn in _TEST_ENVS.items():
    if _id not in gym.registry:
        gym.register(id=_id, entry_point=_fn, disable_env_checker=True)


# --------------------------------------------------------------------------- single GridWorld


def test_single_env_hand_written_path_walls_and_goal():
    env = GridWorldEnv()
    obs, info = env.reset(seed=0)
    assert cell(obs) == 0 and info == {}
    assert env.observation_space.shape == (16,) and env.action_space.n == 4

    # (action, expected row, expected col): walls at the top and left edges keep the agent in place.
    script = [
        (UP, 0, 0),
        (LEFT, 0, 0),
        (RIGHT, 0, 1),
        (RIGHT, 0, 2),
        (RIGHT, 0, 3),
        (RIGHT, 0, 3),
        (DOWN, 1, 3),
        (LEFT, 1, 2),
        (DOWN, 2, 2),
        (RIGHT, 2, 3),
        (RIGHT, 2, 3),
        (DOWN, 3, 3),
    ]
    for k, (action, row, col) in enumerate(script):
        obs, reward, terminated, truncated, info = env.step(action)
        assert env.position == (row, col)
        assert cell(obs) == row * 4 + col
        last = k == len(script) - 1
        assert terminated is last and truncated is False
        assert reward == (1.0 if last else -0.01)
    with pytest.raises(RuntimeError):
        env.step(RIGHT)  # the episode is over


def test_bottom_and_right_walls():
    env = GridWorldEnv()
    env.reset()
    for a in (DOWN, DOWN, DOWN, DOWN, DOWN):
        env.step(a)
    assert env.position == (3, 0)
    env.step(LEFT)
    assert env.position == (3, 0)


def test_optimal_path_return_matches_optimal_return():
    assert GridWorldEnv.optimal_return(4) == pytest.approx(0.95)
    assert GridWorldEnv.optimal_return(5) == pytest.approx(1.0 - 0.01 * 7)
    for size in (2, 4, 6):
        env = GridWorldEnv(size=size)
        env.reset()
        total, terminated = 0.0, False
        for a in [RIGHT] * (size - 1) + [DOWN] * (size - 1):
            assert not terminated
            _, r, terminated, _, _ = env.step(a)
            total += r
        assert terminated
        assert total == pytest.approx(GridWorldEnv.optimal_return(size), abs=1e-12)
    with pytest.raises(ValueError):
        GridWorldEnv(size=1)


def test_gym_make_truncates_at_50_steps():
    env = gym.make(GRIDWORLD_ID)
    env.reset(seed=1)
    for t in range(1, 51):
        obs, r, terminated, truncated, _ = env.step(UP)
        assert not terminated and r == -0.01 and cell(obs) == 0
        assert truncated is (t == 50)
    env.close()


def test_render_ansi():
    env = make_eval_env(GRIDWORLD_ID, render_mode="ansi")
    env.reset()
    env.step(RIGHT)
    assert env.render() == ". A . .\n. . . .\n. . . .\n. . . G\n"
    env.close()


# --------------------------------------------------------------------------- vector GridWorld


def test_native_vector_env_autoreset_and_final_obs():
    env = GridWorldVectorEnv(num_envs=2, max_episode_steps=50)
    assert env.metadata["autoreset_mode"] == SAME_STEP
    assert env.single_observation_space.shape == (16,)
    assert env.observation_space.shape == (2, 16)
    assert env.action_space.shape == (2,)
    obs, info = env.reset(seed=0)
    assert obs.shape == (2, 16) and info == {}

    # env 0 walks the optimal path, env 1 bumps the top wall.
    actions = [RIGHT] * 3 + [DOWN] * 3
    for k, a in enumerate(actions):
        obs, rew, term, trunc, infos = env.step(np.array([a, UP]))
        if k < len(actions) - 1:
            assert infos == {}
    assert term.tolist() == [True, False] and trunc.tolist() == [False, False]
    assert rew.tolist() == [1.0, -0.01] and rew.dtype == np.float64
    assert cell(obs[0]) == 0  # already reset
    assert infos["_final_obs"].tolist() == [True, False]
    assert cell(infos["final_obs"][0]) == 15

    for t in range(7, 51):
        obs, rew, term, trunc, infos = env.step(np.array([UP, UP]))
        assert trunc[1] == (t == 50)
    assert infos["_final_obs"].tolist() == [False, True]
    assert cell(infos["final_obs"][1]) == 0


def _final_obs_rows(infos: dict, num_envs: int) -> dict[int, np.ndarray]:
    """Final observations by env index, for both object arrays (Sync) and dense arrays (native)."""
    if "final_obs" not in infos:
        return {}
    mask = infos["_final_obs"]
    assert mask.shape == (num_envs,)
    return {i: np.asarray(infos["final_obs"][i], dtype=np.float32) for i in np.flatnonzero(mask)}


def test_native_matches_gymnasium_sync_same_step():
    n, steps = 6, 700
    native = make_vec_env(GRIDWORLD_ID, n, seed=0, vector_mode="native")
    sync = make_vec_env(GRIDWORLD_ID, n, seed=0, vector_mode="sync")
    assert isinstance(native.unwrapped, GridWorldVectorEnv)
    assert isinstance(sync, gym.vector.SyncVectorEnv)
    assert autoreset_mode(native) == autoreset_mode(sync) == SAME_STEP
    assert native.single_observation_space == sync.single_observation_space
    assert native.single_action_space == sync.single_action_space

    obs_n, _ = native.reset(seed=3)
    obs_s, _ = sync.reset(seed=3)
    np.testing.assert_array_equal(obs_n, obs_s)

    rng = np.random.default_rng(0)
    # Bias towards right/down so that goals and time limits both happen often.
    probs = np.array([0.15, 0.35, 0.35, 0.15])
    n_term = n_trunc = 0
    for _ in range(steps):
        actions = rng.choice(4, size=n, p=probs)
        out_n = native.step(actions)
        out_s = sync.step(actions)
        for a, b in zip(out_n[:4], out_s[:4]):
            np.testing.assert_array_equal(a, b)
            assert a.dtype == b.dtype
        fin_n, fin_s = _final_obs_rows(out_n[4], n), _final_obs_rows(out_s[4], n)
        assert fin_n.keys() == fin_s.keys()
        for i in fin_n:
            np.testing.assert_array_equal(fin_n[i], fin_s[i])
        assert set(out_n[4]) == set(out_s[4])
        n_term += int(out_n[2].sum())
        n_trunc += int(out_n[3].sum())
    assert n_term >= 10 and n_trunc >= 5, (n_term, n_trunc)
    native.close()
    sync.close()


def test_native_matches_sync_with_env_kwargs():
    kw = {"size": 3}
    native = make_vec_env(GRIDWORLD_ID, 3, seed=0, vector_mode="native", env_kwargs=kw)
    sync = make_vec_env(GRIDWORLD_ID, 3, seed=0, vector_mode="sync", env_kwargs=kw)
    assert native.single_observation_space.shape == (9,)
    np.testing.assert_array_equal(native.reset()[0], sync.reset()[0])
    rng = np.random.default_rng(1)
    for _ in range(120):
        a = rng.integers(0, 4, size=3)
        for x, y in zip(native.step(a)[:4], sync.step(a)[:4]):
            np.testing.assert_array_equal(x, y)


def test_async_gridworld_matches_native():
    native = make_vec_env(GRIDWORLD_ID, 2, seed=0, vector_mode="native")
    asyn = make_vec_env(GRIDWORLD_ID, 2, seed=0, vector_mode="async")
    try:
        assert isinstance(asyn, gym.vector.AsyncVectorEnv)
        assert autoreset_mode(asyn) == SAME_STEP
        np.testing.assert_array_equal(native.reset(seed=0)[0], asyn.reset(seed=0)[0])
        rng = np.random.default_rng(2)
        for _ in range(60):
            a = rng.integers(0, 4, size=2)
            out_n, out_a = native.step(a), asyn.step(a)
            for x, y in zip(out_n[:4], out_a[:4]):
                np.testing.assert_array_equal(x, y)
            fin_n, fin_a = _final_obs_rows(out_n[4], 2), _final_obs_rows(out_a[4], 2)
            assert fin_n.keys() == fin_a.keys()
    finally:
        asyn.close()
        native.close()


def test_make_vec_with_vector_entry_point_and_registration_guard():
    env = gym.make_vec(GRIDWORLD_ID, 4, vectorization_mode="vector_entry_point")
    assert isinstance(env.unwrapped, GridWorldVectorEnv)
    assert env.unwrapped.max_episode_steps == 50
    assert env.reset()[0].shape == (4, 16)
    spec = gym.spec(GRIDWORLD_ID)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        register_envs()
        register_envs()
    assert gym.spec(GRIDWORLD_ID) is spec
    assert spec.max_episode_steps == 50


# --------------------------------------------------------------------------- factory


@pytest.mark.parametrize(
    ("mode", "cls", "expected_mode"),
    [
        ("sync", gym.vector.SyncVectorEnv, SAME_STEP),
        ("async", gym.vector.AsyncVectorEnv, SAME_STEP),
        ("native", None, NEXT_STEP),
    ],
)
def test_make_vec_env_cartpole(mode, cls, expected_mode):
    env = make_vec_env("CartPole-v1", 3, seed=7, vector_mode=mode)
    try:
        if cls is not None:
            assert isinstance(env, cls)
        assert autoreset_mode(env) == expected_mode
        assert check_spaces(env) == "discrete"
        obs, _ = env.reset(seed=7)
        assert obs.shape == (3, 4)
        obs, rew, term, trunc, _ = env.step(env.action_space.sample())
        assert obs.shape == (3, 4) and rew.shape == (3,) and term.shape == (3,) and trunc.shape == (3,)
    finally:
        env.close()


def test_make_vec_env_seeds_action_space():
    a = make_vec_env("CartPole-v1", 4, seed=11)
    b = make_vec_env("CartPole-v1", 4, seed=11)
    np.testing.assert_array_equal(
        np.stack([a.action_space.sample() for _ in range(5)]),
        np.stack([b.action_space.sample() for _ in range(5)]),
    )
    assert a.single_action_space.sample() == b.single_action_space.sample()


def test_unknown_id_suggests_close_match():
    with pytest.raises(ValueError, match="CartPole-v1"):
        check_env_id("CartPol-v1")
    with pytest.raises(ValueError, match="ppokit/GridWorld-v0"):
        make_vec_env("ppokit/GridWorld-v9", 2, seed=0)
    with pytest.raises(ValueError, match="Unknown environment id"):
        make_eval_env("Zzzzzzzzzzzz-v0")
    check_env_id("CartPole-v1")
    check_env_id(GRIDWORLD_ID)
    # A module-qualified id is left to gymnasium, which imports the module.
    check_env_id(f"ppokit.envs:{GRIDWORLD_ID}")
    env = make_vec_env(f"ppokit.envs:{GRIDWORLD_ID}", 2, seed=0, vector_mode="native")
    assert isinstance(env.unwrapped, GridWorldVectorEnv)


def test_native_unavailable_and_bad_mode():
    with pytest.raises(ValueError, match="native.*Pendulum-v1.*sync"):
        make_vec_env("Pendulum-v1", 2, seed=0, vector_mode="native")
    with pytest.raises(ValueError, match="vector_mode"):
        make_vec_env("CartPole-v1", 2, seed=0, vector_mode="threads")
    with pytest.raises(ValueError, match="num_envs"):
        make_vec_env("CartPole-v1", 0, seed=0)


def test_check_spaces_supported():
    assert check_spaces(make_vec_env("Pendulum-v1", 2, seed=0)) == "continuous"
    assert check_spaces(make_vec_env("ppokit_test/MultiDiscreteAction-v0", 2, seed=0)) == "multidiscrete"
    assert check_spaces(make_eval_env("CartPole-v1")) == "discrete"  # a single env works too
    assert check_spaces(make_vec_env(GRIDWORLD_ID, 2, seed=0, vector_mode="native")) == "discrete"
    assert check_spaces(gym.make("ppokit_test/DiscreteObs-v0")) == "discrete"  # Discrete observations: one-hot


@pytest.mark.parametrize(
    ("env_id", "pattern"),
    [
        ("ppokit_test/MultiBinaryAction-v0", "action space MultiBinary"),
        ("ppokit_test/DictAction-v0", "action space Dict"),
        ("ppokit_test/DictObs-v0", "observation space MultiBinary.*at key 'bits'"),
    ],
)
def test_unsupported_spaces_raise(env_id, pattern):
    with pytest.raises(ValueError, match=pattern):
        make_vec_env(env_id, 2, seed=0)
    with pytest.raises(ValueError, match=pattern):
        check_spaces(gym.make(env_id))


def test_check_spaces_rejects_odd_boxes_and_offsets():
    class Fake:
        def __init__(self, act):
            self.single_action_space = act
            self.single_observation_space = spaces.Box(-1, 1, (3,), np.float32)

    with pytest.raises(ValueError, match="1-D Box"):
        check_spaces(Fake(spaces.Box(-1, 1, (2, 2), np.float32)))
    with pytest.raises(ValueError, match="start at 0"):
        check_spaces(Fake(spaces.Discrete(3, start=1)))
    with pytest.raises(ValueError, match="Tuple"):
        check_spaces(Fake(spaces.Tuple((spaces.Discrete(2), spaces.Discrete(2)))))


def test_autoreset_mode_default_and_strings():
    class NoMeta:
        metadata: dict = {}

    class StrMeta:
        metadata = {"autoreset_mode": "SameStep"}

    assert autoreset_mode(NoMeta()) == NEXT_STEP
    assert autoreset_mode(StrMeta()) == SAME_STEP


def test_make_eval_env_is_single_env():
    env = make_eval_env(GRIDWORLD_ID, env_kwargs={"size": 5})
    obs, _ = env.reset(seed=0)
    assert obs.shape == (25,)
    assert env.spec.max_episode_steps == 50
    env.close()
