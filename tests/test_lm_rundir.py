"""One run per LM run dir, as for the Gymnasium trainer: a fresh trainer refuses a dir that holds a run (two runs'
rows would mix in one metrics.csv) unless overwrite=True, a second trainer on a live dir is refused, and a resume into
the run dir logs each iteration exactly once (rows written after the checkpoint are dropped)."""

from __future__ import annotations

import copy
import csv

import pytest

pytest.importorskip("transformers", reason="needs pip install -e '.[lm]'")

from ppokit.lm import GRPOTrainer, LMConfig  # noqa: E402
from ppokit.lm.tiny import build_tiny  # noqa: E402
from ppokit.runtime.rundir import RunDirError  # noqa: E402

PROMPTS = ["X:", "AB:"]
CFG = dict(learning_rate=3e-3, batch_prompts=2, group_size=2, max_new_tokens=4, update_epochs=1, num_minibatches=1,
           tensorboard=False, console=False)


def reward(prompts, completions):
    return [c.count("X") / max(len(c), 4) for c in completions]


@pytest.fixture(scope="module")
def base():
    return build_tiny("ABX:", pad_is_eos=True, seed=0)


def _trainer(base, run_dir, **kw):
    return GRPOTrainer(copy.deepcopy(base[0]), base[1], reward=reward, prompts=PROMPTS, config=LMConfig(**CFG),
                       run_dir=run_dir, **kw)


def _updates(run_dir):
    return [int(float(r["update"])) for r in csv.DictReader(open(run_dir / "metrics.csv"))]


def test_a_fresh_trainer_refuses_a_run_dir_holding_a_run_and_overwrite_starts_clean(base, tmp_path):
    first = _trainer(base, tmp_path / "run")
    first.train(2)
    with pytest.raises(RunDirError, match="live|running|lock"):  # the first one still holds the dir
        _trainer(base, tmp_path / "run").train(1)
    first.close()
    with pytest.raises(RunDirError, match="already holds a run"):
        _trainer(base, tmp_path / "run").train(1)
    assert _updates(tmp_path / "run") == [1, 2]
    again = _trainer(base, tmp_path / "run", overwrite=True)
    again.train(1)
    again.close()
    assert _updates(tmp_path / "run") == [1]


def test_a_resume_into_the_run_dir_logs_each_iteration_once(base, tmp_path):
    run = tmp_path / "run"
    t = _trainer(base, run)
    t.train(2)
    t.save(tmp_path / "ckpt")
    t.train(2)  # iterations 3 and 4 are logged, then the process "dies" before saving them
    t.close()
    resumed = GRPOTrainer.resume(tmp_path / "ckpt", copy.deepcopy(base[0]), base[1], reward=reward,
                                 prompts=PROMPTS, run_dir=run)
    resumed.train(2)
    resumed.close()
    assert _updates(run) == [1, 2, 3, 4]


def test_the_console_line_of_an_lm_run_shows_its_score_and_speed(base, tmp_path, capsys):
    from ppokit.core import schema as S

    t = GRPOTrainer(copy.deepcopy(base[0]), base[1], reward=reward, prompts=PROMPTS,
                    config=LMConfig(**{**CFG, "console": True, "log_every": 1}), run_dir=tmp_path / "run")
    history = t.train(2)
    t.close()
    assert history[-1][S.SPS] > 0  # completions per second
    out = capsys.readouterr().out + capsys.readouterr().err
    assert f"{history[-1][S.SCORE_MEAN]:.1f}" in out and "return –" not in out


def test_a_kill_between_the_policy_swaps_renames_puts_the_previous_policy_back(base, tmp_path):
    from ppokit.runtime import rundir

    run = tmp_path / "run"
    t = _trainer(base, run)
    t.train(2)
    t.close()
    saved = {p.name: p.read_bytes() for p in (run / "policy").iterdir()}
    # The disk as a kill -9 between the two renames of the next save leaves it: the previous policy/ moved aside,
    # the fresh one still under its temp name (half written), no policy/.
    new, aside, final = rundir.model_swap_paths(run, "0123abcd")
    final.rename(aside)
    new.mkdir()
    (new / "model.safetensors").write_bytes(b"half")
    claim = rundir.claim(run, resume=True)  # what a resume claims first
    claim.release()
    assert {p.name: p.read_bytes() for p in final.iterdir()} == saved  # the policy the checkpoint belongs to
    assert not aside.exists() and not new.exists()
    assert any("is back in place" in note for note in claim.notes), claim.notes
    # ... and the run goes on from its checkpoint.
    resumed = GRPOTrainer.resume(run, copy.deepcopy(base[0]), base[1], reward=reward, prompts=PROMPTS)
    resumed.train(1)
    resumed.close()
    assert _updates(run) == [1, 2, 3]
