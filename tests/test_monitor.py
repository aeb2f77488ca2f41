"""Live alert rules on constructed metric sequences: each rule fires when it should, stays quiet when it should
not (CartPole's constant +1 reward, a converged run's annealed tail), and is rate-limited."""

from __future__ import annotations

import math

import pytest

from ppokit.diagnostics.monitor import CLIPFRAC_NEVER_FIRES, KL_NEGLIGIBLE, THRESHOLDS, Monitor


def healthy(i: int = 0, **over) -> dict:
    """Metrics of an unremarkable update (CartPole-like: every reward +1, episode lengths varying)."""
    m = {"charts/episodic_return": 20.0 + 3 * i, "charts/episodic_length": 20.0 + 3 * i,
         "charts/learning_rate": 1e-3, "losses/policy_loss": -0.01, "losses/value_loss": 1.0,
         "diag/entropy": 0.69 - 0.001 * i, "diag/approx_kl": 0.005, "diag/clipfrac": 0.15,
         "diag/explained_variance": 0.5, "diag/grad_norm": 1.0, "diag/skipped_minibatches": 0.0,
         "diag/nonfinite_env": 0.0, "diag/advantages_nonfinite": 0.0, "diag/reward_std": 0.0}
    m.update(over)
    return m


def names(mon: Monitor, seq) -> list[list[str]]:
    return [[a.name for a in mon.check(i + 1, m)] for i, m in enumerate(seq)]


def fired(mon, seq) -> set[str]:
    return {n for ns in names(mon, seq) for n in ns}


def test_healthy_cartpole_sequence_is_silent():
    # Constant +1 reward (reward_std 0) is fine: lengths and returns vary. This was the old false positive.
    assert fired(Monitor(), [healthy(i) for i in range(60)]) == set()


def test_rewards_all_zero():
    seq = [healthy(i, **{"charts/episodic_return": 0.0, "charts/episodic_length": 10.0 + i}) for i in range(6)]
    out = names(Monitor(), seq)
    assert "rewards_all_zero" not in sum(out[:4], [])  # needs reward_patience (5) updates
    assert "rewards_all_zero" in out[4]


def test_zero_reward_variance_needs_constant_returns_too():
    const = [healthy(i, **{"charts/episodic_return": 5.0, "charts/episodic_length": 5.0}) for i in range(6)]
    assert "zero_reward_variance" in fired(Monitor(), const)
    # Same constant reward but episodes of varying length: there is signal.
    varying = [healthy(i, **{"charts/episodic_return": 5.0 + i % 2, "charts/episodic_length": 5.0 + i % 2})
               for i in range(6)]
    assert "zero_reward_variance" not in fired(Monitor(), varying)
    # Constant, but the return moved there from the start (a solved CartPole at 500): no alert.
    solved = [healthy(0)] + [healthy(i, **{"charts/episodic_return": 500.0, "charts/episodic_length": 500.0})
                             for i in range(8)]
    assert "zero_reward_variance" not in fired(Monitor(), solved)


@pytest.mark.parametrize("kl,expected", [(0.015, set()), (0.05, {"kl_high"}), (0.5, {"kl_blowup"})])
def test_kl_thresholds(kl, expected):
    got = {a.name for a in Monitor().check(1, healthy(0, **{"diag/approx_kl": kl}))}
    assert got == expected
    if expected:
        a = Monitor().check(1, healthy(0, **{"diag/approx_kl": kl}))[0]
        assert a.level == ("alert" if kl > THRESHOLDS["kl_alert"] else "warn")
        assert a.data["approx_kl"] == kl and a.data["update"] == 1


def test_clip_never_fires_after_patience_only():
    seq = [healthy(i, **{"diag/clipfrac": 0.0, "diag/approx_kl": 1e-8}) for i in range(6)]
    out = names(Monitor(), seq)
    assert all("clip_never_fires" not in o for o in out[:4]) and "clip_never_fires" in out[4]


def test_a_zero_clip_fraction_with_a_moving_policy_is_healthy():
    # CartPole with the library defaults: clip fraction exactly 0 on every update while the return climbs and the
    # KL is 1e-5..4e-4. The old rule (clip fraction < 0.01 alone) fired on it every 10 updates.
    seq = [healthy(i, **{"diag/clipfrac": 0.0, "diag/approx_kl": kl}) for i, kl in enumerate([2e-4, 1e-5, 3e-6] * 20)]
    assert "clip_never_fires" not in fired(Monitor(), seq)


@pytest.mark.parametrize("clipfrac,kl,fires", [
    (0.0, 0.0, True),
    (0.99 * CLIPFRAC_NEVER_FIRES, 0.99 * KL_NEGLIGIBLE, True),
    (1.01 * CLIPFRAC_NEVER_FIRES, 0.0, False),  # the clip fires a little: the policy moves
    (0.005, 1e-8, False),  # the old 0.01 threshold fired here
    (0.0, 1.01 * KL_NEGLIGIBLE, False),
    (0.0, math.nan, False),  # no KL measured: no evidence the policy stands still
])
def test_clip_never_fires_needs_clip_fraction_and_kl_both_negligible(clipfrac, kl, fires):
    seq = [healthy(i, **{"diag/clipfrac": clipfrac, "diag/approx_kl": kl}) for i in range(5)]
    assert ("clip_never_fires" in fired(Monitor(), seq)) == fires
    assert THRESHOLDS["clipfrac_low"] == CLIPFRAC_NEVER_FIRES == 1e-3 and THRESHOLDS["kl_negligible"] == 1e-6


def test_clip_never_fires_needs_the_condition_to_persist():
    still = {"diag/clipfrac": 0.0, "diag/approx_kl": 1e-8}
    # One update of real movement every 4 updates: never 5 in a row.
    seq = [healthy(i, **(still if i % 4 else {"diag/clipfrac": 0.0, "diag/approx_kl": 1e-4})) for i in range(40)]
    assert "clip_never_fires" not in fired(Monitor(), seq)


def test_a_converged_near_deterministic_policy_that_stops_moving_is_not_flagged():
    # The GridWorld preset at its optimum: entropy far below its start, constant advantages normalize to 0, KL ~1e-8.
    still = {"diag/clipfrac": 0.0, "diag/approx_kl": 1e-8}
    start = [healthy(0, **{"diag/entropy": 1.38})]
    converged = [healthy(i, **still, **{"diag/entropy": 0.03}) for i in range(1, 12)]
    assert "clip_never_fires" not in fired(Monitor(), start + converged)
    # The same stillness at an entropy that has not collapsed is the problem the rule is for.
    stuck = [healthy(i, **still, **{"diag/entropy": 1.2}) for i in range(1, 12)]
    assert "clip_never_fires" in fired(Monitor(), start + stuck)


def test_clip_never_fires_uses_the_kl_after_the_update_when_logged():
    # A2C's in-update KL is taken before its only step (always 0); the KL after the update shows the movement.
    a2c = {"diag/clipfrac": 0.0, "diag/approx_kl": 0.0}
    moving = [healthy(i, **a2c, **{"diag/approx_kl_after": 3e-4}) for i in range(10)]
    assert "clip_never_fires" not in fired(Monitor(), moving)
    stuck = [healthy(i, **a2c, **{"diag/approx_kl_after": 0.0}) for i in range(10)]
    assert "clip_never_fires" in fired(Monitor(), stuck)


def test_clip_near_zero_in_annealed_tail_is_expected():
    seq = [healthy(i, **{"charts/learning_rate": 1e-3 * (1 - i / 20)}) for i in range(10)]
    seq += [healthy(i, **{"charts/learning_rate": 1e-3 * (1 - i / 20), "diag/clipfrac": 0.0, "diag/approx_kl": 0.0})
            for i in range(19, 20)] * 6
    assert "clip_never_fires" not in fired(Monitor(), seq)


def test_clip_never_fires_with_zero_lr_is_an_alert():
    a = [a for ns in [Monitor().check(i, healthy(i, **{"diag/clipfrac": 0.0, "charts/learning_rate": 0.0}))
                      for i in range(1, 2)] for a in ns]
    assert a == []  # not yet: patience
    mon = Monitor()
    alerts = [a for i in range(1, 7) for a in mon.check(i, healthy(i, **{"diag/clipfrac": 0.0,
                                                                           "charts/learning_rate": 0.0}))]
    assert [(a.name, a.level) for a in alerts] == [("clip_never_fires", "alert")]
    assert "learning rate is 0" in alerts[0].message


def test_clipfrac_high_needs_to_be_sustained():
    spiky = [healthy(i, **{"diag/clipfrac": 0.5 if i % 2 else 0.2}) for i in range(12)]
    assert "clipfrac_high" not in fired(Monitor(), spiky)
    sustained = [healthy(i, **{"diag/clipfrac": 0.45}) for i in range(5)]
    assert names(Monitor(), sustained)[-1] == ["clipfrac_high"]


def test_critic_not_learning():
    flat = [healthy(i, **{"diag/explained_variance": -0.1}) for i in range(20)]
    out = names(Monitor(), flat)
    assert "critic_not_learning" in out[19] and all("critic_not_learning" not in o for o in out[:19])
    # Once the critic has learned, a later drop (near-constant returns of a solved task) is not reported.
    rose = [healthy(i, **{"diag/explained_variance": 0.9}) for i in range(5)] + flat
    assert "critic_not_learning" not in fired(Monitor(), rose)


def test_entropy_collapse_discrete():
    seq = [healthy(0, **{"diag/entropy": 0.69}), healthy(1, **{"diag/entropy": 0.2}),
           healthy(2, **{"diag/entropy": 0.03})]
    out = names(Monitor(action_kind="discrete"), seq)
    assert out[1] == [] and out[2] == ["entropy_collapse"]


def test_entropy_collapse_continuous_is_relative_to_start():
    # Gaussian entropy can be negative; a 2-dim policy collapses after a drop of > 2 * 2.5 = 5 nats.
    mon = Monitor(action_kind="continuous", action_dim=2)
    seq = [healthy(0, **{"diag/entropy": 2.8}), healthy(1, **{"diag/entropy": -1.0}),  # drop 3.8: fine
           healthy(2, **{"diag/entropy": -2.5})]  # drop 5.3: collapse
    assert names(mon, seq) == [[], [], ["entropy_collapse"]]
    # Kind unknown: a negative entropy marks the policy continuous, so the fraction rule does not misfire.
    mon = Monitor()
    seq = [healthy(0, **{"diag/entropy": 1.4}), healthy(1, **{"diag/entropy": -0.5})]
    assert names(mon, seq) == [[], []]


@pytest.mark.parametrize("key,value,name", [
    ("diag/skipped_minibatches", 2.0, "nonfinite_loss"),
    ("losses/value_loss", math.inf, "nonfinite_loss"),
    ("diag/approx_kl", math.nan, "nonfinite_loss"),
    ("diag/nonfinite_env", 3.0, "nonfinite_env"),
    ("diag/advantages_nonfinite", 5.0, "nonfinite_advantages"),
])
def test_nonfinite_rules(key, value, name):
    alerts = Monitor().check(1, healthy(0, **{key: value}))
    assert [a.name for a in alerts] == [name] and alerts[0].level == "alert"


def test_rate_limit_per_rule():
    mon = Monitor(cooldown=10)
    hits = [i for i in range(1, 31) if any(a.name == "kl_blowup"
                                           for a in mon.check(i, healthy(i, **{"diag/approx_kl": 1.0})))]
    assert hits == [1, 11, 21]
    # Rules are limited independently: a different rule still fires inside kl_blowup's cooldown.
    mon = Monitor(cooldown=10)
    mon.check(1, healthy(1, **{"diag/approx_kl": 1.0}))
    assert [a.name for a in mon.check(2, healthy(2, **{"diag/nonfinite_env": 1.0, "diag/approx_kl": 1.0}))] \
        == ["nonfinite_env"]


def test_unknown_threshold_is_rejected():
    with pytest.raises(ValueError, match="kl_wran"):
        Monitor(thresholds={"kl_wran": 0.1})


def test_clip_never_fires_stays_quiet_on_the_gridworld_preset_run(tmp_path):
    # Solved within a few updates; later rollouts are all optimal and the policy stops moving (KL ~1e-8).
    from ppokit.config.ppo_config import load_preset
    from ppokit.training.trainer import train

    cfg = load_preset("gridworld")
    cfg.tensorboard, cfg.run_dir = False, str(tmp_path / "grid")
    run = train(cfg, console_enabled=False)
    assert run.metrics[-1]["charts/episodic_return"] > 0.9
    assert "clip_never_fires" not in {a["name"] for a in run.alerts}


@pytest.mark.parametrize("learning_rate,expected", [(2.5e-4, []), (0.0, [("clip_never_fires", "alert")])])
def test_clip_never_fires_on_real_cartpole_runs_only_when_the_policy_cannot_move(tmp_path, learning_rate, expected):
    # The library defaults on CartPole: clip fraction 0 on every update (the old rule fired at update 5), KL ~1e-4.
    from ppokit.config.ppo_config import PPOConfig
    from ppokit.training.trainer import train

    cfg = PPOConfig(env_id="CartPole-v1", total_timesteps=8 * 512, learning_rate=learning_rate, tensorboard=False,
                    run_dir=str(tmp_path / "run"))
    run = train(cfg, console_enabled=False)
    assert max(m["diag/clipfrac"] for m in run.metrics) < 0.01
    got = [(a["name"], a["level"]) for a in run.alerts if a["name"] == "clip_never_fires"]
    assert got == expected


def test_constant_reward_episodes_cut_by_the_time_limit_are_not_zero_reward_variance():
    # Acrobot before its first swing-up: -1 every step, every episode truncated at 500 steps with return -500.
    # The reward function is fine (reaching the goal would end an episode early): no zero-variance alert.
    stuck = [healthy(i, **{"charts/episodic_return": -500.0, "charts/episodic_length": 500.0}) for i in range(12)]
    assert "zero_reward_variance" not in fired(Monitor(time_limit=500), stuck)
    # The same numbers from an env whose episodes all end, terminated, at one length below its time limit: the
    # reward cannot rank actions.
    assert "zero_reward_variance" in fired(Monitor(time_limit=1000), stuck)


def test_returns_that_varied_once_show_the_signal_for_the_rest_of_the_run():
    # Acrobot with the defaults (seed 1): one episode ended early (-340), then a stretch of -500s. The alert used
    # to judge only the last 5 updates and fired; the doctor, judging the whole run, said the rewards vary.
    seq = [healthy(i, **{"charts/episodic_return": r, "charts/episodic_length": -r})
           for i, r in enumerate([-500.0, -340.0] + [-500.0] * 10)]
    assert "zero_reward_variance" not in fired(Monitor(), seq)


def test_monitor_kl_false_turns_the_kl_alerts_off():
    seq = [healthy(i, **{"diag/approx_kl": kl}) for i, kl in enumerate([0.05, 0.5])]
    assert fired(Monitor(), seq) == {"kl_high", "kl_blowup"}
    assert fired(Monitor(monitor_kl=False), seq) == set()
    # Only the KL rules: the clip-fraction ones still run.
    drift = [healthy(i, **{"diag/clipfrac": 0.45, "diag/approx_kl": 0.5}) for i in range(5)]
    assert fired(Monitor(monitor_kl=False), drift) == {"clipfrac_high"}


def test_monitor_clipfrac_false_turns_the_clip_fraction_alerts_off():
    drift = [healthy(i, **{"diag/clipfrac": 0.45}) for i in range(5)]
    still = [healthy(i, **{"diag/clipfrac": 0.0, "diag/approx_kl": 0.0}) for i in range(5)]
    assert "clipfrac_high" in fired(Monitor(), drift) and "clip_never_fires" in fired(Monitor(), still)
    assert fired(Monitor(monitor_clipfrac=False), drift) == set()
    assert fired(Monitor(monitor_clipfrac=False), still) == set()
    assert fired(Monitor(monitor_clipfrac=False), [healthy(0, **{"diag/approx_kl": 0.5})]) == {"kl_blowup"}


def test_monitoring_switched_off_in_the_config_reaches_a_real_run(tmp_path):
    # lr 0 on CartPole: clip_never_fires (alert) with monitoring on (the test above with lr 0). Off (only with
    # --unsafe), the run raises no clip-fraction alert; the guard rail still refuses it without --unsafe.
    from ppokit.analysis.doctor import diagnose
    from ppokit.config.ppo_config import ConfigError, PPOConfig
    from ppokit.training.trainer import train

    with pytest.raises(ConfigError, match="monitor_clipfrac"):
        PPOConfig(env_id="CartPole-v1", monitor_clipfrac=False).validate()
    cfg = PPOConfig(env_id="CartPole-v1", total_timesteps=8 * 512, learning_rate=0.0, tensorboard=False,
                    monitor_clipfrac=False, unsafe=True, run_dir=str(tmp_path / "run"))
    run = train(cfg, console_enabled=False)
    names = {a["name"] for a in run.alerts}
    assert "unsafe_run" in names and not names & {"clip_never_fires", "clipfrac_high"}, names
    d = diagnose(run.run_dir)
    off = [f for f in d.findings if f.cause == "monitoring_off"]
    assert off and "monitor_clipfrac = false" in off[0].evidence[0] and off[0].severity == "note"
    assert d.findings[0].cause == "lr_zero"  # the doctor still reads metrics.csv


def test_policy_lag_growing_fires_on_a_rising_lag_only():
    # Decoupled actors: a learner falling behind adds a version of lag per update; a steady lag (about K - 1 for
    # K actors), a lag that rose and came back, and a synchronous run (no lag column) are quiet.
    rising = [healthy(i, **{"diag/policy_lag": float(i)}) for i in range(12)]
    out = names(Monitor(), rising)  # halves 0..4 and 5..9: means 2 and 7, 5 versions apart at update 10
    assert "policy_lag_growing" not in sum(out[:9], []) and "policy_lag_growing" in out[9]
    steady = [healthy(i, **{"diag/policy_lag": 3.0 + (i % 2)}) for i in range(30)]
    assert "policy_lag_growing" not in fired(Monitor(), steady)
    spike = [healthy(i, **{"diag/policy_lag": 9.0 if i == 15 else 1.0}) for i in range(30)]
    assert "policy_lag_growing" not in fired(Monitor(), spike)
