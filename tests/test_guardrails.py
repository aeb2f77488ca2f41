"""Trust-region guard rails: ``ppokit train`` and ``ppokit plan`` refuse each rule with exit code 2 and a message
naming the field and the safe range; ``--unsafe`` runs and is stamped in config.toml, UNSAFE, alerts.jsonl, the
curves title, the doctor's notes and the HTML report."""

from __future__ import annotations

import json
import re

import pytest
import tomllib  # noqa: E402  (Python >= 3.11)

import ppokit.diagnostics.plots
from ppokit.cli import main
from ppokit.config.ppo_config import PPOConfig

# (flags, field, words the message must contain)
RULES = [
    (["--update-epochs", "31"], "update_epochs", ["<= 30", "safe range 1-30"]),
    (["--clip-coef", "0.35"], "clip_coef", ["<= 0.3", "safe range 0.1-0.3"]),
    (["--no-norm-adv"], "norm_adv", ["advantage normalization is off", "norm_adv = true"]),
    (["--no-monitor-kl"], "monitor_kl", ["KL monitoring is off", "monitor_kl = true"]),
    (["--no-monitor-clipfrac"], "monitor_clipfrac", ["clip-fraction monitoring is off", "monitor_clipfrac = true"]),
]


def _flat(text: str) -> str:
    return re.sub(r"\s+", " ", text)


@pytest.mark.parametrize("flags,field,words", RULES)
@pytest.mark.parametrize("command", ["train", "plan"])
def test_each_rule_is_refused(command, flags, field, words, tmp_path, capsys):
    base = (["train", "--preset", "gridworld", "--run-dir", str(tmp_path / "r"), "--quiet"] if command == "train"
            else ["plan", "--env", "CartPole-v1", "--budget", "10000", "--no-probe"])
    assert main(base + flags) == 2
    err = _flat(capsys.readouterr().err)
    assert f"config field '{field}'" in err
    for w in words:
        assert w in err
    assert "--unsafe" in err
    assert not (tmp_path / "r").exists()  # refused before anything was written


def test_limits_themselves_are_allowed():
    assert PPOConfig(update_epochs=30, clip_coef=0.3).guard_rail_violations() == []
    assert PPOConfig(update_epochs=30, clip_coef=0.3).validate().update_epochs == 30
    # The clip rule is about the clipped objective; ppo-kl does not use eps as a trust region.
    assert PPOConfig(algo="ppo-kl", clip_coef=0.5).guard_rail_violations() == []
    assert [f for f, _ in PPOConfig(update_epochs=31, clip_coef=0.31).guard_rail_violations()] == [
        "update_epochs", "clip_coef"]


def test_unsafe_plan_is_allowed_and_says_so(capsys):
    assert main(["plan", "--env", "CartPole-v1", "--budget", "10000", "--no-probe", "--update-epochs", "40",
                 "--unsafe", "--format", "toml"]) == 0
    out = capsys.readouterr().out
    assert "unsafe = true" in out and "UNSAFE" in out and "update_epochs = 40" in out


@pytest.mark.slow
def test_unsafe_run_is_stamped_everywhere(tmp_path, monkeypatch, capsys):
    from matplotlib.figure import Figure

    titles = []  # the title of every figure matplotlib saves (curves.png's among them)
    savefig = Figure.savefig

    def keep(fig, *args, **kwargs):
        titles.append(fig._suptitle.get_text() if fig._suptitle is not None else None)
        return savefig(fig, *args, **kwargs)

    monkeypatch.setattr(Figure, "savefig", keep)
    run_dir = tmp_path / "unsafe"
    rc = main(["train", "--preset", "gridworld", "--update-epochs", "40", "--clip-coef", "0.5", "--unsafe",
               "--total-timesteps", "1024", "--run-dir", str(run_dir), "--no-tensorboard"])
    assert rc == 0
    console = _flat(capsys.readouterr().out)
    assert "unsafe_run" in console
    assert tomllib.loads((run_dir / "config.toml").read_text())["unsafe"] is True
    stamp = (run_dir / "UNSAFE").read_text()
    assert "update_epochs" in stamp and "clip_coef" in stamp
    alerts = [json.loads(line) for line in (run_dir / "alerts.jsonl").read_text().splitlines()]
    assert any(a["name"] == "unsafe_run" for a in alerts)
    # curves.png is titled from the run's files, unsafe stamp first.
    assert titles == ["UNSAFE run: ppokit/GridWorld-v0 · ppo · seed 1 · unsafe"]
    assert ppokit.diagnostics.plots.run_title(run_dir) == titles[0]
    assert (run_dir / "curves.png").stat().st_size > 5000

    from ppokit.analysis.doctor import diagnose

    assert any(f.cause == "unsafe_run" for f in diagnose(run_dir).findings)
    from ppokit.analysis.report import build_report

    html = build_report(run_dir)
    assert 'class="unsafe-banner"' in html and "UNSAFE" in html


@pytest.mark.slow
def test_safe_run_is_not_stamped(tmp_path):
    run_dir = tmp_path / "safe"
    assert main(["train", "--preset", "gridworld", "--total-timesteps", "512", "--run-dir", str(run_dir), "--quiet",
                 "--no-tensorboard"]) == 0
    assert not (run_dir / "UNSAFE").exists()
    assert tomllib.loads((run_dir / "config.toml").read_text())["unsafe"] is False
    from ppokit.analysis.report import build_report

    assert 'class="unsafe-banner"' not in build_report(run_dir)
