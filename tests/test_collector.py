"""The collector (`dreamer_ver/collector.py`): every env's transitions come
out complete and in order, each with the reply its own carry produced."""

import time

import elements
import jax.numpy as jnp
import numpy as np

from dreamer_ver.collector import Collector
from dreamer_ver.envs import base
from dreamer_ver.inference import InferenceServer

LENGTH = 5  # steps per episode after the reset


class Counter(base.Env):
  """x = 1000 envid + its step number; an episode ends every LENGTH steps;
  env 1 is slow (its steps take 20 ms), so batches mix envs unevenly."""

  def __init__(self, envid):
    self.envid, self.t, self.left = envid, 0, 0

  @property
  def obs_space(self):
    return {'x': elements.Space(np.float32), **base.basic_obs_space()}

  @property
  def act_space(self):
    return {'a': elements.Space(np.float32), 'reset': elements.Space(bool)}

  def step(self, action):
    if self.envid == 1:
      time.sleep(0.02)
    first = bool(action['reset']) or self.left == 0
    self.left = LENGTH if first else self.left - 1
    x = np.float32(1000 * self.envid + self.t)
    self.t += 1
    return {'x': x, **base.basic_obs(is_first=first, is_last=self.left == 0)}


def policy(carry, obs):
  count = jnp.where(obs['is_first'], 0, carry) + 1
  return count, {'a': obs['x'] * 2, 'count': count}


def test_every_envs_transitions_arrive_complete_and_in_order():
  envs, steps = 4, 23
  spec = {'x': ((), np.float32), 'is_first': ((), bool)}
  server = InferenceServer(policy, spec, carry=jnp.int32(0), slots=envs,
                           transports=('thread',)).start()
  try:
    with Collector(server, [Counter(i) for i in range(envs)], rows=10,
                   steps=steps) as collector:
      batches = list(collector)
  finally:
    server.close()
  assert all(len(b['x']) == 10 for b in batches[:-1])
  rows = {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}
  for envid in range(envs):
    mine = rows['envid'] == envid
    x = rows['x'][mine]
    np.testing.assert_array_equal(x, 1000 * envid + np.arange(steps))
    np.testing.assert_array_equal(rows['a'][mine], 2 * x)
    # The count since is_first: the env's own carry, reset each episode.
    np.testing.assert_array_equal(
        rows['count'][mine], np.arange(steps) % (LENGTH + 1) + 1)
    assert rows['is_first'][mine].sum() == -(-steps // (LENGTH + 1))
