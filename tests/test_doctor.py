"""``ppokit doctor`` on REAL short trainings: each run is built to have one known defect, and the doctor's first
finding must name it; a healthy CartPole run must be reported healthy (exit 0)."""

from __future__ import annotations

import json

import gymnasium as gym
import numpy as np
import pytest

from ppokit.cli import main
from ppokit.config import PPOConfig, load_preset
from ppokit.doctor import diagnose
from ppokit.trainer import train

ZERO_ID = "ppokit_test/ZeroRewardCartPole-v0"


class _ZeroReward(gym.Wrapper):
    """CartPole with every reward replaced by 0: episodes still end, but nothing can be learned."""

    def step(self, action):
        obs, _, terminated, truncated, info = self.env.step(action)
        return obs, 0.0, terminated, truncated, info


def _make_zero(**kwargs):
    return _ZeroReward(gym.make("CartPole-v1", **kwargs))


if ZERO_ID not in gym.registry:
    gym.register(ZERO_ID, entry_point=_make_zero)


def _run(tmp_path, name: str, **over):
    config = PPOConfig.from_dict({"tensorboard": False, **over}, load_preset("cartpole"))
    config.run_dir = str(tmp_path / name)
    run = train(config, console_enabled=False)
    return run.run_dir


def _first(run_dir):
    d = diagnose(run_dir)
    return d, d.findings[0].cause


def test_zero_reward_env_is_a_signal_problem(tmp_path):
    run_dir = _run(tmp_path, "zero", env_id=ZERO_ID, total_timesteps=6000)
    d, cause = _first(run_dir)
    assert cause == "rewards_all_zero", d.to_text()
    assert not d.healthy
    assert main(["doctor", str(run_dir)]) == 1


def test_learning_rate_zero_is_an_optimization_link_problem(tmp_path, capsys):
    run_dir = _run(tmp_path, "lr0", learning_rate=0.0, total_timesteps=6000)
    d, cause = _first(run_dir)
    assert cause == "lr_zero", d.to_text()
    # The lesson's Q3 order was followed: the signal passed, the optimization link failed.
    assert d.checks[0].startswith("1 signal validity") and "ok" in d.checks[0]
    assert "PROBLEM" in d.checks[1]
    assert main(["doctor", str(run_dir), "--json"]) == 1
    out = json.loads(capsys.readouterr().out)
    assert out["healthy"] is False and out["findings"][0]["cause"] == "lr_zero"


def test_absurd_learning_rate_blows_up_kl(tmp_path):
    # lr 1.0 with the preset's 20 epochs: inside the guard rails (K <= 30, eps 0.2), so no --unsafe.
    run_dir = _run(tmp_path, "lr1", learning_rate=1.0, update_epochs=20, total_timesteps=6000)
    d, cause = _first(run_dir)
    assert cause == "kl_blowup", d.to_text()
    assert "update 1" in d.findings[0].evidence[0]  # evidence names where it happened


def test_huge_entropy_bonus_pins_entropy_not_collapse(tmp_path):
    # ent_coef is a BONUS: a huge one keeps the policy at maximum entropy (uniform), it does not collapse it.
    run_dir = _run(tmp_path, "ent5", ent_coef=5.0, total_timesteps=8000)
    d, cause = _first(run_dir)
    assert cause == "entropy_pinned", d.to_text()
    assert "lower ent_coef" in d.findings[0].fix
    assert all(f.cause != "entropy_collapse" for f in d.findings)


def test_entropy_collapse(tmp_path):
    # A true collapse: no entropy bonus and one huge Adam step (lr 1.0) per rollout saturate the logits within
    # 2-3 updates (entropy -> 0, always the same action, return ~9). With one epoch of one minibatch the measured
    # KL/clip fraction (taken before that single step) stay 0, so only the entropy shows it. (A smaller LR such as
    # 0.05-0.2 also collapses the entropy but the return can still rise: the doctor then only notes it.)
    run_dir = _run(tmp_path, "collapse", learning_rate=1.0, update_epochs=1, anneal_lr=False, ent_coef=0.0,
                   total_timesteps=8000)
    d, cause = _first(run_dir)
    assert cause == "entropy_collapse", d.to_text()
    assert "PROBLEM" in d.checks[2] and "ok" in d.checks[0] and "ok" in d.checks[1]


@pytest.mark.slow
def test_healthy_cartpole_run(tmp_path, capsys):
    run_dir = _run(tmp_path, "healthy", total_timesteps=40000)
    d, cause = _first(run_dir)
    assert d.healthy and cause == "healthy", d.to_text()
    assert main(["doctor", str(run_dir)]) == 0
    assert "HEALTHY" in capsys.readouterr().out


def test_doctor_rejects_a_non_run_directory(tmp_path):
    assert main(["doctor", str(tmp_path)]) == 2


CONST_ID = "ppokit_test/FixedLengthConstantReward-v0"


class _ConstantReward(gym.Env):
    """+1 every step and every episode terminated after exactly 10 steps, whatever the actions: no signal."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (2,), dtype=np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self._t = 0
        return self.np_random.uniform(-1, 1, 2).astype(np.float32), {}

    def step(self, action):
        self._t += 1
        return self.np_random.uniform(-1, 1, 2).astype(np.float32), 1.0, self._t >= 10, False, {}


if CONST_ID not in gym.registry:
    gym.register(CONST_ID, entry_point=_ConstantReward, max_episode_steps=100)

_SIGNAL_RULES = {"rewards_all_zero", "zero_reward_variance"}


@pytest.mark.parametrize("name,preset,over,verdict", [
    # Acrobot's -1 per step, every episode truncated at 500 steps (return -500) within this budget: the live alert
    # used to say zero_reward_variance "check the reward function" while the doctor found nothing.
    ("acrobot", "acrobot", {"total_timesteps": 5 * 16 * 256}, None),
    ("zero", "cartpole", {"env_id": ZERO_ID, "total_timesteps": 6000}, "rewards_all_zero"),
    ("constant", "cartpole", {"env_id": CONST_ID, "total_timesteps": 6000}, "zero_reward_variance"),
])
def test_the_live_alert_and_the_doctor_give_one_verdict_on_the_reward_signal(tmp_path, name, preset, over, verdict):
    config = PPOConfig.from_dict({"tensorboard": False, **over}, load_preset(preset))
    config.run_dir = str(tmp_path / name)
    run = train(config, console_enabled=False)
    alerted = {a["name"] for a in run.alerts} & _SIGNAL_RULES
    d = diagnose(run.run_dir)
    found = {f.cause for f in d.findings} & _SIGNAL_RULES
    assert alerted == found == ({verdict} if verdict else set()), d.to_text()
    if name == "acrobot":
        rets = [m["charts/episodic_return"] for m in run.metrics if not np.isnan(m["charts/episodic_return"])]
        assert len(rets) >= 2 and set(rets) == {-500.0}  # the case in question: constant returns at the time limit
        note = next(f for f in d.findings if f.cause == "returns_at_time_limit")
        assert note.severity == "note" and "time limit (500 steps)" in note.evidence[0]
    else:
        assert d.findings[0].cause == verdict and not d.healthy


def test_kl_monitoring_off_is_said_by_the_doctor(tmp_path):
    # The KL blow-up of test_absurd_learning_rate_blows_up_kl with monitor_kl off (--unsafe): no live KL alert,
    # the doctor still finds the blow-up in metrics.csv and says that KL monitoring was off.
    run_dir = _run(tmp_path, "klOff", learning_rate=1.0, update_epochs=20, total_timesteps=6000, monitor_kl=False,
                   unsafe=True)
    alerts = [json.loads(x)["name"] for x in (run_dir / "alerts.jsonl").read_text().splitlines() if x.strip()]
    assert not {"kl_high", "kl_blowup"} & set(alerts), alerts
    d, cause = _first(run_dir)
    assert cause == "kl_blowup", d.to_text()
    off = next(f for f in d.findings if f.cause == "monitoring_off")
    assert off.evidence == ["monitor_kl = false: no live alert on approx KL (kl_high, kl_blowup) was raised during "
                            "the run"]


def test_the_doctor_runs_its_rules_in_the_lessons_order():
    from ppokit.doctor import RULES

    names = [r.__name__.removeprefix("_rule_") for r in RULES]
    # signal validity -> optimization link -> trust region -> entropy/exploration -> critic -> "steps too small".
    assert names[:names.index("clip_never_fires") + 1] == [
        "nonfinite", "reward_signal", "signal_alert_cleared", "advantages_constant", "learning_rate", "grad_zero",
        "kl_blowup", "clipfrac_high", "entropy_collapse", "entropy_pinned", "critic", "clip_never_fires"]


def test_an_early_signal_alert_overturned_by_the_run_is_named(tmp_path):
    # A run whose first updates had constant rewards (the live alert fired) and whose later rewards varied.
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cols = ["global_step", "update", "charts/episodic_return", "charts/episodic_length", "diag/reward_std",
            "charts/learning_rate", "diag/entropy"]
    rows = [[512 * u, u, 0.0, 10 + u, 0.0 if u <= 6 else 0.5, 3e-4, 0.69] for u in range(1, 13)]
    (run_dir / "metrics.csv").write_text("\n".join(",".join(map(str, r)) for r in [cols, *rows]) + "\n")
    (run_dir / "alerts.jsonl").write_text(json.dumps({"step": 2560, "level": "alert", "name": "rewards_all_zero",
                                                      "message": "every reward was 0"}) + "\n")
    d = diagnose(run_dir)
    assert not {f.cause for f in d.findings} & _SIGNAL_RULES
    note = next(f for f in d.findings if f.cause == "signal_alert_cleared")
    assert "rewards_all_zero at steps 2560" in note.evidence[0] and "from update 7" in note.evidence[1]
