"""Behaviour of the training loop: diagnostics, early stopping, bootstrapping, checkpoints, resume, bad input."""

from __future__ import annotations

import copy
import csv
import math
import os
import signal

import gymnasium as gym
import numpy as np
import pytest
import torch

from ppokit.config.ppo_config import ConfigError, PPOConfig, load_preset
from ppokit.envs import GridWorldEnv
from ppokit.runtime.checkpoint import CheckpointError, load_checkpoint
from ppokit.training.agent import evaluate, load
from ppokit.training.trainer import CHECKPOINT_NAME, Trainer, resume, train
from ppokit.update.autograd import Batch, UpdateSettings, ppo_update

torch.set_num_threads(1)


def small_gridworld(tmp_path, **kw) -> PPOConfig:
    cfg = load_preset("gridworld")
    cfg.total_timesteps = 2048
    cfg.run_dir = str(tmp_path / "run")
    cfg.tensorboard = kw.pop("tensorboard", False)
    return PPOConfig.from_dict(kw, cfg)


# ------------------------------------------------------------------ test environments
class ConstantRewardEnv(gym.Env):
    """Reward 1 every step, never terminates; only a time limit ends episodes. Observation: [t / limit]."""

    def __init__(self, limit: int = 5):
        self.limit = limit
        self.observation_space = gym.spaces.Box(0.0, 2.0, (1,), np.float32)
        self.action_space = gym.spaces.Discrete(2)
        self.t = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.array([0.0], np.float32), {}

    def step(self, action):
        self.t += 1
        return np.array([self.t / self.limit], np.float32), 1.0, False, False, {}


class NaNEnv(gym.Env):
    """CartPole-like toy that returns a NaN observation or reward every few steps."""

    def __init__(self):
        self.observation_space = gym.spaces.Box(-10.0, 10.0, (3,), np.float32)
        self.action_space = gym.spaces.Discrete(2)
        self.t = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self.np_random.normal(size=3).astype(np.float32), {}

    def step(self, action):
        self.t += 1
        obs = self.np_random.normal(size=3).astype(np.float32)
        reward = float(action)
        if self.t % 7 == 0:
            obs[1] = np.nan
        if self.t % 11 == 0:
            reward = float("inf")
        return obs, reward, self.t >= 20, False, {}


gym.register("ppokit_test/ConstantReward-v0", entry_point=ConstantRewardEnv, max_episode_steps=5)
gym.register("ppokit_test/NaN-v0", entry_point=NaNEnv)


# ------------------------------------------------------------------ diagnostics
def _random_batch(policy, B=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    obs = torch.randn(B, policy.obs_dim, generator=g)
    with torch.no_grad():
        actions, logp, values, _ = policy.act(obs, None, None)
    # Perturb logp_old so that ratios spread across the clip boundary.
    logp_old = logp + 0.3 * torch.randn(B, generator=g)
    return Batch(obs, actions, logp_old, values + 0.1 * torch.randn(B, generator=g),
                 torch.randn(B, generator=g), values + torch.randn(B, generator=g))


def test_update_diagnostics_match_independent_recomputation():
    from ppokit.policies import ActorCritic

    torch.manual_seed(0)
    policy = ActorCritic(4, "discrete", [3], [16, 16])
    batch = _random_batch(policy)
    before = copy.deepcopy(policy)
    opt = torch.optim.Adam(policy.parameters(), lr=1e-3)
    s = UpdateSettings("ppo", update_epochs=1, num_minibatches=1, clip_coef=0.2, clip_vloss=True, norm_adv=True,
                       ent_coef=0.01, vf_coef=0.5, max_grad_norm=0.5, target_kl=None)
    stats = ppo_update(policy, opt, batch, s)

    # Independent recomputation on the saved minibatch with the pre-update policy (one minibatch = the batch).
    with torch.no_grad():
        logits = before.actor(batch.obs)
        probs = torch.softmax(logits, -1)
        logp_new = torch.log(probs.gather(1, batch.actions.view(-1, 1)).squeeze(1))
        ratio = torch.exp(logp_new - batch.logp_old)
        kl_k3 = ((ratio - 1) - torch.log(ratio)).mean()
        kl_k1 = (batch.logp_old - logp_new).mean()
        clipfrac = ((ratio - 1).abs() > 0.2).float().mean()
        entropy = -(probs * torch.log(probs)).sum(-1).mean()
        adv = (batch.advantages - batch.advantages.mean()) / (batch.advantages.std(unbiased=False) + 1e-8)
        surr = torch.minimum(ratio * adv, torch.clamp(ratio, 0.8, 1.2) * adv)
        v = before.critic(batch.obs).squeeze(1)
        v_clip = batch.values_old + torch.clamp(v - batch.values_old, -0.2, 0.2)
        vloss = 0.5 * torch.maximum((v - batch.returns) ** 2, (v_clip - batch.returns) ** 2).mean()
    assert stats["approx_kl"] == pytest.approx(kl_k3.item(), rel=1e-5, abs=1e-7)
    assert stats["approx_kl_k1"] == pytest.approx(kl_k1.item(), rel=1e-5, abs=1e-7)
    assert stats["clipfrac"] == pytest.approx(clipfrac.item(), abs=1e-7)
    assert 0.0 < stats["clipfrac"] < 1.0
    assert stats["entropy"] == pytest.approx(entropy.item(), rel=1e-5)
    assert stats["policy_loss"] == pytest.approx(-surr.mean().item(), rel=1e-5, abs=1e-7)
    assert stats["value_loss"] == pytest.approx(vloss.item(), rel=1e-5)
    assert stats["epochs_run"] == 1 and stats["early_stopped"] == 0 and stats["minibatches"] == 1
    # The gradient norm reported is the pre-clipping global norm of the loss gradient.
    assert stats["grad_norm"] > 0


def test_trainer_explained_variance_is_recomputed_from_its_batch(tmp_path):
    """The logged diag/explained_variance of every update is 1 - Var(R - V_old) / Var(R) of that update's batch
    (the critic's rollout-time values against the GAE returns), recomputed here in float64 numpy."""
    manual: list[float] = []
    trainer = Trainer(small_gridworld(tmp_path), console_enabled=False)
    real = trainer.compute_advantages

    def spy():
        batch, advantages, returns = real()
        # Read now: the batch views the rollout buffer, which the next rollout overwrites.
        v, r = batch.values_old.double().numpy(), batch.returns.double().numpy()
        manual.append(1.0 - np.var(r - v) / np.var(r))
        return batch, advantages, returns

    trainer.compute_advantages = spy
    run = trainer.run()
    logged = [m["diag/explained_variance"] for m in run.metrics]
    assert len(logged) == len(manual) == 8
    assert logged == pytest.approx(manual, rel=1e-4, abs=1e-5)
    assert len({round(x, 6) for x in logged}) > 1  # the critic learns: not one value repeated


def test_early_stopping_fires_with_tiny_target_kl_and_never_without(tmp_path):
    tiny = train(small_gridworld(tmp_path / "a", target_kl=1e-6, update_epochs=10), console_enabled=False)
    assert all(m["diag/early_stopped"] == 1.0 for m in tiny.metrics)
    # The KL of a minibatch is measured in its forward pass, before its step: the first minibatch of an update
    # sees pi_theta == pi_old (KL 0) and is applied; a later one of the first epoch exceeds 1.5 x 1e-6 and stops
    # the update without being applied (at full learning rate the very next one: one minibatch applied).
    assert all(m["diag/epochs_run"] == 1.0 and 1.0 <= m["diag/minibatches"] < 4.0 for m in tiny.metrics)
    assert tiny.metrics[0]["diag/minibatches"] == 1.0
    off = train(small_gridworld(tmp_path / "b", target_kl=None, update_epochs=10), console_enabled=False)
    assert all(m["diag/early_stopped"] == 0.0 and m["diag/epochs_run"] == 10.0 for m in off.metrics)
    assert all(m["diag/minibatches"] == 10.0 * 4 for m in off.metrics)


def test_learning_rate_decays_linearly_to_zero(tmp_path):
    run = train(small_gridworld(tmp_path), console_enabled=False)
    lrs = [m["charts/learning_rate"] for m in run.metrics]
    n = len(lrs)
    expected = [0.0025 * (1 - i / n) for i in range(n)]
    assert lrs == pytest.approx(expected)


# ------------------------------------------------------------------ truncation bootstrapping
def test_truncated_steps_bootstrap_from_the_final_observation_not_the_reset_one(tmp_path):
    cfg = PPOConfig(env_id="ppokit_test/ConstantReward-v0", num_envs=2, num_steps=16, total_timesteps=64,
                    num_minibatches=2, run_dir=str(tmp_path / "r"), tensorboard=False)
    trainer = Trainer(cfg, console_enabled=False)
    trainer.collect_rollout()
    buf = trainer.buffer
    assert buf.truncated.any() and not buf.terminated.any()
    # Every truncated step carries V(final obs = [limit/limit]) and never V(reset obs = [0]).
    with torch.no_grad():
        v_final = trainer.policy.value(torch.tensor([[1.0]])).item()
        v_reset = trainer.policy.value(torch.tensor([[0.0]])).item()
    assert v_final != pytest.approx(v_reset)
    last = trainer.policy.value(trainer.collector.last_obs)
    nxt = buf.next_values(last)
    assert torch.allclose(nxt[buf.truncated], torch.full((int(buf.truncated.sum()),), v_final), atol=1e-6)
    # Elsewhere next_values[t] is V(s_{t+1}).
    inner = ~buf.truncated[:-1]
    assert torch.equal(nxt[:-1][inner], buf.values[1:][inner])
    trainer.logger.close()
    trainer.envs.close()


@pytest.mark.slow
def test_value_of_a_time_limited_infinite_task_approaches_one_over_one_minus_gamma(tmp_path):
    env_id = "ppokit_test/ConstantReward-v0"
    gamma = 0.9
    cfg = PPOConfig(env_id=env_id, num_envs=4, num_steps=32, total_timesteps=40_000, gamma=gamma, gae_lambda=0.95,
                    learning_rate=3e-3, anneal_lr=False, clip_vloss=False, ent_coef=0.0, num_minibatches=4,
                    update_epochs=4, hidden_sizes=[32], run_dir=str(tmp_path / "v"), tensorboard=False)
    run = train(cfg, console_enabled=False)
    agent = load(run.run_dir)
    horizon_value = sum(gamma**k for k in range(5))  # 4.1: what treating truncation as termination would learn
    for t in range(5):
        v = agent.value(np.array([t / 5], np.float32))
        assert abs(v - 1 / (1 - gamma)) < 1.0, (t, v)
        assert v > horizon_value + 3
    # With Gymnasium's autoreset, the start state's value is the infinite-horizon one too.
    assert agent.value(np.array([0.0], np.float32)) == pytest.approx(10.0, abs=1.0)


@pytest.mark.parametrize("vector_mode", ["native", "envpool"])
def test_next_step_autoreset_drops_the_reset_steps_from_the_batch(tmp_path, vector_mode):
    # Gymnasium's native CartPole and envpool use NEXT_STEP autoreset: the step after an episode end is no
    # transition (its action is ignored and its reward is 0).
    cfg = PPOConfig(env_id="CartPole-v1", vector_mode=vector_mode, num_envs=8, num_steps=64, total_timesteps=512,
                    num_minibatches=2, run_dir=str(tmp_path / "n"), tensorboard=False)
    trainer = Trainer(cfg, console_enabled=False)
    trainer.collect_rollout()
    buf = trainer.buffer
    done = buf.terminated | buf.truncated
    assert done[:-1].any()
    # valid[t+1] is False exactly where step t ended an episode.
    assert torch.equal(buf.valid[1:], ~done[:-1])
    assert torch.all(buf.rewards[1:][done[:-1]] == 0)
    batch, _, _ = trainer.compute_advantages()
    assert len(batch) == int(buf.valid.sum()) < cfg.batch_size
    trainer.logger.close()
    trainer.envs.close()


# ------------------------------------------------------------------ learning
@pytest.mark.slow
def test_gridworld_reaches_the_optimal_return_within_20k_steps(tmp_path):
    cfg = load_preset("gridworld")
    cfg.run_dir = str(tmp_path / "gw")
    cfg.tensorboard = False
    run = train(cfg, console_enabled=False)
    assert run.global_step <= 20_000
    optimal = GridWorldEnv.optimal_return(4)
    result = evaluate(load(run.run_dir), episodes=3)
    assert result["mean"] == pytest.approx(optimal)
    returns = [m["charts/episodic_return"] for m in run.metrics]
    assert np.nanmean(returns[-5:]) > optimal - 0.01


@pytest.mark.slow
def test_cartpole_preset_solves_cartpole_within_100k_steps(tmp_path):
    cfg = load_preset("cartpole")
    cfg.run_dir = str(tmp_path / "cp")
    cfg.tensorboard = False
    run = train(cfg, console_enabled=False)
    assert run.global_step <= 100_000
    result = evaluate(load(run.run_dir), episodes=10, deterministic=True)
    assert result["mean"] >= 475, result


@pytest.mark.slow
def test_pendulum_improves_clearly_over_its_start(tmp_path):
    cfg = load_preset("pendulum")
    cfg.total_timesteps = 60_000
    cfg.run_dir = str(tmp_path / "pd")
    cfg.tensorboard = False
    run = train(cfg, console_enabled=False)
    returns = [m["charts/episodic_return"] for m in run.metrics if not math.isnan(m["charts/episodic_return"])]
    start, end = np.mean(returns[:3]), np.mean(returns[-3:])
    # Random Pendulum scores about -1200; a clear improvement is several hundred points.
    assert end > start + 300, (start, end)


def test_continuous_actions_store_the_unclipped_sample_and_its_log_prob(tmp_path):
    cfg = PPOConfig(env_id="Pendulum-v1", num_envs=2, num_steps=64, total_timesteps=128, num_minibatches=2,
                    run_dir=str(tmp_path / "p"), tensorboard=False)
    trainer = Trainer(cfg, console_enabled=False)
    with torch.no_grad():
        trainer.policy.log_std.fill_(1.5)  # std 4.5 on a [-2, 2] action range: many samples fall outside
    trainer.collect_rollout()
    acts = trainer.buffer.actions
    assert (acts.abs() > 2.0).any()
    obs = trainer.buffer.obs.reshape(-1, 3)
    with torch.no_grad():
        mean = trainer.policy.actor(obs)
        dist = torch.distributions.Normal(mean, torch.exp(trainer.policy.log_std))
        ref = dist.log_prob(acts.reshape(-1, 1)).sum(-1)
    assert torch.allclose(trainer.buffer.logp.reshape(-1), ref, atol=1e-5)
    trainer.logger.close()
    trainer.envs.close()


# ------------------------------------------------------------------ sinks
def test_run_dir_holds_csv_tensorboard_checkpoint_config_and_curves(tmp_path):
    import io

    from rich.console import Console

    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=120)
    cfg = small_gridworld(tmp_path, tensorboard=True, log_every=2)
    run = train(cfg, console=console)
    d = run.run_dir
    with open(d / "metrics.csv") as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) == cfg.num_updates == len(run.metrics)
    assert [int(r["global_step"]) for r in rows] == [256 * (i + 1) for i in range(cfg.num_updates)]
    for key in ("diag/approx_kl", "diag/clipfrac", "diag/explained_variance", "charts/episodic_return", "perf/sps"):
        assert key in rows[0]
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(d / "tb"))
    acc.Reload()
    kl = acc.Scalars("diag/approx_kl")
    assert [e.step for e in kl] == [256 * (i + 1) for i in range(cfg.num_updates)]
    assert kl[-1].value == pytest.approx(run.metrics[-1]["diag/approx_kl"], rel=1e-5)
    assert (d / CHECKPOINT_NAME).is_file() and (d / "curves.png").stat().st_size > 1000
    assert PPOConfig.from_toml(d / "config.toml") == cfg
    out = buf.getvalue()
    assert "━" in out and "%" in out  # the live progress bar
    assert "run summary" in out.lower() or "final return" in out.lower()


# ------------------------------------------------------------------ checkpoints and resume
def test_loaded_agent_acts_identically_to_the_trained_policy(tmp_path):
    run = train(small_gridworld(tmp_path), console_enabled=False)
    agent = load(run.run_dir)
    obs = np.eye(16, dtype=np.float32)
    with torch.no_grad():
        expected = run.policy.actor(torch.as_tensor(obs)).argmax(-1).numpy()
        expected_v = run.policy.value(torch.as_tensor(obs)).numpy()
    np.testing.assert_array_equal(agent.act(obs), expected)
    np.testing.assert_allclose(agent.value(obs), expected_v, rtol=1e-6)
    assert agent.act(obs[3]) == expected[3]  # one observation in, one action out
    # SB3's shape: (actions, state); a feed-forward policy hands the state back untouched.
    actions, state = agent.predict(obs, state=None, episode_start=np.ones(16, bool), deterministic=True)
    np.testing.assert_array_equal(actions, expected)
    assert state is None
    torch.manual_seed(0)
    sampled, _ = agent.predict(np.repeat(obs[:1], 2000, axis=0))  # deterministic=False by default, as in SB3
    torch.manual_seed(0)
    assert np.array_equal(sampled, agent.act(np.repeat(obs[:1], 2000, axis=0), deterministic=False))
    assert len(set(sampled.tolist())) > 1  # a fresh 4-action policy samples more than one action


def _metric_rows(path):
    with open(path) as fh:
        rows = list(csv.DictReader(fh))
    return [{k: v for k, v in r.items() if not k.startswith("perf/")} for r in rows]


@pytest.mark.parametrize("normalize_obs", [False, True])
def test_resume_after_ctrl_c_ends_exactly_like_the_uninterrupted_run(tmp_path, monkeypatch, normalize_obs):
    kw = dict(total_timesteps=8 * 256, save_every=100, normalize_obs=normalize_obs, normalize_reward=normalize_obs)
    full = train(small_gridworld(tmp_path / "full", **kw), console_enabled=False)

    cfg = small_gridworld(tmp_path / "cut", **kw)
    trainer = Trainer(cfg, console_enabled=False)
    real_check = trainer.monitor.check

    def check(update, metrics):
        if update == 3:
            os.kill(os.getpid(), signal.SIGINT)  # a real Ctrl-C in the middle of the run
        return real_check(update, metrics)

    trainer.monitor.check = check
    cut = trainer.run()
    assert cut.interrupted and len(cut.metrics) == 3
    assert load_checkpoint(cut.checkpoint)["update"] == 3

    resumed = resume(cut.run_dir, console_enabled=False)
    assert resumed.global_step == full.global_step
    for (name, a), b in zip(full.policy.state_dict().items(), resumed.policy.state_dict().values()):
        assert torch.equal(a, b), name
    assert _metric_rows(cut.run_dir / "metrics.csv") == _metric_rows(full.run_dir / "metrics.csv")


def test_corrupt_or_foreign_checkpoint_is_a_clear_error_and_nothing_is_overwritten(tmp_path):
    run_dir = tmp_path / "bad"
    run_dir.mkdir()
    ck = run_dir / CHECKPOINT_NAME
    ck.write_bytes(b"not a checkpoint at all")
    with pytest.raises(CheckpointError):
        resume(run_dir, console_enabled=False)
    with pytest.raises(CheckpointError):
        load(run_dir)
    assert ck.read_bytes() == b"not a checkpoint at all"
    torch.save(torch.nn.Linear(2, 2).state_dict(), ck)
    before = ck.read_bytes()
    with pytest.raises(CheckpointError, match="not a ppokit checkpoint"):
        load(run_dir)
    assert ck.read_bytes() == before


# ------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    "overrides, field, fragment",
    [
        ({"learning_rate": -1e-3}, "learning_rate", ">= 0"),
        ({"num_minibatches": 3}, "num_minibatches", "does not divide"),
        ({"gamma": 1.5}, "gamma", "(0, 1]"),
        ({"gamma": 0.0}, "gamma", "(0, 1]"),
        ({"num_envs": 0}, "num_envs", "positive integer"),
        ({"activation": "gelu"}, "activation", "tanh"),
        ({"vector_mode": "threads"}, "vector_mode", "sync"),
        ({"target_kl": -0.1}, "target_kl", "> 0"),
    ],
)
def test_invalid_config_names_the_field_before_any_env_is_created(tmp_path, overrides, field, fragment,
                                                                  counted_gridworld):
    env_id, made = counted_gridworld
    cfg = PPOConfig.from_dict({"env_id": env_id, **overrides}, small_gridworld(tmp_path))
    with pytest.raises(ConfigError) as err:
        train(cfg, console_enabled=False)
    assert err.value.field == field
    assert field in str(err.value) and fragment in str(err.value)
    assert len(made) == 1, "an environment was created for an invalid config"


def test_unknown_env_id_suggests_the_closest_registered_ids(tmp_path):
    cfg = small_gridworld(tmp_path, env_id="CartPol-v1")
    with pytest.raises(ValueError, match="CartPole-v1"):
        train(cfg, console_enabled=False)


def test_unsupported_spaces_get_a_clear_error(tmp_path):
    class DictActionEnv(gym.Env):
        observation_space = gym.spaces.Box(-1, 1, (2,), np.float32)
        action_space = gym.spaces.Dict({"a": gym.spaces.Discrete(2)})

        def reset(self, *, seed=None, options=None):
            return np.zeros(2, np.float32), {}

        def step(self, action):
            return np.zeros(2, np.float32), 0.0, True, False, {}

    if "ppokit_test/TrainerDictAction-v0" not in gym.registry:
        gym.register("ppokit_test/TrainerDictAction-v0", entry_point=DictActionEnv)
    cfg = small_gridworld(tmp_path, env_id="ppokit_test/TrainerDictAction-v0")
    with pytest.raises(ValueError, match="Dict"):
        train(cfg, console_enabled=False)


def test_nan_injecting_env_never_corrupts_the_weights_or_the_checkpoint(tmp_path):
    cfg = PPOConfig(env_id="ppokit_test/NaN-v0", num_envs=2, num_steps=32, total_timesteps=512, num_minibatches=2,
                    normalize_obs=True, normalize_reward=True, run_dir=str(tmp_path / "nan"), tensorboard=False)
    run = train(cfg, console_enabled=False)
    assert all(torch.isfinite(p).all() for p in run.policy.parameters())
    assert sum(m["diag/nonfinite_env"] for m in run.metrics) > 0
    assert any(a["name"] == "nonfinite_env" for a in run.alerts)
    state = load_checkpoint(run.checkpoint)
    assert all(torch.isfinite(v).all() for v in state["policy"].values())
    assert all(math.isfinite(m["losses/policy_loss"]) for m in run.metrics)


def test_nonfinite_loss_skips_the_minibatch_and_leaves_weights_untouched():
    from ppokit.policies import ActorCritic

    torch.manual_seed(0)
    policy = ActorCritic(4, "discrete", [3], [8])
    batch = _random_batch(policy, B=32)
    batch.returns[5] = float("nan")
    before = [p.detach().clone() for p in policy.parameters()]
    opt = torch.optim.Adam(policy.parameters(), lr=1e-2)
    s = UpdateSettings("ppo", 2, 2, 0.2, True, True, 0.0, 0.5, 0.5, None)
    stats = ppo_update(policy, opt, batch, s)
    # Every minibatch holding the NaN row is skipped (one per epoch); the others step.
    assert stats["skipped_minibatches"] == 2 and stats["minibatches"] == 2
    assert all(torch.isfinite(p).all() for p in policy.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(before, policy.parameters()))


def test_user_registered_env_trains_through_the_python_api(tmp_path):
    if "ppokit_test/UserGrid-v0" not in gym.registry:
        gym.register("ppokit_test/UserGrid-v0", entry_point=GridWorldEnv, max_episode_steps=20, kwargs={"size": 3})
    run = train(small_gridworld(tmp_path, env_id="ppokit_test/UserGrid-v0", total_timesteps=512),
                console_enabled=False)
    assert run.global_step == 512 and run.policy.obs_dim == 9


# ------------------------------------------------------------------ CLI
def test_cli_train_with_flags_and_toml_then_eval(tmp_path, capsys):
    from ppokit.cli import main

    toml = tmp_path / "c.toml"
    toml.write_text('env_id = "ppokit/GridWorld-v0"\nnum_envs = 4\nnum_steps = 32\nupdate_epochs = 2\n')
    run_dir = tmp_path / "cli"
    rc = main(["train", "--config", str(toml), "--update-epochs", "3", "--total-timesteps", "512",
               "--run-dir", str(run_dir), "--no-tensorboard", "--quiet"])
    assert rc == 0
    cfg = PPOConfig.from_toml(run_dir / "config.toml")
    assert cfg.update_epochs == 3 and cfg.num_envs == 4 and cfg.total_timesteps == 512
    assert main(["eval", str(run_dir), "--episodes", "2"]) == 0
    assert "mean return" in capsys.readouterr().out


def test_cli_env_alias_and_config_errors(tmp_path, capsys):
    from ppokit.cli import main

    rc = main(["train", "--env", "ppokit/GridWorld-v0", "--gamma", "2", "--run-dir", str(tmp_path / "x"), "--quiet"])
    assert rc == 2
    assert "gamma" in capsys.readouterr().err
    rc = main(["train", "--env", "CartPol-v1", "--run-dir", str(tmp_path / "y"), "--quiet"])
    assert rc == 2
    assert "CartPole-v1" in capsys.readouterr().err


def test_bare_train_uses_the_cartpole_preset():
    from ppokit.cli import build_parser
    from ppokit.cli.train import config_from_args

    args = build_parser().parse_args(["train"])
    assert config_from_args(args) == load_preset("cartpole")
    args = build_parser().parse_args(["train", "--env", "Acrobot-v1"])
    assert config_from_args(args).env_id == "Acrobot-v1"


@pytest.mark.slow
def test_cli_eval_records_videos(tmp_path, capsys):
    from ppokit.cli import main

    run = train(small_gridworld(tmp_path, total_timesteps=512), console_enabled=False)
    video_dir = tmp_path / "videos"
    assert main(["eval", str(run.run_dir), "--episodes", "2", "--video", str(video_dir)]) == 0
    videos = sorted(video_dir.glob("*.mp4"))
    assert len(videos) == 2 and all(v.stat().st_size > 500 for v in videos)
    assert "mean return" in capsys.readouterr().out


class TwoKnobsEnv(gym.Env):
    """MultiDiscrete([3, 2]) toy: reward 1 when the first knob is 2 and the second is 0; 10-step episodes."""

    observation_space = gym.spaces.Box(0.0, 1.0, (2,), np.float32)
    action_space = gym.spaces.MultiDiscrete([3, 2])

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(2, np.float32), {}

    def step(self, action):
        self.t += 1
        reward = float(action[0] == 2 and action[1] == 0)
        return np.full(2, self.t / 10, np.float32), reward, self.t >= 10, False, {}


gym.register("ppokit_test/TwoKnobs-v0", entry_point=TwoKnobsEnv)


@pytest.mark.slow
def test_multidiscrete_policy_learns_the_rewarded_joint_action(tmp_path):
    cfg = PPOConfig(env_id="ppokit_test/TwoKnobs-v0", num_envs=4, num_steps=20, total_timesteps=6000,
                    learning_rate=3e-3, num_minibatches=2, run_dir=str(tmp_path / "md"), tensorboard=False)
    run = train(cfg, console_enabled=False)
    agent = load(run.run_dir)
    np.testing.assert_array_equal(agent.act(np.zeros(2, np.float32)), [2, 0])
    assert run.metrics[-1]["charts/episodic_return"] > 8.0


def test_async_vector_mode_trains(tmp_path):
    run = train(small_gridworld(tmp_path, vector_mode="async", num_envs=2, num_steps=64, total_timesteps=512),
                console_enabled=False)
    assert run.global_step == 512 and len(run.metrics) == 4


@pytest.mark.slow
def test_cli_resume_continues_the_run_to_a_new_total(tmp_path):
    from ppokit.cli import main

    run_dir = tmp_path / "res"
    assert main(["train", "--preset", "gridworld", "--total-timesteps", "512", "--run-dir", str(run_dir),
                 "--no-tensorboard", "--quiet"]) == 0
    assert load_checkpoint(run_dir / CHECKPOINT_NAME)["global_step"] == 512
    assert main(["train", "--resume", str(run_dir), "--total-timesteps", "1024", "--quiet"]) == 0
    assert load_checkpoint(run_dir / CHECKPOINT_NAME)["global_step"] == 1024
    with open(run_dir / "metrics.csv") as fh:
        steps = [int(r["global_step"]) for r in csv.DictReader(fh)]
    assert steps == [256, 512, 768, 1024]
    assert main(["train", "--resume", str(tmp_path / "missing"), "--quiet"]) == 2
