"""The fused update against the autograd reference (``update.ppo_update``): losses, gradients, parameters,
diagnostics, guards, optimizer state and an end-to-end training run."""

from __future__ import annotations

import copy
import math

import pytest
import torch

from ppokit.config.ppo_config import PPOConfig
from ppokit.kernels.acting import ActingKernel
from ppokit.kernels.flat_adam import FlatAdam
from ppokit.kernels.fused_step import fused_ppo_update
from ppokit.kernels.mlp_backward import MLPLossKernel, supports, unsupported_reason
from ppokit.policies import ActorCritic
from ppokit.update.autograd import STAT_NAMES, Batch, UpdateSettings, minibatch_loss, ppo_update

KINDS = ["discrete", "continuous"]
ACTIVATIONS = ["tanh", "relu"]


def make_policy(kind: str, activation: str, dtype=torch.float64, obs_dim: int = 5, seed: int = 0) -> ActorCritic:
    torch.manual_seed(seed)
    dims = [3] if kind == "discrete" else [2]
    return ActorCritic(obs_dim, kind, dims, [16, 12], activation).to(dtype)


def make_batch(policy: ActorCritic, B: int, clipped: bool, seed: int = 1) -> Batch:
    """Random transitions; with ``clipped`` the stored logp_old is shifted so that many ratios leave [0.8, 1.2]."""
    g = torch.Generator().manual_seed(seed)
    dtype = next(policy.parameters()).dtype
    obs = torch.randn(B, policy.obs_dim, generator=g, dtype=dtype)
    if policy.kind == "discrete":
        actions = torch.randint(0, policy.action_dims[0], (B,), generator=g)
    else:
        actions = torch.randn(B, policy.action_dims[0], generator=g, dtype=dtype)
    with torch.no_grad():
        logp, _, values = policy.evaluate(obs, actions)
    shift = 0.6 * torch.randn(B, generator=g, dtype=dtype) if clipped else torch.zeros(B, dtype=dtype)
    return Batch(obs, actions, logp + shift, values + 0.5 * torch.randn(B, generator=g, dtype=dtype),
                 torch.randn(B, generator=g, dtype=dtype) * 2 + 0.3, values + torch.randn(B, generator=g, dtype=dtype))


def settings(clip_vloss: bool, **kw) -> UpdateSettings:
    base = dict(algo="ppo", update_epochs=3, num_minibatches=4, clip_coef=0.2, clip_vloss=clip_vloss, norm_adv=True,
                ent_coef=0.01, vf_coef=0.5, max_grad_norm=0.5, target_kl=None)
    base.update(kw)
    return UpdateSettings(**base)


def autograd_grads(policy, mb, s):
    """Reference: loss, stats and per-parameter gradients by autograd."""
    policy.zero_grad(set_to_none=True)
    loss, stats = minibatch_loss(policy, mb, s)
    loss.backward()
    return float(loss.detach()), {k: float(v) for k, v in stats.items()}, [p.grad.clone() for p in policy.parameters()]


def fused_grads(policy, mb, s):
    """Fused: loss, stats and per-parameter gradients (views into the flat gradient)."""
    from ppokit.core.advantages import normalize
    from ppokit.kernels.fused_step import host_stats

    kernel = MLPLossKernel(policy, FlatAdam(policy, lr=1e-3))
    adv = normalize(mb.advantages) if s.norm_adv else mb.advantages
    kernel.loss_and_grad(mb.obs, mb.actions, mb.logp_old, mb.values_old, adv, mb.returns, s)
    kernel.grad_norm_into_stats()
    loss, stats = host_stats(kernel.stat_buf.tolist(), s)
    assert tuple(stats) == STAT_NAMES
    return loss, stats, [p.grad.clone() for p in policy.parameters()]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("clipped", [False, True])
@pytest.mark.parametrize("clip_vloss", [False, True])
@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-5)])
def test_minibatch_loss_and_gradients_match_autograd(kind, activation, clipped, clip_vloss, dtype, tol):
    ref = make_policy(kind, activation, dtype)
    fused = copy.deepcopy(ref)
    mb = make_batch(ref, 64, clipped)
    s = settings(clip_vloss)
    loss_r, stats_r, grads_r = autograd_grads(ref, mb, s)
    loss_f, stats_f, grads_f = fused_grads(fused, mb, s)

    # The data exercise what they claim to: ratios far outside the clip range, or all exactly 1.
    if clipped:
        assert stats_r["clipfrac"] > 0.3
    else:
        assert stats_r["clipfrac"] == 0.0
    assert loss_f == pytest.approx(loss_r, rel=tol, abs=tol)
    for k in ("policy_loss", "value_loss", "entropy", "approx_kl", "approx_kl_k1", "clipfrac"):
        assert stats_f[k] == pytest.approx(stats_r[k], rel=tol, abs=tol), k
    for (name, _), gr, gf in zip(ref.named_parameters(), grads_r, grads_f):
        scale = gr.abs().max().item() + 1e-12
        assert (gr - gf).abs().max().item() <= tol * max(1.0, scale), name
    # The reported grad norm is the norm of the whole (unclipped) gradient.
    full = torch.sqrt(sum((g.double() ** 2).sum() for g in grads_r)).item()
    assert stats_f["grad_norm"] == pytest.approx(full, rel=max(tol, 1e-6))


def test_value_clipping_blocks_gradient_beyond_the_clip():
    """Independent check of the value-clip branch: a value moved past old+-eps away from the target gets no gradient."""
    ref = make_policy("discrete", "tanh")
    mb = make_batch(ref, 32, clipped=False)
    with torch.no_grad():
        v = ref.value(mb.obs)
    # values_old 1 below V (clip 0.2) and returns 5 above V: the clipped value old+0.2 is further from the return
    # than V, so the max picks the clipped branch, whose derivative is 0 outside the clip range.
    mb.values_old = v - 1.0
    mb.returns = v + 5.0
    s = settings(True, ent_coef=0.0)
    _, _, grads = fused_grads(copy.deepcopy(ref), mb, s)
    _, _, grads_r = autograd_grads(ref, mb, s)
    critic_idx = [i for i, (n, _) in enumerate(ref.named_parameters()) if n.startswith("critic")]
    for i in critic_idx:
        assert grads[i].abs().max().item() == 0.0
        assert grads_r[i].abs().max().item() == 0.0


def run_both(kind, activation, s, B=256, dtype=torch.float32, steps=1, clipped=True, nan_rows=None, seed=0):
    ref = make_policy(kind, activation, dtype, seed=seed)
    fused = copy.deepcopy(ref)
    batch = make_batch(ref, B, clipped)
    if nan_rows is not None:
        batch.returns[nan_rows] = float("nan")
    opt_r = torch.optim.Adam(ref.parameters(), lr=3e-3, eps=1e-5, fused=True)
    opt_f = FlatAdam(fused, lr=3e-3, eps=1e-5)
    g_r, g_f = torch.Generator().manual_seed(7), torch.Generator().manual_seed(7)
    out_r, out_f = [], []
    for _ in range(steps):
        out_r.append(ppo_update(ref, opt_r, batch, s, g_r))
        out_f.append(fused_ppo_update(fused, opt_f, batch, s, g_f))
    return ref, fused, out_r, out_f, opt_r, opt_f


def assert_same(ref, fused, out_r, out_f, tol):
    for a, b in zip(out_r, out_f):
        assert a.keys() == b.keys()
        for k in a:
            if math.isnan(a[k]):
                assert math.isnan(b[k]), k
            else:
                assert b[k] == pytest.approx(a[k], rel=tol, abs=tol), k
    for (name, p), q in zip(ref.named_parameters(), fused.parameters()):
        assert (p - q).abs().max().item() <= tol, name


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("clip_vloss", [False, True])
def test_parameters_after_several_updates_match(kind, activation, clip_vloss):
    s = settings(clip_vloss, update_epochs=4, num_minibatches=4)
    ref, fused, out_r, out_f, _, _ = run_both(kind, activation, s, steps=3)
    assert sum(o["minibatches"] for o in out_r) == 3 * 16
    assert_same(ref, fused, out_r, out_f, 1e-5)


@pytest.mark.parametrize("num_minibatches,B", [(1, 256), (3, 250), (8, 250)])
def test_minibatch_splits_match(num_minibatches, B):
    """One minibatch, and uneven tensor_split chunks, give the same updates as the reference."""
    s = settings(True, update_epochs=3, num_minibatches=num_minibatches)
    ref, fused, out_r, out_f, _, _ = run_both("discrete", "tanh", s, B=B, steps=2)
    assert_same(ref, fused, out_r, out_f, 1e-5)


def test_kl_early_stopping_matches():
    s = settings(False, update_epochs=10, num_minibatches=4, target_kl=0.01)
    ref, fused, out_r, out_f, _, _ = run_both("discrete", "tanh", s, clipped=False, steps=2)
    assert out_r[0]["early_stopped"] == 1.0 and out_r[0]["epochs_run"] < 10
    assert_same(ref, fused, out_r, out_f, 1e-5)


def test_nonfinite_minibatches_are_skipped_the_same_way():
    s = settings(False, update_epochs=2, num_minibatches=4)
    ref, fused, out_r, out_f, _, _ = run_both("continuous", "relu", s, nan_rows=[3], steps=1)
    assert out_r[0]["skipped_minibatches"] == 2.0  # the NaN row lands in one minibatch per epoch
    assert out_f[0]["skipped_minibatches"] == 2.0
    assert all(torch.isfinite(p).all() for p in fused.parameters())
    assert_same(ref, fused, out_r, out_f, 1e-5)


def test_float64_updates_match_tightly():
    s = settings(True, update_epochs=4, num_minibatches=4)
    ref, fused, out_r, out_f, _, _ = run_both("continuous", "tanh", s, dtype=torch.float64, steps=3)
    for (name, p), q in zip(ref.named_parameters(), fused.parameters()):
        assert (p - q).abs().max().item() <= 1e-9, name


def test_flat_buffer_backs_the_module_and_state_dict_roundtrips():
    s = settings(True)
    ref, fused, _, _, opt_r, opt_f = run_both("discrete", "relu", s, steps=2)
    # Every module parameter is a view into the one flat buffer.
    assert opt_f.fused  # this torch build has the one-kernel CPU Adam
    ptr, end = opt_f.flat.data_ptr(), opt_f.flat.data_ptr() + opt_f.flat.numel() * opt_f.flat.element_size()
    assert all(ptr <= p.data_ptr() < end for p in fused.parameters())
    # The state dict has the per-parameter layout of a plain Adam over policy.parameters(), with equal moments.
    sd_f, sd_r = opt_f.state_dict(), opt_r.state_dict()
    # The live per-parameter view matches torch's Optimizer.state layout.
    assert [int(st["step"]) for st in opt_f.state.values()] == [int(st["step"]) for st in opt_r.state.values()]
    assert sorted(sd_f["state"]) == sorted(sd_r["state"])
    for i in sd_r["state"]:
        for key in ("exp_avg", "exp_avg_sq", "step"):
            assert torch.allclose(sd_f["state"][i][key], sd_r["state"][i][key], atol=1e-6), (i, key)
    # It loads into a plain Adam, and a plain Adam's loads into a fresh FlatAdam; both then step identically.
    plain = copy.deepcopy(fused)
    opt_plain = torch.optim.Adam(plain.parameters(), lr=3e-3, eps=1e-5, fused=True)
    opt_plain.load_state_dict(sd_f)
    again = copy.deepcopy(ref)
    opt_again = FlatAdam(again, lr=3e-3, eps=1e-5)
    opt_again.load_state_dict(sd_r)
    b = make_batch(ref, 256, True, seed=5)
    for pol, opt, fn in ((plain, opt_plain, ppo_update), (again, opt_again, fused_ppo_update)):
        fn(pol, opt, b, s, torch.Generator().manual_seed(3))
    for p, q in zip(plain.parameters(), again.parameters()):
        assert (p - q).abs().max().item() <= 1e-5
    # A mismatched state dict is refused with a reason.
    with pytest.raises(ValueError, match="parameters"):
        opt_again.load_state_dict({"state": {}, "param_groups": [{**sd_r["param_groups"][0], "params": [0, 1]}]})


def test_unfused_adam_fallback_matches_torch_adam():
    """The arithmetic fallback (no fused kernel) steps exactly like torch.optim.Adam."""
    s = settings(True)
    ref = make_policy("discrete", "tanh")
    fb = copy.deepcopy(ref)
    opt_r = torch.optim.Adam(ref.parameters(), lr=3e-3, eps=1e-5, foreach=False)
    opt_f = FlatAdam(fb, lr=3e-3, eps=1e-5, fused=False)
    b = make_batch(ref, 128, True)
    for _ in range(2):
        ppo_update(ref, opt_r, b, s, torch.Generator().manual_seed(4))
        fused_ppo_update(fb, opt_f, b, s, torch.Generator().manual_seed(4))
    for p, q in zip(ref.parameters(), fb.parameters()):
        assert (p - q).abs().max().item() <= 1e-10


def test_unsupported_policies_and_algos_fall_back():
    md = ActorCritic(4, "multidiscrete", [2, 3], [8], "tanh")
    assert not supports(md, "ppo") and "multidiscrete" in unsupported_reason(md, "ppo")
    pol = ActorCritic(4, "discrete", [2], [8], "tanh")
    assert supports(pol, "ppo")
    assert not supports(pol, "ppo-kl") and not supports(pol, "a2c")
    with pytest.raises(ValueError, match="not fused"):
        fused_ppo_update(pol, FlatAdam(pol), make_batch(pol, 8, False), settings(False, algo="a2c"))


def cartpole_config(tmp_path, fused: bool, name: str) -> PPOConfig:
    return PPOConfig(env_id="CartPole-v1", num_envs=4, num_steps=64, total_timesteps=4 * 64 * 4, num_minibatches=4,
                     update_epochs=4, fused_update=fused, seed=3, tensorboard=False, run_dir=str(tmp_path / name))


@pytest.mark.slow
def test_training_with_fused_on_and_off_gives_the_same_first_updates(tmp_path):
    from ppokit.training.trainer import Trainer, train

    assert Trainer(cartpole_config(tmp_path, True, "probe"), console_enabled=False).fused
    on = train(cartpole_config(tmp_path, True, "on"), console_enabled=False)
    off = train(cartpole_config(tmp_path, False, "off"), console_enabled=False)
    assert len(on.metrics) == len(off.metrics) == 4
    for m_on, m_off in zip(on.metrics[:3], off.metrics[:3]):
        for k, v in m_off.items():
            if k.startswith("perf/"):
                continue
            if math.isnan(v):
                assert math.isnan(m_on[k]), k
            else:
                assert m_on[k] == pytest.approx(v, rel=1e-4, abs=1e-5), k


def test_fused_checkpoints_resume_in_either_mode(tmp_path):
    from ppokit.runtime.checkpoint import load_checkpoint
    from ppokit.training.trainer import CHECKPOINT_NAME, Trainer, resume, train

    cfg = cartpole_config(tmp_path, True, "run")
    cfg.total_timesteps = 4 * 64 * 2
    first = train(cfg, console_enabled=False)
    state = load_checkpoint(first.run_dir / CHECKPOINT_NAME)
    assert len(state["optimizer"]["state"]) == len(list(first.policy.parameters()))
    # Resuming continues the fused run.
    cont = resume(first.run_dir, total_timesteps=4 * 64 * 3, console_enabled=False)
    assert cont.global_step == 4 * 64 * 3 and len(cont.metrics) == 1
    # The same checkpoint loads into the autograd path (plain Adam) with identical weights and moments.
    state["config"]["fused_update"] = False
    cfg_off = PPOConfig.from_dict(state["config"])
    tr = Trainer(cfg_off, run_dir=tmp_path / "off", console_enabled=False, resume_state=state)
    assert not tr.fused
    for p, q in zip(tr.policy.parameters(), first.policy.parameters()):
        assert torch.equal(p, q)
    sd = tr.optimizer.state_dict()
    for i, entry in state["optimizer"]["state"].items():
        assert torch.equal(sd["state"][i]["exp_avg"], entry["exp_avg"])


# ---------------------------------------------------------------------- acting (ActingKernel.act)
def acting_pair(kind, activation, dtype=torch.float32, hidden=(16, 12), obs_dim=5, seed=0):
    """A policy with its FlatAdam, and an independent deep copy (plain module) as the reference actor."""
    torch.manual_seed(seed)
    dims = [3] if kind == "discrete" else [2]
    pol = ActorCritic(obs_dim, kind, dims, list(hidden), activation).to(dtype)
    if kind == "continuous":
        with torch.no_grad():
            pol.log_std.copy_(torch.tensor([-0.3, 0.4], dtype=dtype))
    ref = copy.deepcopy(pol)
    return pol, FlatAdam(pol, lr=1e-2), ref


def acting_kernel(pol, opt):
    """The acting kernel on ``pol``'s parameters as ``opt`` writes them (the trainer's pairing)."""
    return ActingKernel(pol, opt)


def assert_acts_like(kernel, ref, obs, tol, deterministic=False, seed=11):
    """Same RNG state in, same actions out; logp and values within ``tol`` (relative to magnitude, at least 1)."""
    torch.manual_seed(seed)
    with torch.inference_mode():
        a_ref, lp_ref, v_ref, _ = ref.act(obs, None, None, deterministic=deterministic)
    after_ref = torch.rand(3)
    torch.manual_seed(seed)
    with torch.inference_mode():
        a, lp, v, _ = kernel.act(obs, None, None, deterministic=deterministic)
    # The kernel consumed exactly the random numbers the reference did: the next draws agree.
    assert torch.equal(torch.rand(3), after_ref)
    assert a.shape == a_ref.shape and lp.shape == lp_ref.shape == v.shape == v_ref.shape == (obs.shape[0],)
    if ref.kind == "discrete":
        assert a.dtype == torch.long and torch.equal(a, a_ref)
    else:
        torch.testing.assert_close(a, a_ref, rtol=tol, atol=tol)
    torch.testing.assert_close(lp, lp_ref, rtol=tol, atol=tol)
    torch.testing.assert_close(v, v_ref, rtol=tol, atol=tol)
    return a, lp, v


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("dtype,tol", [(torch.float32, 1e-5), (torch.float64, 1e-12)])
def test_acting_matches_policy_act_across_batch_sizes_and_updates(kind, activation, dtype, tol):
    pol, opt, ref = acting_pair(kind, activation, dtype)
    kernel = acting_kernel(pol, opt)
    g = torch.Generator().manual_seed(2)
    sizes = [1, 8, 37, 1024]
    for B in sizes:  # fresh weights
        obs = 2.0 * torch.randn(B, pol.obs_dim, generator=g, dtype=dtype)
        assert_acts_like(kernel, ref, obs, tol, seed=B)
        assert_acts_like(kernel, ref, obs, tol, deterministic=True)
    s = settings(True, update_epochs=2, num_minibatches=2)
    for step in range(3):  # after optimizer steps the acting weights follow the parameters
        batch = make_batch(pol, 64, True, seed=step)
        fused_ppo_update(pol, opt, batch, s, torch.Generator().manual_seed(step))
        ref.load_state_dict(pol.state_dict())
        for B in sizes:
            obs = torch.randn(B, pol.obs_dim, generator=g, dtype=dtype)
            assert_acts_like(kernel, ref, obs, tol, seed=100 * step + B)
    # The parameters really moved, so a stale cache would have failed above.
    start = acting_pair(kind, activation, dtype)[0]
    assert any((p - q).abs().max() > 1e-3 for p, q in zip(pol.parameters(), start.parameters()))


@pytest.mark.parametrize("kind", KINDS)
def test_acting_sees_load_state_dict_and_inplace_parameter_writes(kind):
    pol, opt, ref = acting_pair(kind, "tanh")
    kernel = acting_kernel(pol, opt)
    obs = torch.randn(64, pol.obs_dim)
    assert_acts_like(kernel, ref, obs, 1e-5)  # builds and caches the acting weights
    # policy.load_state_dict writes the flat buffer through the parameter views (a checkpoint resume does this).
    other = acting_pair(kind, "tanh", seed=7)[2]
    pol.load_state_dict(other.state_dict())
    assert_acts_like(kernel, other, obs, 1e-5)
    # An in-place edit of one parameter (here the critic's last bias, under inference mode) is seen too.
    with torch.inference_mode():
        pol.critic[-1].bias.add_(3.0)
    with torch.no_grad():
        other.critic[-1].bias.add_(3.0)
    _, _, v = assert_acts_like(kernel, other, obs, 1e-5)
    # Writes through .data bypass every version counter: invalidate() is the documented way to announce them.
    pol.actor[0].weight.data.mul_(0.5)
    with torch.no_grad():
        other.actor[0].weight.mul_(0.5)
    kernel.invalidate()
    assert_acts_like(kernel, other, obs, 1e-5)
    # FlatAdam.step on its own (without fused_ppo_update) invalidates as well.
    opt.flat.grad.normal_()
    opt.step()
    other.load_state_dict(pol.state_dict())
    assert_acts_like(kernel, other, obs, 1e-5)


def test_acting_after_checkpoint_resume_matches_the_restored_policy(tmp_path):
    from ppokit.runtime.checkpoint import load_checkpoint
    from ppokit.training.trainer import CHECKPOINT_NAME, Trainer, train

    cfg = cartpole_config(tmp_path, True, "run")
    cfg.total_timesteps = 4 * 64 * 2
    first = train(cfg, console_enabled=False)
    state = load_checkpoint(first.run_dir / CHECKPOINT_NAME)
    tr = Trainer(PPOConfig.from_dict(state["config"]), run_dir=tmp_path / "again", console_enabled=False,
                 resume_state=state)
    assert tr.fused
    obs = torch.randn(16, 4)
    assert_acts_like(tr.acting, first.policy, obs, 1e-5)
    # A trainer that acted before the checkpoint's weights were loaded into it acts with the loaded weights.
    fresh = Trainer(PPOConfig.from_dict({**state["config"], "seed": 99}), run_dir=tmp_path / "fresh",
                    console_enabled=False)
    with torch.inference_mode():
        fresh.acting.act(obs, None, None)
    fresh._load_state(state)  # what resume() does
    assert_acts_like(fresh.acting, first.policy, obs, 1e-5)
    for t in (tr, fresh):
        t.envs.close()
        t.logger.close()


@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("kind", KINDS)
def test_acting_with_unequal_actor_critic_and_without_hidden_layers(activation, kind):
    from ppokit.policies.actor_critic import mlp

    # Actor and critic of different widths cannot share one matmul per depth: the per-net fallback runs.
    pol, _, _ = acting_pair(kind, activation, torch.float64)
    pol.critic = mlp(pol.obs_dim, [7, 9, 4], 1, activation, out_gain=1.0).to(torch.float64)
    ref = copy.deepcopy(pol)
    kernel = acting_kernel(pol, FlatAdam(pol))
    assert_acts_like(kernel, ref, torch.randn(20, pol.obs_dim, dtype=torch.float64), 1e-12)
    assert not kernel._merged
    # A critic without hidden layers next to a hidden actor.
    pol, _, _ = acting_pair(kind, activation, torch.float64)
    pol.critic = mlp(pol.obs_dim, [], 1, activation, out_gain=1.0).to(torch.float64)
    ref = copy.deepcopy(pol)
    kernel = acting_kernel(pol, FlatAdam(pol))
    assert_acts_like(kernel, ref, torch.randn(20, pol.obs_dim, dtype=torch.float64), 1e-12)
    assert not kernel._merged
    # No hidden layers: both heads read the observation.
    pol, opt, ref = acting_pair(kind, activation, torch.float64, hidden=())
    kernel = acting_kernel(pol, opt)
    assert_acts_like(kernel, ref, torch.randn(20, pol.obs_dim, dtype=torch.float64), 1e-12)
    # One hidden layer (the merged path with no deeper layer).
    pol, opt, ref = acting_pair(kind, activation, torch.float64, hidden=(6,))
    kernel = acting_kernel(pol, opt)
    assert_acts_like(kernel, ref, torch.randn(20, pol.obs_dim, dtype=torch.float64), 1e-12)
    assert kernel._merged


def test_acting_outputs_are_fresh_and_work_outside_inference_mode():
    pol, opt, ref = acting_pair("discrete", "tanh")
    kernel = acting_kernel(pol, opt)
    obs = torch.randn(8, pol.obs_dim)
    with torch.inference_mode():
        a1, lp1, v1, _ = kernel.act(obs, None, None)  # buffers are created inside inference mode here ...
    kept = (a1.clone(), lp1.clone(), v1.clone())
    a2, lp2, v2, _ = kernel.act(torch.randn(8, pol.obs_dim), None, None)  # ... and reused with grad mode on
    assert not (lp2.requires_grad or v2.requires_grad)
    # Results of one call are not overwritten by the next (the trainer keeps them in its buffer).
    for x, y in zip((a1, lp1, v1), kept):
        assert torch.equal(x, y)
    torch.testing.assert_close(kernel.actor_head(obs), ref.actor(obs).detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_bench_acting_smoke():
    """benchmarks/bench_acting.py runs (tiny budgets) and reports both implementations per batch size."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "bench_acting.py"), "--smoke", "--envs", "8,64"],
                          capture_output=True, text=True, env=dict(os.environ, OMP_NUM_THREADS="1"), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for kind in ("discrete", "continuous"):
        for n in (8, 64):
            assert f"RATIO acting {kind} {n} envs: fused " in proc.stdout
    for n in (8, 64):
        assert f"RATIO acting recurrent {n} envs: kernel " in proc.stdout


# ------------------------------------------------------------------ edge cases where the two paths must agree
def _uniform_policy(dtype=torch.float32) -> ActorCritic:
    """A discrete policy whose actor head is zero: every logp is exactly log(1/3) in both paths."""
    policy = make_policy("discrete", "tanh", dtype)
    with torch.no_grad():
        policy.actor[-1].weight.zero_()
        policy.actor[-1].bias.zero_()
    return policy


def test_constant_advantages_normalize_to_zero_in_both_paths():
    """Seven float32 copies of 0.1 per minibatch (their mean is inexact): the normalized advantages are exactly 0
    in both paths, so with no entropy bonus the actor gets no gradient and neither update moves it."""
    s = settings(False, update_epochs=2, num_minibatches=4, ent_coef=0.0)
    ref = make_policy("discrete", "tanh", torch.float32)
    fused = copy.deepcopy(ref)
    batch = make_batch(ref, 28, clipped=True)
    batch.advantages = torch.full((28,), 0.1)
    actor_before = [p.detach().clone() for p in ref.actor.parameters()]
    critic_before = ref.critic[0].weight.detach().clone()
    opt_r = torch.optim.Adam(ref.parameters(), lr=3e-3, eps=1e-5)
    opt_f = FlatAdam(fused, lr=3e-3, eps=1e-5)
    out_r = ppo_update(ref, opt_r, batch, s, torch.Generator().manual_seed(7))
    out_f = fused_ppo_update(fused, opt_f, batch, s, torch.Generator().manual_seed(7))
    assert out_r["minibatches"] == out_f["minibatches"] == 8
    for net in (ref, fused):
        for p, q in zip(net.actor.parameters(), actor_before):
            assert torch.equal(p, q)
        assert not torch.equal(net.critic[0].weight, critic_before)  # the critic did learn
    assert out_r["policy_loss"] == out_f["policy_loss"] == 0.0


def _tie_batch(policy: ActorCritic, clip: float, n: int = 64):
    """Samples whose ratio is one float32 ulp below 1 - clip and whose advantage makes ``r*A`` round to exactly
    ``(1 - clip)*A``: a tie of the surrogate's two branches with the ratio really outside the clip range.
    Advantages of both signs: A < 0 is past the clip in the improving direction (no gradient), A > 0 is not."""
    obs = torch.randn(n, policy.obs_dim, generator=torch.Generator().manual_seed(3))
    actions = torch.arange(n) % 3
    with torch.no_grad():
        logp, _, values = policy.evaluate(obs, actions)
    low = torch.tensor(1.0 - clip)
    target = torch.nextafter(low, torch.tensor(0.0))
    delta = torch.tensor(math.log(1.0 - clip))
    for _ in range(100):  # walk delta by ulps until exp(logp - (logp - delta)) is the ulp below the bound
        r = torch.exp(logp - (logp - delta))
        if bool((r == target).all()):
            break
        delta = torch.nextafter(delta, torch.tensor(0.0) if bool((r < target).all()) else torch.tensor(-1.0))
    assert bool((r == target).all()), "could not construct a ratio one ulp below the clip"
    cand = torch.rand(20_000, generator=torch.Generator().manual_seed(4)) * 3 + 0.1
    ties = cand[target * cand == low * cand][: n // 2]
    assert ties.numel() == n // 2
    adv = torch.cat([ties, -ties])
    assert bool((r * adv == low * adv).all())
    return Batch(obs, actions, logp - delta, values, adv, values + 1.0)


def test_surrogate_ties_send_the_gradient_to_the_branch_the_clip_rule_picks_in_both_paths():
    clip = 0.25
    ref = _uniform_policy()
    mb = _tie_batch(ref, clip)
    s = settings(False, clip_coef=clip, ent_coef=0.0, vf_coef=0.0, norm_adv=False)
    _, _, grads_r = autograd_grads(ref, mb, s)
    _, _, grads_f = fused_grads(copy.deepcopy(ref), mb, s)
    # Independent reference: A > 0 below the clip keeps the full r*A gradient, A < 0 past the clip gets none.
    ref2 = copy.deepcopy(ref)
    logp, _, _ = ref2.evaluate(mb.obs, mb.actions)
    keep = (mb.advantages > 0).float()
    loss = -(torch.exp(logp - mb.logp_old) * mb.advantages * keep).mean()
    expected = torch.autograd.grad(loss, list(ref2.actor.parameters()))
    actor = [i for i, (n, _) in enumerate(ref.named_parameters()) if n.startswith("actor")]
    assert expected[-2].abs().max() > 0  # the head's weight (the zero head passes nothing further down)
    for i, e in zip(actor, expected):
        torch.testing.assert_close(grads_r[i], e, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(grads_f[i], e, rtol=1e-5, atol=1e-7)


def test_value_clip_ties_send_the_whole_gradient_to_the_unclipped_branch_in_both_paths():
    """V = 0.5, V_old = -0.5, clip 0.25 (V_clipped = -0.25) and R = 0.125, all exact in float32: the squared
    errors tie at 0.375^2. Both paths give the gradient of the unclipped loss (torch.maximum would give half)."""
    clip = 0.25
    ref = make_policy("discrete", "tanh", torch.float32)
    with torch.no_grad():
        ref.critic[-1].weight.zero_()
        ref.critic[-1].bias.fill_(0.5)
    mb = make_batch(ref, 32, clipped=False)
    mb.values_old = torch.full((32,), -0.5)
    mb.returns = torch.full((32,), 0.125)
    s = settings(True, clip_coef=clip, ent_coef=0.0)
    _, _, grads_r = autograd_grads(ref, mb, s)
    _, _, grads_f = fused_grads(copy.deepcopy(ref), mb, s)
    _, _, grads_unclipped = autograd_grads(copy.deepcopy(ref), mb, settings(False, clip_coef=clip, ent_coef=0.0))
    critic = [i for i, (n, _) in enumerate(ref.named_parameters()) if n.startswith("critic")]
    assert any(grads_unclipped[i].abs().max() > 0 for i in critic)
    for i in critic:
        torch.testing.assert_close(grads_r[i], grads_unclipped[i], rtol=0, atol=0)
        torch.testing.assert_close(grads_f[i], grads_unclipped[i], rtol=1e-6, atol=1e-8)


# The epoch loop's guards (non-finite skip, KL early stop at 1.5 x target_kl) are tested once, for both
# step implementations, in tests/test_epochs.py.
