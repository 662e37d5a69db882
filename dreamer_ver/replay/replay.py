"""The replay buffer: stores steps per worker, samples fixed-length sequences.

* Storage: each worker (an env id, say) writes into its own chain of chunks
  (``chunk.py``). Every stored step gets a ``stepid`` (uint8[20]: its
  chunk's 16 uuid bytes, then its row index as 4 big-endian bytes), by
  which the learner addresses rows later (``update``).
* Items: an item is a sequence of ``length`` consecutive steps of one
  worker, named by its first step; items overlap (stride one) and may run
  past the end of their chunk into its successors.
* Capacity: ``capacity`` bounds the items (about the steps); inserting into
  a full buffer removes the oldest item first (FIFO). A chunk is freed, and
  its file deleted, once no item, pending step, writing worker or live
  predecessor refers to it.
* Online queue (``online=True``): every ``length``-th item of each worker is
  also queued, and ``sample(mode='train')`` takes queued items first, so
  every non-overlapping sequence of fresh data is trained on at least once.
* Files (with a ``directory``): ``save`` writes each chunk that changed
  since its last write to one file (``persistence.py``); freeing a chunk
  deletes its file (upstream never did); ``load`` restores the newest
  items in their order. Steps added since the last save live in the
  replay server's write-ahead log (``wal.py``) under their row times
  (``add`` returns one; unique, kept in chunk files): after a load,
  ``row_times`` says which logged steps the files already hold, and
  ``restore`` re-adds the others under their original times.
* Threads: ``add``, ``sample``, ``update``, ``save`` and ``load`` may run
  on different threads (one lock for the bookkeeping; ``sample`` copies rows
  outside it, where only a concurrent ``update`` of the same rows can be
  seen half-applied). Files are written and deleted on one background
  thread, in the order asked.
"""

import collections
import collections.abc
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from dreamer_ver.core.keys import key_problems
from dreamer_ver.core.transitions import RESERVED_KEYS, is_log

from . import chunk as chunklib
from . import selectors as selectorlib
from .persistence import Persistence


STEPID_BYTES = chunklib.UUID_BYTES + 4


class Replay(Persistence):

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
    Returns the step's row time, which names the step in a write-ahead log.
    """
    return self._add(step, worker, stamp=None, queue=self.online)

  def restore(self, step, worker, time):
    """Appends a step recovered from a write-ahead log with the row time it
    got from ``add``. Like loaded items, its items are not queued for online
    training (they may have been trained on before the restart)."""
    return self._add(step, worker, stamp=int(time), queue=False)

  def completes_item(self, worker):
    """Whether the next step of ``worker``'s stream completes a sequence
    (a new item): true once the stream holds ``length - 1`` steps."""
    with self._lock:
      return len(self._pending.get(worker, ())) >= self.length - 1

  def row_times(self):
    """The row times of every step held, sorted: what a recovery checks
    logged steps against."""
    with self._lock:
      # Filled rows never change, so views read outside the lock are safe.
      parts = [chunk.times[:chunk.length] for chunk in self._chunks.values()
               if chunk.length]
    return np.sort(np.concatenate(parts)) if parts else np.zeros(0, np.int64)

  def _add(self, step, worker, stamp, queue):
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
      stamp = chunklib.timestamp() if stamp is None else stamp
      chunk.append(step, stamp)
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
        if queue and position % self.length == 0:
          self._queue.append(itemid)
    return stamp

  def _check_step(self, step):
    problems = mismatches(self._spec, step)
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


def mismatches(spec, values, rows=False):
  """What keeps `values` (one step, or with `rows` a batch of steps along
  the first axis) from the stored structure `spec` (`Replay.spec`): a list
  of problems, empty when it fits. The buffer's own keys are not expected."""
  expected = {k: v for k, v in spec.items() if k not in RESERVED_KEYS}
  problems = key_problems(expected, values)
  what = 'rows of shape' if rows else 'shape'
  for key in sorted(set(expected) & set(values)):
    shape, dtype = expected[key]
    value = values[key]
    got = value.shape[1:] if rows else value.shape
    if got != tuple(shape) or value.dtype != dtype:
      problems.append(
          f'key {key!r}: expected {what} {tuple(shape)} {dtype}, '
          f'received {what} {got} {value.dtype}')
  return problems


def _prepare_step(step):
  if not isinstance(step, collections.abc.Mapping):
    raise TypeError(f'A step must be a dict, got {type(step).__name__}.')
  prepared = {}
  for key, value in step.items():
    if not isinstance(key, str):
      raise ValueError(f'Step keys must be strings, got {key!r}.')
    if is_log(key) or key in RESERVED_KEYS:
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


def _close_episodes(data):
  """Sequences start an episode; a step before an ``is_first`` ends one."""
  if 'is_first' not in data:
    return
  data['is_first'][:, 0] = True
  if 'is_last' in data:
    data['is_last'][:, :-1] = np.logical_or(
        data['is_last'][:, :-1], data['is_first'][:, 1:])
