"""Envs that tests share. This module imports no JAX: env processes load
it."""

import sys
import time

import elements
import numpy as np
import pytest

from dreamer_ver.envs import base


def rendered_dmc(config):
  """A dmc cartpole env (`config` as for make_env) and its first
  observation; skips the test where MuJoCo cannot render."""
  pytest.importorskip('dm_control')
  from dreamer_ver.envs import make_env
  try:
    env = make_env('dmc_cartpole_balance', config)
    reset = {k: np.zeros(s.shape, s.dtype) for k, s in env.act_space.items()}
    reset['reset'] = np.bool_(True)
    return env, env.step(reset)
  except Exception as e:  # No usable OpenGL backend (EGL/OSMesa) here.
    pytest.skip(f'MuJoCo rendering unavailable: {type(e).__name__}: {e}')


class Counter(base.Env):
  """x = 1000 envid + its step number; an episode ends every `length`
  steps after its reset; env 1 is slow (its steps take 20 ms), so batches
  mix envs unevenly; `jax` says whether the process stepping the env
  imported JAX; the step numbered `fail_at` raises."""

  def __init__(self, envid, length=5, fail_at=None):
    self.envid, self.length, self.fail_at = envid, length, fail_at
    self.t, self.left = 0, 0

  @property
  def obs_space(self):
    return {'x': elements.Space(np.float32), 'jax': elements.Space(bool),
            **base.basic_obs_space()}

  @property
  def act_space(self):
    return {'a': elements.Space(np.float32), 'reset': elements.Space(bool)}

  def step(self, action):
    if self.envid == 1:
      time.sleep(0.02)
    if self.t == self.fail_at:
      raise ValueError(f'env {self.envid} fails at step {self.t}')
    first = bool(action['reset']) or self.left == 0
    self.left = self.length if first else self.left - 1
    x = np.float32(1000 * self.envid + self.t)
    self.t += 1
    return {'x': x, 'jax': 'jax' in sys.modules,
            **base.basic_obs(is_first=first, is_last=self.left == 0)}
