"""Persistence of the replay buffer: chunk files written, deleted and loaded
on one background thread (the "Files" section of `replay.py`'s docstring).

`Persistence` is a mixin of `Replay`: its methods work on the buffer's
chunks, references and items under the buffer's lock (`_lock`), and use the
buffer's `_io` executor (one thread, so file work happens in the order it was
requested), `_io_errors`, `directory`, `compress` and `_metrics`.
"""

import collections
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from dreamer_ver.core.atomic import StorageFault, storage_fault

from . import chunk as chunklib

log = logging.getLogger(__name__)


class Persistence:

  def save(self, wait=False):
    """Writes chunks that are new or changed since they were last written.

    Open chunks are written with the rows they have so far (and rewritten
    under their new name once they grow), so saving does not split streams.
    Chunks changed by ``update`` are rewritten too. Work happens on the
    background thread; ``wait=True`` blocks until it (and every earlier file
    operation) is done and raises if any of it failed.
    """
    if not self._io:
      return None
    with self._lock:
      todo = [chunk for chunk in self._chunks.values() if _needs_write(chunk)]
    for chunk in todo:
      self._io.submit(self._guarded, self._write_chunk, chunk)
    if wait:
      self.flush()
    return None

  def flush(self):
    """Waits for pending file operations; raises the first one that failed
    (a full or read-only disk's as the StorageFault it was)."""
    if not self._io:
      return
    self._barrier()
    errors, self._io_errors = self._io_errors, []
    if errors and isinstance(errors[0], StorageFault):
      raise errors[0]
    if errors:
      raise RuntimeError(
          f'{len(errors)} replay file operations failed.') from errors[0]

  def _barrier(self):
    if self._io:
      self._io.submit(lambda: None).result()

  def close(self):
    """Finishes pending file operations and stops the background thread."""
    if self._io:
      try:
        self.flush()
      finally:
        self._io.shutdown(wait=True)
        self._io = None

  def load(self, directory=None, amount=None):
    """Loads saved chunks, newest first, until ``amount`` items are covered.

    ``amount`` defaults to the capacity. Chunks already in memory (or freed
    by this buffer) are skipped; unreadable files are logged and skipped.

    The loaded items join the FIFO after the items already stored, in the
    order they were completed (the row times saved with each chunk), so a
    full buffer keeps exactly the newest ones. Chunks are chosen by creation
    time, newest first, each together with its predecessor, which holds the
    newest items of slower workers in all but extreme cases.

    Chunks loaded from this buffer's own directory keep their files (deleted
    on eviction); chunks from another directory are written to this buffer's
    directory by the next ``save``. Files that are not needed stay on disk.
    Returns the number of loaded items stored afterwards.
    """
    directory = Path(directory) if directory else self.directory
    if directory is None or not directory.is_dir():
      return 0
    own = bool(self.directory) and directory.resolve() == (
        self.directory.resolve())
    if own:
      self._barrier()  # Let queued writes and deletions land first.
    if amount is None:
      amount = self.capacity or np.inf

    with self._lock:
      skip = set(self._chunks) | self._retired
      live = [(c.time, c.uuid, c.succ, c.length) for c in self._chunks.values()]
    ondisk = _scan(directory, skip)
    counts = self._count_items(live + [
        (f.stamp, f.uuid, f.succ, f.length) for f in ondisk.values()])
    chosen, total = [], 0
    for file in sorted(ondisk.values(), reverse=True):
      if total >= amount:
        break
      chosen.append(file)
      total += counts[file.uuid]
    # Chunks are chosen by creation time, but items age by when they were
    # completed: a slower worker's newest items can sit in an older chunk.
    # So each chosen chunk brings its predecessor; the items beyond
    # ``amount`` are then dropped by exact step times.
    predecessors = {f.succ: f for f in ondisk.values()}
    taken = {file.uuid for file in chosen}
    for file in list(chosen):
      before = predecessors.get(file.uuid)
      if before is not None and before.uuid not in taken:
        chosen.append(before)
        taken.add(before.uuid)
    if not chosen:
      return 0

    paths = [file.path for file in chosen]
    with ThreadPoolExecutor(4, 'replay_load') as pool:
      loaded = [c for c in pool.map(_try_load, paths) if c is not None]
    if not own:
      for chunk in loaded:
        chunk.path = None
    return self._register(loaded, amount)

  def _register(self, loaded, amount):
    with self._lock:
      loaded = [
          c for c in loaded
          if c.uuid not in self._chunks and c.uuid not in self._retired]
      if not loaded:
        return 0
      spec = self._spec or _structure(loaded[0])
      for chunk in loaded:
        if _structure(chunk) != spec:
          raise ValueError(
              f'Replay.load: {chunk.path or chunk.filename} holds '
              f'{_structure(chunk)}, the buffer stores {spec}.')
      self._spec = spec
      for chunk in loaded:
        self._chunks[chunk.uuid] = chunk
      infos = [(c.time, c.uuid, c.succ, c.length)
               for c in self._chunks.values()]
      counts = self._count_items(infos)
      for chunk in loaded:
        self._refs[chunk.uuid] = counts[chunk.uuid]
      for chunk in loaded:
        if chunk.succ in self._chunks:
          self._refs[chunk.succ] += 1
          self._linked.add(chunk.uuid)
      for chunk in loaded:
        if self._refs.get(chunk.uuid, None) == 0:
          # Neither an item starts here nor does a loaded predecessor need it.
          self._refs[chunk.uuid] = 1
          self._release(chunk, delete_file=False)
      # Insert in the order the items were completed (by the time of their
      # last step), so the FIFO drops exactly the oldest ones.
      order = []
      for chunk in loaded:
        if chunk.uuid in self._chunks and counts[chunk.uuid]:
          ends = self._item_end_times(chunk, counts[chunk.uuid])
          order += [(end, row, chunk) for row, end in enumerate(ends.tolist())]
      order.sort(key=lambda entry: entry[:2])
      keep = int(min(amount, self.capacity or np.inf, len(order)))
      # Items that would be evicted right away are never inserted, and the
      # chunks that only they needed are dropped without touching the files.
      for _, _, chunk in order[:len(order) - keep]:
        self._release(chunk, delete_file=False)
      for _, row, chunk in order[len(order) - keep:]:
        self._insert(chunk, row)
      self._metrics['chunks_loaded'] += len(loaded)
      return keep

  def _item_end_times(self, chunk, count):
    """Times of the last steps of the first ``count`` items of a chunk."""
    parts, rows = [chunk.times[:chunk.length]], chunk.length
    while rows < count + self.length - 1:
      chunk = self._chunks[chunk.succ]
      parts.append(chunk.times[:chunk.length])
      rows += chunk.length
    times = np.concatenate(parts)
    return times[self.length - 1: self.length - 1 + count]

  def _count_items(self, infos):
    """Item starts per chunk, given (time, uuid, succ, length) of a set.

    A row starts an item when the chunk's remaining rows plus the rows of the
    chunks that follow it (within the set) hold at least ``length`` steps.
    """
    following = {}  # uuid -> rows in the chunk and all that follow it
    for _, uuid, succ, length in sorted(infos, reverse=True):
      following[uuid] = length + following.get(succ, 0)
    counts = {}
    for _, uuid, succ, length in infos:
      total = length + following.get(succ, 0)
      counts[uuid] = int(np.clip(total - self.length + 1, 0, length))
    return counts

  def _write_chunk(self, chunk):
    with self._lock:
      if chunk.uuid not in self._chunks or not _needs_write(chunk):
        return
      name = chunk.filename
      arrays = chunk.snapshot()
      chunk.dirty = False
      old = chunk.path
    path = self.directory / name
    try:
      chunklib.write_npz(path, arrays, self.compress)
    except BaseException:
      with self._lock:
        chunk.dirty = True
      raise
    with self._lock:
      chunk.path = path
      self._metrics['files_written'] += 1
    if old is not None and old != path:
      old.unlink(missing_ok=True)

  def _delete_file(self, chunk):
    with self._lock:
      path, chunk.path = chunk.path, None
    if path is not None:
      path.unlink(missing_ok=True)
      with self._lock:
        self._metrics['files_deleted'] += 1

  def _guarded(self, fn, *args):
    """Runs a file operation; keeps its error for `flush`. A full or
    read-only disk is an expected fault: kept as its one-line StorageFault
    without a traceback, and said by whoever flushes."""
    try:
      fn(*args)
    except Exception as error:
      fault = storage_fault(error)
      if fault is None:
        log.exception('Replay file operation failed')
      self._io_errors.append(fault or error)


class _File(collections.namedtuple('_File', 'stamp uuid succ length path')):
  """A chunk file found on disk; sorts by creation time."""


def _scan(directory, skip):
  """Chunk files in ``directory`` by uuid, leaving out the uuids in skip."""
  found = {}
  for path in directory.glob('*.npz'):
    try:
      file = _File(*chunklib.parse_filename(path.name), path)
    except ValueError:
      continue
    if file.uuid in skip:
      continue
    # A crash between writing a grown chunk and deleting its older file
    # leaves two files of one chunk: keep the one with more rows.
    other = found.get(file.uuid)
    if other is None or (file.length, file.succ != chunklib.NO_SUCC) > (
        other.length, other.succ != chunklib.NO_SUCC):
      found[file.uuid] = file
  return found


def _structure(chunk):
  return {key: (a.shape[1:], a.dtype) for key, a in chunk.data.items()}


def _needs_write(chunk):
  if chunk.length == 0:
    return False
  return chunk.dirty or chunk.path is None or chunk.path.name != chunk.filename


def _try_load(path):
  """The chunk at `path`, or None (said in one line: a damaged file is an
  expected fault, its rows are lost, the rest loads)."""
  try:
    return chunklib.Chunk.load(path)
  except Exception as error:
    log.warning('Skipping unreadable replay chunk %s (%s: %s).', path,
                type(error).__name__, error)
    return None
