"""A chunk: a fixed number of consecutive steps of one worker, stored by column.

A chunk holds one preallocated numpy array per key, each of shape
``[size, *step_shape]``. The arrays are created from the first appended step,
so a chunk costs nothing until it is used. ``length`` says how many rows are
filled; rows are only ever appended, never removed, so rows below ``length``
stay where they are for the lifetime of the chunk (``write`` may change their
values in place).

Chunks of the same worker form a chain: ``succ`` is the uuid of the chunk that
continues the stream, so a sequence may start near the end of one chunk and
continue in the next.

Every row also records when it was appended (``times``, nanoseconds from
the same strictly increasing clock as chunk stamps), so the order of steps
across workers survives a save and load.

On disk a chunk is one ``.npz`` file holding only the filled rows, plus the
row times under the member name ``TIME_KEY``. Everything that is not an array
lives in the file name::

    {time:020d}-{uuid hex}-{succ hex}-{length}.npz

``time`` is a creation stamp in nanoseconds that increases strictly within a
process, so sorting file names sorts chunks by age. Files are written and read
without pickle.
"""

import threading
import time
import uuid as uuidlib
import zipfile
from pathlib import Path

import numpy as np

from dreamer_ver.core.atomic import write_atomically

UUID_BYTES = 16
NO_SUCC = bytes(UUID_BYTES)
TIME_KEY = '__time__'

_stamp_lock = threading.Lock()
_last_stamp = 0


def new_uuid():
  """Returns 16 random bytes that are never all zero."""
  while True:
    value = uuidlib.uuid4().bytes
    if value != NO_SUCC:
      return value


def timestamp():
  """Nanoseconds since the epoch, strictly increasing within this process."""
  global _last_stamp
  with _stamp_lock:
    _last_stamp = max(time.time_ns(), _last_stamp + 1)
    return _last_stamp


class Chunk:
  """Up to ``size`` consecutive steps, one numpy array per key."""

  __slots__ = (
      'uuid', 'succ', 'time', 'size', 'length', 'data', 'times', 'path',
      'dirty')

  def __init__(self, size, uuid=None, stamp=None):
    if size < 1:
      raise ValueError(f'Chunk size must be at least 1, got {size}.')
    self.uuid = uuid or new_uuid()
    self.succ = NO_SUCC
    self.time = timestamp() if stamp is None else int(stamp)
    self.size = int(size)
    self.length = 0
    self.data = None
    self.times = None
    # Persistence bookkeeping: the file that currently holds this chunk, and
    # whether filled rows were changed in place since that file was written.
    self.path = None
    self.dirty = False

  def __repr__(self):
    return f'Chunk({self.filename}, size={self.size})'

  @property
  def full(self):
    return self.length >= self.size

  @property
  def nbytes(self):
    if self.data is None:
      return 0
    return sum(array.nbytes for array in self.data.values())

  @property
  def filename(self):
    return format_filename(self.time, self.uuid, self.succ, self.length)

  def append(self, step, stamp=None):
    """Writes one step (a dict of arrays) into the next free row."""
    if self.full:
      raise ValueError(f'{self!r} is full.')
    if TIME_KEY in step:
      raise ValueError(f'{TIME_KEY!r} is reserved for row times.')
    if self.data is None:
      self.data = {
          key: np.empty((self.size, *np.shape(value)), np.asarray(value).dtype)
          for key, value in step.items()}
      self.times = np.zeros(self.size, np.int64)
    for key, value in step.items():
      self.data[key][self.length] = value
    self.times[self.length] = timestamp() if stamp is None else stamp
    self.length += 1

  def slice(self, start, stop):
    """Views of rows ``start`` to ``stop`` (exclusive) of every key."""
    if not 0 <= start <= stop <= self.length:
      raise IndexError(f'Rows {start}:{stop} outside {self.length} filled.')
    return {key: array[start:stop] for key, array in self.data.items()}

  def write(self, rows, values):
    """Overwrites filled ``rows`` (an index array or slice) of some keys."""
    for key, value in values.items():
      self.data[key][rows] = value
    self.dirty = True

  def snapshot(self):
    """Copies of the filled rows (and their times under ``TIME_KEY``)."""
    if self.data is None:
      return {}
    arrays = {k: array[:self.length].copy() for k, array in self.data.items()}
    arrays[TIME_KEY] = self.times[:self.length].copy()
    return arrays

  def save(self, directory, compress=True):
    """Writes the filled rows to ``directory`` and returns the path."""
    path = Path(directory) / self.filename
    write_npz(path, self.snapshot(), compress)
    self.path = path
    self.dirty = False
    return path

  @classmethod
  def load(cls, path):
    """Reads a chunk file written by ``save`` (or ``write_npz``)."""
    path = Path(path)
    stamp, uuid, succ, length = parse_filename(path.name)
    with np.load(path, allow_pickle=False) as archive:
      data = {key: archive[key] for key in archive.files}
    times = data.pop(TIME_KEY, None)
    if times is None:  # Without row times, rows count up from the stamp.
      times = stamp + np.arange(length, dtype=np.int64)
    for key, array in {**data, TIME_KEY: times}.items():
      if len(array) != length:
        raise ValueError(
            f'{path.name}: key {key!r} has {len(array)} rows, the file name '
            f'says {length}.')
    chunk = cls(max(length, 1), uuid=uuid, stamp=stamp)
    chunk.succ = succ
    chunk.length = length
    chunk.data = data
    chunk.times = times.astype(np.int64)
    chunk.path = path
    return chunk


def format_filename(stamp, uuid, succ, length):
  return f'{stamp:020d}-{uuid.hex()}-{succ.hex()}-{length}.npz'


def parse_filename(name):
  """Splits a chunk file name into (time, uuid, succ, length).

  Raises ValueError for names that are not chunk files.
  """
  if not name.endswith('.npz'):
    raise ValueError(f'Not a chunk file name: {name!r}')
  parts = name[:-len('.npz')].split('-')
  if len(parts) != 4:
    raise ValueError(f'Not a chunk file name: {name!r}')
  stamp, uuid, succ, length = parts
  uuid, succ = bytes.fromhex(uuid), bytes.fromhex(succ)
  if len(uuid) != UUID_BYTES or len(succ) != UUID_BYTES:
    raise ValueError(f'Not a chunk file name: {name!r}')
  return int(stamp), uuid, succ, int(length)


def write_npz(path, arrays, compress=True):
  """Writes arrays as an ``.npz`` archive without pickle, atomically.

  The archive is built member by member (rather than with ``np.savez``) so any
  key name works, and it is written to a temporary name first and then moved
  into place, so a reader never sees half a file.
  """
  method = zipfile.ZIP_DEFLATED if compress else zipfile.ZIP_STORED

  def write(file):
    with zipfile.ZipFile(file, 'w', compression=method, compresslevel=1) as zf:
      for key, array in arrays.items():
        with zf.open(key + '.npy', 'w', force_zip64=True) as member:
          np.lib.format.write_array(
              member, np.ascontiguousarray(array), allow_pickle=False)
  write_atomically(path, write)
