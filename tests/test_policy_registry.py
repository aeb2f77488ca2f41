"""The policy registry: every registered policy type survives save -> load with identical actions; a checkpoint of
the previous release (no "type" in its policy spec) still loads and resumes as an ActorCritic; an unknown type is
refused with a message naming it and this version; observation normalization touches only float vector parts.

``tests/data/release_58adec1/`` was written by ppokit at commit 58adec1 (the release before the registry)::

    git archive 58adec1 src | tar -x -C /tmp/old
    PYTHONPATH=/tmp/old/src python3 -c "..."   # cartpole preset, 512 steps, 2 envs x 128, seed 3, hidden [8]

``expected.json`` holds that release's greedy actions and values for 16 fixed observations.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium import spaces

import ppokit
from ppokit.cli import main
from ppokit.config.ppo_config import ConfigError, load_preset
from ppokit.policies import (
    ActorCritic,
    Policy,
    PolicySpecError,
    build_policy,
    policy_from_spec,
    policy_types,
    register_policy,
)
from ppokit.policies.encoder_networks import EncoderActorCritic
from ppokit.rollout.normalize import ObsNormalizer, PartsObsNormalizer
from ppokit.runtime import checkpoint as ckpt
from ppokit.training.trainer import Trainer

RELEASE = Path(__file__).resolve().parent / "data" / "release_58adec1"


class _Cue(gym.Env):
    """A Box(3) vector observation (or, with ``image``, a 3x36x36 uint8 image); 2 actions; 8-step episodes."""

    def __init__(self, image: bool = False):
        self.image = image
        self.observation_space = spaces.Box(0, 255, (3, 36, 36), np.uint8) if image \
            else spaces.Box(-1.0, 1.0, (3,), np.float32)
        self.action_space = spaces.Discrete(2)

    def _obs(self):
        return self.observation_space.sample()

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.observation_space.seed(seed)
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        self.t += 1
        return self._obs(), float(action), False, self.t >= 8, {}


class _DictCue(gym.Env):
    """Dict observation: constant pixels (value 77), a float vector ``cue`` of scale ~5 around 3, a one-hot
    ``phase``. Lets a test see exactly which parts observation normalization touches."""

    observation_space = spaces.Dict({"pixels": spaces.Box(0, 255, (1, 36, 36), np.uint8),
                                     "cue": spaces.Box(-50.0, 50.0, (2,), np.float32),
                                     "phase": spaces.Discrete(3)})
    action_space = spaces.Discrete(2)

    def _obs(self):
        cue = (3.0 + 5.0 * self.np_random.normal(size=2)).astype(np.float32)
        return {"pixels": np.full((1, 36, 36), 77, np.uint8), "cue": cue, "phase": self.t % 3}

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        self.t += 1
        return self._obs(), float(action), False, self.t >= 8, {}


def _tiny(**overrides):
    cfg = load_preset("gridworld")
    cfg.total_timesteps, cfg.num_envs, cfg.num_steps, cfg.seed = 128, 2, 32, 0
    cfg.hidden_sizes, cfg.tensorboard = [16], False
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


# One env per registered type: a new type must add its case here, or the round-trip test fails.
CASES = {"actor_critic": lambda: _Cue(image=False), "encoder_actor_critic": lambda: _Cue(image=True),
         "recurrent_actor_critic": lambda: _Cue(image=False)}
CONFIGS = {"recurrent_actor_critic": {"recurrent": "lstm", "recurrent_hidden": 8}}  # what builds the type


def test_every_registered_type_has_a_round_trip_case():
    assert set(policy_types()) == set(CASES)


@pytest.mark.parametrize("type_name", sorted(CASES))
def test_every_registered_type_round_trips_with_identical_actions(type_name, tmp_path):
    factory = CASES[type_name]
    run = ppokit.train(_tiny(**CONFIGS.get(type_name, {})), run_dir=tmp_path / "r", console_enabled=False,
                       env=factory)
    assert run.policy.spec()["type"] == type_name and isinstance(run.policy, Policy)
    agent = ppokit.load(run.run_dir, env=factory)
    assert type(agent.policy) is type(run.policy) and agent.policy.spec() == run.policy.spec()
    for (name, a), (_, b) in zip(run.policy.state_dict().items(), agent.policy.state_dict().items()):
        assert torch.equal(a, b), name
    env = factory()
    obs = np.stack([env.observation_space.sample() for _ in range(32)])
    x = torch.as_tensor(obs)
    with torch.inference_mode():
        greedy = run.policy.actor(x).argmax(-1).numpy()  # a recurrent policy's: from a fresh state
        values = run.policy.value(x).numpy()
    if run.policy.initial_state(1) is None:
        np.testing.assert_array_equal(agent.act(obs), greedy)
    else:
        assert np.array_equal(agent.predict(obs, None, np.ones(32, bool), deterministic=True)[0], greedy)
    np.testing.assert_array_equal(agent.value(obs), values)
    # The spec alone rebuilds the same class (fresh weights: load the state dict next).
    assert type(policy_from_spec(run.policy.spec())) is type(run.policy)


def test_a_previous_release_checkpoint_loads_as_an_actor_critic_with_its_actions(tmp_path):
    with pytest.warns(ckpt.CheckpointWarning, match="version-1"):
        raw = ckpt.load_checkpoint(RELEASE / "checkpoint.pt")
    assert "type" not in raw["policy_spec"]  # written before the registry
    expected = json.loads((RELEASE / "expected.json").read_text())
    with pytest.warns(ckpt.CheckpointWarning):
        agent = ppokit.load(RELEASE / "checkpoint.pt")
    assert type(agent.policy) is ActorCritic and agent.policy.spec()["type"] == "actor_critic"
    obs = np.asarray(expected["obs"], dtype=np.float32)
    # The greedy actions exactly (the closest pair of logits is 3e-3 apart); the values within a tolerance another
    # CPU's float kernels satisfy (they differ from the 7th digit on), far below what a wrong load would change.
    assert agent.act(obs).tolist() == expected["actions"]
    np.testing.assert_allclose(agent.value(obs), expected["values"], rtol=1e-4, atol=1e-5)


def test_a_previous_release_run_resumes(tmp_path):
    run_dir = tmp_path / "old"
    shutil.copytree(RELEASE, run_dir)
    (run_dir / "expected.json").unlink()
    with pytest.warns(ckpt.CheckpointWarning):
        run = ppokit.resume(run_dir, total_timesteps=1024, console_enabled=False)
    assert run.global_step == 1024 and type(run.policy) is ActorCritic
    assert ckpt.load_checkpoint(run_dir / "checkpoint.pt")["policy_spec"]["type"] == "actor_critic"


def _with_spec(tmp_path: Path, spec_update: dict) -> Path:
    with pytest.warns(ckpt.CheckpointWarning):
        state = ckpt.load_checkpoint(RELEASE / "checkpoint.pt")
    state = {k: v for k, v in state.items() if k not in ("format", "version")}
    state["policy_spec"] = {**state["policy_spec"], **spec_update}
    path = tmp_path / "checkpoint.pt"
    ckpt.save_checkpoint(path, state)
    return path


def test_an_unknown_policy_type_is_refused_naming_it_and_this_version(tmp_path, capsys):
    path = _with_spec(tmp_path, {"type": "transformer_v9"})
    with pytest.raises(ckpt.CheckpointError, match=rf"policy type 'transformer_v9' is not known to ppokit "
                                                   rf"{ppokit.__version__} \(known: actor_critic, "
                                                   r"encoder_actor_critic, recurrent_actor_critic\)"):
        ppokit.load(path)
    capsys.readouterr()
    assert main(["eval", str(path), "--episodes", "1"]) == 2
    captured = capsys.readouterr()
    assert "transformer_v9" in captured.err and "Traceback" not in captured.err + captured.out


def test_a_spec_its_class_refuses_is_a_clear_error(tmp_path):
    with pytest.raises(PolicySpecError, match="does not fit ActorCritic"):
        policy_from_spec({"type": "actor_critic", "obs_dim": 4, "kind": "discrete", "action_dims": [2],
                          "hidden_sizes": [8], "layers": 3})
    with pytest.raises(ckpt.CheckpointError, match="cannot be loaded.*does not fit ActorCritic"):
        ppokit.load(_with_spec(tmp_path, {"depth": 2}))


def test_register_policy_names_a_class_once():
    class Wide(ActorCritic):
        def spec(self):
            return {**super().spec(), "type": "test_wide"}

    try:
        register_policy("test_wide", Wide)
        register_policy("test_wide", Wide)  # the same class again is fine
        with pytest.raises(ValueError, match="already registered to"):
            register_policy("test_wide", ActorCritic)
        policy = Wide(4, "discrete", [2], [8])
        rebuilt = policy_from_spec(policy.spec())
        assert type(rebuilt) is Wide and rebuilt.spec() == policy.spec()
    finally:
        from ppokit.policies import registry as policies

        policies._POLICY_TYPES.pop("test_wide", None)


def test_build_policy_picks_the_type_from_the_observation_space():
    act = spaces.Discrete(3)
    assert type(build_policy(spaces.Box(-1, 1, (5,)), act, [8], "tanh")) is ActorCritic
    assert type(build_policy(spaces.Discrete(4), act, [8], "tanh")) is ActorCritic  # one-hot, still flat
    # A 2-D or non-uint8 Box stays a flattened MLP input, as before images had a CNN.
    assert type(build_policy(spaces.Box(0, 255, (40, 40), np.uint8), act, [8], "tanh")) is ActorCritic
    assert type(build_policy(spaces.Box(0, 1, (3, 40, 40), np.float32), act, [8], "tanh")) is ActorCritic
    frames = build_policy(spaces.Box(0, 255, (4, 84, 84), np.uint8), act, [8], "tanh")  # an Atari frame stack
    assert type(frames) is EncoderActorCritic and frames.trunk.cnns[0].convs[0].in_channels == 4
    assert type(build_policy(_DictCue.observation_space, act, [8], "tanh")) is EncoderActorCritic


# ------------------------------------------------------------------------------ observation normalization
def test_obs_normalization_touches_only_the_float_vector_parts(tmp_path):
    cfg = _tiny(normalize_obs=True, total_timesteps=256)
    trainer = Trainer(cfg, run_dir=tmp_path / "r", console_enabled=False, env=_DictCue)
    assert isinstance(trainer.obs_norm, PartsObsNormalizer) and set(trainer.obs_norm.parts) == {"cue"}
    run = trainer.run()
    buf = trainer.buffer.obs
    assert buf["pixels"].dtype == torch.uint8 and bool((buf["pixels"] == 77).all())  # the raw bytes
    np.testing.assert_array_equal(buf["phase"].sum(-1).numpy(), 1.0)  # one-hot codes stay codes
    rms = trainer.obs_norm.parts["cue"].rms
    assert abs(float(rms.mean.mean()) - 3.0) < 1.0 and abs(float(rms.std.mean()) - 5.0) < 1.0
    # The cue as stored is standardized: mean ~0 and std ~1 where the raw one is ~3 and ~5.
    assert abs(float(buf["cue"].mean())) < 0.3 and abs(float(buf["cue"].std()) - 1.0) < 0.3
    # Saved, loaded and applied (frozen) by the agent, to the cue only.
    agent = ppokit.load(run.run_dir, env=_DictCue)
    assert isinstance(agent.obs_norm, PartsObsNormalizer) and agent.obs_norm.frozen
    torch.testing.assert_close(agent.obs_norm.parts["cue"].rms.mean, rms.mean)
    obs = _DictCue().observation_space.sample()
    x, single = agent._obs(obs)
    assert single and torch.equal(x["pixels"], torch.as_tensor(obs["pixels"])[None])
    expected = trainer.obs_norm.parts["cue"].normalize(torch.as_tensor(obs["cue"])[None])
    torch.testing.assert_close(x["cue"], expected)


def test_a_flat_box_keeps_its_single_normalizer(tmp_path):
    trainer = Trainer(_tiny(normalize_obs=True), run_dir=tmp_path / "r", console_enabled=False, env=_Cue)
    assert type(trainer.obs_norm) is ObsNormalizer and trainer.obs_norm.shape == (3,)


def test_normalize_obs_is_refused_for_a_pure_image(tmp_path):
    with pytest.raises(ConfigError, match=r"normalize_obs.*is an image \(uint8 pixels"):
        ppokit.train(_tiny(normalize_obs=True), run_dir=tmp_path / "r", console_enabled=False,
                     env=lambda: _Cue(image=True))


def test_resuming_with_an_env_of_another_observation_kind_names_both_policies(tmp_path):
    run = ppokit.train(_tiny(), run_dir=tmp_path / "r", console_enabled=False, env=lambda: _Cue(image=True))
    with pytest.raises(ckpt.CheckpointError, match=r"holds a policy for 3888 observation features, discrete actions "
                                                   r"\[2\] \(image observations, encoder_actor_critic\), but .* needs "
                                                   r"one for 3 observation features"):
        ppokit.resume(run.run_dir, total_timesteps=256, console_enabled=False, env=_Cue)
