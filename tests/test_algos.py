"""The algorithm registry (``ppokit.core.algos``): each variant's named loss terms against the objectives written out by
hand, its schedule/hook/guard-rail/fused fields read by the trainer, config and fused kernel, a new variant that
trains through the trainer by registering it alone, and no string comparison of ``algo`` left outside the registry.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from ppokit.config.ppo_config import ConfigError, PPOConfig, load_preset
from ppokit.core.algos import ALGOS, TERM_NAMES, Algo, describe_algos, get_algo, loss_terms, register
from ppokit.kernels.mlp_backward import supports, unsupported_reason
from ppokit.policies import ActorCritic
from ppokit.training.trainer import Trainer, train
from ppokit.update.epochs import UpdateSettings
from test_variants import _tiny_config as _variants_tiny_config  # the gridworld preset cut to a few updates


def _settings(algo: str, **kw) -> UpdateSettings:
    base = dict(algo=algo, update_epochs=4, num_minibatches=4, clip_coef=0.2, clip_vloss=True, norm_adv=True,
                ent_coef=0.01, vf_coef=0.5, max_grad_norm=0.5, target_kl=0.02, kl_beta=0.7)
    base.update(kw)
    return UpdateSettings(**base)


def _inputs(shape=(64,), seed=0):
    """Per-sample inputs with ratios well inside and well outside the clip range, and value changes beyond it."""
    g = torch.Generator().manual_seed(seed)
    logp_old = -torch.rand(shape, generator=g, dtype=torch.float64) * 2
    logp_new = (logp_old + 0.6 * torch.randn(shape, generator=g, dtype=torch.float64)).requires_grad_()
    adv = torch.randn(shape, generator=g, dtype=torch.float64)
    entropy = torch.rand(shape, generator=g, dtype=torch.float64)
    values_old = torch.randn(shape, generator=g, dtype=torch.float64)
    values = (values_old + torch.randn(shape, generator=g, dtype=torch.float64)).requires_grad_()
    returns = torch.randn(shape, generator=g, dtype=torch.float64)
    return dict(logp_new=logp_new, logp_old=logp_old, advantages=adv, entropy=entropy, values=values,
                returns=returns, values_old=values_old)


def _terms(name, x, s, mask=None, mode="mean"):
    ratio = (x["logp_new"] - x["logp_old"]).exp()
    return loss_terms(get_algo(name), x["logp_new"], x["logp_old"], ratio, x["advantages"], x["entropy"],
                      x["values"], x["returns"], x["values_old"], s, mask, mode)


def _by_hand(name, x, s):
    """Each variant's loss terms from the papers' formulas, with no call into ``objectives``."""
    r = (x["logp_new"] - x["logp_old"]).exp()
    a = x["advantages"]
    if name == "ppo":  # Schulman et al. 2017, eq. 7
        policy = -torch.min(r * a, r.clamp(1 - s.clip_coef, 1 + s.clip_coef) * a).mean()
    elif name == "ppo-kl":  # section 4, the KL by the k3 estimator (r - 1) - log r
        policy = -((r * a).mean() - s.kl_beta * ((r - 1) - r.log()).mean())
    else:  # a2c: the policy gradient surrogate at ratio 1
        policy = -(r * a).mean()
    sq = (x["values"] - x["returns"]) ** 2
    if name == "ppo":  # PPO2's clipped value loss
        v_clip = x["values_old"] + (x["values"] - x["values_old"]).clamp(-s.clip_coef, s.clip_coef)
        value = 0.5 * torch.max(sq, (v_clip - x["returns"]) ** 2).mean()
    else:
        value = 0.5 * sq.mean()
    return {"policy": policy, "value": value, "entropy": -x["entropy"].mean()}


@pytest.mark.parametrize("name", ["ppo", "ppo-kl", "a2c"])
def test_terms_match_the_formulas(name):
    x, s = _inputs(), _settings(name)
    got, want = _terms(name, x, s), _by_hand(name, x, s)
    assert tuple(got) == TERM_NAMES
    for k in TERM_NAMES:
        torch.testing.assert_close(got[k], want[k], rtol=1e-12, atol=1e-12, msg=k)
    # the gradients agree too (the clipped branches pass none)
    g_got = torch.autograd.grad(got["policy"] + got["value"], [x["logp_new"], x["values"]])
    g_want = torch.autograd.grad(want["policy"] + want["value"], [x["logp_new"], x["values"]])
    for a, b in zip(g_got, g_want):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_the_inputs_exercise_the_clips():
    """The hand check above means something: some ratios and value changes lie past the clip range."""
    x = _inputs()
    r = (x["logp_new"] - x["logp_old"]).exp()
    assert 5 < int(((r - 1).abs() > 0.2).sum()) < 59
    assert int(((x["values"] - x["values_old"]).abs() > 0.2).sum()) > 5
    ppo, a2c = _terms("ppo", x, _settings("ppo")), _terms("a2c", x, _settings("a2c"))
    assert not torch.equal(ppo["value"], a2c["value"]) and not torch.equal(ppo["policy"], a2c["policy"])


def test_ppo_value_unclipped_when_clip_vloss_off():
    x = _inputs()
    got = _terms("ppo", x, _settings("ppo", clip_vloss=False))["value"]
    torch.testing.assert_close(got, 0.5 * ((x["values"] - x["returns"]) ** 2).mean(), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", ["ppo", "ppo-kl", "a2c"])
@pytest.mark.parametrize("mode", ["token_mean", "seq_mean_token_mean"])
def test_terms_take_a_token_mask(name, mode):
    """A ragged [B, T] batch: the masked terms equal the formulas on the real tokens only, padding ignored."""
    B, T = 4, 6
    lengths = [6, 1, 3, 4]
    mask = torch.tensor([[t < n for t in range(T)] for n in lengths])
    x = _inputs((B, T), seed=3)
    with torch.no_grad():  # garbage in the padding must not reach the terms
        for k in ("advantages", "returns", "entropy"):
            x[k][~mask] = 1e6
    s = _settings(name)
    got = _terms(name, x, s, mask, mode)
    rows = []
    for b, n in enumerate(lengths):
        row = {k: v[b, :n] for k, v in x.items()}
        rows.append(_by_hand(name, row, s))
    for k in TERM_NAMES:
        if mode == "seq_mean_token_mean":  # every sequence weighs the same
            want = torch.stack([r[k] for r in rows]).mean()
        else:  # every token weighs the same
            want = sum(r[k] * n for r, n in zip(rows, lengths)) / sum(lengths)
            if name == "ppo-kl" and k == "policy":  # two separate token means, each over all tokens
                flat = {kk: v[mask] for kk, v in x.items()}
                want = _by_hand(name, flat, s)[k]
        torch.testing.assert_close(got[k], want, rtol=1e-10, atol=1e-10, msg=f"{k} {mode}")


# ---------------------------------------------------------------------------- the fields the other modules read
def test_registry_describes_the_variants():
    assert list(ALGOS) == ["ppo", "ppo-kl", "a2c"]
    ppo, kl, a2c = ALGOS["ppo"], ALGOS["ppo-kl"], ALGOS["a2c"]
    assert ppo.clip_value and ppo.clip_guard_rail and ppo.fused and ppo.after_update is None
    assert not kl.clip_value and not kl.clip_guard_rail and not kl.fused and kl.adapts_kl_beta
    assert (a2c.update_epochs, a2c.num_minibatches, a2c.kl_stop) == (1, 1, False)
    assert (ppo.update_epochs, ppo.num_minibatches, ppo.kl_stop) == (None, None, True)
    # ppo-kl's hook is the beta rule with the config's target
    cfg = load_preset("gridworld")
    cfg.kl_target = 0.01
    assert kl.after_update(1.0, 0.05, cfg) == 2.0 and kl.after_update(1.0, 0.001, cfg) == 0.5
    assert kl.after_update(1.0, 0.01, cfg) == 1.0


def test_help_lists_the_registry():
    fields = {f.name: f for f in dataclasses.fields(PPOConfig)}
    assert describe_algos() == "ppo (clipped surrogate), ppo-kl (adaptive KL penalty) or a2c (one step per rollout)"
    assert fields["algo"].metadata["help"] == f"objective: {describe_algos()}"


def test_register_refuses_a_duplicate_and_get_names_the_known():
    with pytest.raises(ValueError, match="already registered"):
        register(Algo("ppo", "again", ALGOS["ppo"].policy_term))
    with pytest.raises(ValueError, match="unknown algo 'trpo'; registered: ppo, ppo-kl, a2c"):
        get_algo("trpo")


def test_config_validates_against_the_registry(monkeypatch):
    cfg = load_preset("gridworld")
    cfg.algo = "trpo"
    with pytest.raises(ConfigError, match="algo.*must be one of ppo, ppo-kl, a2c, got 'trpo'"):
        cfg.validate()
    # the clip guard rail follows the registry's flag, not the name
    for name, guarded in (("ppo", True), ("ppo-kl", False), ("a2c", False)):
        c = load_preset("gridworld")
        c.algo, c.clip_coef = name, 0.5
        assert ("clip_coef" in dict(c.guard_rail_violations())) == guarded, name
    monkeypatch.setitem(ALGOS, "ppo", Algo("ppo", "x", ALGOS["ppo"].policy_term, clip_guard_rail=False))
    c = load_preset("gridworld")
    c.clip_coef = 0.5
    assert "clip_coef" not in dict(c.guard_rail_violations())


def test_fused_support_reads_the_registry(monkeypatch):
    policy = ActorCritic(4, "discrete", [2], [8, 8])
    assert supports(policy, "ppo") and not supports(policy, "ppo-kl") and not supports(policy, "a2c")
    assert "only 'ppo' is fused" in unsupported_reason(policy, "a2c")
    assert not supports(policy, "no-such-algo")
    monkeypatch.setitem(ALGOS, "ppo", Algo("ppo", "x", ALGOS["ppo"].policy_term, fused=False))
    assert not supports(policy, "ppo")


def _tiny_config(tmp_path, algo, updates=3, **kw):
    return _variants_tiny_config(tmp_path, algo, updates=updates, **kw)


@pytest.mark.parametrize("name, epochs, minibatches, target_kl", [
    ("ppo", 3, 4, 0.05), ("ppo-kl", 3, 4, 0.05), ("a2c", 1, 1, None)])
def test_trainer_schedule_follows_the_registry(tmp_path, name, epochs, minibatches, target_kl):
    cfg = _tiny_config(tmp_path, name, update_epochs=3, num_minibatches=4, target_kl=0.05)
    tr = Trainer(cfg, console_enabled=False)
    try:
        s = tr.update_settings(0.2)
        assert (s.algo, s.update_epochs, s.num_minibatches, s.target_kl) == (name, epochs, minibatches, target_kl)
        assert tr.fused == (name == "ppo")
    finally:
        tr.envs.close()
        tr.logger.close()


# ---------------------------------------------------------------------------- a new variant, registered alone
def test_a_registered_algo_trains_through_the_trainer(tmp_path, monkeypatch):
    """"ppo-noclip-value": PPO's clipped surrogate, an unclipped value loss, two epochs of one minibatch, a hook
    that records each update's KL; only the registry knows of it, and a run trains with it end to end."""
    calls = {"policy": 0, "hook": []}
    ppo_term = ALGOS["ppo"].policy_term

    def policy_term(*args, **kw):
        calls["policy"] += 1
        return ppo_term(*args, **kw)

    def hook(beta, kl_after, config):
        calls["hook"].append(kl_after)
        return beta * 1.5

    monkeypatch.setitem(ALGOS, "ppo-noclip-value", Algo(
        "ppo-noclip-value", "PPO without the value clip", policy_term, clip_value=False, update_epochs=2,
        num_minibatches=1, after_update=hook))
    # clip_coef 0.5 passes: this algo does not ask for the clip guard rail
    cfg = _tiny_config(tmp_path, "ppo-noclip-value", updates=3, clip_coef=0.5, clip_vloss=True, init_kl_beta=1.0)
    run = train(cfg, console_enabled=False)
    assert len(run.metrics) == 3
    assert calls["policy"] == 3 * 2 * 1  # updates x the algo's epochs x its minibatches, on the autograd path
    assert calls["hook"] == [m["diag/approx_kl_after"] for m in run.metrics]
    assert [m["charts/kl_beta"] for m in run.metrics] == [1.5, 2.25, 3.375]
    assert all(m["losses/value_loss"] > 0 for m in run.metrics)


def test_algos_imports_without_torch():
    """``PPOConfig`` validates against the registry, and the CLI's start-up stays free of torch."""
    import subprocess
    import sys

    code = "import sys, ppokit.core.algos, ppokit.config.ppo_config; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False", out.stdout + out.stderr
