"""Per-env RSSM carries of one policy device, in one device-resident table.

The table holds `[slots + 1, ...]` carries; the extra last row absorbs the
padding rows of a bucket. The jitted policy step gathers the batch's rows by
slot, steps, and scatters the new carries back into the donated table, so
no per-env Python tree work happens on the hot path.
"""

import threading

import jax


def table_step(step):
  """Turns `step(carry, *args) -> (carry, *outs)` on a batch of carries into
  `(table, slots, *args) -> (table, *outs)`: gathers the rows at `slots`,
  steps, and scatters the new carries back (jit it with the table donated).
  Padding rows all point at the spare last row, so they never touch a
  real env's carry."""

  def stepped(table, slots, *args):
    carry = jax.tree.map(lambda x: x[slots], table)
    carry, *outs = step(carry, *args)
    table = jax.tree.map(lambda t, c: t.at[slots].set(c), table, carry)
    return (table, *outs)

  return stepped


class CarryFull(ValueError):
  """A new env id found no free carry slot: serving it would hand it the
  carry of another env that may still be running."""


class CarryLane:
  """One policy device's share of the actor: its carry table, the slots
  of the env ids it serves, and the lock its inference threads share.

  An env id keeps its slot for the lane's lifetime (a restarted env comes
  back with its id and resets its carry by `is_first`), so a slot is never
  handed to another env: once every slot is taken, a new id is refused
  (`CarryFull`, counted in `refused`) instead of silently continuing from
  another env's RSSM state.
  """

  def __init__(self, index, table, slots, device=None):
    self.index = index
    self.device = device
    self.table = table if device is None else jax.device_put(table, device)
    self.slots = int(slots)
    self.padding = self.slots  # the row that padding rows read and write
    self.slot_of = {}  # envid -> slot
    self.flat_params = None  # (the policy's params, their leaves)
    self.refused = 0  # requests of new env ids that found no free slot
    self.lock = threading.Lock()

  def slot(self, envid):
    """The slot of `envid`, a free one for a new id; raises CarryFull when
    every slot belongs to another env id."""
    slot = self.slot_of.get(envid)
    if slot is not None:
      return slot
    if len(self.slot_of) >= self.slots:
      self.refused += 1
      raise CarryFull(
          f'env id {envid} needs a carry slot, but all {self.slots} slots of '
          f'policy lane {self.index} belong to env ids '
          f'{_ids(self.slot_of)}; the actor holds run.envs + run.eval_envs '
          'carries: set them to cover every env id it serves')
    slot = self.slot_of[envid] = len(self.slot_of)
    return slot


def _ids(slot_of, shown=8):
  ids = sorted(slot_of)
  text = ', '.join(map(str, ids[:shown]))
  return f'[{text}{", ..." if len(ids) > shown else ""}]'
