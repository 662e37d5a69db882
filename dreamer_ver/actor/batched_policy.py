"""Any jitted batched policy as a batch-server handler, with or without
per-env carries: the actor's machinery without the DreamerV3 agent.

  policy = BatchedPolicy(fn, spec, carry=None, slots=64, buckets=None)
  replies, _ = policy.handle(requests)  # what a BatchServer calls

`fn(obs) -> out` without carries, or `fn(carry, obs) -> (carry, out)` with
them, takes and returns batches: `obs` a dict of `[B, ...]` arrays shaped
like `spec` (key -> (shape, dtype) of one env, or a space or array),
`out` a dict of `[B, ...]` arrays. A request is one env's dict: the keys
of `spec` (and `envid`, an integer scalar, when there are carries).

Carries: `carry` is one env's initial carry (a pytree of arrays). The table
of `slots + 1` carries lives on `device`; each env id gets a slot on its
first call and keeps it, so the carry a call gets is the one its env's
previous call returned (`carries.py`). Resetting is the policy's business:
send a flag such as `is_first` and select the initial carry inside `fn`.

Batches are padded to the next of `buckets` (powers of two up to `slots` by
default) and every bucket is compiled by `compile()`, so nothing compiles
while callers wait. A request that does not fit `spec` gets a RequestError
of its own; the rest of its batch is served.
"""

import time

import jax
import jax.numpy as jnp
import numpy as np

from dreamer_ver.actor.carries import CarryLane, table_step
from dreamer_ver.actor.preemption import powers_of_two
from dreamer_ver.actor.requests import admit, bucket_of, stack_rows


class BatchedPolicy:

  def __init__(self, fn, spec, carry=None, slots=64, buckets=None,
               device=None):
    self.spec = {k: _struct(v) for k, v in spec.items()}
    self.slots = int(slots)
    self.buckets = sorted(set(buckets or powers_of_two(self.slots)))
    self.device = device
    self.lane = None
    if carry is None:
      self._step = jax.jit(fn)
    else:
      table = jax.tree.map(
          lambda x: jnp.repeat(jnp.asarray(x)[None], self.slots + 1, 0), carry)
      self.lane = CarryLane(0, table, self.slots, device)
      self._step = jax.jit(table_step(fn), donate_argnums=(0,))
    self.out_spec = self._out_spec()

  @property
  def max_batch(self):
    return self.buckets[-1]

  def compile(self):
    """Compiles every bucket; returns the seconds of one compiled call per
    bucket (a cutoff's starting estimate)."""
    times = {}
    for size in self.buckets:
      obs = {k: np.zeros((size, *s.shape), s.dtype)
             for k, s in self.spec.items()}
      for _ in range(2):  # The second call measures the compiled step.
        start = time.perf_counter()
        jax.block_until_ready(self._run(obs, size))
        times[size] = time.perf_counter() - start
    return times

  def handle(self, requests):
    """Batch server handler: one reply (dict of arrays) or RequestError
    per request, in order."""
    replies, valid = admit(requests, self.spec, self.lane)
    if not valid:
      return replies, None
    datas = [requests[i].data for i in valid]
    size = bucket_of(self.buckets, len(datas))
    obs = stack_rows(datas, self.spec, size)
    slots = [self.lane.slot_of[int(d['envid'])] for d in datas
             ] if self.lane is not None else []
    out = jax.device_get(self._run(obs, size, slots))
    for row, i in enumerate(valid):
      replies[i] = {k: v[row] for k, v in out.items()}
    return replies, None

  def _run(self, obs, size, slots=()):
    """The jitted step on a padded batch; `slots` are the carry slots of
    its first rows (the rest read and write the padding row)."""
    if self.device is not None:
      obs = jax.device_put(obs, self.device)
    if self.lane is None:
      return self._step(obs)
    index = np.full((size,), self.lane.padding, np.int32)
    index[:len(slots)] = slots
    with self.lane.lock:
      self.lane.table, out = self._step(self.lane.table, index, obs)
    return out

  def _out_spec(self):
    """One row of the policy's output: key -> (shape, dtype), what a shared
    memory client needs to know of the reply."""
    obs = {k: jax.ShapeDtypeStruct((1, *s.shape), s.dtype)
           for k, s in self.spec.items()}
    if self.lane is None:
      out = jax.eval_shape(self._step, obs)
    else:
      index = jax.ShapeDtypeStruct((1,), np.int32)
      _, out = jax.eval_shape(self._step, self.lane.table, index, obs)
    if not isinstance(out, dict):
      raise TypeError(f'the policy must return a dict of arrays, got {out}')
    return {k: (tuple(v.shape[1:]), np.dtype(v.dtype)) for k, v in out.items()}


def _struct(space):
  """A spec entry: (shape, dtype), or anything with .shape and .dtype (an
  array, elements.Space, jax.ShapeDtypeStruct)."""
  shape, dtype = (space.shape, space.dtype) if hasattr(
      space, 'shape') else space
  return jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype))
