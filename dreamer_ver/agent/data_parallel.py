"""`Agent.train` and `Agent.report` data-parallel over a set of devices.

  dp = DataParallel(agent, jax.devices())
  state = dp.put_state(state)              # replicated on every device
  carry = dp.put_rows(agent.init_carry(B))  # rows split along 'data'
  state, carry, outs, metrics = dp.train(state, carry, dp.put_rows(batch))

One mesh axis, `data`, over the devices. Batch rows (and the train carry,
and the fresh latents `train` returns for replay) are split along it; the
state -- params, optimizer, slow critic, return normaliser, step, RNG --
is replicated. The step is the agent's own `_train`, compiled once for
these shardings: XLA partitions it and inserts the reductions (gradient
sums, the return normaliser's batch percentiles, the loss means), so the
result is the one-device step on the same global batch, up to the order
of float sums. Random draws agree as well: JAX's threefry keys are
partitionable (the default), so a row's draw does not depend on where it
runs.

Multi-host: every process builds the mesh over all processes' devices
(`jax.devices()` after `jax.distributed.initialize`) and passes its own
rows to `put_rows`, which assembles the global array from each process's
part (`jax.make_array_from_process_local_data`). On one host the process's
part is the whole batch. `local` and `local_rows` take a process's part of
the results back out.
"""

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P


class DataParallel:

  def __init__(self, agent, devices):
    devices = list(devices)
    self.processes = len({device.process_index for device in devices})
    self.mesh = Mesh(np.array(devices), ('data',))
    self.replicated = NamedSharding(self.mesh, P())
    self.rows = NamedSharding(self.mesh, P('data'))
    rep, rows = self.replicated, self.rows
    # Shardings given for whole arguments apply to every leaf under them.
    self.train = jax.jit(
        agent._train, donate_argnums=(0,),
        in_shardings=(rep, rows, rows), out_shardings=(rep, rows, rows, rep))
    stacked = self.split(axis=1)  # train_many: [K, rows, ...]
    self.train_many = jax.jit(
        agent._train_many, donate_argnums=(0,),
        in_shardings=(rep, rows, stacked),
        out_shardings=(rep, rows, stacked, rep))
    self.report = jax.jit(
        agent._report, in_shardings=(rep, rows), out_shardings=rep)

  def split(self, axis=0):
    """Arrays split along `data` at `axis`, whole along the others."""
    return NamedSharding(self.mesh, P(*[None] * axis, 'data'))

  def put_state(self, state):
    return jax.device_put(state, self.replicated)

  def put_rows(self, tree, axis=0):
    """This process's rows (along `axis`) of a batch or carry, as global
    arrays split along `data`; one host: all of them."""
    rows = self.split(axis)
    return jax.tree.map(
        lambda x: jax.make_array_from_process_local_data(rows, x), tree)

  def local(self, tree):
    """This process's copy of replicated arrays (the state, the metrics),
    on its first train device."""
    return jax.tree.map(lambda x: x.addressable_data(0), tree)

  def local_rows(self, tree, axis=0):
    """This process's rows (along `axis`) of row-split arrays, as numpy:
    what it passed to `put_rows`, in the same order."""
    def rows(x):
      shards = sorted(x.addressable_shards,
                      key=lambda s: s.index[axis].start or 0)
      return np.concatenate([np.asarray(s.data) for s in shards], axis)
    return jax.tree.map(rows, tree)
