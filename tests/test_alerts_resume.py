"""Live alerts continue across a resume: the monitor's state (cooldowns, patience windows, the run summary, the
first entropy and learning rate) is in the checkpoint, so a run stopped and resumed raises exactly the alerts of
the same run never stopped; an LM run's alerts (the Gymnasium monitor's and the LM rules') do the same."""

from __future__ import annotations

import copy
import json

import pytest

from ppokit.config.ppo_config import PPOConfig
from ppokit.diagnostics.monitor import Monitor
from ppokit.training.trainer import resume, train


def _alerts(run_dir) -> list[tuple[int, str, str]]:
    rows = [json.loads(line) for line in (run_dir / "alerts.jsonl").read_text().splitlines()]
    return [(r["step"], r["level"], r["name"]) for r in rows if r["level"] != "info"]


def test_a_resumed_run_raises_the_alerts_of_the_unbroken_run(tmp_path):
    # A learning rate this high makes the KL alerts fire from the first update on: kl_high at update 1, then quiet
    # for the 10-update cooldown. A resume at update 5 that forgot the cooldown would raise kl_high again at 6.
    cfg = PPOConfig(env_id="CartPole-v1", num_envs=4, num_steps=64, num_minibatches=4, update_epochs=20,
                    learning_rate=0.05, anneal_lr=False, total_timesteps=256 * 12, tensorboard=False, seed=1)
    train(cfg, run_dir=tmp_path / "whole", console_enabled=False)
    stop = train(cfg, run_dir=tmp_path / "broken", console_enabled=False,
                 callbacks=[lambda info: False if info.update == 5 else None])
    assert stop.global_step == 256 * 5
    resume(tmp_path / "broken", console_enabled=False)
    whole = _alerts(tmp_path / "whole")
    assert sum(name == "kl_high" for _, _, name in whole) == 1, whole  # the cooldown held it back
    assert _alerts(tmp_path / "broken") == whole


def test_monitor_state_round_trips_and_a_malformed_one_changes_nothing():
    m = Monitor()
    rows = [{"diag/clipfrac": 0.5, "diag/approx_kl": 0.05, "diag/entropy": 0.6, "charts/learning_rate": 1e-3}] * 6
    fired = [a.name for i, row in enumerate(rows, 1) for a in m.check(i, row)]
    assert "kl_high" in fired and "clipfrac_high" in fired
    fresh = Monitor()
    fresh.load_state_dict(copy.deepcopy(m.state_dict()))
    assert fresh.state_dict() == m.state_dict()
    assert [a.name for a in fresh.check(7, rows[0])] == [a.name for a in m.check(7, rows[0])] == []  # cooling down
    before = fresh.state_dict()
    for broken in ({**before, "last_fired": {"kl_high": "soon"}}, {k: v for k, v in before.items() if k != "summary"}):
        with pytest.raises((TypeError, ValueError, KeyError)):
            fresh.load_state_dict(broken)
        assert fresh.state_dict() == before


def test_an_lm_resume_keeps_the_zero_variance_streak(tmp_path):
    pytest.importorskip("transformers", reason="needs pip install -e '.[lm]'")
    from ppokit.core.schema import THRESHOLDS
    from ppokit.lm import GRPOTrainer, LMConfig
    from ppokit.lm.tiny import build_tiny

    base = build_tiny("ABX:", pad_is_eos=True, seed=0)
    cfg = LMConfig(learning_rate=3e-3, batch_prompts=2, group_size=2, max_new_tokens=4, update_epochs=1,
                   num_minibatches=1, tensorboard=False, console=False)

    def flat(prompts, completions):  # every group scores its completions the same: zero reward variance
        return [1.0] * len(completions)

    def trainer(run):
        return GRPOTrainer(copy.deepcopy(base[0]), base[1], reward=flat, prompts=["X:", "AB:"], config=cfg,
                           run_dir=run)

    patience = int(THRESHOLDS["reward_patience"])
    whole = trainer(tmp_path / "whole")
    whole.train(patience + 1)
    whole.close()
    first = trainer(tmp_path / "broken")
    first.train(patience - 1)  # one iteration short of the alert
    first.close()
    again = GRPOTrainer.resume(tmp_path / "broken", copy.deepcopy(base[0]), base[1], reward=flat,
                               prompts=["X:", "AB:"])
    again.train(2)
    again.close()
    assert "zero_reward_variance" in [a["name"] for a in again.alerts]  # at iteration `patience`, as unbroken
    assert _alerts(tmp_path / "broken") == _alerts(tmp_path / "whole")
