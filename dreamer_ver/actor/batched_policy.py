"""Any jitted batched policy as a batch-server handler: the one inference
path, which the DreamerV3 actor (`actor.py`) runs too.

  policy = BatchedPolicy(fn, spec, carry=None, params=None, slots=64)
  replies, _ = policy.handle(requests)  # what a BatchServer calls
  policy.update(new_params, version)    # between batches, no recompile

`fn` takes and returns batches; its arguments depend on what the policy
keeps, in this order: `params` (when given), the carries (when `carry` is
given), `obs`, and a PRNG key (`keyed=True`, a new key per batch, folded
from the batch's number inside the jitted step: on the host it would be a
dispatch of its own, a third of a small batch's host time on a CPU):

  fn(obs) -> out                         fn(carry, obs) -> (carry, out)
  fn(params, obs) -> out                 fn(params, carry, obs) -> (carry, out)

`obs` is a dict of `[B, ...]` arrays shaped like `spec` (key -> (shape,
dtype) of one env, or a space or array), `out` a dict of `[B, ...]` arrays.
A request is one env's dict: the keys of `spec`, `envid` (an integer
scalar) when there are carries, any of the `meta` keys (key -> (shape,
dtype), like `spec`: values passed through, checked as observations are),
and `log/` keys.

Params: `params` is the first pytree, or a `ParamsStore` to share with a
trainer; `update(params, version)` publishes new ones, which the next batch
uses (they are an argument of the jitted step, so nothing recompiles), and
every reply carries the `version` that acted.

Carries: `carry` is one env's initial carry (a pytree of arrays). The table
of `slots + 1` carries lives on the lane's device; each env id gets a slot
on its first call and keeps it, so the carry a call gets is the one its
env's previous call returned (`carries.py`). Resetting is the policy's
business: send a flag such as `is_first` and select the initial carry
inside `fn`.

Lanes: one per device of `devices` (or of the params store), each with its
own carry table and params copy; a request names its lane (the batch
server routes each connection to one). Batches are padded to the next of
`buckets` (powers of two up to `slots` by default) and every bucket is
compiled by `compile()`, so nothing compiles while callers wait. A request
that does not fit gets a RequestError of its own; the rest of its batch is
served.
"""

import itertools
import time

import jax
import jax.numpy as jnp
import numpy as np

from dreamer_ver.actor.carries import CarryLane, table_step
from dreamer_ver.actor.params import ParamsStore
from dreamer_ver.actor.batching import powers_of_two
from dreamer_ver.actor.requests import admit


class BatchedPolicy:

  def __init__(self, fn, spec, carry=None, slots=64, buckets=None,
               device=None, params=None, version=0, devices=None, meta=None,
               keyed=False, seed=0):
    self.spec = {k: _struct(v) for k, v in spec.items()}
    self.slots = int(slots)
    self.buckets = sorted(set(buckets or powers_of_two(self.slots)))
    self.meta = {k: _struct(v) for k, v in (meta or {}).items()}
    self.carries = carry is not None
    if devices is None:
      devices = params.devices if isinstance(params, ParamsStore) else (
          device,)
    self.store = params
    if params is not None and not isinstance(params, ParamsStore):
      self.store = ParamsStore(params, version, devices)
    def table():  # One per lane: the jitted step donates it.
      return () if carry is None else jax.tree.map(
          lambda x: jnp.repeat(jnp.asarray(x)[None], self.slots + 1, 0), carry)
    self.lanes = [CarryLane(i, table(), self.slots, d)
                  for i, d in enumerate(devices)]
    self.key = jax.random.PRNGKey(seed)
    self._batch_numbers = itertools.count()  # one PRNG stream per batch
    self._treedef = jax.tree.structure(self._params(self.lanes[0])[0])
    self._step = jax.jit(table_step(_normalized(
        fn, params is not None, self.carries, keyed, self._treedef)),
        donate_argnums=(0,))
    self._out_spec = None

  @property
  def max_batch(self):
    return self.buckets[-1]

  @property
  def version(self):
    return self.store.version if self.store is not None else 0

  def update(self, params, version):
    """Publishes new params; the next batch of every lane uses them."""
    if self.store is None:
      raise ValueError('this policy was built without params')
    self.store.publish(params, version)

  def compile(self):
    """Compiles every bucket on every lane's device; returns the seconds of
    one compiled call per bucket, one dict per lane (a cutoff's starting
    estimate)."""
    times = []
    for lane in self.lanes:
      times.append({})
      params = self._params(lane)[0]
      for size in self.buckets:
        obs = {k: np.zeros((size, *s.shape), s.dtype)
               for k, s in self.spec.items()}
        slots = np.full((size,), lane.padding, np.int32)
        for _ in range(2):  # The second call measures the compiled step.
          start = time.perf_counter()
          jax.block_until_ready(self.forward(lane, params, slots, obs))
          times[-1][size] = time.perf_counter() - start
    return times

  def handle(self, requests):
    """Batch server handler: one reply (dict of arrays, with `version` when
    the policy has params) or RequestError per request, in order."""
    batch = self.admit([r.data for r in requests], requests[0].lane)
    replies = batch.errors
    if not batch.valid:
      return replies, None
    out, version = self.run(batch, requests[0].lane)
    if self.store is not None:
      out['version'] = np.full((len(batch.valid),), version, np.int64)
    for row, i in enumerate(batch.valid):
      replies[i] = {k: v[row] for k, v in out.items()}
    return replies, None

  def admit(self, datas, lane=0):
    """Checks request dicts of lane `lane` and stacks the valid ones into
    a padded batch with their carry slots (`requests.admit`)."""
    return admit(datas, self.spec, self.buckets,
                 self.lanes[lane] if self.carries else None, self.meta)

  def run(self, batch, lane=0):
    """The policy on an admitted batch of lane `lane`: (the out of its
    valid rows on the host, the params version that acted)."""
    lane = self.lanes[lane]
    with lane.lock:
      params, version = self._params(lane)
      number = next(self._batch_numbers) % 2 ** 32
      out = self.forward(lane, params, batch.slots, batch.obs, number)
    return fetch(out, len(batch.valid)), version

  def forward(self, lane, params, slots, obs, number=0):
    """The jitted step alone: gathers the carries at `slots` of the lane's
    table, runs the policy (keyed by batch `number`) and scatters the new
    carries back. Returns `out` on the device; the caller holds `lane.lock`
    if other threads serve the lane."""
    if lane.device is not None and self.store is None and not self.carries:
      # Else the lane's committed params and carries pin the step to its
      # device, and jit copies the host's arrays there itself: a device_put
      # of the obs first costs more than the step on a CPU (docs/benchmarks.md).
      obs = jax.device_put(obs, lane.device)
    lane.table, out = self._step(
        lane.table, slots, self._leaves(lane, params), obs, self.key,
        np.uint32(number))
    return out

  @property
  def out_spec(self):
    """One row of the policy's output: key -> (shape, dtype), what a shared
    memory client needs to know of the reply (traced once, when asked)."""
    if self._out_spec is None:
      lane = self.lanes[0]
      obs = {k: jax.ShapeDtypeStruct((1, *s.shape), s.dtype)
             for k, s in self.spec.items()}
      slots = jax.ShapeDtypeStruct((1,), np.int32)
      leaves = self._leaves(lane, self._params(lane)[0])
      _, out = jax.eval_shape(self._step, lane.table, slots, leaves, obs,
                              self.key, np.uint32(0))
      if not isinstance(out, dict):
        raise TypeError(
            f'the policy must return a dict of arrays, got {out}')
      self._out_spec = {k: (tuple(v.shape[1:]), np.dtype(v.dtype))
                        for k, v in out.items()}
      if self.store is not None:
        self._out_spec['version'] = ((), np.dtype(np.int64))
    return self._out_spec

  def _params(self, lane):
    if self.store is None:
      return (), 0
    return self.store.latest(lane.index)

  def _leaves(self, lane, params):
    """The leaves of `params`, flattened once per published tree (by
    identity): the jitted step takes them flat, as flattening the tree on
    every call cost 7 of its 19 us of dispatch on a CPU (size1m). The
    params and their leaves are one attribute, so that threads flattening
    at once never leave one's params with another's leaves."""
    flat = lane.flat_params
    if flat is None or flat[0] is not params:
      flat = lane.flat_params = (params, self._treedef.flatten_up_to(params))
    return flat[1]


def fetch(out, rows):
  """The first `rows` rows of each of the `out` dict's device arrays, on
  the host: every copy under way before the first wait (what
  `jax.device_get` does, at a third of its cost on a CPU)."""
  for value in out.values():
    value.copy_to_host_async()
  return {k: np.asarray(v)[:rows] for k, v in out.items()}


def _normalized(fn, params, carries, keyed, treedef):
  """`fn` as step(carry, leaves, obs, key, number) -> (carry, out),
  whatever of those it takes (the module docstring's order): the params
  are the `leaves` of `treedef`, the batch's key is `key` folded with
  `number`."""
  def step(carry, leaves, obs, key, number):
    weights = jax.tree.unflatten(treedef, leaves)
    args = ((weights,) if params else ()) + ((carry,) if carries else ()) + (
        obs,) + ((jax.random.fold_in(key, number),) if keyed else ())
    result = fn(*args)
    return tuple(result) if carries else (carry, result)
  return step


def _struct(space):
  """A spec entry: (shape, dtype), or anything with .shape and .dtype (an
  array, elements.Space, jax.ShapeDtypeStruct)."""
  shape, dtype = (space.shape, space.dtype) if hasattr(
      space, 'shape') else space
  return jax.ShapeDtypeStruct(tuple(shape), np.dtype(dtype))
