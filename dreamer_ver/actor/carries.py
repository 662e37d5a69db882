"""Per-env RSSM carries of one policy device, in one device-resident table.

The table holds `[slots + 1, ...]` carries; the extra last row absorbs the
padding rows of a bucket. The jitted policy step gathers the batch's rows by
slot, steps, and scatters the new carries back into the donated table, so
no per-env Python tree work happens on the hot path.
"""

import collections
import threading

import jax


class CarryLane:
  """One policy device's share of the actor: its carry table, the slots of
  the env ids it serves, and the lock its inference threads share."""

  def __init__(self, index, table, slots, device=None):
    self.index = index
    self.table = table if device is None else jax.device_put(table, device)
    self.slots = int(slots)
    self.padding = self.slots  # the row that padding rows read and write
    self.slot_of = collections.OrderedDict()  # envid -> slot, oldest first
    self.lock = threading.Lock()

  def slot(self, envid):
    """Slot of an env id; a new id takes a free slot or the least recently
    used one (its carry is reset anyway by that env's is_first)."""
    slot_of = self.slot_of
    if envid in slot_of:
      slot_of.move_to_end(envid)
      return slot_of[envid]
    if len(slot_of) < self.slots:
      slot = len(slot_of)
    else:
      _, slot = slot_of.popitem(last=False)
    slot_of[envid] = slot
    return slot
