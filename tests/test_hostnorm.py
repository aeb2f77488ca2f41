"""The one-env lean normalizer path (``hostnorm.HostNormalizers``) computes what the torch normalizers compute,
bit for bit: op by op against ``normalize.ObsNormalizer`` / ``RewardScaler``, and on whole runs against the
torch path (switched off by making ``HostNormalizers.applies`` refuse)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ppokit.rollout.hostnorm import HostNormalizers
from ppokit.rollout.normalize import ObsNormalizer, RewardScaler


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)


@pytest.mark.parametrize("frozen_at", [None, 40])
def test_host_path_equals_torch_normalizers_step_by_step(frozen_at):
    rng = np.random.default_rng(0)
    D = 11
    ref_o, ref_r = ObsNormalizer((D,)), RewardScaler(1, 0.99)
    lean_o, lean_r = ObsNormalizer((D,)), RewardScaler(1, 0.99)
    host = HostNormalizers(lean_o, lean_r)
    assert host.load()
    for t in range(300):
        if t == frozen_at:
            for x in (ref_o, ref_r, lean_o, lean_r):
                x.frozen = True
        # Scales over many decades so rounding differences would show.
        row = (rng.normal(size=(1, D)) * 10.0 ** rng.uniform(-3, 4, size=D) + rng.normal() * 50).astype(np.float32)
        reward = np.array([rng.normal() * 10.0 ** rng.uniform(-2, 2)])
        done = np.array([rng.random() < 0.05])
        ref_o.update(torch.as_tensor(row))
        host.update_obs(row)
        assert torch.equal(ref_o.normalize(torch.as_tensor(row)), torch.from_numpy(host.normalize(row)))
        want = ref_r.scale(torch.as_tensor(reward, dtype=torch.float32), torch.as_tensor(done))
        got = host.scale(reward[0], done[0])
        assert want.item() == got and want.dtype == torch.float32
    # The torch objects were written through: states equal to the reference's, dtypes and shapes included.
    for ref, lean in ((ref_o.state_dict(), lean_o.state_dict()), (ref_r.state_dict(), lean_r.state_dict())):
        assert ref.keys() == lean.keys()
        for key in ref:
            assert _same(ref[key], lean[key]), key


def test_host_path_is_refused_where_it_would_not_be_exact():
    on, rs = ObsNormalizer((3,)), RewardScaler(1, 0.99)
    cpu = torch.device("cpu")
    assert HostNormalizers.applies(1, cpu, on, rs)
    assert HostNormalizers.applies(1, cpu, None, rs) and HostNormalizers.applies(1, cpu, on, None)
    assert not HostNormalizers.applies(2, cpu, on, RewardScaler(2, 0.99))  # several rows per merge
    assert not HostNormalizers.applies(1, cpu, None, None)
    assert not HostNormalizers.applies(1, torch.device("meta"), on, rs)
    on.rms.reduce = lambda n, m, v: (n, m, v)  # a data-parallel merge: the torch path must run
    assert not HostNormalizers(on, rs).load()


def _run(tmp_path, name, lean: bool, monkeypatch, **kw):
    from ppokit.config.ppo_config import PPOConfig
    from ppokit.training.trainer import Trainer

    monkeypatch.setattr(HostNormalizers, "applies", staticmethod(lambda *a: lean))
    cfg = PPOConfig(env_id="Pendulum-v1", num_envs=1, num_steps=64, num_minibatches=4, update_epochs=2,
                    total_timesteps=192, seed=5, tensorboard=False, normalize_obs=True, normalize_reward=True,
                    log_every=1000, **kw)
    trainer = Trainer(cfg, run_dir=tmp_path / name, console_enabled=False)
    assert (trainer.collector.host_norm is not None) == lean
    run = trainer.run()
    rows = [{k: v for k, v in m.items() if not k.startswith("perf/") and k != "charts/SPS"} for m in run.metrics]
    return rows, run.policy.state_dict(), trainer.obs_norm.state_dict(), trainer.reward_scaler.state_dict()


@pytest.mark.parametrize("fused", [True, False])
def test_whole_run_identical_with_and_without_host_path(tmp_path, monkeypatch, fused):
    lean = _run(tmp_path, "lean", True, monkeypatch, fused_update=fused)
    ref = _run(tmp_path, "torch", False, monkeypatch, fused_update=fused)
    rows_l, rows_r = lean[0], ref[0]
    assert len(rows_l) == len(rows_r) == 3
    for a, b in zip(rows_l, rows_r):
        assert a.keys() == b.keys()
        for k in a:
            assert a[k] == b[k] or (a[k] != a[k] and b[k] != b[k]), k  # NaN == NaN for "nothing this update"
    for d_l, d_r in zip(lean[1:], ref[1:]):
        for key in d_r:
            assert _same(d_l[key], d_r[key]), key
