"""A checkpoint or run dir is data, never code, and a bad one is one clear error.

Loading never imports a module only the checkpoint names; a changed byte or a NaN policy is refused; missing keys,
another env's shapes, an unknown stored config key and a failed save are one line and exit code 2 (or non-zero),
for ``ppokit eval`` and ``ppokit train --resume`` alike.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import pytest
import torch

import ppokit
from ppokit.cli import main
from ppokit.config.ppo_config import PPOConfig
from ppokit.runtime.checkpoint import (
    CheckpointError,
    CheckpointWarning,
    load_checkpoint,
    save_checkpoint,
)
from ppokit.training.trainer import CHECKPOINT_NAME, resume, train

torch.set_num_threads(1)

EVIL = '''
import pathlib
pathlib.Path(__file__).with_name("pwned").write_text("evilmod ran")
'''


def _tiny(env_id: str, run_dir: Path, **kw) -> PPOConfig:
    return PPOConfig(env_id=env_id, num_envs=2, num_steps=16, num_minibatches=2, update_epochs=1,
                     total_timesteps=64, tensorboard=False, run_dir=str(run_dir), **kw)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """One finished CartPole run and one Pendulum run (continuous), trained once and copied per test."""
    base = tmp_path_factory.mktemp("trained")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        train(_tiny("CartPole-v1", base / "cartpole"), console_enabled=False)
        train(_tiny("Pendulum-v1", base / "pendulum"), console_enabled=False)
    return base


@pytest.fixture
def fresh_evilmod(monkeypatch):
    """Each test imports its own evilmod.py: forget any earlier import, and this one after the test."""
    monkeypatch.setitem(sys.modules, "evilmod", None)
    del sys.modules["evilmod"]


def _copy(runs: Path, name: str, dest: Path) -> Path:
    shutil.copytree(runs / name, dest, ignore=shutil.ignore_patterns("*.lock", "latest"))
    return dest


def _rewrite(run_dir: Path, edit) -> None:
    """Change the checkpoint's state with ``edit(state)`` and write it back as ppokit would (valid checksum)."""
    path = run_dir / CHECKPOINT_NAME
    state = load_checkpoint(path)
    del state["format"], state["version"]
    edit(state)
    save_checkpoint(path, state, finite=())


def _out(capsys) -> str:
    captured = capsys.readouterr()
    # rich wraps at the console width; join the lines to read the message as the one line it is.
    return " ".join((captured.out + captured.err).split())


def _cli(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    # `python -m` puts cwd on sys.path, so an evilmod.py in cwd is importable: the worst case for the loader.
    return subprocess.run([sys.executable, "-m", "ppokit.cli", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=300, env={**__import__("os").environ, "COLUMNS": "400"})


# ------------------------------------------------------------------ 1. no import a checkpoint alone names
@pytest.mark.slow  # subprocesses: seconds each; CI runs it
def test_eval_and_resume_never_import_a_module_the_checkpoint_names(runs, tmp_path, monkeypatch, fresh_evilmod):
    run_dir = _copy(runs, "cartpole", tmp_path / "run")
    (tmp_path / "evilmod.py").write_text(EVIL)
    marker = tmp_path / "pwned"

    def poison(state):
        state["config"]["env_id"] = "evilmod:CartPole-v1"

    _rewrite(run_dir, poison)
    toml = run_dir / "config.toml"
    toml.write_text(toml.read_text().replace('"CartPole-v1"', '"evilmod:CartPole-v1"'))

    for args in (["eval", "run", "--episodes", "1"], ["train", "--resume", "run", "--quiet"]):
        proc = _cli(args, tmp_path)
        text = proc.stdout + proc.stderr
        assert proc.returncode == 2, text
        assert "Traceback" not in text
        assert "'evilmod:CartPole-v1'" in text and "--import-module evilmod" in text
        assert not marker.exists(), f"{args[0]} imported evilmod"

    # In-process from here (as importable as under `python -m` in tmp_path): the user naming another env
    # replaces the stored one, so nothing is imported and the policy is evaluated ...
    monkeypatch.syspath_prepend(str(tmp_path))
    assert main(["eval", str(run_dir), "--episodes", "1", "--env", "CartPole-v1"]) == 0
    assert not marker.exists()
    # ... and the way out the error names works (which also shows the module was there to be imported).
    assert main(["eval", str(run_dir), "--episodes", "1", "--import-module", "evilmod"]) == 0
    assert marker.exists()


@pytest.mark.slow  # subprocesses: seconds each; CI runs it
def test_a_config_file_never_imports_a_module_and_import_module_opens_config_and_resume(runs, tmp_path):
    """A --config file is a file too: its module:Env id is refused unless the user names the module."""
    (tmp_path / "evilmod.py").write_text(EVIL + "import gymnasium\ngymnasium.register('Evil-v0', "
                                         "entry_point='gymnasium.envs.classic_control:CartPoleEnv', "
                                         "max_episode_steps=50)\n")
    marker = tmp_path / "pwned"
    (tmp_path / "evil.toml").write_text('env_id = "evilmod:Evil-v0"\nnum_envs = 2\nnum_steps = 16\n'
                                        'num_minibatches = 2\nupdate_epochs = 1\ntotal_timesteps = 64\n'
                                        'tensorboard = false\n')
    proc = _cli(["train", "--config", "evil.toml", "--run-dir", "r1", "--quiet"], tmp_path)
    text = proc.stdout + proc.stderr
    assert proc.returncode == 2, text
    assert "Traceback" not in text and "--import-module evilmod" in text
    assert not marker.exists(), "a --config file imported its env id's module"

    # Named by the user: the module is imported, the run trains, and its resume needs the same permission.
    proc = _cli(["train", "--config", "evil.toml", "--run-dir", "r1", "--quiet", "--import-module", "evilmod"],
                tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert marker.exists()
    marker.unlink()
    proc = _cli(["train", "--resume", "r1", "--total-timesteps", "128", "--quiet"], tmp_path)
    assert proc.returncode == 2 and "--import-module evilmod" in proc.stdout + proc.stderr
    assert not marker.exists()
    proc = _cli(["train", "--resume", "r1", "--total-timesteps", "128", "--quiet", "--import-module", "evilmod"],
                tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert marker.exists()


def test_a_stored_this_module_is_refused_without_printing_the_zen(runs, tmp_path):
    run_dir = _copy(runs, "cartpole", tmp_path / "run")
    _rewrite(run_dir, lambda s: s["config"].__setitem__("env_id", "this:CartPole-v1"))
    proc = _cli(["eval", "run", "--episodes", "1"], tmp_path)
    assert proc.returncode == 2
    assert "Beautiful is better than ugly" not in proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr


def test_python_api_refuses_unless_allowed(runs, tmp_path, monkeypatch, fresh_evilmod):
    run_dir = _copy(runs, "cartpole", tmp_path / "run")
    _rewrite(run_dir, lambda s: s["config"].__setitem__("env_id", "evilmod:CartPole-v1"))
    (tmp_path / "evilmod.py").write_text(EVIL)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(CheckpointError, match=r"allow_import=\('evilmod',\)"):
        ppokit.load(run_dir)
    with pytest.raises(CheckpointError, match="evilmod"):
        resume(run_dir, console_enabled=False)
    assert not (tmp_path / "pwned").exists()
    agent = ppokit.load(run_dir, allow_import=("evilmod",))
    assert ppokit.evaluate(agent, episodes=1)["returns"]
    assert (tmp_path / "pwned").exists()


@pytest.mark.parametrize("env_id, expected", [
    ("this:Foo-v0", "module 'this' was imported but registered no env"),
    ("nosuchmodule_zz:Foo-v0", "no module named 'nosuchmodule_zz'"),
    ("a:b:Foo-v0", "malformed"),
])
def test_train_with_a_bad_module_env_id_is_one_clean_error(tmp_path, capsys, env_id, expected):
    rc = main(["train", "--env", env_id, "--run-dir", str(tmp_path / "r"), "--quiet", "--total-timesteps", "64"])
    out = _out(capsys)
    assert rc == 2
    assert expected in out and "Traceback" not in out


# ------------------------------------------------------------------ 9. checksum and finite policy
def _flip_one_data_byte(path: Path) -> None:
    """Flip the low byte of the first element of the largest tensor: torch's zip stores data uncompressed."""
    with zipfile.ZipFile(path) as zf:
        info = max((i for i in zf.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
        assert info.compress_type == zipfile.ZIP_STORED
    raw = bytearray(path.read_bytes())
    # Local header: 30 fixed bytes, then the name and the extra field; the data follows.
    name_len = int.from_bytes(raw[info.header_offset + 26: info.header_offset + 28], "little")
    extra_len = int.from_bytes(raw[info.header_offset + 28: info.header_offset + 30], "little")
    offset = info.header_offset + 30 + name_len + extra_len
    raw[offset] ^= 0x01  # a float32's least significant mantissa bit: still finite, still loads without the checksum
    path.write_bytes(bytes(raw))


def test_a_flipped_byte_is_refused(runs, tmp_path, capsys):
    run_dir = _copy(runs, "cartpole", tmp_path / "run")
    path = run_dir / CHECKPOINT_NAME
    _flip_one_data_byte(path)
    # torch itself does not notice: the damage is only visible through the checksum.
    torch.load(path, weights_only=True)
    with pytest.raises(CheckpointError, match="checksum"):
        load_checkpoint(path)
    assert main(["eval", str(run_dir), "--episodes", "1"]) == 2
    assert "checksum" in _out(capsys)
    assert main(["train", "--resume", str(run_dir), "--quiet"]) == 2
    assert "checksum" in _out(capsys)


def test_a_non_finite_policy_is_refused_on_load(runs, tmp_path, capsys):
    run_dir = _copy(runs, "cartpole", tmp_path / "run")

    def poison(state):
        for t in state["policy"].values():
            t.fill_(float("nan"))

    _rewrite(run_dir, poison)  # written with a valid checksum and an empty "finite" list, as an attacker could
    with pytest.raises(CheckpointError, match="NaN or Inf"):
        ppokit.load(run_dir)
    assert main(["eval", str(run_dir), "--episodes", "1"]) == 2
    out = _out(capsys)
    assert "state['policy']" in out and "NaN or Inf" in out
    assert main(["train", "--resume", str(run_dir), "--quiet"]) == 2


def test_version_1_checkpoints_load_with_a_warning_and_v2_needs_its_checksum(runs, tmp_path):
    run_dir = _copy(runs, "cartpole", tmp_path / "run")
    path = run_dir / CHECKPOINT_NAME
    state = load_checkpoint(path)
    torch.save({**state, "version": 1}, path)  # what ppokit 0.1 wrote: no checksum, no "finite"
    with pytest.warns(CheckpointWarning, match="version-1"):
        agent = ppokit.load(run_dir)
    assert ppokit.evaluate(agent, episodes=1)["returns"]
    torch.save({**state, "version": 2}, path)  # a version-2 file stripped of its checksum
    with pytest.raises(CheckpointError, match="without a checksum"):
        load_checkpoint(path)


# ------------------------------------------------------------------ 7. bad checkpoints: one line, exit 2
@pytest.mark.parametrize("key", ["policy", "policy_spec", "config", "optimizer", "loop", "rng", "global_step"])
def test_missing_keys_are_a_clear_error_for_eval_and_resume(runs, tmp_path, capsys, key):
    run_dir = _copy(runs, "cartpole", tmp_path / "run")
    _rewrite(run_dir, lambda s: s.pop(key))
    commands = [["train", "--resume", str(run_dir), "--quiet", "--total-timesteps", "128"]]
    if key in ("policy", "policy_spec", "config"):  # what evaluation needs
        commands.append(["eval", str(run_dir), "--episodes", "1"])
    for args in commands:
        assert main(args) == 2, args
        out = _out(capsys)
        assert repr(key) in out and "Traceback" not in out


def test_an_unknown_stored_config_key_is_a_clear_error(runs, tmp_path, capsys):
    run_dir = _copy(runs, "cartpole", tmp_path / "run")
    _rewrite(run_dir, lambda s: s["config"].__setitem__("bogus_field", 1))
    for args in (["eval", str(run_dir), "--episodes", "1"], ["train", "--resume", str(run_dir), "--quiet"]):
        assert main(args) == 2
        out = _out(capsys)
        assert "bogus_field" in out and "stored config" in out


def test_eval_on_an_env_with_other_spaces_names_both(runs, tmp_path, capsys):
    cartpole = _copy(runs, "cartpole", tmp_path / "cartpole")
    pendulum = _copy(runs, "pendulum", tmp_path / "pendulum")
    assert main(["eval", str(cartpole), "--env", "Acrobot-v1", "--episodes", "1"]) == 2
    out = _out(capsys)
    assert "Acrobot-v1 does not match the trained policy" in out
    assert "Discrete(2)" in out and "Discrete(3)" in out and "(4,)" in out and "(6,)" in out
    # A continuous policy on a discrete env.
    assert main(["eval", str(pendulum), "--env", "CartPole-v1", "--episodes", "1"]) == 2
    out = _out(capsys)
    assert "CartPole-v1 does not match" in out and "Discrete(2)" in out and "Box(-2.0, 2.0, (1,), float32)" in out
    with pytest.raises(ValueError, match="does not match"):
        ppokit.evaluate(ppokit.load(pendulum), env_id="CartPole-v1", episodes=1)


def test_resuming_a_checkpoint_whose_policy_does_not_fit_its_env(runs, tmp_path, capsys):
    run_dir = _copy(runs, "cartpole", tmp_path / "run")
    _rewrite(run_dir, lambda s: s["config"].__setitem__("env_id", "Acrobot-v1"))
    assert main(["train", "--resume", str(run_dir), "--quiet"]) == 2
    out = _out(capsys)
    assert "holds a policy for 4 observation features, discrete actions [2]" in out
    assert "6 observation features, discrete actions [3]" in out
    # A policy tensor of the wrong shape for its own spec.
    _rewrite(run_dir, lambda s: (s["config"].__setitem__("env_id", "CartPole-v1"),
                                 s["policy"].__setitem__("actor.0.weight", torch.zeros(3, 3))))
    assert main(["eval", str(run_dir), "--episodes", "1"]) == 2
    assert "does not fit its policy_spec" in _out(capsys)
    assert main(["train", "--resume", str(run_dir), "--quiet"]) == 2
    assert "cannot be resumed" in _out(capsys)


@pytest.mark.parametrize("exc, shown", [
    (OSError(28, "No space left on device"), "No space left on device (errno 28 ENOSPC; the disk is full)"),
    (PermissionError(13, "Permission denied"), "Permission denied (errno 13 EACCES"),
    (RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 1152 vs 1040"),
     "[enforce fail at inline_container.cc:672]"),
])
def test_a_failed_save_keeps_the_previous_checkpoint_and_exits_non_zero(tmp_path, capsys, monkeypatch, exc, shown):
    # Tests run as root, where chmod cannot make a directory unwritable: the failure is injected into torch.save.
    real_save, calls = torch.save, []

    def failing_save(obj, f, *args, **kwargs):
        calls.append(1)
        if len(calls) > 1:
            f.write(b"PK\x03\x04 half a checkpoint")
            raise exc
        return real_save(obj, f, *args, **kwargs)

    monkeypatch.setattr(torch, "save", failing_save)
    run_dir = tmp_path / "run"
    rc = main(["train", "--env", "CartPole-v1", "--num-envs", "2", "--num-steps", "16", "--num-minibatches", "2",
               "--total-timesteps", "128", "--save-every", "1", "--run-dir", str(run_dir), "--quiet",
               "--no-tensorboard"])
    monkeypatch.undo()
    out = _out(capsys)
    assert rc != 0
    assert f"could not write the checkpoint {run_dir / CHECKPOINT_NAME}" in out and shown in out
    assert "previous checkpoint is unchanged" in out and "Traceback" not in out
    assert load_checkpoint(run_dir / CHECKPOINT_NAME)["update"] == 1
    assert not list(run_dir.glob(".*.tmp"))



# ------------------------------------------------------------------ eval's missing-dependency message
@pytest.mark.parametrize("text, package", [
    ('pygame is not installed, run `pip install "gymnasium[classic-control]"`', "pygame"),
    ('MoviePy is not installed, run `pip install "gymnasium[other]"`', "moviepy"),
])
def test_eval_names_the_missing_dependency_and_keeps_its_brackets(runs, tmp_path, capsys, monkeypatch, text, package):
    import gymnasium as gym

    run_dir = _copy(runs, "cartpole", tmp_path / "run")

    def missing(*args, **kwargs):
        raise gym.error.DependencyNotInstalled(text)

    # Gymnasium's recorder is what raises this when the package is absent: simulate its absence there.
    monkeypatch.setattr(gym.wrappers, "RecordVideo", missing)
    assert main(["eval", str(run_dir), "--episodes", "1", "--video", str(tmp_path / "v")]) == 2
    out = _out(capsys)
    assert out.startswith(f"error: {package} is not installed (pip install 'ppokit[video]')")
    # Rich markup would swallow "[classic-control]" and "[video]" unless escaped.
    assert text.split("run ")[1] in out
    if package == "pygame":
        assert "moviepy" not in out
