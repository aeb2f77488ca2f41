"""Image observations: a uint8 image Box is stored as uint8 [C, H, W] and read by the Nature CNN, which scales the
pixels by 1/255 itself; the layout follows the channel axis; a fixed-seed image env learns through the CNN."""

from __future__ import annotations

import math

import gymnasium as gym
import numpy as np
import pytest
import torch
from gymnasium import spaces

import ppokit
from ppokit.cli import main
from ppokit.config.ppo_config import load_preset
from ppokit.envs.encoders import BoxEncoder, ImageEncoder, image_layout, observation_encoder
from ppokit.envs.errors import EnvError, check_obs_batch
from ppokit.policies import build_policy
from ppokit.policies.encoder_networks import EncoderActorCritic, NatureCNN
from ppokit.training.trainer import Trainer


class _Brightness(gym.Env):
    """A uniformly bright (200) or dark (30) image, drawn each step; action 1 pays on bright images, action 0 on
    dark ones. 8-step episodes: a random policy returns ~4, a perfect one 8."""

    def __init__(self, shape=(3, 64, 64)):
        self.observation_space = spaces.Box(0, 255, shape, np.uint8)
        self.action_space = spaces.Discrete(2)

    def _obs(self):
        self.bright = int(self.np_random.integers(2))
        return np.full(self.observation_space.shape, 200 if self.bright else 30, np.uint8)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return self._obs(), {}

    def step(self, action):
        reward = float(int(action) == self.bright)
        self.t += 1
        return self._obs(), reward, False, self.t >= 8, {}


def _config(**overrides):
    cfg = load_preset("gridworld")
    cfg.num_envs, cfg.num_steps, cfg.seed, cfg.tensorboard = 4, 64, 0, False
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


# ------------------------------------------------------------------------------------------ layout
@pytest.mark.parametrize("shape,layout", [((3, 64, 64), "chw"), ((4, 84, 84), "chw"), ((1, 40, 40), "chw"),
                                          ((64, 64, 3), "hwc"), ((84, 84, 4), "hwc"), ((40, 50, 1), "hwc"),
                                          ((10, 64, 64), None), ((64, 64), None)])
def test_the_layout_is_where_the_channel_axis_is(shape, layout):
    space = spaces.Box(0, 255, shape, np.uint8)
    assert image_layout(space) == layout
    enc = observation_encoder(space)
    assert isinstance(enc, ImageEncoder if layout else BoxEncoder)
    if layout is None:
        return
    x = np.random.default_rng(0).integers(0, 256, size=(2, *shape), dtype=np.uint8)
    out = enc.encode(x, 2)
    expected = x if layout == "chw" else x.transpose(0, 3, 1, 2)
    assert out.dtype == np.uint8 and out.flags.c_contiguous
    np.testing.assert_array_equal(out, expected)
    assert enc.layout() == (expected.shape[1:], torch.uint8)


def test_only_uint8_3d_boxes_are_images():
    assert image_layout(spaces.Box(0, 1, (3, 64, 64), np.float32)) is None
    assert image_layout(spaces.Box(0, 255, (3, 64, 64), np.int32)) is None
    assert image_layout(spaces.Box(0, 1, (3, 64, 64), np.uint8)) is None  # a 0/1 mask, not pixels: stays flat


def test_an_image_too_small_for_the_cnn_is_refused_naming_its_shape(tmp_path):
    with pytest.raises(ValueError, match=r"shape \(3, 35, 64\) \(read as \(C, H, W\): 35x64 pixels, 3 channels\) "
                                         r"is too small for the Nature CNN.*>= 36x36"):
        observation_encoder(spaces.Box(0, 255, (3, 35, 64), np.uint8))
    observation_encoder(spaces.Box(0, 255, (3, 36, 36), np.uint8))  # the smallest that fits
    with pytest.raises(ValueError, match=r"shape \(8, 8, 3\).*too small"):
        ppokit.train(_config(total_timesteps=256), run_dir=tmp_path / "r", console_enabled=False,
                     env=lambda: _Brightness((8, 8, 3)))


def test_env_checks_accept_uint8_pixels_and_refuse_other_values():
    space = spaces.Box(0, 255, (40, 40, 3), np.uint8)
    frames = np.full((2, 40, 40, 3), 9, np.uint8)
    out = check_obs_batch(frames, 2, space, "E-v0", "step()", 3)
    assert out.dtype == np.uint8 and out.shape == (2, 3, 40, 40)
    np.testing.assert_array_equal(check_obs_batch(frames.astype(np.float64), 2, space, "E-v0", "step()", 3), out)
    with pytest.raises(EnvError, match="outside the integers 0..255"):
        check_obs_batch(frames.astype(np.float64) * 40, 2, space, "E-v0", "step()", 3)


# ------------------------------------------------------------------------------------------ the network
def test_the_nature_cnn_has_the_published_architecture_and_init():
    torch.manual_seed(0)
    policy = build_policy(spaces.Box(0, 255, (4, 84, 84), np.uint8), spaces.Discrete(6), [64], "tanh")
    assert isinstance(policy, EncoderActorCritic)
    cnn = policy.trunk.cnns[0]
    convs = [m for m in cnn.convs if isinstance(m, torch.nn.Conv2d)]
    assert [(c.in_channels, c.out_channels, c.kernel_size, c.stride) for c in convs] == [
        (4, 32, (8, 8), (4, 4)), (32, 64, (4, 4), (2, 2)), (64, 64, (3, 3), (1, 1))]
    assert cnn.linear[0].in_features == 3136 and cnn.linear[0].out_features == 512  # 7x7x64 for 84x84

    def gain(weight):  # orthogonal init: the rows (or columns) are orthonormal times the gain
        w = weight.detach().reshape(weight.shape[0], -1)
        gram = w @ w.T if w.shape[0] <= w.shape[1] else w.T @ w
        g = math.sqrt(float(gram.diagonal().mean()))
        torch.testing.assert_close(gram, g * g * torch.eye(gram.shape[0]), atol=1e-4, rtol=0)
        return g

    for layer in (*convs, cnn.linear[0]):
        assert gain(layer.weight) == pytest.approx(math.sqrt(2.0), rel=1e-4) and not layer.bias.any()
    assert gain(policy.actor_head.weight) == pytest.approx(0.01, rel=1e-4)
    assert gain(policy.critic_head.weight) == pytest.approx(1.0, rel=1e-4)
    # One trunk for both heads (the Atari PPO setup): the actor and the critic share every CNN parameter.
    names = [n for n, _ in policy.named_parameters()]
    assert all(n.startswith(("trunk.", "actor_head.", "critic_head.")) for n in names)


def test_the_pixels_are_scaled_by_1_over_255_inside_the_model():
    torch.manual_seed(0)
    cnn = NatureCNN(3, 36, 36)
    pixels = torch.randint(0, 256, (5, 3, 36, 36), dtype=torch.uint8)
    # The reference applies the same layers to pixels / 255 by hand: dropping the scaling (or scaling twice)
    # inside forward() makes the two differ.
    reference = cnn.linear(cnn.convs(pixels.to(torch.float32) / 255.0))
    torch.testing.assert_close(cnn(pixels), reference, rtol=0, atol=0)
    assert not torch.allclose(cnn(pixels), cnn.linear(cnn.convs(pixels.to(torch.float32))))


# ------------------------------------------------------------------------------------------ end to end
@pytest.mark.slow
def test_a_3x64x64_image_env_learns_through_the_cnn_with_a_uint8_buffer(tmp_path):
    cfg = _config(total_timesteps=2048, learning_rate=3e-3)
    trainer = Trainer(cfg, run_dir=tmp_path / "r", console_enabled=False, env=_Brightness)
    assert isinstance(trainer.policy, EncoderActorCritic) and not trainer.fused  # autograd: no fused CNN kernel
    buf = trainer.buffer.obs
    assert buf.dtype == torch.uint8 and buf.shape == (64, 4, 3, 64, 64)  # 12 KB a step, not 48 KB of floats
    run = trainer.run()
    assert set(torch.unique(trainer.buffer.obs).tolist()) == {30, 200}  # the raw bytes, as the env sent them
    returns = [m["charts/episodic_return"] for m in run.metrics]
    assert returns[0] < 5.0  # random: ~4 of 8
    assert np.mean(returns[-2:]) >= 6.5, returns
    agent = ppokit.load(run.run_dir, env=_Brightness)
    assert ppokit.evaluate(agent, episodes=4)["mean"] >= 7.0
    bright, dark = np.full((3, 64, 64), 200, np.uint8), np.full((3, 64, 64), 30, np.uint8)
    assert agent.act(bright) == 1 and agent.act(dark) == 0  # one image is one observation
    np.testing.assert_array_equal(agent.act(np.stack([dark, bright, bright])), [0, 1, 1])  # a batch


def test_an_hwc_image_env_trains_evaluates_and_acts(tmp_path):
    factory = lambda: _Brightness((40, 40, 3))  # noqa: E731
    trainer = Trainer(_config(total_timesteps=256, num_envs=2), run_dir=tmp_path / "r", console_enabled=False,
                      env=factory)
    assert trainer.buffer.obs.shape == (64, 2, 3, 40, 40) and trainer.buffer.obs.dtype == torch.uint8
    run = trainer.run()
    agent = ppokit.load(run.run_dir, env=factory)
    frames = np.random.default_rng(1).integers(0, 256, size=(6, 40, 40, 3), dtype=np.uint8)
    with torch.inference_mode():
        greedy = run.policy.actor(torch.as_tensor(frames).permute(0, 3, 1, 2)).argmax(-1).numpy()
    np.testing.assert_array_equal(agent.act(frames), greedy)  # HWC in, transposed to CHW as in training
    assert agent.act(frames[0]) == greedy[0]
    with pytest.raises(ValueError, match=r"image observation of shape \(3, 40, 40\)"):
        agent.act(frames[0].transpose(2, 0, 1))
    assert len(ppokit.evaluate(agent, episodes=2)["returns"]) == 2


IMAGE_ID, SMALL_ID = "ppokit_test/Brightness-v0", "ppokit_test/TinyBrightness-v0"
if IMAGE_ID not in gym.registry:
    gym.register(IMAGE_ID, entry_point=_Brightness, kwargs={"shape": (36, 36, 3)})
    gym.register(SMALL_ID, entry_point=_Brightness, kwargs={"shape": (3, 16, 16)})


def test_an_image_env_trains_and_evaluates_from_the_cli(tmp_path, capsys):
    run_dir = tmp_path / "img"
    assert main(["train", "--env", IMAGE_ID, "--preset", "gridworld", "--total-timesteps", "256", "--num-envs", "2",
                 "--run-dir", str(run_dir), "--quiet"]) == 0
    capsys.readouterr()
    assert main(["eval", str(run_dir), "--episodes", "2"]) == 0
    assert f"{IMAGE_ID}: mean return" in capsys.readouterr().out
    # Too small for the CNN: one line naming the shape, exit code 2, no traceback.
    assert main(["train", "--env", SMALL_ID, "--preset", "gridworld", "--total-timesteps", "256",
                 "--run-dir", str(tmp_path / "small"), "--quiet"]) == 2
    captured = capsys.readouterr()
    assert "(3, 16, 16)" in captured.err and "too small for the Nature CNN" in captured.err
    assert "Traceback" not in captured.err + captured.out
