"""A write-ahead log: records that must survive a kill between checkpoints
(the replay service's use of it and its crash windows: docs/architecture.md,
"The write-ahead log").

  log = WriteAheadLog(folder, mode)  # mode: 'flush', 'fsync' or 'off'
  log.append(record)                 # a flat dict of numpy arrays, buffered
  log.commit()                       # to the OS ('flush'), or to disk ('fsync')
  log.recover(covered)               # the records of segments >= covered
  generation = log.rotate()          # at a checkpoint; later records: not in it
  log.drop_before(generation)        # once that checkpoint is on disk

Format: a folder of segments ``{generation:012d}.wal``, numbered in the
order they were written; each record is an 8-byte little-endian payload
length, the payload's CRC32 (4 bytes) and the payload (a 4-byte header
length, a msgpack header with each array's key, dtype and shape, then the
arrays' bytes: about 10 us a record, where portal's ``packlib``, which
walks nested trees, takes 45). Only a segment's end can be torn: a write
that fails abandons its segment, and later records go to the next one.
``recover`` ends a segment at a record cut short or failing its checksum
(it was never acknowledged) and appends to a segment numbered after all of
them, so a crash during or after a recovery finds the same records again.
Mode ``flush`` survives a kill of the process, ``fsync`` a power loss too
(it also fsyncs the folder when a segment is created, and syncs the file
systems before ``drop_before``), ``off`` writes nothing.

Not thread-safe: the owner serializes ``append``, ``commit``, ``rotate``
and ``close``; ``drop_before`` only deletes older segments, so it may run
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

from dreamer_ver.core.atomic import with_path

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
    except BaseException as error:
      with_path(error, self._path(self.generation))
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
    except BaseException as error:
      with_path(error, self._path(self.generation))
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
