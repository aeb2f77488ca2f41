"""The one-env rollout (``one_env.py``, ``envs.factory.step_one_env``) computes what the general loop computes.

The golden runs (``tests/golden``) use two envs, so they never take the one-env loop; here the same fixed-seed
one-env run goes through both loops (``Collector.one_env_path`` off for the reference) and must give the same
metrics.csv (timing columns aside) and the same final parameters, bit for bit: Pendulum (SAME_STEP truncation
bootstrap, observation and reward normalization, fused and autograd), CartPole (discrete, terminations, no
normalization) and InvertedPendulum-v5 where MuJoCo is installed. The lean env step is compared with
``SyncVectorEnv.step`` itself in both autoreset modes, state included.
"""

from __future__ import annotations

import csv
import importlib.util
import io
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch

from ppokit.envs.factory import one_env_steppable, step_one_env
from ppokit.rollout import one_env
from ppokit.rollout.collector import Collector

GOLDEN = Path(__file__).resolve().parent / "golden"
_spec = importlib.util.spec_from_file_location("ppokit_make_golden_1env", GOLDEN / "make_golden.py")
make_golden = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_golden)


def _run(tmp_path: Path, name: str, lean: bool, env=None, **overrides) -> tuple[str, str, bool]:
    from ppokit.config.ppo_config import PPOConfig
    from ppokit.training.trainer import Trainer

    kw = dict(num_envs=1, num_steps=64, num_minibatches=4, update_epochs=2, seed=5, tensorboard=False,
              log_every=1000, save_every=1000, total_timesteps=4 * 64, **overrides)
    old = Collector.one_env_path
    Collector.one_env_path = lean
    try:
        trainer = Trainer(PPOConfig(**kw), run_dir=tmp_path / f"{name}-{lean}", console_enabled=False, env=env)
        took = trainer.collector._one_env
        run = trainer.run()
    finally:
        Collector.one_env_path = old
    return (make_golden.strip_timing((run.run_dir / "metrics.csv").read_text()), make_golden.params_sha256(run.policy),
            took)


CASES = {
    "pendulum_fused": dict(env_id="Pendulum-v1", normalize_obs=True, normalize_reward=True, fused_update=True),
    "pendulum_autograd": dict(env_id="Pendulum-v1", normalize_obs=True, normalize_reward=True, fused_update=False),
    "pendulum_obs_only": dict(env_id="Pendulum-v1", normalize_obs=True, fused_update=True),
    "cartpole_plain": dict(env_id="CartPole-v1", fused_update=True),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_one_env_run_matches_general_loop(name, tmp_path):
    lean_csv, lean_params, took = _run(tmp_path, name, True, **CASES[name])
    ref_csv, ref_params, ref_took = _run(tmp_path, name, False, **CASES[name])
    assert took and not ref_took, "the case must compare the one-env loop against the general one"
    assert lean_csv == ref_csv
    assert lean_params == ref_params


def test_one_env_mujoco_run_matches_general_loop(tmp_path):
    pytest.importorskip("mujoco", reason="needs pip install -e '.[mujoco]'")
    cfg = dict(env_id="InvertedPendulum-v5", normalize_obs=True, normalize_reward=True, fused_update=True)
    lean = _run(tmp_path, "ip", True, **cfg)
    ref = _run(tmp_path, "ip", False, **cfg)
    assert lean[2] and not ref[2]
    assert lean[:2] == ref[:2]


class _Hostile(gym.Wrapper):
    """Pendulum that now and then returns a NaN or Inf observation value, an Inf reward or a None reward."""

    def __init__(self):
        super().__init__(gym.make("Pendulum-v1"))
        self.n = 0

    def step(self, action):
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.n += 1
        if self.n % 23 == 0:
            obs = obs.copy()
            obs[1] = np.nan if self.n % 2 else np.inf
        if self.n % 31 == 0:
            reward = float("inf")
        if self.n % 37 == 0:
            reward = None
        return obs, reward, terminated, truncated, info


def test_one_env_nonfinite_steps_match_general_loop(tmp_path):
    """NaN/Inf observations and rewards (and a None reward) are counted, zeroed and left out the same way."""
    cfg = dict(normalize_obs=True, normalize_reward=True, fused_update=True)
    lean = _run(tmp_path, "hostile", True, env=_Hostile, **cfg)
    ref = _run(tmp_path, "hostile", False, env=_Hostile, **cfg)
    assert lean[2] and not ref[2]
    assert lean[:2] == ref[:2]
    rows = list(csv.DictReader(io.StringIO(lean[0])))
    assert sum(float(r["diag/nonfinite_env"]) for r in rows) >= 10  # the hostile steps were met


def _vec(env_id: str, mode):
    return gym.make_vec(env_id, num_envs=1, vectorization_mode="sync", vector_kwargs={"autoreset_mode": mode})


@pytest.mark.parametrize("mode", [gym.vector.AutoresetMode.SAME_STEP, gym.vector.AutoresetMode.NEXT_STEP])
@pytest.mark.parametrize("env_id", ["CartPole-v1", "Pendulum-v1"])
def test_step_one_env_is_sync_vector_env_step(env_id, mode):
    """Side by side from the same seed: the same observations, rewards, flags, final observation and the same
    state left in the vector env, through episode ends (CartPole terminates, Pendulum truncates at 200)."""
    ref, lean = _vec(env_id, mode), _vec(env_id, mode)
    assert one_env_steppable(lean)
    ref.reset(seed=3)
    lean.reset(seed=3)
    rng = np.random.default_rng(0)
    ends = 0
    for _ in range(450):
        a = np.asarray([ref.single_action_space.sample()]) if env_id == "CartPole-v1" else \
            rng.uniform(-2, 2, size=(1, 1)).astype(np.float32)
        obs, rew, term, trunc, info = ref.step(a)
        lobs, lrew, lterm, ltrunc, final = step_one_env(lean, a[0])
        assert np.array_equal(obs, lobs) and obs.dtype == lobs.dtype
        assert (float(rew[0]), bool(term[0]), bool(trunc[0])) == (lrew, lterm, ltrunc)
        if "final_obs" in info:
            ends += 1
            assert np.array_equal(info["final_obs"][0], final)
            built = lean._add_info({}, {"final_obs": final}, 0)["final_obs"]
            assert built.dtype == info["final_obs"].dtype and np.array_equal(built[0], info["final_obs"][0])
        else:
            assert final is None
        for attr in ("_rewards", "_terminations", "_truncations", "_autoreset_envs", "_observations"):
            assert np.array_equal(getattr(ref, attr), getattr(lean, attr)), attr
        assert np.array_equal(ref._env_obs[0], lean._env_obs[0])
    if mode == gym.vector.AutoresetMode.SAME_STEP:
        assert ends >= 2
    ref.close()
    lean.close()


def test_steppable_only_for_a_plain_one_env_sync_vector_env():
    same = gym.vector.AutoresetMode.SAME_STEP
    two = gym.make_vec("CartPole-v1", num_envs=2, vectorization_mode="sync", vector_kwargs={"autoreset_mode": same})
    assert not one_env_steppable(two)
    two.close()

    class Sub(gym.vector.SyncVectorEnv):
        pass

    sub = Sub([lambda: gym.make("CartPole-v1")])
    assert not one_env_steppable(sub)  # a subclass may step differently
    sub.close()


def test_failing_env_names_env_0(tmp_path):
    """A sub-env that raises mid-rollout ends the run with the same one-line error through the lean step."""
    from ppokit.config.ppo_config import PPOConfig
    from ppokit.envs.errors import EnvError
    from ppokit.training.trainer import train

    class Breaks(gym.Wrapper):
        def __init__(self):
            super().__init__(gym.make("Pendulum-v1"))
            self.n = 0

        def step(self, action):
            self.n += 1
            if self.n == 40:
                raise RuntimeError("simulator exploded")
            return self.env.step(action)

    messages = []
    for lean in (True, False):
        old = Collector.one_env_path
        Collector.one_env_path = lean
        try:
            with pytest.raises(EnvError) as info:
                train(PPOConfig(num_envs=1, num_steps=64, total_timesteps=128, tensorboard=False, seed=1),
                      run_dir=tmp_path / str(lean), console_enabled=False, env=Breaks)
        finally:
            Collector.one_env_path = old
        messages.append(str(info.value).replace(str(tmp_path / str(lean)), "RUN"))
    assert "simulator exploded" in messages[0]
    assert messages[0] == messages[1]


def test_acting_kernel_out_writes_the_same_bits():
    from ppokit.kernels.acting import ActingKernel
    from ppokit.policies import build_policy

    for act_space in (gym.spaces.Box(-1, 1, (3,), np.float32), gym.spaces.Discrete(4)):
        torch.manual_seed(0)
        policy = build_policy(gym.spaces.Box(-1, 1, (5,), np.float32), act_space, (16, 16), "tanh")
        k = ActingKernel(policy)
        obs = torch.randn(1, 5)
        with torch.inference_mode():
            torch.manual_seed(1)
            a, lp, v = (x.clone() for x in k.act(obs, None, None)[:3])
            torch.manual_seed(1)
            out = (torch.full_like(a, 7), torch.full_like(lp, 7), torch.full_like(v, 7))
            assert k.act(obs, None, None, out=out)[3] is None
        for x, y in zip((a, lp, v), out):
            assert torch.equal(x, y)


def test_applies_only_to_one_cpu_box_env():
    class Fake:
        num_envs, masked = 1, False
        device = torch.device("cpu")
        obs_norm = reward_scaler = host_norm = None

    from ppokit.envs.encoders import BoxEncoder

    c = Fake()
    c.encoder, c.policy = BoxEncoder(3), type("P", (), {"kind": "continuous"})()
    c.envs = _vec("Pendulum-v1", gym.vector.AutoresetMode.SAME_STEP)
    assert one_env.applies(c)
    c.obs_norm = object()  # a normalizer without host replicas: the general loop
    assert not one_env.applies(c)
    c.obs_norm, c.masked = None, True
    assert not one_env.applies(c)
    c.envs.close()


def _torch_recursion(deltas, decay):
    """The torch loop ``advantages._recursion`` runs on other devices (the reference of its numpy path)."""
    out = torch.empty_like(deltas)
    last = torch.zeros_like(deltas[0])
    for t in range(deltas.shape[0] - 1, -1, -1):
        last = deltas[t] + decay[t] * last
        out[t] = last
    return out


@pytest.mark.parametrize("n", [1, 3, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_host_gae_recursion_is_the_torch_loop_bit_for_bit(n, dtype):
    from ppokit.core.advantages import _recursion, gae

    g = torch.Generator().manual_seed(n)
    T = 300
    deltas = (torch.randn(T, n, generator=g, dtype=dtype) * 10.0 ** torch.randint(-6, 6, (T, n), generator=g))
    decay = 0.99 * 0.95 * (torch.rand(T, n, generator=g) > 0.05).to(dtype)
    deltas[7, 0], deltas[9, -1] = float("nan"), float("inf")  # non-finite values propagate as in torch
    got, want = _recursion(deltas, decay), _torch_recursion(deltas, decay)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert torch.equal(got.view(torch.int64 if dtype == torch.float64 else torch.int32),
                       want.view(torch.int64 if dtype == torch.float64 else torch.int32))
    # Through gae() as the trainer calls it (inference mode), against its terms computed by hand.
    r, v, nv = (torch.randn(T, n, generator=g, dtype=dtype) for _ in range(3))
    term, trunc = torch.rand(T, n, generator=g) < 0.03, torch.rand(T, n, generator=g) < 0.03
    with torch.inference_mode():
        adv, ret = gae(r, v, nv, term, trunc, 0.99, 0.95)
    d = r + 0.99 * (1.0 - term.to(dtype)) * nv - v
    ref = _torch_recursion(d, (0.99 * 0.95) * (1.0 - (term | trunc).to(dtype)))
    assert torch.equal(adv, ref) and torch.equal(ret, ref + v)


@pytest.mark.parametrize("env_id", ["CartPole-v1", "Pendulum-v1"])
def test_one_env_next_step_collector_matches_general_loop(env_id):
    """A NEXT_STEP vector env (the reset step is no transition): the same buffer, episodes and loop state."""
    from ppokit.policies import build_policy
    from ppokit.rollout.normalize import ObsNormalizer, RewardScaler

    results = []
    for lean in (True, False):
        envs = _vec(env_id, gym.vector.AutoresetMode.NEXT_STEP)
        torch.manual_seed(0)
        policy = build_policy(envs.single_observation_space, envs.single_action_space, (8,), "tanh")
        on = ObsNormalizer(policy.obs_dim)
        old = Collector.one_env_path
        Collector.one_env_path = lean
        try:
            c = Collector(envs, policy, policy, num_steps=300, device=torch.device("cpu"), env_id=env_id,
                          obs_norm=on, reward_scaler=RewardScaler(1, 0.99), perf={"env": 0.0, "inference": 0.0},
                          fail=lambda *a, **k: RuntimeError(a))
        finally:
            Collector.one_env_path = old
        assert c._one_env == lean
        c.reset(seed=4)
        out = [c.collect(0) for _ in range(2)]
        b = c.buffer
        results.append((out, [t.clone() for t in (b.obs, b.actions, b.logp, b.values, b.rewards, b.terminated,
                                                  b.truncated, b.valid, b.final_values, b.has_final)],
                        c.next_obs_raw.copy(), c.ep_return.copy(), c.ep_length.copy(), c.prev_done.copy(),
                        c.last_obs.clone(), on.rms.mean.clone()))
        envs.close()
    (out_a, bufs_a, *rest_a), (out_b, bufs_b, *rest_b) = results
    assert out_a == out_b and len(out_a[1][0]) > 0
    assert not bool(bufs_a[7].all())  # NEXT_STEP reset steps were met (not transitions)
    for x, y in zip(bufs_a, bufs_b):
        assert torch.equal(x, y)
    for x, y in zip(rest_a, rest_b):
        assert np.array_equal(np.asarray(x), np.asarray(y))
