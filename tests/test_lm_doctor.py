"""``ppokit doctor`` and ``ppokit report`` on language-model run dirs (doctor_lm): each rule on a hand-made
metrics.csv that shows exactly its symptom (and a near miss that must not fire), then a real PPO run with
kl_coef 0 and a hackable reward (reward = length) flagged as reward hacking."""

from __future__ import annotations

import csv
import json
import math

import pytest

from ppokit.analysis.doctor import diagnose
from ppokit.cli import main
from ppokit.core import schema as S

N = 40


def _run(tmp_path, name="run", algo="grpo", config=None, **cols):
    """A run dir like an LM trainer writes: metrics.csv (update + the given columns) and lm_run.json."""
    d = tmp_path / name
    d.mkdir()
    n = len(next(iter(cols.values())))
    names = [S.UPDATE, S.GLOBAL_STEP, *cols]
    with open(d / "metrics.csv", "w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(names)
        for i in range(n):
            w.writerow([i + 1, 64 * (i + 1), *(cols[k][i] for k in cols)])
    cfg = {"kl_coef": 0.05, "beta": 0.04, **(config or {})}
    (d / "lm_run.json").write_text(json.dumps({"kind": "lm", "algo": algo, "config": cfg}))
    return d


def _ramp(a, b, n=N):
    return [a + (b - a) * i / (n - 1) for i in range(n)]


def _healthy(**over):
    """A healthy GRPO run: score rising and plateauing, KL to ref settling at a few nats, sane diagnostics."""
    cols = {
        "score": [min(0.9, 0.35 + 0.05 * i) for i in range(N)],
        "kl_ref": [min(4.0, 0.4 * i) for i in range(N)],
        "length": [10.0] * N, "eos": [1.0] * N, "distinct": [0.9] * N, "zero_std": [0.0] * N,
        "entropy": _ramp(1.8, 0.9), "approx_kl": [0.005] * N, "clipfrac": [0.1] * N,
    }
    cols.update(over)
    keys = {"score": S.SCORE_MEAN, "kl_ref": S.KL_REF, "length": S.RESPONSE_LENGTH, "eos": S.EOS_FRAC,
            "distinct": S.DISTINCT_FRAC, "zero_std": S.FRAC_REWARD_ZERO_STD, "entropy": S.ENTROPY,
            "approx_kl": S.APPROX_KL, "clipfrac": S.CLIPFRAC}
    return {keys[k]: v for k, v in cols.items()}


def _causes(d):
    return [f.cause for f in d.findings if f.severity == "problem"]


def test_healthy_lm_run(tmp_path, capsys):
    run = _run(tmp_path, **_healthy())
    d = diagnose(run)
    assert d.healthy and _causes(d) == [], d.to_text()
    assert main(["doctor", str(run)]) == 0
    assert "HEALTHY" in capsys.readouterr().out


def test_reward_hacking_kl_still_climbing(tmp_path):
    run = _run(tmp_path, **_healthy(kl_ref=[0.5 * i for i in range(N)]))  # 0 -> 19.5 nats and growing
    d = diagnose(run)
    assert _causes(d)[0] == "reward_hacking", d.to_text()
    assert "still growing" in " ".join(d.findings[0].evidence)
    assert main(["doctor", str(run)]) == 1


def test_reward_hacking_needs_the_score_to_rise(tmp_path):
    # The same runaway KL with a flat score is not hacking (nothing was bought with it).
    d = diagnose(_run(tmp_path, **_healthy(kl_ref=[0.5 * i for i in range(N)], score=[0.4] * N)))
    assert "reward_hacking" not in _causes(d)


def test_reward_hacking_without_kl_penalty_even_when_kl_plateaus(tmp_path):
    # A hacked reward saturates within a few iterations; with kl_coef 0 nothing pulls the policy back.
    cols = _healthy(kl_ref=[min(9.0, 1.5 * i) for i in range(N)])
    d = diagnose(_run(tmp_path, "a", algo="ppo", config={"kl_coef": 0.0}, **cols, **{S.KL_COEF: [0.0] * N}))
    assert _causes(d)[0] == "reward_hacking", d.to_text()
    assert "kl_coef 0.0 (no KL anchor at all)" in d.findings[0].evidence[2]
    assert "raise kl_coef from 0" in d.findings[0].fix
    # The same curves with a KL penalty in place: a plateau at 9 nats is where the penalty holds it.
    assert "reward_hacking" not in _causes(diagnose(_run(tmp_path, "b", algo="ppo", **cols,
                                                          **{S.KL_COEF: [0.05] * N})))
    # GRPO's anchor is beta (it logs no kl_coef column).
    d = diagnose(_run(tmp_path, "c", algo="grpo", config={"beta": 0.0}, **cols))
    assert _causes(d)[0] == "reward_hacking" and "raise beta from 0" in d.findings[0].fix


def test_length_collapse_and_eos_lost(tmp_path):
    d = diagnose(_run(tmp_path, "short", **_healthy(length=_ramp(10.0, 1.2))))
    assert "length_collapse" in _causes(d)
    d = diagnose(_run(tmp_path, "long", **_healthy(eos=[1.0] * 4 + [0.0] * (N - 4), length=[16.0] * N)))
    assert "eos_lost" in _causes(d) and "length_collapse" not in _causes(d)
    d = diagnose(_run(tmp_path, "ok", **_healthy(length=_ramp(10.0, 7.0))))  # shorter, not collapsed
    assert "length_collapse" not in _causes(d)


def test_diversity_collapse(tmp_path):
    d = diagnose(_run(tmp_path, "ent", **_healthy(entropy=_ramp(1.8, 0.02, 20) + [0.02] * 20)))
    assert "diversity_collapse" in _causes(d)
    d = diagnose(_run(tmp_path, "distinct", **_healthy(distinct=_ramp(1.0, 1 / 64, 20) + [1 / 64] * 20)))
    assert "diversity_collapse" in _causes(d)
    # The demo's GRPO ends at ~10% of its entropy and ~17% distinct answers (the task has one best answer): fine.
    d = diagnose(_run(tmp_path, "demo", **_healthy(entropy=_ramp(1.75, 0.17), distinct=_ramp(1.0, 0.17))))
    assert "diversity_collapse" not in _causes(d)


def test_zero_reward_variance_groups(tmp_path):
    stuck = _healthy(zero_std=[1.0] * N, score=[0.0] * N)
    d = diagnose(_run(tmp_path, "stuck", **stuck))
    assert _causes(d)[0] == "zero_reward_variance" and "trl#3857" in d.findings[0].fix
    # Groups that saturate after the score rose: a note (the task is learned), not a problem.
    d = diagnose(_run(tmp_path, "solved", **_healthy(zero_std=[0.0] * 20 + [0.8] * 20)))
    assert d.healthy
    assert any(f.cause == "zero_reward_variance" and f.severity == "note" for f in d.findings)
    # A few equal groups now and then (less than half) are normal.
    assert diagnose(_run(tmp_path, "few", **_healthy(zero_std=[0.25] * N))).healthy


def test_trust_region_rules_are_the_gymnasium_doctors(tmp_path):
    d = diagnose(_run(tmp_path, "kl", **_healthy(approx_kl=[0.005] * 30 + [0.5] * 10)))
    assert "kl_blowup" in _causes(d)
    d = diagnose(_run(tmp_path, "cf", **_healthy(clipfrac=[0.1] * 30 + [0.6] * 10)))
    assert "clipfrac_high" in _causes(d)
    d = diagnose(_run(tmp_path, "still", **_healthy(clipfrac=[0.0] * N, approx_kl=[0.0] * N, score=[0.4] * N)))
    assert _causes(d) == ["policy_not_moving"]
    # KL at the warn level on a few iterations, an unsafe config with monitoring off: notes, still healthy.
    d = diagnose(_run(tmp_path, "notes", config={"unsafe": True, "monitor_kl": False},
                      **_healthy(approx_kl=[0.005] * 38 + [0.05] * 2)))
    assert d.healthy and {"kl_high", "unsafe_run", "monitoring_off"} <= {f.cause for f in d.findings}


def test_nonfinite_and_flat(tmp_path):
    d = diagnose(_run(tmp_path, "nan", **_healthy(score=[0.4] * 20 + [math.nan] * 20)))
    assert _causes(d)[0] == "nonfinite"
    d = diagnose(_run(tmp_path, "flat", **_healthy(score=[0.4] * N)))
    assert _causes(d) == ["score_flat"]


def test_dpo_run_is_judged_by_its_preference_accuracy(tmp_path):
    up = {S.DPO_PREF_ACCURACY: _ramp(0.5, 0.95), S.POLICY_LOSS: _ramp(0.69, 0.2)}
    assert diagnose(_run(tmp_path, "up", algo="dpo", **up)).healthy
    flat = {S.DPO_PREF_ACCURACY: [0.5] * N, S.POLICY_LOSS: [0.69] * N}
    d = diagnose(_run(tmp_path, "flat", algo="dpo", **flat))
    assert _causes(d) == ["score_flat"]
    # DPO has no reward: no finding of its run speaks of one.
    assert d.findings[0].title.startswith("the preference accuracy did not improve")
    assert "reward" not in d.to_text().replace("dpo/", ""), d.to_text()


@pytest.mark.parametrize("iterations,verdict", [(20, "healthy"), (3, "too_short")])
def test_a_real_dpo_run_whose_accuracy_jumps_at_once(tmp_path, capsys, iterations, verdict):
    # DPO's first step scores every pair 0 (the policy is pi_ref, so chosen and rejected tie); the tiny model then
    # ranks all pairs right from its second step: accuracy 0.0 -> 1.0. The doctor used to average the jump into
    # its start window and report "the score did not improve ... check that the reward can vary".
    pytest.importorskip("transformers", reason="needs pip install -e '.[lm]'")
    from ppokit.lm import DPOTrainer, LMConfig
    from ppokit.lm.tiny import build_tiny

    model, tok = build_tiny("ABX:", pad_is_eos=True, seed=0)
    pairs = [(p, "XXXX", "ABAB") for p in ("X:", "AB:", "BXAX:", "A:")]
    pairs += [(p, "XAXX", "BBAA") for p in ("X:", "AB:", "BXAX:", "A:")]
    trainer = DPOTrainer(model, tok, pairs=pairs, config=LMConfig(learning_rate=3e-3, batch_prompts=4, beta=0.5),
                         run_dir=tmp_path / "dpo")
    accuracy = [m[S.DPO_PREF_ACCURACY] for m in trainer.train(iterations)]
    trainer.save(tmp_path / "dpo")
    trainer.close()
    assert accuracy[0] == 0.0 and accuracy[-1] == 1.0, accuracy
    d = diagnose(tmp_path / "dpo")
    assert d.verdict == verdict and not d.problems, d.to_text()
    assert "reward" not in d.to_text().replace("dpo/", ""), d.to_text()
    assert main(["doctor", str(tmp_path / "dpo")]) == 0
    assert ("HEALTHY" if verdict == "healthy" else "TOO SHORT TO JUDGE: 3 iteration(s)") in capsys.readouterr().out
    if verdict == "healthy":  # an LM run's checkpoint, truncated: named in one line, the metrics still judged
        state = tmp_path / "dpo" / "trainer_state.pt"
        with open(state, "r+b") as fh:
            fh.truncate(state.stat().st_size // 2)
        d = diagnose(tmp_path / "dpo")
        assert [f.cause for f in d.problems] == ["checkpoint_unreadable"], d.to_text()
        assert str(state) in d.problems[0].evidence[0]
        metrics = next(f for f in d.findings if f.cause == "healthy")
        assert metrics.title == "the metrics show a healthy run" and "dpo/pref_accuracy 0 in" in metrics.evidence[0]


def test_gymnasium_runs_keep_their_doctor(tmp_path):
    from ppokit.analysis.doctor import load_run
    from ppokit.analysis.doctor_lm import is_lm_run

    d = tmp_path / "gym"
    d.mkdir()
    (d / "metrics.csv").write_text(f"{S.UPDATE},{S.GLOBAL_STEP},{S.EPISODIC_RETURN}\n1,128,10\n2,256,20\n")
    assert not is_lm_run(load_run(d))


def test_report_on_an_lm_run(tmp_path):
    from ppokit.analysis.report import build_report

    run = _run(tmp_path, **_healthy(kl_ref=[0.5 * i for i in range(N)]))
    page = build_report(run)
    assert f"{N} iterations" in page and "environment steps" not in page
    for col in (S.SCORE_MEAN, S.KL_REF, S.RESPONSE_LENGTH, S.FRAC_REWARD_ZERO_STD):
        assert f'id="plot-{col.replace("/", "-")}"' in page
    assert "reward hacking" in page and "algo grpo" in page
    assert "plot-dpo-pref_accuracy" not in page  # only the curves the run logged
    dpo = _run(tmp_path, "dpo", algo="dpo", **{S.DPO_PREF_ACCURACY: _ramp(0.5, 0.9), S.POLICY_LOSS: _ramp(0.7, 0.3)})
    page = build_report(dpo)
    assert 'id="plot-dpo-pref_accuracy"' in page and 'id="plot-charts-score_mean"' not in page


# ---------------------------------------------------------------- a real run: kl_coef 0 and reward = length
@pytest.mark.slow  # SFT 150 steps + 24 PPO iterations: ~8 s on one thread
def test_doctor_flags_a_real_kl0_length_reward_run_as_reward_hacking(tmp_path, capsys):
    pytest.importorskip("transformers", reason="needs pip install -e '.[lm]'")
    from ppokit.lm import PPOTrainer, demo
    from ppokit.lm.tiny import build_tiny

    model, tok = build_tiny(demo.ALPHABET, seed=1)
    demo.supervised_finetune(model, tok, steps=150, seed=1)
    config = demo.lm_config(1, demo.DemoSettings(), learning_rate=2e-3, kl_coef=0.0)
    trainer = PPOTrainer(model, tok, reward=demo.length_reward, prompts=[demo.PROMPT] * 8, config=config,
                         run_dir=tmp_path / "hack")
    trainer.train(24)
    trainer.close()
    assert main(["doctor", str(tmp_path / "hack")]) == 1
    text = capsys.readouterr().out
    assert "1. [PROBLEM] reward hacking" in text, text
