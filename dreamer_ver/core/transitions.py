"""What a transition batch is: the one contract between the actor that
ships it, replay and the logger that take it, and the learner that trains on
what replay stored. Every other module imports these names from here.

A batch is a dict of numpy arrays with one row per env step, N rows:

  envid            int [N]     the env the row belongs to (ROUTING_KEYS)
  is_eval          bool [N]    an eval env's row: the eval replay stores it,
                               the train replay never (ROUTING_KEYS)
  <obs key>        [N, ...]    the env's observation, as its obs_space says,
                               with reward, is_first, is_last, is_terminal
  <action key>     [N, ...]    the action the policy took (act_space)
  dyn/deter, ...   [N, ...]    the policy's carry after the step (the latents
                               the learner starts from)
  version          int64 [N]   the params version that acted
  log/<name>       [N, ...]    a value only logged (LOG_PREFIX): never stored
                               by replay, never seen by the agent
  shipment         int [2]     [sender, seq], the one key that is not a
                               column (SHIPMENT): a resent batch is stored
                               once (`StoredShipments`)

The actor's requests carry observations, `envid` and `is_eval` (META: key
-> (shape, dtype) of one request's value; passed through, not observed).
Replay adds `stepid` and `consec` to what it stores (RESERVED_KEYS): a
batch's own values for them are dropped. The logger needs LOGGER_KEYS in
every row. `check_rows` checks the shape; the servers call it before
touching their state, so a malformed batch changes nothing and its caller
gets an error naming the key.
"""

import collections.abc

import numpy as np

SHIPMENT = 'shipment'
LOG_PREFIX = 'log/'
META = {'is_eval': ((), bool)}
ROUTING_KEYS = ('envid', 'is_eval')
RESERVED_KEYS = ('stepid', 'consec')
LOGGER_KEYS = ('envid', 'is_eval', 'is_first', 'is_last', 'reward')


def is_log(key):
  """Whether `key` is only logged (`log/<name>`)."""
  return key.startswith(LOG_PREFIX)


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
