"""Action masking: masked logits in the policy, masks read from the env, stored, and applied in the update.

The walls GridWorld (``ppokit/GridWorldWalls-v0``) sends its mask both ways an env can (``info["action_mask"]``
and an ``action_masks()`` method) and counts the moves its mask forbids, which makes "never steps into a wall"
measurable.
"""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch

import ppokit
from ppokit.cli import main
from ppokit.config.ppo_config import PPOConfig, load_preset
from ppokit.core.objectives import categorical_entropy
from ppokit.envs import GRIDWORLD_WALLS_ID, GridWorldWallsEnv
from ppokit.envs.masks import action_masks_available, read_action_masks
from ppokit.policies import ActorCritic, mask_logits
from ppokit.runtime.checkpoint import load_checkpoint
from ppokit.training.trainer import Trainer
from ppokit.update.autograd import AutogradStep
from ppokit.update.epochs import ppo_epochs


def _policy(kind: str = "discrete", dims: tuple[int, ...] = (5,), seed: int = 0) -> ActorCritic:
    torch.manual_seed(seed)
    policy = ActorCritic(6, kind, list(dims), [16], "tanh")
    # Large head weights: the unmasked distribution is far from uniform, so a leak of mass would show.
    with torch.no_grad():
        policy.actor[-1].weight.mul_(300.0)
    return policy


def _random_mask(rows: int, n: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mask = torch.rand(rows, n, generator=g) < 0.5
    mask[torch.arange(rows), torch.randint(n, (rows,), generator=g)] = True  # at least one allowed action
    return mask


def _walls_config(**overrides):
    cfg = load_preset("gridworld")
    cfg.env_id = GRIDWORLD_WALLS_ID
    for key, value in overrides.items():
        setattr(cfg, key, value)
    return cfg


# ---------------------------------------------------------------------------------------------- the policy
def test_masked_actions_are_never_sampled_over_10k_draws():
    policy = _policy()
    obs = torch.randn(10_000, 6)
    mask = _random_mask(10_000, 5)
    with torch.inference_mode():
        actions, logp, _, _ = policy.act(obs, None, None, action_mask=mask)
        greedy, _, _, _ = policy.act(obs, None, None, action_mask=mask, deterministic=True)
        unmasked, _, _, _ = policy.act(obs, None, None)
    assert mask[torch.arange(10_000), actions].all()
    assert mask[torch.arange(10_000), greedy].all()
    assert torch.isfinite(logp).all()
    # The same policy without the mask does pick forbidden actions: the mask, not luck, keeps them out.
    assert not mask[torch.arange(10_000), unmasked].all()


def test_masked_actions_have_zero_probability_and_no_entropy():
    policy = _policy()
    obs = torch.randn(256, 6)
    mask = _random_mask(256, 5)
    probs = []
    with torch.no_grad():
        for a in range(5):
            logp, ent, _ = policy.evaluate(obs, torch.full((256,), a), action_mask=mask)
            probs.append(logp.exp())
        probs = torch.stack(probs, -1)
        assert (probs[~mask] == 0.0).all()  # exactly zero, not merely small
        assert torch.allclose(probs.sum(-1), torch.ones(256), atol=1e-6)
        # Entropy equals the entropy of the distribution over the allowed actions alone.
        logits = policy.actor(obs)
        expected = torch.stack([categorical_entropy(logits[i][mask[i]]) for i in range(256)])
        assert torch.isfinite(ent).all()
        torch.testing.assert_close(ent, expected, rtol=1e-5, atol=1e-6)


def test_masked_logits_get_exactly_zero_gradient():
    policy = _policy()
    head = policy.actor(torch.randn(64, 6)).detach().requires_grad_(True)
    mask = _random_mask(64, 5)
    actions = torch.multinomial(mask.float(), 1).squeeze(-1)  # allowed actions only, as stored in a rollout
    logp, ent = policy.log_prob_entropy(mask_logits(head, mask), actions)
    (-(logp.sum()) - 0.1 * ent.sum()).backward()
    assert torch.isfinite(head.grad).all()
    assert (head.grad[~mask] == 0.0).all()
    assert (head.grad[mask] != 0.0).any()


def test_multidiscrete_masks_each_sub_action():
    policy = _policy("multidiscrete", (3, 4))
    obs = torch.randn(2000, 6)
    mask = torch.cat([_random_mask(2000, 3, 2), _random_mask(2000, 4, 3)], -1)
    with torch.inference_mode():
        actions, _, _, _ = policy.act(obs, None, None, action_mask=mask)
    rows = torch.arange(2000)
    assert mask[rows, actions[:, 0]].all() and mask[rows, 3 + actions[:, 1]].all()


def test_unmasked_calls_compute_what_they_did():
    policy = _policy()
    obs, actions = torch.randn(32, 6), torch.randint(5, (32,))
    with torch.no_grad():
        plain = policy.evaluate(obs, actions)
        all_allowed = policy.evaluate(obs, actions, action_mask=torch.ones(32, 5, dtype=torch.bool))
    for a, b in zip(plain, all_allowed):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="continuous"):
        _policy("continuous", (2,)).evaluate(obs, torch.zeros(32, 2), action_mask=torch.ones(32, 2, dtype=bool))


# ---------------------------------------------------------------------------------------------- the env
def test_walls_gridworld_mask_and_bumps():
    env = GridWorldWallsEnv()
    _, info = env.reset(seed=0)
    np.testing.assert_array_equal(info["action_mask"], [0, 1, 1, 0])  # up and left leave the grid
    np.testing.assert_array_equal(env.action_masks(), info["action_mask"])
    _, _, _, _, info = env.step(1)  # right, to (0, 1): a wall at (0, 2) blocks moving right again
    np.testing.assert_array_equal(info["action_mask"], [0, 0, 1, 1])
    obs_before = env._obs()
    obs, reward, terminated, _, _ = env.step(1)
    assert env.wall_bumps == 1 and reward == -0.01 and not terminated
    np.testing.assert_array_equal(obs, obs_before)
    with pytest.raises(ValueError, match="outside"):
        GridWorldWallsEnv(walls=[(4, 0)])
    with pytest.raises(ValueError, match="goal"):
        GridWorldWallsEnv(walls=[(3, 3)])

    # A random policy without the mask bumps into walls and edges; sampling within the mask never does.
    rng = np.random.default_rng(0)
    env = gym.make(GRIDWORLD_WALLS_ID)
    for masked in (False, True):
        env.unwrapped.wall_bumps = 0
        _, info = env.reset(seed=0)
        for _ in range(500):
            allowed = np.flatnonzero(info["action_mask"]) if masked else np.arange(4)
            _, _, term, trunc, info = env.step(int(rng.choice(allowed)))
            if term or trunc:
                _, info = env.reset()
        assert (env.unwrapped.wall_bumps == 0) if masked else (env.unwrapped.wall_bumps > 0)


def test_vector_env_masks_from_info_flags_and_method():
    envs = gym.make_vec(GRIDWORLD_WALLS_ID, num_envs=3, vectorization_mode="sync")
    assert action_masks_available(envs)
    _, info = envs.reset(seed=0)
    np.testing.assert_array_equal(read_action_masks(envs, info, 4), np.tile([False, True, True, False], (3, 1)))
    # The info masks equal the method's; without info every env is asked through its method; a row flagged as
    # sent by no env allows every action.
    envs.step(np.array([1, 2, 2]))
    info = envs.step(np.array([0, 0, 1]))[4]
    via_info = read_action_masks(envs, info, 4)
    np.testing.assert_array_equal(via_info, np.stack(envs.call("action_masks")) != 0)
    np.testing.assert_array_equal(read_action_masks(envs, {}, 4), via_info)
    info = dict(info, _action_mask=np.array([True, False, True]))
    assert read_action_masks(envs, info, 4)[1].all()
    with pytest.raises(ValueError, match="expected"):
        read_action_masks(envs, {"action_mask": np.ones((3, 5))}, 4)
    with pytest.raises(ValueError, match="allows no action"):
        read_action_masks(envs, {"action_mask": np.zeros((3, 4))}, 4)
    envs.close()
    plain = gym.make_vec("ppokit/GridWorld-v0", num_envs=2, vectorization_mode="sync")
    assert not action_masks_available(plain)
    plain.close()


# ---------------------------------------------------------------------------------------------- training
def test_stored_logp_equals_the_recomputed_masked_logp(tmp_path):
    trainer = Trainer(_walls_config(seed=3), run_dir=tmp_path / "r", console_enabled=False)
    assert trainer.masked and not trainer.fused  # the fused kernel has no masks: autograd
    trainer.collect_rollout()
    batch, _, _ = trainer.compute_advantages()
    assert batch.action_mask is not None and batch.action_mask.dtype == torch.bool
    assert batch.action_mask[torch.arange(len(batch)), batch.actions].all()
    with torch.no_grad():
        logp, _, _ = trainer.policy.evaluate(batch.obs, batch.actions, action_mask=batch.action_mask)
        unmasked, _, _ = trainer.policy.evaluate(batch.obs, batch.actions)
    assert torch.equal((logp - batch.logp_old).exp(), torch.ones(len(batch)))  # ratio exactly 1
    assert not torch.allclose(unmasked, batch.logp_old)  # the mask changes the stored log-prob
    # The update's loss evaluates under the minibatch's mask: one epoch, one minibatch, KL and clipfrac exactly 0
    # before the step (without the mask the ratio would be about 2 on the untrained policy).
    settings = trainer.update_settings(0.2)
    settings.update_epochs, settings.num_minibatches, settings.target_kl = 1, 1, None
    stats = ppo_epochs(batch, settings, AutogradStep(trainer.policy, trainer.optimizer))
    assert stats["approx_kl"] == 0.0 and stats["clipfrac"] == 0.0 and stats["minibatches"] == 1.0
    trainer.envs.close()


def test_walls_gridworld_learns_with_masking_and_never_bumps(tmp_path):
    trainer = Trainer(_walls_config(seed=1, total_timesteps=8192), run_dir=tmp_path / "r", console_enabled=False)
    trainer.run()
    returns = [m["charts/episodic_return"] for m in trainer.metrics if "charts/episodic_return" in m]
    assert returns[-1] >= 0.93  # the registered threshold, 0.02 below the optimum 0.95
    assert sum(env.unwrapped.wall_bumps for env in trainer.envs.envs) == 0


def test_plain_envs_store_no_masks(tmp_path):
    cfg = load_preset("gridworld")
    trainer = Trainer(cfg, run_dir=tmp_path / "r", console_enabled=False)
    assert not trainer.masked and trainer.buffer.masks is None and "next_mask" not in trainer.collector.loop_state()
    trainer.envs.close()


def test_checkpoint_round_trip_and_masked_agent(tmp_path):
    run_dir = tmp_path / "r"
    trainer = Trainer(_walls_config(seed=2, total_timesteps=512), run_dir=run_dir, console_enabled=False)
    trainer.run()
    saved_mask = trainer.collector.next_mask.copy()
    state = load_checkpoint(run_dir / "checkpoint.pt")
    assert state["loop"]["next_mask"].dtype == torch.bool
    resumed = Trainer(PPOConfig.from_dict(state["config"]), run_dir=run_dir, console_enabled=False,
                      resume_state=state)
    try:
        np.testing.assert_array_equal(resumed.collector.next_mask, saved_mask)
        current = np.stack(resumed.envs.call("action_masks")) != 0  # the restored envs agree with the mask
        np.testing.assert_array_equal(current, saved_mask)
    finally:
        resumed._abandon()
    assert ppokit.resume(run_dir, total_timesteps=1024, console_enabled=False).global_step == 1024

    agent = ppokit.load(run_dir)
    env = GridWorldWallsEnv()
    obs, info = env.reset(seed=0)
    for _ in range(30):
        action = int(agent.act(obs, action_mask=info["action_mask"], deterministic=False))
        assert info["action_mask"][action] == 1
        obs, _, term, _, info = env.step(action)
        if term:
            obs, info = env.reset()
    assert env.wall_bumps == 0
    batch_actions = agent.act(np.stack([obs, obs]), action_mask=np.array([[0, 0, 1, 0], [1, 0, 0, 0]]))
    np.testing.assert_array_equal(batch_actions, [2, 0])
    with pytest.raises(ValueError, match="action_mask has 3 entries"):
        agent.act(obs, action_mask=[1, 1, 1])
    result = ppokit.evaluate(agent, episodes=2)
    assert np.isfinite(result["mean"])


def test_cli_trains_the_walls_gridworld(tmp_path):
    rc = main(["train", "--env", GRIDWORLD_WALLS_ID, "--run-dir", str(tmp_path / "r"), "--quiet",
               "--total-timesteps", "256"])
    assert rc == 0
    assert (tmp_path / "r" / "metrics.csv").exists()


class _MethodOnly(gym.Wrapper):
    """The walls GridWorld with its info masks removed: the masks come only from ``action_masks()``."""

    def reset(self, **kwargs):
        obs, _ = self.env.reset(**kwargs)
        return obs, {}

    def step(self, action):
        obs, reward, terminated, truncated, _ = self.env.step(action)
        return obs, reward, terminated, truncated, {}


def test_masks_from_the_action_masks_method_are_stored_and_obeyed(tmp_path):
    cfg = _walls_config(seed=4, total_timesteps=256, num_envs=4)
    trainer = Trainer(cfg, run_dir=tmp_path / "r", console_enabled=False,
                      env=lambda: gym.wrappers.TimeLimit(_MethodOnly(GridWorldWallsEnv()), 50))
    assert trainer.masked
    trainer.collect_rollout()
    buf = trainer.buffer
    assert buf.masks.dtype == torch.bool and buf.masks.shape == (cfg.num_steps, 4, 4)
    taken = buf.masks.gather(-1, buf.actions.unsqueeze(-1)).squeeze(-1)
    assert taken.all() and not buf.masks.all()  # real masks (some moves forbidden), every action allowed
    assert sum(env.unwrapped.wall_bumps for env in trainer.envs.envs) == 0
    trainer._abandon()


def test_the_evaluation_gate_acts_within_the_mask(tmp_path):
    trainer = Trainer(_walls_config(seed=5, eval_episodes=4), run_dir=tmp_path / "r", console_enabled=False)
    # An untrained greedy policy keeps choosing one move; unmasked it would bump for the whole episode.
    assert np.isfinite(trainer.evaluate_gate())
    assert sum(env.unwrapped.wall_bumps for env in trainer._eval_envs.envs) == 0
    trainer._abandon()


# ------------------------------------------------------------------------- a mask only in info (no attribute)
class InfoOnlyMask(gym.Env):
    """3 actions; action 2 pays most but is always masked, and the mask is sent only as ``info["action_mask"]``
    (no ``action_mask`` attribute, no ``action_masks()`` method). ``taken`` counts the masked action per env
    instance (class-level, so the test reads it after the run)."""

    observation_space = gym.spaces.Box(-1.0, 1.0, (2,), np.float32)
    action_space = gym.spaces.Discrete(3)
    metadata: dict = {"render_modes": []}
    MASK = np.array([1, 1, 0], dtype=np.int8)
    taken = 0
    steps = 0

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        return np.zeros(2, np.float32), {"action_mask": self.MASK.copy()}

    def step(self, action):
        self.t += 1
        InfoOnlyMask.steps += 1
        InfoOnlyMask.taken += int(action) == 2
        reward = 2.0 if int(action) == 2 else float(action)
        return np.zeros(2, np.float32), reward, False, self.t >= 10, {"action_mask": self.MASK.copy()}


@pytest.mark.parametrize("vector_mode, eval_every", [("sync", 0), ("sync", 1), ("async", 0)])
def test_a_mask_sent_only_in_info_is_applied_from_the_first_reset(tmp_path, vector_mode, eval_every):
    InfoOnlyMask.taken = InfoOnlyMask.steps = 0
    assert not hasattr(InfoOnlyMask(), "action_mask") and not hasattr(InfoOnlyMask(), "action_masks")
    cfg = PPOConfig(num_envs=2, num_steps=32, total_timesteps=640, num_minibatches=2, update_epochs=2,
                    vector_mode=vector_mode, run_dir=str(tmp_path / "run"), tensorboard=False,
                    eval_every=eval_every, eval_threshold=1e9 if eval_every else None, eval_episodes=2)
    trainer = Trainer(cfg, console_enabled=False, env=InfoOnlyMask)
    trainer.run()
    assert trainer.masked and trainer.collector.masked and not trainer.fused
    # The last rollout as stored: every step masked, action 2 never taken.
    assert trainer.buffer.masks.shape == (32, 2, 3) and not trainer.buffer.masks[..., 2].any()
    assert not (trainer.buffer.actions == 2).any()
    if vector_mode == "sync":  # the envs run here, so their counts are readable
        # 10 updates of 2 x 32 steps, plus the evaluation gate's episodes: the masked action, the best-paying
        # one (which an unmasked policy learns to take), never once.
        assert InfoOnlyMask.steps >= 640
        assert InfoOnlyMask.taken == 0, (InfoOnlyMask.taken, InfoOnlyMask.steps)
