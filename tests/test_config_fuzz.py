"""Bad config values, from the command line and from TOML files: each is refused before anything trains, with exit
code 2, one message naming the field, and no traceback. Then the decisions around them: strict types, what a
resume accepts, the planner's config for a bare ``--env``, resource limits, and the small CLI conveniences.

The table runs through ``ppokit.cli.main`` in-process (fast); a representative subset also runs the real
``python -m ppokit.cli`` in a subprocess, where a traceback would really reach the user.
"""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys

import pytest
import torch

import ppokit.config.resources
from ppokit.cli import main
from ppokit.config.ppo_config import ConfigError, PPOConfig, load_preset
from ppokit.config.resources import check_memory, estimate_memory, usable_threads

LONG_NAME = "x" * 300
NUMBERS_NOT_INTS = ["1e999", "-1e999", "nan", "1.5", "abc", ""]

# (field named in the error, flag, value): command-line text, the way a user types it.
CLI_CASES = [
    ("env_id", "--env", ""),
    *[("num_envs", "--num-envs", v) for v in ["0", "-1", *NUMBERS_NOT_INTS, "1000000000"]],
    ("vector_mode", "--vector-mode", "parallel"),
    # env_kwargs: a JSON object of identifier keys and plain values (numbers, strings, bools, lists).
    *[("env_kwargs", "--env-kwargs", v) for v in ["{", "map_name=8x8", "[1, 2]", '"8x8"', "null", "{'a': 1}",
                                                   '{"a": null}', '{"a": {"b": 1}}', '{"a": NaN}', '{"a": 1e999}',
                                                   '{"map-name": 1}', '{"": 1}', '{"a": [1, null]}',
                                                   '{"a": 1' + "0" * 30 + "}"]],
    *[("num_steps", "--num-steps", v) for v in ["0", "1e999", "2.5", "1000000000"]],
    *[("total_timesteps", "--total-timesteps", v) for v in ["0", "-5", "1e999", "1e-3", "ten", "1e30"]],
    *[("learning_rate", "--learning-rate", v) for v in ["nan", "inf", "-1", "1e308", "2", "abc"]],
    *[("gamma", "--gamma", v) for v in ["0", "1.5", "nan", "-inf"]],
    *[("gae_lambda", "--gae-lambda", v) for v in ["-0.1", "2", "inf"]],
    *[("algo", "--algo", v) for v in ["sarsa", "PPO"]],
    *[("num_minibatches", "--num-minibatches", v) for v in ["0", "3", "1e999", "true"]],
    *[("update_epochs", "--update-epochs", v) for v in ["0", "31", "1e999"]],
    *[("recurrent_seq_len", "--recurrent-seq-len", v) for v in ["-1", "100000", "2.5"]],
    *[("clip_coef", "--clip-coef", v) for v in ["0", "-0.2", "0.35", "1e308"]],
    *[("ent_coef", "--ent-coef", v) for v in ["1e308", "-1", "nan", "1001"]],
    *[("vf_coef", "--vf-coef", v) for v in ["1e308", "-0.5"]],
    *[("max_grad_norm", "--max-grad-norm", v) for v in ["0", "-1", "inf", "1e308"]],
    *[("target_kl", "--target-kl", v) for v in ["1e308", "nan", "-0.01", "0", "x"]],
    *[("init_kl_beta", "--init-kl-beta", v) for v in ["0", "1e308"]],
    *[("kl_target", "--kl-target", v) for v in ["0", "1e999"]],
    *[("hidden_sizes", "--hidden-sizes", v) for v in ["64 64", "", "0", "-64", "1.5", "64,abc", "1e999", "2000000"]],
    ("activation", "--activation", "sigmoid"),
    *[("recurrent", "--recurrent", v) for v in ["rnn", "LSTM", ""]],
    *[("recurrent_hidden", "--recurrent-hidden", v) for v in ["0", "1e999", "100000", "64.5"]],
    *[("recurrent_critic", "--recurrent-critic", v) for v in ["both", "true"]],
    *[("actors", "--actors", v) for v in ["-1", "2.5", "1000000"]],
    *[("max_policy_lag", "--max-policy-lag", v) for v in ["-1", "1.5"]],
    *[("actor_timeout", "--actor-timeout", v) for v in ["-1", "nan", "1e999", "x"]],
    *[("actor_clip", "--actor-clip", v) for v in ["ppo", "Proximal", ""]],
    ("ray_address", "--ray-address", "auto"),  # refused: Ray places actors, and --actors is 0 here
    *[("seed", "--seed", v) for v in ["-1", "1e999", "4294967296", "1.5"]],
    *[("device", "--device", v) for v in ["cudax", "gpu", "", "cuda:99", "CPU"]],
    *[("torch_threads", "--torch-threads", v) for v in ["0", "1e999", "-2"]],
    *[("dist_timeout", "--dist-timeout", v) for v in ["0", "-5", "nan", "1e999"]],
    *[("env_timeout", "--env-timeout", v) for v in ["-5", "nan", "1e999", "1e7", "soon"]],
    *[("run_dir", "--run-dir", v) for v in ["/dev/null", "{tmp}/a_file", "{tmp}/a_file/below", LONG_NAME,
                                             "{tmp}/" + LONG_NAME + "/x"]],
    *[("log_every", "--log-every", v) for v in ["0", "1e999"]],
    *[("save_every", "--save-every", v) for v in ["0", "-1"]],
    *[("eval_every", "--eval-every", v) for v in ["-1", "1e999"]],
    *[("eval_threshold", "--eval-threshold", v) for v in ["5", "nan"]],  # 5 without --eval-every
    *[("eval_episodes", "--eval-episodes", v) for v in ["0", "1e999", "100000000000"]],
]

# (field, TOML line): values a file can hold but the field's type does not allow.
TOML_CASES = [
    *[("env_id", f"env_id = {v}") for v in ["5", "true", '""']],
    *[("num_envs", f"num_envs = {v}") for v in ['"12"', "true", "1.5", "[4]", "1e999", "nan"]],
    ("vector_mode", "vector_mode = 1"),
    *[("env_kwargs", f"env_kwargs = {v}") for v in ['"{}"', '\'{"is_slippery": false}\'', "[1]", "5",
                                                     "{ a = { b = 1 } }", '{ "map-name" = 1 }', "{ a = [{ b = 1 }] }",
                                                     "{ a = nan }", "{ a = 1979-05-27 }"]],
    ("env_kwargs", "[env_kwargs]\nmap_name = { size = 8 }"),
    *[("normalize_obs", f"normalize_obs = {v}") for v in ['"yes"', "1", "0.0"]],
    ("normalize_reward", 'normalize_reward = "true"'),
    *[("num_steps", f"num_steps = {v}") for v in ['"128"', "false"]],
    *[("total_timesteps", f"total_timesteps = {v}") for v in ['"1e5"', "true", "1e999"]],
    *[("learning_rate", f"learning_rate = {v}") for v in ['"0.001"', "true", "1" + "0" * 400]],
    *[("anneal_lr", f"anneal_lr = {v}") for v in ['"no"', "1"]],
    ("anneal_clip", 'anneal_clip = "off"'),
    *[("gamma", f"gamma = {v}") for v in ["true", '"0.99"']],
    ("gae_lambda", "gae_lambda = false"),
    *[("norm_adv", f"norm_adv = {v}") for v in ['"false"', "0", "false"]],  # false: the guard rail
    ("algo", "algo = 1"),
    ("num_minibatches", "num_minibatches = true"),
    ("update_epochs", "update_epochs = 4.5"),
    ("recurrent_seq_len", "recurrent_seq_len = true"),
    *[("actors", f"actors = {v}") for v in ['"2"', "true"]],
    ("max_policy_lag", 'max_policy_lag = "8"'),
    ("actor_timeout", 'actor_timeout = "600"'),
    *[("ray_address", f"ray_address = {v}") for v in ["1", "[]"]],
    ("clip_coef", 'clip_coef = "0.2"'),
    ("clip_vloss", 'clip_vloss = "yes"'),
    ("ent_coef", "ent_coef = true"),
    ("vf_coef", 'vf_coef = "0.5"'),
    ("max_grad_norm", "max_grad_norm = true"),
    *[("target_kl", f"target_kl = {v}") for v in ["true", '"x"', "-1", "0", "inf"]],
    ("init_kl_beta", "init_kl_beta = false"),
    ("kl_target", "kl_target = true"),
    *[("hidden_sizes", f"hidden_sizes = {v}") for v in ["[1.5]", "[true]", "[]", '"64,64"', "[0]", "64", '["64"]']],
    ("activation", "activation = 1"),
    *[("ortho_init", f"ortho_init = {v}") for v in ['"no"', "0"]],
    ("recurrent", "recurrent = true"),
    *[("monitor_kl", f"monitor_kl = {v}") for v in ['"true"', "false"]],  # false: the guard rail
    ("monitor_clipfrac", "monitor_clipfrac = 1"),
    *[("unsafe", f"unsafe = {v}") for v in ['"yes"', "1"]],
    *[("seed", f"seed = {v}") for v in ["true", '"1"', "99999999999999999999999"]],
    ("device", "device = 0"),
    ("torch_threads", "torch_threads = true"),
    ("fused_update", 'fused_update = "on"'),
    *[("run_dir", f"run_dir = {v}") for v in ["[]", "true", "{}", "5"]],
    ("log_every", 'log_every = "10"'),
    ("save_every", "save_every = 2.5"),
    ("tensorboard", 'tensorboard = "false"'),
    ("track", 'track = "yes"'),
    *[("wandb_project", f"wandb_project = {v}") for v in ["5", '""']],
    ("wandb_entity", "wandb_entity = true"),
    ("capture_video", 'capture_video = "on"'),
    *[("video_every", f"video_every = {v}") for v in ["0", "2.5", '"10"']],
    ("eval_every", "eval_every = true"),
    *[("eval_threshold", f"eval_threshold = {v}") for v in ["true", '"500"']],
    ("eval_episodes", "eval_episodes = false"),
    *[("eval_deterministic", f"eval_deterministic = {v}") for v in ['"no"', "1"]],
    # The file itself: an unknown key or table, a key beside [ppo] that would be ignored.
    ("foo", "foo = 1"),
    ("extra", "[extra]\nx = 1"),
    ("gamma", "gamma = 0.9\n[ppo]\nnum_envs = 4"),
]


def _train(argv: list[str], tmp_path, capsys) -> tuple[int, str]:
    run_dir = tmp_path / "run"
    try:
        rc = main(["train", "--preset", "gridworld", "--run-dir", str(run_dir), "--quiet", "--no-tensorboard", *argv])
    except SystemExit as exc:  # argparse
        rc = exc.code
    err = capsys.readouterr().err
    # Refused before anything was written (the run dir given in a case may be the bad one; this one is the default).
    assert not run_dir.exists()
    return rc, " ".join(err.split())


def test_the_table_covers_every_config_field_with_over_100_values():
    named = {f for f, *_ in CLI_CASES} | {f for f, _ in TOML_CASES}
    assert set(PPOConfig.field_names()) <= named
    assert len(CLI_CASES) + len(TOML_CASES) >= 100


@pytest.mark.parametrize("field,flag,value", CLI_CASES, ids=[f"{f}={v[:12]}" for f, _, v in CLI_CASES])
def test_bad_flag_value_is_a_clear_error(field, flag, value, tmp_path, capsys):
    (tmp_path / "a_file").write_text("not a directory")
    # --flag=value: argparse would take "-1e999" after a space for an option.
    rc, err = _train([f"{flag}={value.replace('{tmp}', str(tmp_path))}"], tmp_path, capsys)
    assert rc == 2, err
    assert f"'{field}'" in err and "Traceback" not in err, err


@pytest.mark.parametrize("field,line", TOML_CASES, ids=[f"{f}:{ln[:16]}" for f, ln in TOML_CASES])
def test_bad_toml_value_is_a_clear_error(field, line, tmp_path, capsys):
    path = tmp_path / "c.toml"
    path.write_text(line + "\n")
    rc, err = _train(["--config", str(path)], tmp_path, capsys)
    assert rc == 2, err
    assert f"'{field}'" in err and "Traceback" not in err, err


@pytest.mark.parametrize("content", [os.urandom(256) + b"\xff\xfe", b"PK\x03\x04" + bytes(range(256))],
                         ids=["random-bytes", "zip-like-checkpoint"])
def test_binary_config_file_is_refused(content, tmp_path, capsys):
    path = tmp_path / "checkpoint.pt"
    path.write_bytes(content)
    rc, err = _train(["--config", str(path)], tmp_path, capsys)
    assert rc == 2 and "'config'" in err and "not a UTF-8 TOML file" in err, err


# A subset through the real console entry point: a traceback here is what a user would see.
SUBPROCESS_CASES = [
    ("num_envs", ["--num-envs", "1e999"]),  # OverflowError before
    ("device", ["--device", "cudax"]),  # RuntimeError from torch.device before
    ("run_dir", ["--run-dir", "/dev/null"]),  # NotADirectoryError before
]


def test_the_real_cli_prints_one_error_line_and_exits_2(tmp_path):
    env = {**os.environ, "COLUMNS": "200"}
    for field, argv in SUBPROCESS_CASES:
        proc = subprocess.run([sys.executable, "-m", "ppokit.cli", "train", "--preset", "gridworld", "--quiet", *argv],
                              capture_output=True, text=True, cwd=tmp_path, env=env, timeout=120)
        assert proc.returncode == 2, (argv, proc.stderr)
        assert f"'{field}'" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (tmp_path / "runs").exists()


# ------------------------------------------------------------------ strict types, decided
def test_command_line_text_still_parses():
    cfg = PPOConfig.from_dict({"total_timesteps": "1e5", "hidden_sizes": "64, 32", "num_envs": "8",
                               "target_kl": "none", "normalize_obs": "true"})
    assert cfg.total_timesteps == 100_000 and cfg.hidden_sizes == [64, 32] and cfg.num_envs == 8
    assert cfg.target_kl is None and cfg.normalize_obs is True
    assert PPOConfig.from_dict({"hidden_sizes": "64,64"}).hidden_sizes == [64, 64]


def test_toml_whole_floats_are_ints_and_ints_are_floats(tmp_path):
    path = tmp_path / "c.toml"
    path.write_text("[ppo]\ntotal_timesteps = 1e5\nnum_envs = 8.0\ngamma = 1\n")
    cfg = PPOConfig.from_toml(path)
    assert (cfg.total_timesteps, cfg.num_envs, cfg.gamma) == (100_000, 8, 1.0)
    assert type(cfg.num_envs) is int and type(cfg.gamma) is float


def test_python_constructed_configs_are_type_checked_too():
    for bad in [dict(num_envs=True), dict(normalize_obs="yes"), dict(run_dir=[]), dict(target_kl=True),
                dict(hidden_sizes=[64.5]), dict(learning_rate="0.1")]:
        with pytest.raises(ConfigError) as e:
            PPOConfig(**bad).validate()
        assert e.value.field == next(iter(bad))


# ------------------------------------------------------------------ resume
@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    """One real gridworld run of one batch (256 steps), saved; tests copy it before resuming it."""
    run_dir = tmp_path_factory.mktemp("resume") / "run"
    assert main(["train", "--preset", "gridworld", "--total-timesteps", "256", "--run-dir", str(run_dir),
                 "--quiet", "--no-tensorboard"]) == 0
    return run_dir


def _saved_step(run_dir) -> int:
    from ppokit.runtime.checkpoint import load_checkpoint

    return int(load_checkpoint(run_dir / "checkpoint.pt")["global_step"])


def test_resume_takes_total_timesteps_written_like_a_fresh_run(trained_run, tmp_path):
    import shutil

    run_dir = shutil.copytree(trained_run, tmp_path / "run")
    assert _saved_step(run_dir) == 256
    assert main(["train", "--resume", str(run_dir), "--total-timesteps", "5.12e2", "--quiet"]) == 0
    assert _saved_step(run_dir) == 512  # 5.12e2 read as 512, as a fresh run reads it
    assert main(["train", "--resume", str(run_dir), "--quiet"]) == 0
    assert _saved_step(run_dir) == 512  # no --total-timesteps: the checkpoint's total, already reached


@pytest.mark.parametrize("argv,field", [
    (["--learning-rate", "nan"], "learning_rate"),
    (["--num-envs", "0"], "num_envs"),
    (["--num-envs", "8", "--no-normalize-obs"], "num_envs"),
    (["--preset", "cartpole"], "preset"),
    (["--total-timesteps", "1e999"], "total_timesteps"),
    (["--total-timesteps", "0"], "total_timesteps"),
])
def test_resume_refuses_every_other_flag_and_says_which_it_accepts(argv, field, trained_run, capsys):
    before = {name: (trained_run / name).read_bytes() for name in ("checkpoint.pt", "metrics.csv")}
    assert main(["train", "--resume", str(trained_run), "--quiet", *argv]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert f"'{field}'" in err and "Traceback" not in err
    if field not in ("total_timesteps",):
        assert "--resume accepts only --total-timesteps" in err
    # refused before the run was touched
    assert {name: (trained_run / name).read_bytes() for name in before} == before


# ------------------------------------------------------------------ a bare --env gets the planner's config
def _trained(argv, run_dir) -> PPOConfig:
    """Train for real with ``argv`` into ``run_dir``; the config the run saved (config.toml)."""
    assert main([*argv, "--run-dir", str(run_dir), "--no-tensorboard"]) == 0
    return PPOConfig.from_toml(run_dir / "config.toml")


def test_bare_env_trains_the_planners_config_and_says_so(tmp_path, capsys):
    from ppokit.config.planner import make_plan, planned_config

    # What a bare --env resolves to: the planner's plan at the preset's budget (100k for CartPole).
    planned, source = planned_config({"env_id": "CartPole-v1"})
    assert planned == make_plan("CartPole-v1", load_preset("cartpole").total_timesteps, probe=False).config
    assert "planner settings for CartPole-v1" in source
    # The tuned values (gamma 0.98, lambda 0.8, lr 1e-3), not the library defaults (0.99, 0.95, 2.5e-4) ...
    assert (planned.gamma, planned.gae_lambda, planned.learning_rate) == (0.98, 0.8, 1e-3)
    # ... and the CLI trains them and says so (a short run: the plan at a 512-step budget).
    saved = _trained(["train", "--env", "CartPole-v1", "--total-timesteps", "512"], tmp_path / "run")
    err = " ".join(capsys.readouterr().err.split())
    assert "config: planner settings for CartPole-v1" in err and "ppokit plan" in err
    short = planned_config({"env_id": "CartPole-v1", "total_timesteps": 512})[0]
    assert saved == dataclasses.replace(short, run_dir=str(tmp_path / "run"), tensorboard=False)


def test_flags_override_the_planned_config(tmp_path, capsys):
    cfg = _trained(["train", "--env", "CartPole-v1", "--learning-rate", "0.01", "--total-timesteps", "2048",
                    "--quiet"], tmp_path / "run")
    assert (cfg.learning_rate, cfg.total_timesteps, cfg.gamma) == (0.01, 2048, 0.98)
    assert "planner" not in capsys.readouterr().err  # --quiet


def test_unknown_env_gets_the_planners_rules_and_a_preset_or_file_is_not_replaced(tmp_path, capsys):
    import dataclasses

    cfg = _trained(["train", "--env", "ppokit/GridWorld-v0", "--total-timesteps", "4096"], tmp_path / "a")
    assert "ppokit's rules" in " ".join(capsys.readouterr().err.split())
    assert cfg.env_id == "ppokit/GridWorld-v0" and cfg.total_timesteps == 4096
    cfg = _trained(["train", "--preset", "gridworld", "--env", "ppokit/GridWorld-v0", "--total-timesteps", "512"],
                   tmp_path / "b")
    preset = dataclasses.replace(load_preset("gridworld"), total_timesteps=512, tensorboard=False,
                                 run_dir=str(tmp_path / "b"))
    assert cfg == preset and "planner" not in capsys.readouterr().err


def test_bad_flag_with_a_bare_env_is_refused_before_the_env_is_probed(tmp_path, capsys, counted_gridworld):
    env_id, made = counted_gridworld
    assert main(["train", "--env", env_id, "--num-envs", "1e999", "--run-dir", str(tmp_path / "run")]) == 2
    assert "'num_envs'" in capsys.readouterr().err
    assert len(made) == 1, "the planner probed the env of a refused command line"
    assert not (tmp_path / "run").exists()


def test_fewer_steps_than_one_batch_is_said(tmp_path, capsys):
    _trained(["train", "--preset", "gridworld", "--total-timesteps", "100", "--quiet"], tmp_path / "a")
    err = " ".join(capsys.readouterr().err.split())
    assert "warning:" in err and "total_timesteps=100 is less than one batch" in err and "256" in err
    _trained(["train", "--preset", "gridworld", "--total-timesteps", "256", "--quiet"], tmp_path / "b")
    assert "warning" not in capsys.readouterr().err


# ------------------------------------------------------------------ resources
def test_memory_estimate_refuses_what_the_machine_cannot_hold(monkeypatch):
    cfg = PPOConfig(num_envs=8, num_steps=128)
    monkeypatch.setattr(ppokit.config.resources, "available_memory", lambda device="cpu": 10 << 30)
    check_memory(cfg, obs_dim=4)  # CartPole-sized: fine
    with pytest.raises(ConfigError) as e:
        check_memory(cfg, obs_dim=10_000_000)  # 1024 transitions x 40 MB each
    assert e.value.field == "num_steps" and "GiB" in e.value.reason
    # The estimate grows with every factor the brief names: T, N, the observation size.
    assert estimate_memory(cfg, 100) > estimate_memory(cfg, 10)
    assert estimate_memory(PPOConfig(num_envs=16, num_steps=128), 10) > estimate_memory(cfg, 10)


def test_the_trainer_repeats_the_memory_check_with_the_real_observation_size(monkeypatch, tmp_path):
    from ppokit.training.trainer import train

    cfg = PPOConfig.from_dict({"run_dir": str(tmp_path / "m"), "tensorboard": False}, load_preset("gridworld"))
    # Room for a one-float observation (what validate() assumes) but not for GridWorld's real one.
    room = estimate_memory(cfg, 1) + 1
    monkeypatch.setattr(ppokit.config.resources, "available_memory", lambda device="cpu": room)
    cfg.validate()
    with pytest.raises(ConfigError) as e:
        train(cfg, console_enabled=False)
    assert e.value.field in ("num_envs", "num_steps")


def test_available_memory_reads_the_machine():
    have = ppokit.config.resources.available_memory()
    assert have is None or have > 0


def test_torch_threads_are_capped_at_the_core_count(capsys, tmp_path):
    from ppokit.training.trainer import train

    cores = os.cpu_count() or 1
    assert usable_threads(1) == 1
    assert usable_threads(10**6) == cores
    assert f"{cores} CPU cores" in capsys.readouterr().err
    cfg = PPOConfig.from_dict({"run_dir": str(tmp_path / "t"), "tensorboard": False, "total_timesteps": 256,
                               "torch_threads": 1_000_000}, load_preset("gridworld"))
    try:
        train(cfg, console_enabled=False)  # torch segfaults when asked for a million threads
        assert torch.get_num_threads() == cores
    finally:
        torch.set_num_threads(1)
    assert "using" in capsys.readouterr().err


def test_unavailable_accelerators_are_refused_by_name():
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="cuda") as e:
            PPOConfig(device="cuda").validate()
        assert e.value.field == "device"
    if not (getattr(torch.backends, "mps", None) and torch.backends.mps.is_available()):
        with pytest.raises(ConfigError, match="mps"):
            PPOConfig(device="mps").validate()


# ------------------------------------------------------------------ small conveniences
def test_version_flag(capsys):
    from ppokit import __version__

    with pytest.raises(SystemExit) as e:
        main(["--version"])
    assert e.value.code == 0
    assert capsys.readouterr().out.strip() == f"ppokit {__version__}"


def test_help_texts_show_the_real_run_dir_layout_and_every_preset(capsys, monkeypatch):
    from ppokit.config.ppo_config import list_presets
    from ppokit.training.trainer import default_run_dir

    monkeypatch.setenv("COLUMNS", "300")  # argparse would break 'cartpole-fast' at its hyphen
    name = default_run_dir(PPOConfig(env_id="CartPole-v1", algo="a2c", seed=3)).name
    assert name.startswith("CartPole-v1__a2c__s3__")
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "runs/<env>__<algo>__s<seed>__<YYYYmmdd-HHMMSS>" in capsys.readouterr().out
    for command in ("sweep", "compare"):
        with pytest.raises(SystemExit):
            main([command, "--help"])
        text = capsys.readouterr().out
        line = next(ln for ln in text.splitlines() if "--preset PRESET" in ln and "shipped" in ln)
        assert all(p in line for p in list_presets()), line


def test_sweep_refuses_an_absurd_number_of_runs_before_building_the_grid(tmp_path, capsys):
    out = tmp_path / "sw"
    assert main(["sweep", "--preset", "gridworld", "--set", "gamma=0.9,0.99", "--seeds", "5001", "--out", str(out)]) == 2
    err = " ".join(capsys.readouterr().err.split())
    assert "'seeds'" in err and "10,002 runs" in err and not out.exists()


def test_an_envpool_task_the_planner_cannot_probe_keeps_the_library_defaults():
    from ppokit.config.planner import planned_config

    # "Pong-v5" is no Gymnasium id: a probe would raise, so returning at all shows that none was made.
    config, source = planned_config({"env_id": "Pong-v5", "vector_mode": "envpool", "num_envs": "8"})
    assert config == PPOConfig(env_id="Pong-v5", vector_mode="envpool", num_envs=8)
    assert "library defaults for Pong-v5" in source


def test_an_image_observation_is_counted_in_bytes_not_floats():
    import gymnasium as gym
    import numpy as np
    import torch

    from ppokit.config.resources import layout_bytes
    from ppokit.envs.encoders import observation_encoder

    frames = observation_encoder(gym.spaces.Box(0, 255, (4, 84, 84), np.uint8)).layout()
    assert layout_bytes(frames) == 4 * 84 * 84
    assert layout_bytes(((3,), torch.float32)) == 12
    both = observation_encoder(gym.spaces.Dict({"img": gym.spaces.Box(0, 255, (3, 36, 36), np.uint8),
                                                "vec": gym.spaces.Box(-1, 1, (5,), np.float32)})).layout()
    assert layout_bytes(both) == 3 * 36 * 36 + 5 * 4
    cfg = PPOConfig(num_envs=8, num_steps=128)
    assert estimate_memory(cfg, 4 * 84 * 84, layout_bytes(frames)) < estimate_memory(cfg, 4 * 84 * 84) / 3
