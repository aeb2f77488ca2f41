"""Running statistics, observation normalisation and reward scaling against plain numpy references."""

from __future__ import annotations

import numpy as np
import pytest
import torch

torch.set_num_threads(1)

from ppokit.rollout.normalize import ObsNormalizer, RewardScaler, RunningMeanStd  # noqa: E402


@pytest.mark.parametrize("shape", [(), (3,), (2, 2)])
def test_running_mean_std_equals_numpy_of_concatenation(shape):
    rng = np.random.default_rng(0)
    # Uneven batch sizes, including a single sample, and a large offset to stress cancellation.
    batches = [rng.normal(5e3, 3.0, size=(b, *shape)) for b in (1, 7, 64, 3, 250)]
    rms = RunningMeanStd(shape)
    assert torch.all(rms.mean == 0) and torch.all(rms.var == 1) and rms.count.item() == 0
    # Before any batch the state is float64 already (a checkpoint of a fresh normalizer says "float64").
    assert all(t.dtype == torch.float64 for t in rms.state_dict().values())
    for b in batches:
        rms.update(torch.as_tensor(b))
    ref = np.concatenate(batches, axis=0)
    assert rms.mean.dtype == torch.float64 and rms.var.dtype == torch.float64
    assert tuple(rms.mean.shape) == shape
    np.testing.assert_allclose(rms.mean.numpy(), ref.mean(axis=0), rtol=1e-12)
    np.testing.assert_allclose(rms.var.numpy(), ref.var(axis=0), rtol=1e-9)
    assert rms.count.item() == len(ref)


def test_running_mean_std_accepts_numpy_and_ignores_empty_batch():
    rms = RunningMeanStd((2,))
    rms.update(np.array([[1.0, 2.0], [3.0, 6.0]], dtype=np.float32))
    rms.update(np.zeros((0, 2)))
    np.testing.assert_allclose(rms.mean.numpy(), [2.0, 4.0])
    np.testing.assert_allclose(rms.var.numpy(), [1.0, 4.0])
    with pytest.raises(ValueError, match=r"^expected a batch of shape \[B, 2\], got \(3, 5\)$"):
        rms.update(np.zeros((3, 5)))
    with pytest.raises(ValueError, match=r"^expected a batch of shape \[B, 2, 3\], got \(4, 3\)$"):
        RunningMeanStd((2, 3)).update(np.zeros((4, 3)))


def test_an_int_shape_is_a_one_axis_shape():
    rms = RunningMeanStd(3)
    assert rms.shape == (3,) and rms.mean.shape == (3,) and rms.var.shape == (3,)
    rms.update(np.array([[1.0, 2.0, 3.0], [3.0, 2.0, 1.0]]))
    np.testing.assert_allclose(rms.var.numpy(), [1.0, 0.0, 1.0])


def test_float32_observations_are_accumulated_in_float64():
    # The statistics of a float32 batch are those of its values in float64: the float32 mean of 1000 values near
    # 1e4 is off by ~3e-4 and their variance by ~1e-6 relative, far above float64's rounding.
    rng = np.random.default_rng(3)
    x = (1e4 + rng.random((1000, 1))).astype(np.float32)
    rms = RunningMeanStd((1,))
    rms.update(x)
    exact = x.astype(np.float64)
    np.testing.assert_allclose(rms.mean.numpy(), exact.mean(0), rtol=1e-14)
    np.testing.assert_allclose(rms.var.numpy(), exact.var(0), rtol=1e-10)


def test_obs_normalizer_formula_clip_and_dtype():
    rng = np.random.default_rng(1)
    data = rng.normal([1.0, -2.0, 0.0], [0.5, 2.0, 1e-3], size=(500, 3))
    norm = ObsNormalizer((3,), clip=5.0)
    norm.update(data)
    x = rng.normal(size=(8, 3))
    x[0] = [1e6, -1e6, 0.0]  # far outside: must be clipped to +-clip
    out = norm.normalize(torch.as_tensor(x, dtype=torch.float32))
    assert out.dtype == torch.float32 and out.shape == (8, 3)
    ref = np.clip((x.astype(np.float32) - data.mean(0)) / np.sqrt(data.var(0) + 1e-8), -5.0, 5.0)
    np.testing.assert_allclose(out.numpy(), ref, rtol=1e-5, atol=1e-5)
    assert out[0, 0].item() == 5.0 and out[0, 1].item() == -5.0
    assert out.abs().max().item() <= 5.0
    # A single unbatched observation broadcasts the same way.
    np.testing.assert_allclose(norm.normalize(x[1]).numpy(), out[1].numpy(), rtol=1e-6)


def test_obs_normalizer_frozen_does_not_update():
    norm = ObsNormalizer((2,))
    norm.update(np.array([[0.0, 0.0], [2.0, 4.0]]))
    before = {k: v.clone() for k, v in norm.state_dict().items()}
    norm.frozen = True
    norm.update(np.full((10, 2), 100.0))
    for k, v in norm.state_dict().items():
        assert torch.equal(v, before[k])
    norm.frozen = False
    norm.update(np.full((10, 2), 100.0))
    assert not torch.equal(norm.state_dict()["mean"], before["mean"])


def _reward_scaler_reference(rewards, dones, gamma, clip, eps):
    """Plain-Python reward scaling: var over every discounted return seen so far."""
    n_steps, n_envs = rewards.shape
    returns = [0.0] * n_envs
    seen: list[float] = []
    out = np.zeros_like(rewards)
    for t in range(n_steps):
        for i in range(n_envs):
            returns[i] = returns[i] * gamma + rewards[t, i]
        seen.extend(returns)
        var = float(np.var(seen))
        for i in range(n_envs):
            out[t, i] = min(max(rewards[t, i] / (var + eps) ** 0.5, -clip), clip)
            if dones[t, i]:
                returns[i] = 0.0
    return out


@pytest.mark.parametrize(("gamma", "clip"), [(0.99, 10.0), (0.9, 1.5)])
def test_reward_scaler_matches_python_loop(gamma, clip):
    rng = np.random.default_rng(2)
    n_steps, n_envs = 300, 4
    rewards = rng.normal(0.5, 2.0, size=(n_steps, n_envs))
    dones = rng.random((n_steps, n_envs)) < 0.05
    ref = _reward_scaler_reference(rewards, dones, gamma, clip, 1e-8)
    scaler = RewardScaler(n_envs, gamma, clip=clip)
    got = np.stack([scaler.scale(rewards[t], dones[t]).numpy() for t in range(n_steps)])
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=1e-6)
    if clip < 2:
        assert (np.abs(got) == np.float32(clip)).any(), "the clip branch was never exercised"


def test_reward_scaler_frozen_keeps_statistics_but_tracks_returns():
    scaler = RewardScaler(2, 0.5)
    scaler.scale(torch.tensor([1.0, 2.0]), torch.tensor([False, False]))
    scaler.scale(torch.tensor([3.0, -1.0]), torch.tensor([False, True]))
    var = scaler.rms.var.clone()
    np.testing.assert_allclose(scaler.returns.numpy(), [3.5, 0.0])
    scaler.frozen = True
    out = scaler.scale(torch.tensor([4.0, 4.0]), torch.tensor([False, False]))
    assert torch.equal(scaler.rms.var, var)
    np.testing.assert_allclose(out.numpy(), np.clip(4.0 / np.sqrt(var.item() + 1e-8), -10, 10), rtol=1e-6)
    np.testing.assert_allclose(scaler.returns.numpy(), [5.75, 4.0])


def test_state_dicts_round_trip_through_weights_only_load(tmp_path):
    rng = np.random.default_rng(3)
    norm = ObsNormalizer((4,), clip=3.0)
    norm.update(rng.normal(2.0, 3.0, size=(50, 4)))
    scaler = RewardScaler(3, 0.99)
    for _ in range(20):
        scaler.scale(rng.normal(size=3), rng.random(3) < 0.2)

    path = tmp_path / "norm.pt"
    torch.save({"obs": norm.state_dict(), "rew": scaler.state_dict()}, path)
    loaded = torch.load(path, weights_only=True)
    for sd in loaded.values():
        assert all(isinstance(v, torch.Tensor) for v in sd.values())

    norm2 = ObsNormalizer((4,), clip=3.0)
    norm2.load_state_dict(loaded["obs"])
    scaler2 = RewardScaler(3, 0.99)
    scaler2.load_state_dict(loaded["rew"])

    x = rng.normal(size=(5, 4))
    assert torch.equal(norm.normalize(x), norm2.normalize(x))
    r, d = rng.normal(size=3), np.array([True, False, False])
    assert torch.equal(scaler.scale(r, d), scaler2.scale(r, d))
    assert torch.equal(scaler.returns, scaler2.returns)

    # A different env count keeps the statistics but restarts the per-env returns.
    scaler3 = RewardScaler(5, 0.99)
    scaler3.load_state_dict(loaded["rew"])
    assert torch.equal(scaler3.rms.var, loaded["rew"]["var"]) and torch.all(scaler3.returns == 0)

    with pytest.raises(ValueError, match="shape"):
        ObsNormalizer((3,)).load_state_dict(loaded["obs"])


def test_split_moments_recovers_the_batch_a_merge_added():
    # A rollout worker ships the moments of what it added to its statistics (rollout/actors.py): they must be the
    # added batch's own count, mean and population variance, so the learner's merge of them is the merge of the data.
    from ppokit.rollout.normalize import RunningMeanStd, merge_moments, split_moments

    g = torch.Generator().manual_seed(0)
    rms = RunningMeanStd(3)
    rms.update(torch.randn(50, 3, generator=g) * 2 + 1)
    before = rms.state_dict()
    added = torch.randn(30, 3, generator=g, dtype=torch.float64) * 3 - 2
    rms.update(added)
    n, mean, var = split_moments(before, rms.state_dict())
    assert n == 30
    torch.testing.assert_close(mean, added.mean(0))
    torch.testing.assert_close(var, added.var(0, unbiased=False))
    count, m, v = merge_moments(before["count"], before["mean"], before["var"], n, mean, var)
    torch.testing.assert_close(m, rms.mean)
    torch.testing.assert_close(v, rms.var)
    assert split_moments(before, before)[0] == 0.0  # nothing added


def test_reward_scaler_edge_inputs():
    # Equal returns in every env (variance 0): eps alone keeps the scale finite, r / sqrt(0 + 1e-8) = 1e-5 / 1e-4.
    scaler = RewardScaler(2, 0.99)
    np.testing.assert_allclose(scaler.scale(np.array([1e-5, 1e-5]), np.array([False, False])).numpy(), [0.1, 0.1],
                               rtol=1e-6)
    # Episode ends given as 0/1 integers (not bools) still restart the return of the env that ended.
    scaler.scale(np.array([1e-5, 1e-5]), np.array([0, 1]))
    np.testing.assert_allclose(scaler.returns.numpy(), [1e-5 * 0.99 + 1e-5, 0.0], rtol=1e-12)
    # Either input of the wrong length is refused, not broadcast.
    for rewards, dones in (([1.0, 2.0, 3.0], [False, False]), ([1.0, 2.0], [False, False, False])):
        with pytest.raises(ValueError, match=r"expected rewards and dones of shape \[2\]"):
            scaler.scale(np.array(rewards), np.array(dones))


def test_a_normalizer_on_a_device_keeps_its_statistics_and_results_there_for_host_inputs():
    """The collector hands numpy observations and rewards to a normalizer built on the training device (CUDA):
    everything must land on that device, not on torch's default one. The "meta" device stands in for CUDA on a
    CPU-only machine: a meta tensor mixed with a CPU tensor raises, and each result's device is asserted."""
    meta = torch.device("meta")
    rms = RunningMeanStd(3, device="meta")
    assert {rms.mean.device, rms.var.device, rms.count.device} == {meta}
    rms.update(np.ones((4, 3)))
    assert {rms.mean.device, rms.var.device, rms.count.device} == {meta}
    rms.load_state_dict(RunningMeanStd(3).state_dict())  # a CPU checkpoint restored onto the device
    assert {t.device for t in rms.state_dict().values()} == {meta}

    obs = ObsNormalizer(3, device="meta")
    obs.update(np.ones((2, 3)))
    out = obs.normalize(np.ones((2, 3)))
    assert out.device == meta and out.dtype == torch.float32 and out.shape == (2, 3)
    obs.load_state_dict(ObsNormalizer(3).state_dict())
    assert {t.device for t in obs.state_dict().values()} == {meta}

    rs = RewardScaler(2, 0.99, device="meta")
    assert rs.returns.device == meta and rs.rms.mean.device == meta
    scaled = rs.scale(np.ones(2), np.array([False, True]))
    assert scaled.device == meta and scaled.dtype == torch.float32 and scaled.shape == (2,)
    assert rs.returns.device == meta
    cpu = RewardScaler(2, 0.99)
    rs.load_state_dict(cpu.state_dict())  # the per-env returns kept (same num_envs), moved to the device
    assert {t.device for t in rs.state_dict().values()} == {meta}
    rs.load_state_dict(RewardScaler(3, 0.99).state_dict())  # another num_envs: fresh returns, on the device
    assert rs.returns.device == meta and rs.returns.shape == (2,)
