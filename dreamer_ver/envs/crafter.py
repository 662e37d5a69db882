"""Crafter (tasks ``crafter_reward`` and ``crafter_noreward``).

The observation is ``image``, the top-down view rendered at ``size``
[height, width] (uint8 RGB), and ``log/reward``, the env's reward even in
``crafter_noreward``, whose ``reward`` is always 0. With ``logs``, each of
Crafter's 22 achievements adds ``log/achievement_<name>``, the int32 number of
times it was unlocked so far in the episode (0 on the reset step). The action
is ``action``, one of Crafter's 17 discrete actions.

An episode ends when the player dies, which is terminal, or after ``length``
steps (0: never), which is not. Worlds are generated from ``seed`` (and the
episode's number), so one seed gives the same sequence of worlds.

Follows upstream DreamerV3's env, except that upstream seeds Crafter at
random and can also write a stats.jsonl per env; here ``scores.jsonl`` holds
the ``log/`` keys of every episode. crafter is imported lazily.
"""

import elements
import numpy as np

from . import base


class Crafter(base.Env):

  TASKS = ('reward', 'noreward')

  def __init__(self, task, size=(64, 64), logs=True, length=10000, seed=0):
    import crafter
    if task not in self.TASKS:
      raise ValueError(
          f"Unknown crafter task '{task}'; known: "
          f"{', '.join('crafter_' + t for t in self.TASKS)}")
    if len(size) != 2 or min(size) < 1:
      raise ValueError(f'size must be two positive ints, got {size}')
    if length < 0:
      raise ValueError(f'length must be >= 0, got {length}')
    self._size = tuple(int(x) for x in size)
    # Crafter takes its size as (width, height).
    self._env = crafter.Env(
        size=self._size[::-1], reward=(task == 'reward'), length=length,
        seed=seed)
    self._achievements = list(crafter.constants.achievements) if logs else []
    self._done = True

  @property
  def obs_space(self):
    spaces = {
        'image': elements.Space(np.uint8, self._size + (3,)),
        'log/reward': elements.Space(np.float32),
    }
    for name in self._achievements:
      spaces[f'log/achievement_{name}'] = elements.Space(np.int32)
    return {**spaces, **base.basic_obs_space()}

  @property
  def act_space(self):
    return {
        'reset': elements.Space(bool),
        'action': elements.Space(
            np.int32, (), 0, self._env.action_space.n),
    }

  def step(self, action):
    if action['reset'] or self._done:
      self._done = False
      return self._obs(self._env.reset(), 0.0, {}, is_first=True)
    image, reward, self._done, info = self._env.step(int(action['action']))
    return self._obs(
        image, reward, info, is_last=self._done,
        is_terminal=info['discount'] == 0)

  def _obs(self, image, reward, info, is_first=False, is_last=False,
           is_terminal=False):
    counts = info.get('achievements', {})
    obs = {
        'image': image,
        'log/reward': np.float32(info.get('reward', 0.0)),
        **{f'log/achievement_{name}': np.int32(counts.get(name, 0))
           for name in self._achievements},
    }
    return {**obs, **base.basic_obs(reward, is_first, is_last, is_terminal)}
