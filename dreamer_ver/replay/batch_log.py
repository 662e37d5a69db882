"""One write-ahead log record per ``add_batch`` of the replay server
(``runtime/replay_process.py``): built as its rows are stored, read back at
recovery.

A batch record holds the stored rows' ``envid``, ``is_eval`` and ``time``
(the row time ``Replay.add`` gave each, which names a row for good),
``inserts`` (how many of them the limiter counted), ``shipment`` = [sender,
seq, rows of the batch stored so far] when the batch had an id, and each
stored column under ``step/<key>`` (a column may have any name). The server
also logs ``{'samples': n}`` for each train sample.
"""

import numpy as np

STEP = 'step/'


class PendingRows:
  """The rows of one add_batch that are stored but not yet logged;
  ``shipment``: the batch's (sender, seq), or None."""

  def __init__(self, envid, is_eval, data, shipment):
    self.envid, self.is_eval, self.data = envid, is_eval, data
    self.shipment = shipment
    self.rows, self.times, self.inserts = [], [], 0

  def note(self, row, time, counts=False):
    """Row `row` was stored at `time`; `counts`: the limiter counted it."""
    self.rows.append(row)
    self.times.append(time)
    self.inserts += int(counts)

  def take(self):
    """The noted rows as one log record (None if there are none); the
    rows count as logged afterwards."""
    if not self.rows:
      return None
    rows = np.array(self.rows)
    whole = len(rows) == len(self.envid)  # All rows, in order: no copies.
    pick = lambda array: array if whole else array[rows]
    record = {
        'envid': pick(self.envid), 'is_eval': pick(self.is_eval),
        'time': np.array(self.times, np.int64),
        'inserts': np.int64(self.inserts),
        **{STEP + key: pick(value) for key, value in self.data.items()}}
    if self.shipment is not None:
      # [sender, seq, rows of the batch stored so far]: rows are stored in
      # order, so those up to the last one noted.
      record['shipment'] = np.array(
          [*self.shipment, self.rows[-1] + 1], np.int64)
    self.rows, self.times, self.inserts = [], [], 0
    return record


def contains(sorted_values, values):
  """Which of ``values`` are in the sorted array ``sorted_values``."""
  if not len(sorted_values):
    return np.zeros(len(values), bool)
  at = np.minimum(np.searchsorted(sorted_values, values),
                  len(sorted_values) - 1)
  return sorted_values[at] == values


def columns(record):
  """The stored columns of a batch record, by their own names."""
  return {key[len(STEP):]: value for key, value in record.items()
          if key.startswith(STEP)}
