"""The shape every transition batch on the wire has, checked in one place.

A batch is a dict of arrays with one row per env step: `envid` is an int
array [N] and every other value has N rows, except the optional shipment id
(`SHIPMENT`: int [sender, seq], stamped by the actor's Shipper) by which a
server recognises a resent batch. The replay and logger servers check it
before touching their state, so a malformed batch changes nothing and its
caller gets an error naming the key. `StoredShipments` tells a server
which rows of a resent batch it has not stored yet.
"""

import collections.abc

import numpy as np

from dreamer_ver.actor.shipping import SHIPMENT


def check_rows(trans, method, required=()):
  """{key: array} of the columns of `trans` (every key but `SHIPMENT`), or
  TypeError / ValueError naming `method`, the key, and what was expected."""
  if not isinstance(trans, collections.abc.Mapping):
    raise TypeError(
        f'{method} expects a dict of arrays, got {type(trans).__name__}.')
  missing = [key for key in ('envid', *required) if key not in trans]
  if missing:
    raise ValueError(
        f'{method}: missing keys {missing}; received keys {sorted(trans)}.')
  arrays = {key: np.asarray(value) for key, value in trans.items()
            if key != SHIPMENT}
  envid = arrays['envid']
  if envid.ndim != 1 or not np.issubdtype(envid.dtype, np.integer):
    raise ValueError(
        f"{method}: 'envid' must be an int array [N], received "
        f'{envid.dtype} {envid.shape}.')
  count = len(envid)
  for key, value in arrays.items():
    if value.ndim == 0 or value.shape[0] != count:
      received = value.shape[0] if value.ndim else 'a scalar'
      raise ValueError(
          f'{method}: key {key!r}: expected leading dim N={count} (from '
          f"'envid'), received {received} (shape {value.shape}).")
    if value.dtype == object:
      raise ValueError(f'{method}: key {key!r} has dtype object.')
  return arrays


def shipment_of(trans, method):
  """(sender, seq) of a batch's shipment id, None for a batch without one,
  or ValueError naming `method`."""
  if SHIPMENT not in trans:
    return None
  shipment = np.asarray(trans[SHIPMENT])
  if shipment.shape != (2,) or not np.issubdtype(shipment.dtype, np.integer):
    raise ValueError(
        f"{method}: {SHIPMENT!r} must be an int array [sender, seq], "
        f'received {shipment.dtype} {shipment.shape}.')
  sender, seq = shipment.tolist()
  return sender, seq


class StoredShipments:
  """Per sender, the newest shipment a server stored and how many of its
  rows, so that every shipment is stored once.

  The actor stamps each batch with ``[sender, seq]`` (``actor/shipping.py``)
  and sends in seq order. A batch with an older seq, or the same one fully
  stored, is a resend and stores nothing. One cut short (by a stop, or by a
  kill after a save's cut fell inside it) stores the rest when resent. A
  lower seq can only be a resend: a server takes one sender's batches one
  at a time in arrival order, and a reconnected client resends in order
  before its new calls. A batch without an id is stored as it comes.
  """

  def __init__(self):
    self.newest = {}  # sender -> (seq, rows of that batch stored)

  def first_new_row(self, shipment, rows):
    """The first row of a batch of ``rows`` rows that is not stored yet:
    0 for a new shipment or a batch without an id, ``rows`` for an older
    one, and for the newest one the rows it stored."""
    if shipment is None:
      return 0
    sender, seq = shipment
    stored_seq, stored_rows = self.newest.get(sender, (-1, 0))
    if seq < stored_seq:
      return rows
    return stored_rows if seq == stored_seq else 0

  def stored(self, shipment, rows):
    """Notes that the first ``rows`` rows of ``shipment`` are stored."""
    if shipment is not None:
      sender, seq = shipment
      self.newest[sender] = (seq, rows)

  def save(self):
    """As JSON: {"sender": [seq, rows]}."""
    return {str(sender): list(stored) for sender, stored in self.newest.items()}

  def load(self, state):
    """From what `save` returned."""
    self.newest = {int(sender): tuple(stored)
                   for sender, stored in state.items()}
