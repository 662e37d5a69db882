"""The collector (`dreamer_ver/inference/collector.py`): every env's transitions come
out complete and in order, each with the reply its own carry produced, on
threads or in env processes, exactly `total_frames` of them."""

import functools

import jax.numpy as jnp
import numpy as np
import pytest
from helpers.envs import Counter
from portal.client_socket import Disconnected

from dreamer_ver.inference.collector import Collector
from dreamer_ver.inference.server import InferenceServer

LENGTH = 5  # steps per episode after the reset
CARRY = jnp.int32(0)


def per_episode(carry, obs):
  """Counts the env's calls since its episode began."""
  count = jnp.where(obs['is_first'], 0, carry) + 1
  return count, {'a': obs['x'] * 2, 'count': count}


def calls(carry, obs):
  """Counts all of the env's calls."""
  return carry + 1, {'a': obs['x'] * 2, 'count': carry + 1}


def counters(envs, **kwargs):
  return [functools.partial(Counter, i, **kwargs) for i in range(envs)]


def rows_of(batches):
  return {k: np.concatenate([b[k] for b in batches]) for k in batches[0]}


def check_calls(batches, envs, jax_imported):
  """Each env's transitions in order, each with the env's count of calls
  (its carry) and the action for its x; `jax`: where the envs stepped."""
  rows = rows_of(batches)
  assert {k: v.dtype for k, v in rows.items()} == {
      'x': np.float32, 'jax': bool, 'reward': np.float32, 'is_first': bool,
      'is_last': bool, 'is_terminal': bool, 'envid': np.int64,
      'a': np.float32, 'count': np.int32}
  assert all(v.shape == rows['x'].shape for v in rows.values())
  assert set(rows['envid']) <= set(range(envs))
  for envid in range(envs):
    mine = rows['envid'] == envid
    steps = np.arange(mine.sum())
    np.testing.assert_array_equal(rows['x'][mine], 1000 * envid + steps)
    np.testing.assert_array_equal(rows['count'][mine], steps + 1)
  np.testing.assert_array_equal(rows['a'], 2 * rows['x'])
  assert (rows['jax'] == jax_imported).all()


def test_every_envs_transitions_arrive_complete_and_in_order():
  envs = 4
  spec = {'x': ((), np.float32), 'is_first': ((), bool)}
  server = InferenceServer(per_episode, spec, carry=CARRY, slots=envs,
                           transports=('thread',)).start()
  try:
    with Collector(counters(envs, length=LENGTH), server,
                   frames_per_batch=10, total_frames=60) as collector:
      batches = list(collector)
    server.client().close()  # The collector left the given server open.
  finally:
    server.close()
  assert [len(b['x']) for b in batches] == [10] * 6
  rows = rows_of(batches)
  for envid in range(envs):
    mine = rows['envid'] == envid
    x = rows['x'][mine]
    np.testing.assert_array_equal(x, 1000 * envid + np.arange(len(x)))
    np.testing.assert_array_equal(rows['a'][mine], 2 * x)
    # The count since is_first: the env's own carry, reset each episode.
    step = np.arange(len(x)) % (LENGTH + 1)
    np.testing.assert_array_equal(rows['is_first'][mine], step == 0)
    np.testing.assert_array_equal(rows['count'][mine], step + 1)


def test_a_function_policy_serves_exactly_total_frames():
  made = []

  def make(envid):
    made.append(Counter(envid))
    return made[-1]

  with Collector([functools.partial(make, i) for i in range(3)], calls,
                 frames_per_batch=4, total_frames=10,
                 carry=CARRY) as collector:
    batches = list(collector)
    assert list(collector) == []
  assert [len(b['x']) for b in batches] == [4, 4, 2]
  assert sum(env.t for env in made) == 10  # The envs stepped no further.
  check_calls(batches, 3, jax_imported=True)
  with pytest.raises(Disconnected):  # The collector closed its server.
    collector.server.client()


def test_env_processes_give_the_same_transitions_and_import_no_jax():
  with Collector(counters(2), calls, frames_per_batch=4, total_frames=12,
                 processes=True, carry=CARRY) as collector:
    batches = list(collector)
  assert [len(b['x']) for b in batches] == [4, 4, 4]
  check_calls(batches, 2, jax_imported=False)


def test_an_env_that_raises_ends_iteration_naming_it():
  envs = [functools.partial(Counter, 0),
          functools.partial(Counter, 1, fail_at=3)]
  with Collector(envs, calls, frames_per_batch=4, carry=CARRY) as collector:
    with pytest.raises(
        RuntimeError,
        match='(?s)env 1 of the collector failed.*'
              'ValueError: env 1 fails at step 3'):
      for _ in collector:
        pass


@pytest.mark.parametrize('has, processes', [('thread', True),
                                            ('shm', False)])
def test_a_given_server_without_the_envs_transport_is_refused(
    has, processes):
  server = InferenceServer(calls, {'x': ((), np.float32)}, carry=CARRY,
                           transports=(has,))
  try:
    with pytest.raises(ValueError, match='transport'):
      Collector(counters(1), server, 4, processes=processes)
  finally:
    server.close()
