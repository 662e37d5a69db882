"""A cheap synthetic env for tests and throughput runs (``dummy_disc``/``_cont``).

Its spaces match upstream's dummy env, so it exercises every kind of input
the agent must handle: an image, vectors, 2-D arrays, and int tokens.
Both tasks expose both action keys; the task only decides which one is
rewarded.

Reward, chosen so that a working agent can learn it within a few thousand
steps but a broken one cannot:
  * every observation shows a fresh random cue in [0, 5) (as ``token`` and
    as the image brightness) and a random goal in [-1, 1]^6 (as
    ``vector[:6]``; ``vector[6]`` is the episode progress count / length);
  * ``dummy_disc``: reward 1 when ``act_disc`` equals the cue of the
    observation the action was chosen on, else 0;
  * ``dummy_cont``: reward ``1 - mean(|act_cont - goal|) / 2`` in [0, 1],
    using the goal of that same observation.
``count`` is the number of steps since the last reset (0 on ``is_first``).
Episodes end after ``length`` steps with ``is_last`` and ``is_terminal``.
The cue and goal sequence is a deterministic function of ``seed``.
"""

import elements
import numpy as np

from . import base


class Dummy(base.Env):

  TASKS = ('disc', 'cont')

  def __init__(self, task, length=100, size=(64, 64), seed=0):
    if task not in self.TASKS:
      raise ValueError(
          f"Unknown dummy task '{task}', expected one of {self.TASKS}.")
    self._task = task
    self._length = int(length)
    self._size = tuple(size)
    self._rng = np.random.default_rng(seed)
    self._count = 0
    self._done = True
    self._cue = 0
    self._goal = np.zeros(6, np.float32)

  @property
  def obs_space(self):
    return {
        'image': elements.Space(np.uint8, self._size + (3,)),
        'vector': elements.Space(np.float32, (7,)),
        'token': elements.Space(np.int32, (), 0, 256),
        'count': elements.Space(np.float32, (), 0, self._length),
        'float2d': elements.Space(np.float32, (4, 5)),
        'int2d': elements.Space(np.int32, (2, 3), 0, 4),
        **base.basic_obs_space(),
    }

  @property
  def act_space(self):
    return {
        'reset': elements.Space(bool),
        'act_disc': elements.Space(np.int32, (), 0, 5),
        'act_cont': elements.Space(np.float32, (6,), -1, 1),
    }

  def step(self, action):
    if action['reset'] or self._done:
      self._count = 0
      self._done = False
      return self._obs(0.0, is_first=True)
    if self._task == 'disc':
      reward = float(int(action['act_disc']) == self._cue)
    else:
      error = np.abs(np.asarray(action['act_cont']) - self._goal).mean()
      reward = 1.0 - error / 2
    self._count += 1
    self._done = self._count >= self._length
    return self._obs(reward, is_last=self._done, is_terminal=self._done)

  def _obs(self, reward, is_first=False, is_last=False, is_terminal=False):
    self._cue = int(self._rng.integers(0, 5))
    self._goal = self._rng.uniform(-1, 1, 6).astype(np.float32)
    progress = np.float32(self._count / self._length)
    return {
        'image': np.full(self._size + (3,), 60 * self._cue, np.uint8),
        'vector': np.append(self._goal, progress).astype(np.float32),
        'token': np.int32(self._cue),
        'count': np.float32(self._count),
        'float2d': np.ones((4, 5), np.float32),
        'int2d': np.full((2, 3), self._count % 4, np.int32),
        **base.basic_obs(reward, is_first, is_last, is_terminal),
    }
