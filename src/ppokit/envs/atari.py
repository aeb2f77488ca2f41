"""Atari environments with the 9 Atari details of "The 37 implementation details of PPO" (Huang et al., 2022).

The stack, inside out (one env; the trainer vectorizes it with Gymnasium's Sync/AsyncVectorEnv):

1. ``gym.make(id, frameskip=1)``: the raw ALE game (ale-py), one emulator frame per step;
2. Gymnasium's ``AtariPreprocessing`` (exact for these details): no-op reset of 1-30 random no-ops (detail 1),
   the action repeated 4 frames with the max of the last two frames (detail 2, max-and-skip), 84x84 grayscale
   (detail 5, ``cv2.INTER_AREA`` as in Mnih et al. 2015), uint8;
   ``GameStatistics`` on top of it records the unclipped score and the length (agent steps) of each whole game,
   beneath the life and clipping wrappers, where CleanRL's ``ppo_atari.py`` puts ``RecordEpisodeStatistics``: the
   training curve's ``charts/episodic_return`` is then the game score published figures report;
3. ``EpisodicLife`` (ours: Gymnasium's ``terminal_on_life_loss`` ends the whole game): a life loss ends the
   *training* episode, and ``reset()`` after it continues the same game (detail 3);
4. ``FireReset`` (ours; Gymnasium has none), for games whose action 1 is FIRE: FIRE then action 2 after every
   reset, so the game starts (detail 4);
5. ``ClipReward`` (training only): the reward's sign (detail 6);
6. ``FrameStackObservation(4)``: the last 4 frames, channels first, ``[4, 84, 84]`` uint8 (detail 7). The Nature
   CNN shared by actor and critic, pixels scaled by 1/255 inside the model (details 8-9), is the policy's.

Evaluation (``make_atari_env(train=False)``) keeps 1-4 and 6 and drops the clipping; ``WholeGame`` on top runs the
reset that training would do after a life loss itself and goes on, so an evaluation episode is one whole game and
its return the game's unclipped score (what CleanRL and SB3 report, through a monitor under the life wrapper).

Why not ale-py 0.12's threaded ``AtariVectorEnv`` (about 2x faster per step): measured here, its
``episodic_life=True`` resets the whole game after a life loss (lives back to 5, ``episode_frame_number`` 0), so
the agent never plays a game's later lives; and with ``reward_clipping=True`` its info carries no raw reward, so the
game score is lost. Neither is the detail as defined, so ``vector_mode = "native"`` is refused for Atari ids.
"""

from __future__ import annotations

import functools
from typing import Any

import gymnasium as gym
import numpy as np

from ppokit.envs.backends import get_backend

__all__ = ["ClipReward", "EpisodicLife", "FireReset", "GameStatistics", "WholeGame", "finished_games", "records_games", "is_atari_id", "make_atari_env",
           "make_atari_vec_env", "register_ale", "wrap_atari", "FRAME_STACK", "NOOP_MAX", "FRAME_SKIP", "SCREEN_SIZE"]

NOOP_MAX, FRAME_SKIP, SCREEN_SIZE, FRAME_STACK = 30, 4, 84, 4
_ALE_ENTRY_POINT = "ale_py.env:AtariEnv"


def register_ale(env_id: str | None = None) -> bool:
    """Register ale-py's ``ALE/...`` ids with Gymnasium when ``env_id`` looks like one (or always, for None);
    False when ale-py is not installed. Importing ale-py costs ~0.1 s, so other ids never trigger it."""
    if env_id is not None and not (env_id.startswith("ALE/") or "NoFrameskip" in env_id or env_id in gym.registry):
        return False
    if env_id is not None and env_id in gym.registry:
        return True
    try:
        import ale_py
    except ImportError:
        return False
    gym.register_envs(ale_py)
    return True


def is_atari_id(env_id: Any) -> bool:
    """Whether ``env_id`` is a registered ALE game (its entry point is ale-py's ``AtariEnv``)."""
    if not isinstance(env_id, str) or ":" in env_id or not register_ale(env_id):
        return False
    try:
        return gym.spec(env_id).entry_point == _ALE_ENTRY_POINT
    except gym.error.Error:
        return False


# The info keys ``GameStatistics`` sets on the step that ends a game (a vector env stacks them per env).
GAME_SCORE, GAME_LENGTH = "game_score", "game_length"


class GameStatistics(gym.Wrapper):
    """The unclipped score and the length in agent steps of a whole game, in ``info[GAME_SCORE]`` and
    ``info[GAME_LENGTH]`` of the step that ends it (the game's own termination or truncation).

    It sits beneath ``EpisodicLife`` and ``ClipReward``, so it sees every life, the raw rewards, and the steps the
    wrappers above take inside ``reset`` (the continuing no-op, FIRE): the same figures as CleanRL's
    ``RecordEpisodeStatistics`` under its wrappers, except that CleanRL's length counts emulator frames (4 per
    step, plus the reset no-ops). A game that ends inside a reset of the wrappers above (its last life lost on
    the continuing no-op) is not reported: those wrappers start the next game at once and drop that step's info.
    """

    records_game = True  # what ``records_games`` looks for through the vector env

    def __init__(self, env: gym.Env):
        super().__init__(env)
        self.score, self.length = 0.0, 0

    def step(self, action: Any):
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.score += float(reward)
        self.length += 1
        if terminated or truncated:
            info = dict(info, **{GAME_SCORE: self.score, GAME_LENGTH: self.length})
        return obs, reward, terminated, truncated, info

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        self.score, self.length = 0.0, 0
        return self.env.reset(seed=seed, options=options)


def records_games(envs: Any, env_id: Any) -> bool:
    """Whether every env of the vector env ``envs`` of ``env_id`` has a ``GameStatistics`` (an ALE game built by
    ``make_atari_vec_env``; not envpool's Atari, which has its own wrappers)."""
    if not is_atari_id(env_id) or not hasattr(envs, "get_attr"):
        return False
    try:
        return all(bool(x) for x in envs.get_attr("records_game"))
    except AttributeError:
        return False


def finished_games(info: dict) -> list[tuple[float, int]]:
    """(score, length) of each game that ended in this step of a SAME_STEP vector env of ``GameStatistics``
    envs (the ended step's info is ``info["final_info"]``, Gymnasium's SAME_STEP autoreset), in env order."""
    final = info.get("final_info")
    if not final or GAME_SCORE not in final:
        return []
    ended = np.flatnonzero(final["_" + GAME_SCORE])
    return [(float(final[GAME_SCORE][i]), int(final[GAME_LENGTH][i])) for i in ended]


class EpisodicLife(gym.Wrapper):
    """A life loss ends the training episode but not the game (Mnih et al. 2015; Huang et al. 2022, Atari detail 3).

    ``step`` returns ``terminated=True`` when the lives counter drops and lives remain; ``reset`` then continues
    the same game with one no-op step (its reward goes to ``info["reset_reward"]``); only a real game over (the
    game's own termination or truncation; ``game_ended``) or a seeded reset resets the emulator.
    """

    def __init__(self, env: gym.Env):
        super().__init__(env)
        self.lives = 0
        self.game_ended = True

    def step(self, action: Any):
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.game_ended = bool(terminated or truncated)
        lives = self.env.unwrapped.ale.lives()
        if 0 < lives < self.lives:
            terminated = True  # the game goes on; the agent learns that losing a life ends its return
        self.lives = lives
        return obs, reward, terminated, truncated, info

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        # A seeded reset starts a new game (a seed asks for one), as does a game over; otherwise, after a life
        # loss, the game goes on.
        if self.game_ended or seed is not None:
            obs, info = self.env.reset(seed=seed, options=options)
        else:
            obs, reward, terminated, truncated, info = self.env.step(0)  # continue the game after a life loss
            info = dict(info, reset_reward=float(reward))
            if terminated or truncated:  # the no-op itself ended the game: a real reset
                obs, info = self.env.reset(seed=seed, options=options)
        self.lives = self.env.unwrapped.ale.lives()
        return obs, info


class FireReset(gym.Wrapper):
    """FIRE (action 1) then action 2 after every reset, for games that wait for FIRE to start (Breakout); the
    rewards of those two steps go to ``info["reset_reward"]`` (Huang et al. 2022, Atari detail 4)."""

    def __init__(self, env: gym.Env):
        super().__init__(env)
        meanings = env.unwrapped.get_action_meanings()
        if len(meanings) < 3 or meanings[1] != "FIRE":
            raise ValueError(f"FireReset needs FIRE as action 1 and at least 3 actions, got {meanings}")

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        obs, info = self.env.reset(seed=seed, options=options)
        dropped = float(info.get("reset_reward", 0.0))
        for action in (1, 2):
            obs, reward, terminated, truncated, step_info = self.env.step(action)
            dropped += float(reward)
            info = dict(info, **step_info)
            if terminated or truncated:
                obs, info = self.env.reset(seed=seed, options=options)
                dropped = float(info.get("reset_reward", 0.0))
        return obs, dict(info, reset_reward=dropped)


class ClipReward(gym.RewardWrapper):
    """The reward's sign, -1, 0 or +1, so one learning rate fits every game (Huang et al. 2022, Atari detail 6)."""

    def reward(self, reward: Any) -> float:
        return float(np.sign(reward))


class WholeGame(gym.Wrapper):
    """Evaluation over a whole game: where training ends an episode at a life loss and resets (continuing the
    game, firing), this wrapper runs that same reset and goes on, adding the rewards of its steps, so one episode is
    one game and its return the game's unclipped score. Needs ``EpisodicLife`` below it."""

    def step(self, action: Any):
        obs, reward, terminated, truncated, info = self.env.step(action)
        if terminated and not truncated and not self.env.get_wrapper_attr("game_ended"):
            obs, reset_info = self.env.reset()
            reward = float(reward) + float(reset_info.get("reset_reward", 0.0))
            info = dict(info, **reset_info)
            terminated = False
        return obs, reward, terminated, truncated, info

    def reset(self, *, seed: int | None = None, options: dict | None = None):
        return self.env.reset(seed=seed, options=options)


def make_atari_env(env_id: str, env_kwargs: dict | None = None, train: bool = True,
                   render_mode: str | None = None) -> gym.Env:
    """One Atari env with the stack of this module's docstring: training (``train``: clipped rewards, a life loss
    ends the episode) or evaluation (unclipped, one episode per game). ``env_kwargs`` go to ``gym.make`` (e.g.
    ``repeat_action_probability``); ``frameskip`` is the wrappers' (4), so the raw env is built with 1."""
    register_ale(env_id)
    kwargs = dict(env_kwargs or {})
    if kwargs.pop("frameskip", 1) not in (1, FRAME_SKIP):
        from ppokit.core.errors import ConfigError

        raise ConfigError("env_kwargs", f"frameskip is fixed at {FRAME_SKIP} by ppokit's Atari wrappers (the max of "
                          "the last two of 4 frames); remove it from env_kwargs")
    if render_mode is not None:
        kwargs["render_mode"] = render_mode
    return wrap_atari(gym.make(env_id, frameskip=1, **kwargs), train)


def wrap_atari(env: gym.Env, train: bool = True) -> gym.Env:
    """The wrappers of ``make_atari_env`` around a raw ALE env built with ``frameskip=1``."""
    env = gym.wrappers.AtariPreprocessing(env, noop_max=NOOP_MAX, frame_skip=FRAME_SKIP, screen_size=SCREEN_SIZE,
                                          terminal_on_life_loss=False, grayscale_obs=True, scale_obs=False)
    env = EpisodicLife(GameStatistics(env))
    meanings = env.unwrapped.get_action_meanings()
    if len(meanings) >= 3 and meanings[1] == "FIRE":
        env = FireReset(env)
    if train:
        env = ClipReward(env)
    env = gym.wrappers.FrameStackObservation(env, FRAME_STACK)
    if not train:
        env = WholeGame(env)
    return env


def make_atari_vec_env(env_id: str, num_envs: int, vector_mode: str = "sync", env_kwargs: dict | None = None,
                       train: bool = True) -> gym.vector.VectorEnv:
    """``num_envs`` Atari envs in a Sync (default) or Async vector env with SAME_STEP autoreset (ppokit's mode for
    both, so a truncated game bootstraps from ``info["final_obs"]``)."""
    backend = get_backend(vector_mode)
    if backend.from_factories is None:
        from ppokit.core.errors import ConfigError

        raise ConfigError("vector_mode", f"{vector_mode!r} is not available for Atari ids: ale-py's AtariVectorEnv "
                          "resets the whole game after a life loss and drops the raw score when clipping rewards, "
                          "so ppokit runs its exact wrappers under vector_mode 'sync' or 'async'")
    factory = functools.partial(make_atari_env, env_id, dict(env_kwargs or {}), train)
    return backend.from_factories([factory] * int(num_envs))  # async: workers that die with the trainer
