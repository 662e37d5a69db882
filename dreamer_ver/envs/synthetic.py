"""A synthetic env with a configurable step time, for tests and benchmarks.

Each episode is a contextual bandit of `length` rounds: `vector[0]` shows a
cue in {0, 1} and the reward is 1 when the action equals the cue shown with
the previous observation, so a policy that reads the cue scores `length` and
a random one half of it. The last round ends the game (`is_terminal`), so
the critic's value is bounded by the rounds left; as a time limit it would
be bootstrapped past the end towards 1 / (1 - discount) = 333 rewards,
where the critic's error swamps the one-reward difference between the
actions and a learned policy can fall apart. `count` is the step index
within the episode, which lets tests check that per-env state is routed
correctly.

Task `synthetic_tagged` also names every step, for fault soaks
(bench/soaks/chaos.py) that check the stored rows afterwards: `tag` is (seed, pid
of the env process, serial number of the step in this process; float32,
exact below 2**24), and
`log/pid` and `log/episode` name the episode (env process, episode number
in it) in the logger's scores.

Step time: `step_time` seconds, times `slow_factor` for the envs that draw
`slow` (a fraction `slow_frac` of seeds), times a per-step lognormal factor
with sigma `jitter`.
"""

import os
import time

import elements
import numpy as np

from . import base


class Synthetic(base.Env):

  def __init__(self, task, seed=0, length=100, vector_size=4, step_time=0.0,
               jitter=0.0, slow_frac=0.0, slow_factor=4.0):
    self.tagged = task == 'tagged'
    self.seed = int(seed)
    self.serial = 0
    self.episode = 0
    self.rng = np.random.default_rng(seed)
    self.length = int(length)
    self.size = int(vector_size)
    self.jitter = float(jitter)
    self.slow = bool(self.rng.random() < slow_frac)
    self.step_time = float(step_time) * (slow_factor if self.slow else 1.0)
    self.count = None
    self.cue = 0

  @property
  def obs_space(self):
    space = {
        **base.basic_obs_space(),
        'vector': elements.Space(np.float32, (self.size,)),
        'count': elements.Space(np.float32),
    }
    if self.tagged:
      space['tag'] = elements.Space(np.float32, (3,))
      space['log/pid'] = elements.Space(np.float32)
      space['log/episode'] = elements.Space(np.float32)
    return space

  @property
  def act_space(self):
    return {
        'action': elements.Space(np.int32, (), 0, 2),
        'reset': elements.Space(bool),
    }

  def step(self, action):
    self._sleep()
    if action['reset'] or self.count is None or self.count >= self.length:
      self.count = 0
      self.episode += 1
      return self._obs(0.0, is_first=True)
    reward = float(int(action['action']) == self.cue)
    self.count += 1
    return self._obs(reward, is_last=self.count >= self.length)

  def _obs(self, reward, is_first=False, is_last=False):
    self.cue = int(self.rng.integers(0, 2))
    vector = np.zeros(self.size, np.float32)
    vector[0] = self.cue
    obs = {
        **base.basic_obs(reward, is_first, is_last, is_terminal=is_last),
        'vector': vector,
        'count': np.float32(self.count),
    }
    if self.tagged:
      self.serial += 1
      obs['tag'] = np.array([self.seed, os.getpid(), self.serial], np.float32)
      obs['log/pid'] = np.float32(os.getpid())
      obs['log/episode'] = np.float32(self.episode)
    return obs

  def _sleep(self):
    if not self.step_time:
      return
    factor = np.exp(self.rng.normal(0, self.jitter)) if self.jitter else 1.0
    time.sleep(self.step_time * factor)
