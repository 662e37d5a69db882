"""A write-ahead log: records that must survive a kill between checkpoints.

The replay server (``replay/server.py``) logs what it stores so that
every row it acknowledged is back after a SIGKILL, not only the rows of its
last checkpoint.

What is logged
  Records: flat dicts of numpy arrays (numbers become 0-d arrays). The
  replay server writes two kinds: the rows of one ``add_batch`` it stored
  (env id, is_eval, the columns, the row time each got from ``Replay.add``,
  which names the row for good, how many of them the limiter counted, and
  the batch's shipment id with how many of its rows are stored so far),
  and the number of train sequences the limiter counted for a sample.

Format
  The log is a folder of segments, ``{generation:012d}.wal``, numbered in
  the order they were written. A segment is a sequence of records, each an
  8-byte little-endian payload length, the payload's CRC32 (4 bytes) and
  the payload: a 4-byte header length, the header (msgpack: key, dtype and
  shape of each array) and the arrays' bytes. (portal's ``packlib``, which
  the wire uses, walks nested trees: about 45 us per record of a batch, most
  of the log's cost; this takes about 10.) Only the end of a segment can be
  torn: a write that fails abandons its segment, later records go to the
  next.

When it is flushed
  ``commit`` hands the buffered records to the operating system, which the
  replay server does before it replies to ``add_batch``. Mode ``flush``
  stops there: the rows survive a kill of the process, not of the machine.
  ``fsync`` also fsyncs the segment (and the folder when a segment is
  created): they survive a power loss too, at the cost of a disk round trip
  per batch. ``off`` writes nothing: a kill loses the rows since the last
  checkpoint.

Recovery
  ``recover(covered)`` deletes the segments older than ``covered`` (the
  checkpoint holds their records) and returns the records of the others,
  oldest first. A record that is cut short or fails its checksum ends its
  segment: it was being written when the process died, so it was never
  acknowledged. Later records go to a segment numbered after all of them,
  so a crash during or after a recovery finds the same records again.

Truncation
  At a checkpoint the owner calls ``rotate``, under the same lock as its
  appends, and records the number it returns in the checkpoint: records
  appended before it are in the checkpoint's state, later ones are not.
  Once the checkpoint is on disk, ``drop_before`` deletes the older
  segments (``fsync`` mode first syncs the file systems, so the checkpoint
  is durable before the log that it replaces goes).

Crash windows, case by case: ``docs/architecture.md`` (the write-ahead
log).

Threads
  Not thread-safe: the owner serializes ``append``, ``commit``, ``rotate``
  and ``close``. ``drop_before`` only deletes older segments, so it may run
  alongside appends.
"""

import logging
import math
import os
import struct
import zlib
from pathlib import Path

import msgpack
import numpy as np

log = logging.getLogger(__name__)

MODES = ('flush', 'fsync', 'off')
SUFFIX = '.wal'
HEADER = struct.Struct('<QI')  # payload length, CRC32 of the payload


class WriteAheadLog:
  """Segments of records in ``directory``; ``mode`` is one of MODES."""

  def __init__(self, directory, mode='flush'):
    if mode not in MODES:
      raise ValueError(f'WAL mode must be one of {MODES}, got {mode!r}.')
    self.directory = Path(directory)
    self.mode = mode
    # The segment appends go to; its file is created by the first append.
    self.generation = max((g + 1 for g, _ in self._segments()), default=0)
    self._file = None

  @property
  def enabled(self):
    return self.mode != 'off'

  # ------------------------------------------------------------- writing

  def append(self, record):
    """Buffers one record (not yet flushed; see ``commit``)."""
    if not self.enabled:
      return
    buffers = _pack(record)
    size = sum(len(b) for b in buffers)
    crc = 0
    for buffer in buffers:
      crc = zlib.crc32(buffer, crc)
    try:
      file = self._file or self._open()
      # One write: a large record goes to the OS in one system call.
      file.write(b''.join([HEADER.pack(size, crc), *buffers]))
    except BaseException:
      self._abandon()
      raise

  def commit(self):
    """Makes the appended records survive a kill (``fsync``: a power loss)."""
    if self._file is None:
      return
    try:
      self._file.flush()
      if self.mode == 'fsync':
        os.fsync(self._file.fileno())
    except BaseException:
      self._abandon()
      raise

  def rotate(self):
    """Commits and starts a new segment; returns its generation: the
    segments before it hold every record appended so far."""
    self.commit()
    if self._file is not None:
      self._file.close()
      self._file = None
    self.generation += 1
    return self.generation

  def close(self):
    self.commit()
    if self._file is not None:
      self._file.close()
      self._file = None

  def _open(self):
    self.directory.mkdir(parents=True, exist_ok=True)
    self._file = open(self._path(self.generation), 'ab')
    if self.mode == 'fsync':
      _fsync_directory(self.directory)
    return self._file

  def _abandon(self):
    """After a failed write the segment may end in a partial record: close
    it and go on in the next one, so that only segment ends are torn."""
    if self._file is not None:
      try:
        self._file.close()
      except OSError:
        pass
      self._file = None
    self.generation += 1

  # ------------------------------------------------- recovery, truncation

  def recover(self, covered):
    """The records of the segments numbered ``covered`` or later, oldest
    first (an iterator); deletes the older segments. Later appends go to a
    segment numbered after all of them. Call it before the first append."""
    if self._file is not None:
      raise RuntimeError('WriteAheadLog.recover: records were appended.')
    self.drop_before(covered)
    segments = [(g, path) for g, path in self._segments() if g >= covered]
    self.generation = max(
        [covered, self.generation] + [g + 1 for g, _ in segments])
    return (record for _, path in segments
            for record in _read_segment(path))

  def drop_before(self, generation):
    """Deletes the segments numbered below ``generation``."""
    old = [path for g, path in self._segments() if g < generation]
    if old and self.mode == 'fsync':
      os.sync()  # The checkpoint that replaces them must be on disk first.
    for path in old:
      path.unlink(missing_ok=True)

  def _segments(self):
    """(generation, path) of the segment files, oldest first."""
    if not self.directory.is_dir():
      return []
    found = []
    for path in self.directory.glob('*' + SUFFIX):
      stem = path.name[:-len(SUFFIX)]
      if stem.isdigit():
        found.append((int(stem), path))
    return sorted(found)

  def _path(self, generation):
    return self.directory / f'{generation:012d}{SUFFIX}'


def _read_segment(path):
  """The complete records of one segment; stops at a torn one."""
  with open(path, 'rb') as file:
    left = os.fstat(file.fileno()).st_size
    while left:
      header = file.read(HEADER.size)
      size, crc = HEADER.unpack(header) if len(header) == HEADER.size else (
          0, 0)
      # A packed record is never empty; a length past the end is torn.
      payload = file.read(size) if 0 < size <= left - HEADER.size else b''
      record = None
      if len(payload) == size > 0 and zlib.crc32(payload) == crc:
        try:
          record = _unpack(payload)
        except Exception:
          pass
      if record is None:
        log.warning('Replay log %s: dropped a torn record at its end '
                    '(%d bytes).', path, left)
        return
      left -= HEADER.size + size
      yield record


def _pack(record):
  """Byte buffers of one record's payload (a dict of arrays)."""
  arrays = {key: np.asarray(value, order='C') for key, value in record.items()}
  header = msgpack.packb(
      [[key, a.dtype.str, list(a.shape)] for key, a in arrays.items()])
  return [len(header).to_bytes(4, 'little'), header,
          *(memoryview(a).cast('B') for a in arrays.values() if a.size)]


def _unpack(payload):
  size = int.from_bytes(payload[:4], 'little')
  offset = 4 + size
  record = {}
  for key, dtype, shape in msgpack.unpackb(payload[4:offset]):
    dtype, count = np.dtype(dtype), math.prod(shape)
    if count:
      record[key] = np.frombuffer(
          payload, dtype, count, offset).reshape(shape)
    else:
      record[key] = np.zeros(shape, dtype)
    offset += count * dtype.itemsize
  if offset != len(payload):
    raise ValueError('Record payload longer than its arrays.')
  return record


def _fsync_directory(directory):
  fd = os.open(directory, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)
