"""The replay buffer: stores steps per worker, samples fixed-length sequences.

Storage
  Each worker (an env id, say) writes into its own chain of chunks (see
  ``chunk.py``). Every stored step gets a ``stepid``: the 16 uuid bytes of its
  chunk followed by its row index as 4 big-endian bytes (uint8[20]). Step ids
  let the learner address rows later (``update``).

Items
  An item is a sequence of ``length`` consecutive steps of one worker,
  identified by its first step. Items overlap (a sliding window with stride
  one): once a worker has written ``length`` steps past some step, that step
  becomes the start of a new item. The window may run past the end of its
  chunk into the successor chunks.

Capacity
  ``capacity`` bounds the number of items (close to the number of steps).
  Inserting into a full buffer first removes the oldest item (FIFO). A chunk
  is freed once nothing refers to it any more, and if it was saved, its file
  is deleted.

  What refers to a chunk: each item that starts in it, each step of it that
  is not an item start yet (the newest ``length - 1`` steps of a worker), the
  worker that is still writing into it, and its predecessor in the chain
  while that predecessor is alive (items of the predecessor may extend into
  it).

Online queue
  With ``online=True`` every ``length``-th item of each worker (the item
  starting at worker step 0, ``length``, ``2 * length``, ...) is also queued,
  and ``sample(mode='train')`` takes queued items first. So every
  non-overlapping sequence of fresh data is trained on at least once; the
  selector is used when the queue is empty.

Files
  With a ``directory``, ``save`` writes each chunk to one file (only chunks
  that are new, grew, got a successor or were updated since their last
  write), and freeing a chunk deletes its file, so the directory holds about
  what the buffer holds (upstream never deleted chunk files). ``load``
  restores the newest items, in their original order.

Threads
  All bookkeeping happens under one lock, so ``add``, ``sample``, ``update``,
  ``save`` and ``load`` may be called from different threads. ``sample``
  copies the rows outside the lock: rows of a chunk never move and freed chunks
  are not reused, so only a concurrent ``update`` of the same rows can be seen
  half-applied. Files are written and deleted on one background thread, in
  the order the work was requested.
"""

import collections
import collections.abc
import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from . import chunk as chunklib
from . import selectors as selectorlib


STEPID_BYTES = chunklib.UUID_BYTES + 4

# Keys the buffer produces itself; callers' values for them are dropped.
RESERVED_KEYS = ('stepid', 'consec')

log = logging.getLogger(__name__)


class Replay:

  def __init__(
      self, length, capacity, directory=None, chunksize=1024, online=False,
      selector=None, seed=0, compress=True):
    if length < 1:
      raise ValueError(f'length must be at least 1, got {length}.')
    if capacity is not None and capacity < 1:
      raise ValueError(f'capacity must be at least 1 or None, got {capacity}.')
    if chunksize < 1:
      raise ValueError(f'chunksize must be at least 1, got {chunksize}.')
    self.length = int(length)
    self.capacity = None if capacity is None else int(capacity)
    self.chunksize = int(chunksize)
    self.online = online
    self.selector = selector if selector is not None else (
        selectorlib.Uniform(seed))
    self.compress = compress

    self._lock = threading.RLock()
    self._nonempty = threading.Condition(self._lock)
    self._spec = None  # key -> (shape, dtype) of one step, incl. stepid

    self._chunks = {}  # uuid -> live chunk
    self._refs = {}  # uuid -> number of references
    self._linked = set()  # uuids of chunks holding a reference on their succ
    self._retired = set()  # uuids of chunks freed here; never load them again

    self._items = {}  # item id -> (chunk, start row)
    self._fifo = collections.deque()  # item ids, oldest first
    self._next_item = 0
    self._queue = collections.deque()  # online item ids, oldest first

    self._open = {}  # worker -> chunk it writes into
    self._pending = {}  # worker -> deque of (chunk, row) not yet item starts
    self._written = collections.defaultdict(int)  # worker -> steps written

    self.directory = Path(directory) if directory else None
    if self.directory:
      self.directory.mkdir(parents=True, exist_ok=True)
      self._io = ThreadPoolExecutor(1, 'replay_io')
    else:
      self._io = None
    self._io_errors = []

    self._metrics = collections.Counter()

  def __len__(self):
    return len(self._items)

  @property
  def spec(self):
    """The stored structure: key -> (shape, dtype) of one step, or None."""
    return None if self._spec is None else dict(self._spec)

  # ------------------------------------------------------------------ add

  def add(self, step, worker=0):
    """Appends one step (a dict of array-likes) to ``worker``'s stream.

    Keys starting with ``log/`` and the reserved keys (``stepid``, ``consec``)
    are dropped. The first step fixes the stored structure; a later step whose
    keys, shapes or dtypes differ raises ValueError and changes nothing.
    """
    step = _prepare_step(step)
    with self._lock:
      if self._spec is None:
        spec = {key: (value.shape, value.dtype) for key, value in step.items()}
        spec['stepid'] = ((STEPID_BYTES,), np.dtype(np.uint8))
        self._spec = spec
      else:
        self._check_step(step)

      chunk = self._open.get(worker)
      if chunk is None:
        chunk = self._new_chunk(refs=1)
        self._open[worker] = chunk
        self._pending[worker] = collections.deque()
      row = chunk.length
      step['stepid'] = np.frombuffer(
          chunk.uuid + row.to_bytes(4, 'big'), np.uint8)
      chunk.append(step)
      self._refs[chunk.uuid] += 1
      pending = self._pending[worker]
      pending.append((chunk, row))
      if chunk.full:
        self._seal(chunk, worker)

      self._metrics['adds'] += 1
      self._written[worker] += 1
      if len(pending) >= self.length:
        start_chunk, start_row = pending.popleft()
        itemid = self._insert(start_chunk, start_row)
        position = self._written[worker] - self.length
        if self.online and position % self.length == 0:
          self._queue.append(itemid)

  def _check_step(self, step):
    expected = {k: v for k, v in self._spec.items() if k not in RESERVED_KEYS}
    missing = sorted(set(expected) - set(step))
    unexpected = sorted(set(step) - set(expected))
    problems = []
    if missing:
      problems.append(f'missing keys {missing}')
    if unexpected:
      problems.append(f'unexpected keys {unexpected}')
    for key in sorted(set(expected) & set(step)):
      shape, dtype = expected[key]
      value = step[key]
      if value.shape != shape or value.dtype != dtype:
        problems.append(
            f'key {key!r}: expected shape {shape} dtype {dtype}, '
            f'received shape {value.shape} dtype {value.dtype}')
    if problems:
      raise ValueError(
          'Replay.add: step does not match the stored structure: '
          + '; '.join(problems))

  def _new_chunk(self, refs):
    chunk = chunklib.Chunk(self.chunksize)
    self._chunks[chunk.uuid] = chunk
    self._refs[chunk.uuid] = refs
    return chunk

  def _seal(self, chunk, worker):
    """Ends a full chunk: the worker continues in a linked successor."""
    succ = self._new_chunk(refs=2)  # The worker writes into it; chunk links it.
    chunk.succ = succ.uuid
    self._linked.add(chunk.uuid)
    self._open[worker] = succ
    self._release(chunk)  # The worker no longer writes into it.

  def _insert(self, chunk, row):
    """Makes (chunk, row) an item. The caller has taken its reference."""
    while self.capacity and len(self._items) >= self.capacity:
      self._evict()
    itemid = self._next_item
    self._next_item += 1
    self._items[itemid] = (chunk, row)
    self._fifo.append(itemid)
    stepids = None
    if getattr(self.selector, 'uses_stepids', True):
      stepids = np.concatenate([
          part.data['stepid'][start:stop]
          for part, start, stop, _ in self._segments(chunk, row)])
    self.selector[itemid] = stepids
    self._metrics['inserts'] += 1
    self._nonempty.notify_all()
    return itemid

  def _evict(self):
    itemid = self._fifo.popleft()
    chunk, _ = self._items.pop(itemid)
    del self.selector[itemid]
    self._metrics['evicted'] += 1
    # Queue entries are in item order, so evicted ones sit at its front.
    while self._queue and self._queue[0] not in self._items:
      self._queue.popleft()
    self._release(chunk)

  def _release(self, chunk, delete_file=True):
    """Drops one reference; frees the chunk (and maybe successors) at zero."""
    while chunk is not None:
      refs = self._refs[chunk.uuid] - 1
      if refs > 0:
        self._refs[chunk.uuid] = refs
        return
      del self._refs[chunk.uuid]
      del self._chunks[chunk.uuid]
      self._retired.add(chunk.uuid)
      self._metrics['chunks_freed'] += 1
      if self._io and delete_file:
        self._io.submit(self._guarded, self._delete_file, chunk)
      succ = None
      if chunk.uuid in self._linked:
        self._linked.discard(chunk.uuid)
        succ = self._chunks.get(chunk.succ)
      chunk = succ

  def _segments(self, chunk, row):
    """The parts of the item starting at (chunk, row).

    Returns a list of (chunk, start, stop, offset): rows start:stop of the
    chunk go to positions offset:offset + stop - start of the sequence.
    """
    segments = []
    offset = 0
    while True:
      take = min(chunk.length - row, self.length - offset)
      if take <= 0:
        raise RuntimeError(f'Item runs past the filled rows of {chunk!r}.')
      segments.append((chunk, row, row + take, offset))
      offset += take
      if offset == self.length:
        return segments
      chunk, row = self._chunks[chunk.succ], 0

  # --------------------------------------------------------------- sample

  def sample(self, batch, mode='train', timeout=None):
    """Returns a dict of arrays ``[batch, length, ...]``.

    Besides the stored keys it holds ``stepid`` (uint8[20] per step) and
    ``consec`` (int32 zeros: the index of the window within the sampled item,
    as upstream's consecutive-window stream would number it). ``is_first`` of
    the first step is set, and ``is_last`` is set before any later
    ``is_first``, so every sequence starts and ends episodes cleanly.

    Blocks until the buffer holds an item, or raises TimeoutError after
    ``timeout`` seconds. Online items are only used in ``train`` mode.
    """
    if mode not in ('train', 'report', 'eval'):
      raise ValueError(f'Unknown sample mode {mode!r}.')
    with self._lock:
      if not self._nonempty.wait_for(lambda: self._items, timeout):
        raise TimeoutError(f'Replay still empty after {timeout} seconds.')
      plans = []
      for _ in range(batch):
        itemid = None
        if self.online and mode == 'train':
          while self._queue and itemid is None:
            candidate = self._queue.popleft()
            if candidate in self._items:
              itemid = candidate
              self._metrics['samples_online'] += 1
        if itemid is None:
          itemid = self.selector()
        plans.append(self._segments(*self._items[itemid]))
      self._metrics['samples' if mode == 'train' else 'samples_' + mode] += (
          batch)
      spec = self._spec

    data = {
        key: np.empty((batch, self.length, *shape), dtype)
        for key, (shape, dtype) in spec.items()}
    for index, segments in enumerate(plans):
      for chunk, start, stop, offset in segments:
        end = offset + stop - start
        for key, array in data.items():
          array[index, offset:end] = chunk.data[key][start:stop]
    data['consec'] = np.zeros((batch, self.length), np.int32)
    _close_episodes(data)
    return data

  # --------------------------------------------------------------- update

  def update(self, data):
    """Writes values back at the given step ids.

    ``data['stepid']`` has shape ``[B, T, 20]``; every other key holds
    ``[B, T, ...]`` values of a stored key (not ``stepid``). An optional
    ``priority`` ``[B, T]`` goes to the selector's ``prioritize`` (ignored
    for selectors without one). Steps whose chunk was already freed are
    skipped and counted in ``stats()['updates_skipped']``. Returns the number
    of steps written.
    """
    if 'stepid' not in data:
      raise ValueError('Replay.update needs a stepid entry.')
    stepid = np.asarray(data['stepid'])
    if (stepid.ndim < 2 or stepid.shape[-1] != STEPID_BYTES
        or stepid.dtype != np.uint8):
      raise ValueError(
          f'stepid must be uint8 [..., {STEPID_BYTES}], got '
          f'{stepid.dtype} {stepid.shape}.')
    lead = stepid.shape[:-1]
    flat = np.ascontiguousarray(stepid).reshape(-1, STEPID_BYTES)
    priority = data.get('priority')
    if priority is not None:
      priority = np.asarray(priority, np.float64)
      if priority.shape != lead:
        raise ValueError(
            f'Replay.update: priority must have shape {lead}, got '
            f'{priority.shape}.')
    values = {
        key: np.asarray(value) for key, value in data.items()
        if key not in ('stepid', 'priority')}
    self._check_update(values, lead)
    values = {
        key: value.reshape(len(flat), *value.shape[len(lead):])
        for key, value in values.items()}

    uuids = flat[:, :chunklib.UUID_BYTES].copy().view(
        np.dtype((np.void, chunklib.UUID_BYTES))).reshape(-1)
    rows = flat[:, chunklib.UUID_BYTES:].astype(np.int64) @ (
        256 ** np.arange(3, -1, -1, dtype=np.int64))
    unique, which = np.unique(uuids, return_inverse=True)
    which = which.reshape(-1)

    written = skipped = 0
    with self._lock:
      if priority is not None and hasattr(self.selector, 'prioritize'):
        self.selector.prioritize(flat, priority.reshape(-1))
      if values:
        for group, uuid in enumerate(unique):
          mask = which == group
          chunk = self._chunks.get(uuid.tobytes())
          if chunk is None:  # Evicted: nothing left to write to.
            skipped += int(mask.sum())
            continue
          valid = mask & (rows < chunk.length)
          skipped += int(mask.sum()) - int(valid.sum())
          if valid.any():
            chunk.write(rows[valid], {k: v[valid] for k, v in values.items()})
            written += int(valid.sum())
      self._metrics['updates'] += written
      self._metrics['updates_skipped'] += skipped
    return written

  def _check_update(self, values, lead):
    spec = self._spec or {}
    for key, value in values.items():
      if key not in spec or key in RESERVED_KEYS:
        raise ValueError(f'Replay.update: {key!r} is not a stored key.')
      shape, dtype = spec[key]
      if value.shape != (*lead, *shape):
        raise ValueError(
            f'Replay.update: key {key!r}: expected shape {(*lead, *shape)}, '
            f'received {value.shape}.')
      if not np.can_cast(value.dtype, dtype, 'same_kind'):
        raise ValueError(
            f'Replay.update: key {key!r}: expected dtype {dtype}, '
            f'received {value.dtype}.')

  # ---------------------------------------------------------- save / load

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
    """Waits for pending file operations; raises the first one that failed."""
    if not self._io:
      return
    self._barrier()
    errors, self._io_errors = self._io_errors, []
    if errors:
      raise RuntimeError(
          f'{len(errors)} replay file operations failed.') from errors[0]

  def _barrier(self):
    if self._io:
      self._io.submit(lambda: None).result()

  def close(self):
    """Finishes pending file operations and stops the background thread."""
    if self._io:
      self.flush()
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
    try:
      fn(*args)
    except Exception as error:
      log.exception('Replay file operation failed')
      self._io_errors.append(error)

  # ---------------------------------------------------------------- stats

  def stats(self):
    """Counters since construction plus the current sizes."""
    with self._lock:
      metrics = dict(self._metrics)
      chunks = list(self._chunks.values())
      stats = {
          'size': len(self._items),
          'items': len(self._items),
          'capacity': self.capacity,
          'steps': sum(chunk.length for chunk in chunks),
          'chunks': len(chunks),
          'streams': len(self._open),
          'online_queue': len(self._queue),
          'ram_gb': sum(chunk.nbytes for chunk in chunks) / 1024 ** 3,
      }
    for key in (
        'adds', 'inserts', 'samples', 'samples_online', 'samples_report',
        'samples_eval', 'updates', 'updates_skipped', 'evicted',
        'chunks_freed', 'chunks_loaded', 'files_written', 'files_deleted'):
      stats[key] = metrics.get(key, 0)
    adds = stats['adds']
    stats['replay_ratio'] = (
        self.length * stats['samples'] / adds if adds else float('nan'))
    return stats


def _prepare_step(step):
  if not isinstance(step, collections.abc.Mapping):
    raise TypeError(f'A step must be a dict, got {type(step).__name__}.')
  prepared = {}
  for key, value in step.items():
    if not isinstance(key, str):
      raise ValueError(f'Step keys must be strings, got {key!r}.')
    if key.startswith('log/') or key in RESERVED_KEYS:
      continue
    if key == chunklib.TIME_KEY:
      raise ValueError(f'Step key {key!r} is reserved for row times.')
    value = np.asarray(value)
    if value.dtype == object:
      raise ValueError(f'Step key {key!r} has dtype object; store arrays.')
    prepared[key] = value
  if not prepared:
    raise ValueError('A step needs at least one key to store.')
  return prepared


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
  try:
    return chunklib.Chunk.load(path)
  except Exception:
    log.warning('Skipping unreadable replay chunk %s', path, exc_info=True)
    return None


def _close_episodes(data):
  """Sequences start an episode; a step before an ``is_first`` ends one."""
  if 'is_first' not in data:
    return
  data['is_first'][:, 0] = True
  if 'is_last' in data:
    data['is_last'][:, :-1] = np.logical_or(
        data['is_last'][:, :-1], data['is_first'][:, 1:])
