"""GridWorld: a small deterministic exercise environment for PPO.

The agent starts in the top-left cell (index 0) of a ``size x size`` grid and
must reach the bottom-right cell (index ``size * size - 1``).

Reward definition (used by both the single and the vector env):
    * every step that does NOT reach the goal pays ``STEP_REWARD = -0.01``;
    * the step that reaches the goal pays ``GOAL_REWARD = +1.0`` (no step
      penalty is added on top of it) and terminates the episode.

The shortest path takes ``2 * (size - 1)`` steps, so the optimal undiscounted
return is ``1.0 - 0.01 * (2 * (size - 1) - 1)``, i.e. ``0.95`` on the 4x4 grid.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces
from gymnasium.utils import seeding
from gymnasium.vector.utils import batch_space

STEP_REWARD = -0.01
GOAL_REWARD = 1.0
DEFAULT_SIZE = 4
DEFAULT_MAX_EPISODE_STEPS = 50

# Row/column displacement per action: 0 up, 1 right, 2 down, 3 left.
_D_ROW = np.array([-1, 0, 1, 0], dtype=np.int64)
_D_COL = np.array([0, 1, 0, -1], dtype=np.int64)


def _check_size(size: int) -> int:
    size = int(size)
    # With size 1 the start is the goal and the episode could never begin.
    if size < 2:
        raise ValueError(f"GridWorld size must be >= 2, got {size}")
    return size


def _move(pos: np.ndarray, action: np.ndarray, size: int) -> np.ndarray:
    """Next cell index for cell indices ``pos`` [...] and actions [...] (walls block moves)."""
    row = np.clip(pos // size + _D_ROW[action], 0, size - 1)
    col = np.clip(pos % size + _D_COL[action], 0, size - 1)
    return row * size + col


def _ansi(pos: int, size: int) -> str:
    goal = size * size - 1
    rows = []
    for r in range(size):
        cells = []
        for c in range(size):
            idx = r * size + c
            cells.append("A" if idx == pos else ("G" if idx == goal else "."))
        rows.append(" ".join(cells))
    return "\n".join(rows) + "\n"


class GridWorldEnv(gym.Env):
    """Deterministic ``size x size`` grid; obs one-hot float32 [size*size], 4 actions, goal step pays +1.0."""

    metadata = {"render_modes": ["ansi", "rgb_array"], "render_fps": 4}

    def __init__(self, size: int = DEFAULT_SIZE, render_mode: str | None = None):
        self.size = _check_size(size)
        self.n_cells = self.size * self.size
        self.goal = self.n_cells - 1
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(f"render_mode must be None or one of {self.metadata['render_modes']}, got {render_mode!r}")
        self.render_mode = render_mode
        self.observation_space = spaces.Box(0.0, 1.0, shape=(self.n_cells,), dtype=np.float32)
        self.action_space = spaces.Discrete(4)
        self._pos: int | None = None
        self._done = False

    @staticmethod
    def optimal_return(size: int = DEFAULT_SIZE) -> float:
        """Undiscounted return of the shortest path on a ``size x size`` grid (0.95 for size 4)."""
        n_steps = 2 * (_check_size(size) - 1)
        return GOAL_REWARD + STEP_REWARD * (n_steps - 1)

    @property
    def position(self) -> tuple[int, int]:
        """Current (row, col) of the agent."""
        if self._pos is None:
            raise RuntimeError("call reset() first")
        return divmod(self._pos, self.size)

    def _obs(self) -> np.ndarray:
        obs = np.zeros(self.n_cells, dtype=np.float32)
        obs[self._pos] = 1.0
        return obs

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        """Put the agent on cell 0; returns (obs [size*size] float32, {})."""
        super().reset(seed=seed)
        self._pos = 0
        self._done = False
        return self._obs(), {}

    def _checked_action(self, action) -> int:
        """The action as an int in 0..3; an episode must be running."""
        if self._pos is None or self._done:
            raise RuntimeError("call reset() before step() (the episode is over or never started)")
        a = int(action)
        if not 0 <= a < 4:
            raise ValueError(f"action must be in 0..3, got {action!r}")
        return a

    def step(self, action):
        """Move one cell; returns (obs, reward, terminated, truncated=False, {})."""
        a = self._checked_action(action)
        self._pos = int(_move(np.int64(self._pos), np.int64(a), self.size))
        terminated = self._pos == self.goal
        self._done = terminated
        reward = GOAL_REWARD if terminated else STEP_REWARD
        return self._obs(), reward, terminated, False, {}

    def render(self):
        """Text picture (render_mode='ansi', A agent, G goal) or an RGB frame (render_mode='rgb_array')."""
        if self._pos is None:
            return None
        if self.render_mode == "ansi":
            return _ansi(self._pos, self.size)
        if self.render_mode == "rgb_array":
            return _rgb(self._pos, self.size)
        return None


def _rgb(pos: int, size: int, cell: int = 32) -> np.ndarray:
    """``[size*cell, size*cell, 3]`` uint8 frame: grey grid, green goal, blue agent (video recording needs sizes
    divisible by 16, which 32-pixel cells give)."""
    frame = np.full((size * cell, size * cell, 3), 235, dtype=np.uint8)
    frame[::cell, :] = 160
    frame[:, ::cell] = 160

    def fill(index: int, color: tuple[int, int, int], margin: int) -> None:
        r, c = divmod(index, size)
        frame[r * cell + margin:(r + 1) * cell - margin, c * cell + margin:(c + 1) * cell - margin] = color

    fill(size * size - 1, (60, 170, 80), 2)
    fill(pos, (40, 90, 200), 7)
    return frame


class GridWorldVectorEnv(gym.vector.VectorEnv):
    """``num_envs`` GridWorlds stepped together with numpy; SAME_STEP autoreset, truncation at ``max_episode_steps``.

    When env i ends (terminated or truncated), the returned ``obs[i]`` is already
    the reset observation and ``infos["final_obs"][i]`` holds the true last
    observation, flagged by ``infos["_final_obs"][i]``. ``infos["final_obs"]`` is
    a float32 array [num_envs, size*size]; rows whose mask is False hold the same
    observation as the returned batch. Like gymnasium's SyncVectorEnv, these keys
    (and the empty ``final_info``/``_final_info``) only appear on steps where at
    least one env ended.
    """

    metadata = {
        "render_modes": ["ansi"],
        "render_fps": 4,
        "autoreset_mode": gym.vector.AutoresetMode.SAME_STEP,
    }

    def __init__(
        self,
        num_envs: int = 1,
        size: int = DEFAULT_SIZE,
        max_episode_steps: int | None = DEFAULT_MAX_EPISODE_STEPS,
        render_mode: str | None = None,
    ):
        if int(num_envs) < 1:
            raise ValueError(f"num_envs must be >= 1, got {num_envs}")
        self.num_envs = int(num_envs)
        self.size = _check_size(size)
        self.n_cells = self.size * self.size
        self.goal = self.n_cells - 1
        if max_episode_steps is not None and int(max_episode_steps) < 1:
            raise ValueError(f"max_episode_steps must be >= 1 or None, got {max_episode_steps}")
        self.max_episode_steps = None if max_episode_steps is None else int(max_episode_steps)
        if render_mode is not None and render_mode not in self.metadata["render_modes"]:
            raise ValueError(f"render_mode must be None or one of {self.metadata['render_modes']}, got {render_mode!r}")
        self.render_mode = render_mode
        # A per-instance copy so that callers editing metadata do not leak into the class.
        self.metadata = dict(type(self).metadata)
        self.metadata["autoreset_mode"] = gym.vector.AutoresetMode.SAME_STEP

        self.single_observation_space = spaces.Box(0.0, 1.0, shape=(self.n_cells,), dtype=np.float32)
        self.single_action_space = spaces.Discrete(4)
        self.observation_space = batch_space(self.single_observation_space, self.num_envs)
        self.action_space = batch_space(self.single_action_space, self.num_envs)

        self._pos = np.zeros(self.num_envs, dtype=np.int64)
        self._steps = np.zeros(self.num_envs, dtype=np.int64)
        self._started = False
        self._rows = np.arange(self.num_envs)

    def _obs(self, pos: np.ndarray) -> np.ndarray:
        obs = np.zeros((self.num_envs, self.n_cells), dtype=np.float32)
        obs[self._rows, pos] = 1.0
        return obs

    def reset(self, *, seed: int | list | None = None, options: dict[str, Any] | None = None):
        """Reset all envs (or those in ``options["reset_mask"]`` [N] bool); returns (obs [N, size*size], {})."""
        # The dynamics are deterministic; the seed only feeds np_random for API parity.
        if isinstance(seed, (list, tuple)):
            seed = seed[0] if len(seed) else None
        if seed is not None:
            self._np_random, self._np_random_seed = seeding.np_random(seed)
        mask = None if options is None else options.get("reset_mask")
        if mask is not None:
            mask = np.asarray(mask, dtype=np.bool_)
            if mask.shape != (self.num_envs,):
                raise ValueError(f"reset_mask must have shape ({self.num_envs},), got {mask.shape}")
            if not self._started and not mask.all():
                raise RuntimeError("the first reset must reset every env")
            self._pos[mask] = 0
            self._steps[mask] = 0
        else:
            self._pos[:] = 0
            self._steps[:] = 0
        self._started = True
        return self._obs(self._pos), {}

    def step(self, actions):
        """Step with actions [N] in 0..3; returns (obs [N, size*size] f32, rewards [N] f64, term, trunc, infos)."""
        if not self._started:
            raise RuntimeError("call reset() before step()")
        actions = np.asarray(actions)
        if actions.shape != (self.num_envs,):
            raise ValueError(f"actions must have shape ({self.num_envs},), got {actions.shape}")
        if not np.issubdtype(actions.dtype, np.integer):
            if not np.all(np.mod(actions, 1) == 0):
                raise ValueError(f"actions must be integers in 0..3, got {actions!r}")
        actions = actions.astype(np.int64)
        if actions.min() < 0 or actions.max() > 3:
            raise ValueError(f"actions must be in 0..3, got {actions!r}")

        self._pos = _move(self._pos, actions, self.size)
        self._steps += 1
        terminated = self._pos == self.goal
        if self.max_episode_steps is None:
            truncated = np.zeros(self.num_envs, dtype=np.bool_)
        else:
            # Same rule as gymnasium's TimeLimit: both flags can be True on the same step.
            truncated = self._steps >= self.max_episode_steps
        rewards = np.where(terminated, GOAL_REWARD, STEP_REWARD).astype(np.float64)

        obs = self._obs(self._pos)
        done = terminated | truncated
        infos: dict[str, Any] = {}
        if done.any():
            infos["final_obs"] = obs.copy()
            infos["_final_obs"] = done.copy()
            infos["final_info"] = {}
            infos["_final_info"] = done.copy()
            self._pos[done] = 0
            self._steps[done] = 0
            obs[done] = 0.0
            obs[done, 0] = 1.0
        return obs, rewards, terminated, truncated, infos

    def render(self):
        """Tuple of text pictures, one per env, when render_mode='ansi'."""
        if self.render_mode == "ansi":
            return tuple(_ansi(int(p), self.size) for p in self._pos)
        return None


# Default walls of GridWorldWalls (row, col) on the 4x4 grid: a wall down column 2 with a gap in the bottom row,
# so the shortest path (down the left edge, then along the bottom) still takes 6 steps and returns 0.95.
DEFAULT_WALLS = ((0, 2), (1, 2), (2, 2))


class GridWorldWallsEnv(GridWorldEnv):
    """``GridWorldEnv`` with wall cells, and the action mask that action-masked PPO reads.

    A move into a wall or off the grid leaves the agent in place (paying the step reward) and counts one
    ``wall_bumps``. The mask of the current cell (``int8 [4]``, 1 = allowed: the move stays on the grid and out of
    the walls) comes in ``info["action_mask"]`` after every reset and step (Gymnasium's Taxi convention) and from
    ``action_masks()`` (SB3-contrib's). With masking a policy never bumps; a random policy does.
    """

    def __init__(self, size: int = DEFAULT_SIZE, walls: Any = DEFAULT_WALLS, render_mode: str | None = None):
        super().__init__(size=size, render_mode=render_mode)
        cells = set()
        for w in walls:
            r, c = (int(v) for v in w)
            if not (0 <= r < self.size and 0 <= c < self.size):
                raise ValueError(f"wall ({r}, {c}) lies outside the {self.size}x{self.size} grid")
            cells.add(r * self.size + c)
        if 0 in cells or self.goal in cells:
            raise ValueError("walls may not cover the start (0, 0) or the goal cell")
        self.walls = frozenset(cells)
        self.wall_bumps = 0
        # The mask of every cell, computed once: move a stays on the grid and does not enter a wall.
        self._masks = np.zeros((self.n_cells, 4), dtype=np.int8)
        for pos in range(self.n_cells):
            r, c = divmod(pos, self.size)
            for a in range(4):
                nr, nc = r + int(_D_ROW[a]), c + int(_D_COL[a])
                inside = 0 <= nr < self.size and 0 <= nc < self.size
                self._masks[pos, a] = inside and (nr * self.size + nc) not in self.walls

    def action_masks(self) -> np.ndarray:
        """``int8 [4]``: 1 where the move from the current cell is allowed."""
        if self._pos is None:
            raise RuntimeError("call reset() first")
        return self._masks[self._pos].copy()

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        obs, _ = super().reset(seed=seed, options=options)
        return obs, {"action_mask": self.action_masks()}

    def step(self, action):
        """Move one cell unless the move is masked (a wall or the edge): then stay and count a bump."""
        a = self._checked_action(action)
        if not self._masks[self._pos, a]:
            self.wall_bumps += 1
            return self._obs(), STEP_REWARD, False, False, {"action_mask": self.action_masks()}
        obs, reward, terminated, truncated, _ = super().step(a)
        return obs, reward, terminated, truncated, {"action_mask": self.action_masks()}

    def render(self):
        frame = super().render()
        if self.render_mode == "ansi" and frame is not None:
            chars = list(frame)
            for w in self.walls:  # each cell is one char plus a separator
                chars[w * 2] = "#"
            return "".join(chars)
        return frame
