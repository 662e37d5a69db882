"""BatchedPolicy's host path against a plain reference: the same rows,
carries and keys give the same outputs, whatever the path does to be fast."""

import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dreamer_ver.actor.batched_policy import BatchedPolicy
from dreamer_ver.actor.carries import CarryLane
from dreamer_ver.rpc.batch_requests import Request

SEED = 3


def fn(carry, obs, key):
  """A carry that sums what its env sent, and noise from the batch's key."""
  total = carry['total'] + obs['x']
  noise = jax.random.uniform(key, obs['x'].shape)
  return {'total': total}, {'total': total, 'noise': noise}


def test_outputs_and_carries_match_a_reference_batch_by_batch():
  policy = BatchedPolicy(
      fn, {'x': ((), np.float32)}, carry={'total': jnp.zeros((), jnp.float32)},
      slots=8, keyed=True, seed=SEED)
  policy.compile()
  rng = np.random.default_rng(0)
  totals = {}  # The reference: envid -> its carry.
  for number, envids in enumerate(
      [[0], [2, 1, 0], [4, 3, 2, 1, 0], [7, 6, 5, 4, 3, 2, 1, 0], [5, 7]]):
    xs = rng.normal(size=len(envids)).astype(np.float32)
    requests = [Request(conn=e, reqnum=number, arrival=0.0, envid=e,
                        data={'x': x, 'envid': np.int64(e)})
                for e, x in zip(envids, xs)]
    replies, _ = policy.handle(requests)
    size = min(b for b in policy.buckets if b >= len(envids))
    key = jax.random.fold_in(jax.random.PRNGKey(SEED), number)
    noise = np.asarray(jax.random.uniform(key, (size,)))[:len(envids)]
    for row, (envid, x, reply) in enumerate(zip(envids, xs, replies)):
      totals[envid] = np.float32(totals.get(envid, 0.0) + x)
      assert reply['total'] == totals[envid], (number, envid)
      assert reply['noise'] == noise[row], (number, envid)


def test_rows_with_a_value_that_is_not_finite_fail_alone():
  policy = BatchedPolicy(lambda obs: {'y': obs['x'].sum(-1)},
                         {'x': ((3,), np.float32)}, slots=8)
  xs = [[1, 2, 3], [1, np.nan, 3], [4, 5, 6], [np.inf, 0, 0]]
  requests = [Request(conn=i, reqnum=0, arrival=0.0, envid=i,
                      data={'x': np.array(x, np.float32)})
              for i, x in enumerate(xs)]
  replies, _ = policy.handle(requests)
  assert [r['y'] for r in (replies[0], replies[2])] == [6, 15]
  for bad in replies[1], replies[3]:
    assert str(bad) == "key 'x': values must be finite"


def test_params_of_another_structure_are_refused_when_published():
  policy = BatchedPolicy(lambda params, obs: {'y': obs['x'] * params['w']},
                         {'x': ((), np.float32)}, params={'w': np.float32(2)},
                         slots=2)
  policy.update({'w': np.float32(3)}, 1)
  request = Request(conn=0, reqnum=0, arrival=0.0, data={'x': np.float32(1)})
  assert policy.handle([request])[0][0]['y'] == 3
  with pytest.raises(ValueError, match='published params are'):
    policy.update({'w': np.float32(4), 'b': np.float32(0)}, 2)
  assert policy.handle([request])[0][0]['y'] == 3  # still the last good ones


def test_params_and_their_leaves_stay_a_pair_when_threads_interleave():
  """A batch's thread and another flattening older params at the same
  time (the output spec is read without the lane's lock): however their
  writes interleave, the next batch runs the newest params."""
  policy = BatchedPolicy(lambda params, obs: {'y': obs['x'] * params['w']},
                         {'x': ((), np.float32)}, params={'w': np.float32(0)},
                         slots=1)
  lane = policy.lanes[0]
  old = policy._params(lane)[0]
  policy.update({'w': np.float32(2)}, 1)
  new = policy._params(lane)[0]
  wrote, resume = threading.Event(), threading.Event()

  class Paused(CarryLane):  # Thread A stops after its first write.
    def __setattr__(self, key, value):
      object.__setattr__(self, key, value)
      if threading.current_thread().name == 'A' and not wrote.is_set():
        wrote.set()
        resume.wait(10)

  lane.__class__ = Paused
  thread = threading.Thread(target=policy._leaves, args=(lane, new), name='A')
  thread.start()
  assert wrote.wait(10)
  policy._leaves(lane, old)
  resume.set()
  thread.join(10)
  lane.__class__ = CarryLane
  out, version = policy.run(policy.admit([{'x': np.float32(1)}]), 0)
  assert version == 1 and out['y'].tolist() == [2]
