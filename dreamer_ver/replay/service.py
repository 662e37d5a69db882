"""The replay service: stores transitions from the actor, serves batches to
the learner. ``ReplayService`` holds the logic and is usable without sockets
(``runtime/replay_process.py`` serves it):

* a train replay (sequences of ``batch_length + replay_context`` steps, one
  stream per env id, online queue), an eval replay (sequences of
  ``report_length + replay_context`` steps) and the samples-per-insert
  limiter that turns ``run.train_ratio`` into back-pressure;
* ``add_batch`` waits in the limiter before each train row, so a learner that
  falls behind slows the actor down; sampling waits when the learner runs
  ahead of the data;
* every wait gives up when the service is closing, so a stop never hangs on a
  blocked caller.

Write-ahead log (``replay/wal.py``, in ``logdir/replay_wal``; ``replay.wal``
says how hard it flushes): rows the service acknowledged survive a SIGKILL.

How it logs, cuts a checkpoint and recovers: ``docs/architecture.md``
(the write-ahead log).

Shipments are stored once (a batch logged but not answered at a kill comes
back from the log, and the client resends it): ``StoredShipments`` in
``core/transitions.py``, updated per row under the log lock and carried
by each log record and by the checkpoint.

What is stored: every column of the transition batch but ``envid`` and
``is_eval`` (env id = replay stream, is_eval = which replay), ``log/*`` and
the shipment id; ``version`` (the params that acted: the learner's policy
lag) too, unless the replay resumed from a run that did not store it.
The learner's batches hold the stored keys plus ``stepid`` and ``consec``.

This module imports neither JAX nor the agent.
"""

import contextlib
import functools
import threading
import time
from pathlib import Path

import numpy as np

from dreamer_ver.core.atomic import (
    StorageFault, read_json, storage_fault, write_json)
from dreamer_ver.replay import batch_log, build
from dreamer_ver.replay.replay import mismatches
from dreamer_ver.replay.wal import WriteAheadLog
from dreamer_ver.core.transitions import (
    RESERVED_KEYS, ROUTING_KEYS, StoredShipments, check_rows, is_log,
    shipment_of)

METHODS = (
    'add_batch', 'release_inserts', 'sample_batch_train', 'sample_share_train',
    'sample_batch_report', 'sample_batch_eval', 'update')


class Closing(RuntimeError):
  """Raised to a caller whose wait was cut short because the service stops."""


class ReplayService:
  """Train and eval replays plus the limiter, with the server's methods."""

  def __init__(self, options, logdir, poll=0.05):
    """`options`: `build.Options` (`ReplayService.of(config)` builds them
    from a run config)."""
    logdir = Path(logdir)
    self.logdir = logdir
    self.batch_size = options.batch_size
    self.batch_length = options.batch_length
    self.train_length = self.batch_length + options.context
    self.report_length = options.report_length + options.context
    if self.report_length > self.train_length:
      raise ValueError(
          f'report_length + replay_context ({self.report_length}) must not '
          f'exceed batch_length + replay_context ({self.train_length}).')
    self.train = build.train_replay(options, logdir)
    self.eval = build.eval_replay(options, logdir)
    self.limiter = build.make_limiter(options)
    self.ckpt = logdir / 'ckpt' / 'replay.json'
    self.wal = WriteAheadLog(logdir / 'replay_wal', options.wal)
    # Storing a row, counting it and noting it for the log happen under this
    # lock, as do log appends and a save's cut: the cut falls between rows.
    self._log_lock = threading.Lock()
    self._unlogged = None  # batch_log.PendingRows of the running add_batch
    self.shipments = StoredShipments()
    self.poll = poll
    self._closing = threading.Event()
    self._closed = False
    self._released = set()  # senders whose inserts skip the limiter
    self._cond = threading.Condition()  # Wakes waiters on insert/sample/close.
    self._waits = {kind: [0.0, 0, 0] for kind in ('insert', 'sample')}
    self._waits_lock = threading.Lock()
    self._last_counts = _counts(self.train.stats())
    self._last_eval_counts = _counts(self.eval.stats())
    self.activity = 0  # RPCs so far; the server saves only after new ones.
    # The first write that failed on a full or read-only disk: from then on
    # every add_batch is refused with it and the server stops in order.
    self.fault = None

  @classmethod
  def of(cls, config, **kwargs):
    """The service of a run config: its replay options, in its logdir."""
    return cls(build.Options.of(config), config.logdir, **kwargs)

  # -------------------------------------------------------------- writing

  def add_batch(self, trans):
    """Stores a transition batch; train rows wait for the limiter.

    The whole batch is checked before any row is stored, so a malformed
    batch raises ValueError and changes nothing. The stored rows are in the
    write-ahead log before it returns. Calls are serialized (the server runs
    one worker per method). A resent shipment stores only the rows it did
    not store before (none, unless it was cut short). Returns {} once every
    row is stored: a stop that cuts the limiter's wait short stores the
    rest without it, as the caller will not send them again.
    """
    self.activity += 1
    self.check()
    envid, is_eval, data = self._check_batch(trans)
    shipment = shipment_of(trans, 'add_batch')
    unlogged = self._unlogged = batch_log.PendingRows(envid, is_eval, data, shipment)
    try:
      for index in range(self.shipments.first_new_row(shipment, len(envid)),
                         len(envid)):
        # The limiter counts sequences (items), as upstream: a row that
        # completes none never waits, or a fleet with more envs than the
        # limiter's fill tolerance would block before any sequence exists.
        counts = not is_eval[index] and self.train.completes_item(
            int(envid[index]))
        if counts and not self._closing.is_set():
          self._wait('insert', functools.partial(self._may_insert, shipment))
        if self._closed:
          raise Closing('replay closed before the batch was stored')
        self._store(unlogged, index, counts)
    finally:
      with self._log_lock, self._storage():
        self._unlogged = None
        self._log(unlogged)
        self.wal.commit()  # Before the reply: what is acknowledged is logged.
    return {}

  def check(self):
    """Raises the StorageFault that stopped this service, if one did."""
    if self.fault is not None:
      raise StorageFault(f'replay stopped storing: {self.fault}')

  @contextlib.contextmanager
  def _storage(self):
    """Turns a full or read-only disk's error into a StorageFault, kept
    in `fault` (the first one)."""
    try:
      yield
    except Exception as error:
      fault = storage_fault(error)
      if fault is None:
        raise
      self.fault = self.fault or fault
      raise fault from None

  def release_inserts(self, sender):
    """Lets the add_batch calls of shipper `sender`, waiting or later, store
    without waiting for the limiter: a stopping agent's learner no longer
    samples, and its last shipments must still be stored."""
    self._released.add(int(sender))
    self._notify()
    return {}

  def _may_insert(self, shipment):
    if shipment is not None and shipment[0] in self._released:
      return True, ''
    return self.limiter.want_insert()

  def _store(self, unlogged, index, counts):
    step = {key: value[index] for key, value in unlogged.data.items()}
    worker = int(unlogged.envid[index])
    evaluating = unlogged.is_eval[index]
    with self._log_lock:
      replay = self.eval if evaluating else self.train
      unlogged.note(index, replay.add(step, worker=worker), counts)
      if counts:
        self.limiter.insert()
      self.shipments.stored(unlogged.shipment, index + 1)
    if not evaluating:
      self._notify()

  def _log(self, unlogged):
    """Appends the rows noted so far as one record; holds _log_lock."""
    record = unlogged.take()
    if record is not None:
      self.wal.append(record)

  def update(self, data):
    """Writes values (the learner's latents) back at their step ids."""
    self.activity += 1
    self.train.update(data)
    return {}

  # ------------------------------------------------------------- sampling

  def sample_batch_train(self, rows=None, timeout=None):
    """[rows, batch_length + replay_context] sequences for training, rows
    defaulting to batch_size. Counts one update's batch (batch_size
    sequences) in the limiter, whatever ``rows``: a multi-host learner's
    first process takes its share here, the others theirs from
    ``sample_share_train``.

    Waits while the limiter refuses (too little data, or the learner is too
    far ahead), then while the buffer has no sequence yet. Raises
    TimeoutError after ``timeout`` seconds and Closing when the service stops.
    """
    self.activity += 1
    rows = self._rows(rows)
    deadline = None if timeout is None else time.monotonic() + timeout
    if not self._wait('sample', self.limiter.want_sample, timeout):
      raise Closing('Replay is closing.')
    # After a storage fault the learner still samples while the run stops:
    # the log no longer counts samples (none of them was a stored row).
    with self._log_lock, contextlib.suppress(StorageFault), self._storage():
      self.limiter.sample(self.batch_size)  # The limiter counts sequences.
      if self.fault is None:
        self.wal.append({'samples': self.batch_size})
    self._notify()
    return self._sample(self.train, 'train', rows, deadline)

  def sample_share_train(self, rows):
    """[rows, batch_length + replay_context] sequences of an update that
    ``sample_batch_train`` already counted: the limiter is not asked."""
    self.activity += 1
    return self._sample(self.train, 'train', self._rows(rows), None)

  def sample_batch_report(self, rows=None, timeout=None):
    """[rows, report_length + replay_context]: the first steps of train
    sequences (no limiter: reports do not count as training)."""
    self.activity += 1
    deadline = None if timeout is None else time.monotonic() + timeout
    batch = self._sample(self.train, 'report', self._rows(rows), deadline)
    return {
        key: np.ascontiguousarray(value[:, :self.report_length])
        for key, value in batch.items()}

  def sample_batch_eval(self, rows=None):
    """Like the report batch, from eval episodes; {} while there are none
    (the learner's eval stream must never block)."""
    self.activity += 1
    rows = self._rows(rows)
    if not len(self.eval):
      return {}
    return self.eval.sample(rows, 'eval', timeout=0)

  def _rows(self, rows):
    """A caller's row count, checked: 1 to batch_size (None: batch_size)."""
    if rows is None:
      return self.batch_size
    value = np.asarray(rows)  # The wire carries ints as 0-d arrays.
    if value.shape or value.dtype.kind not in 'iu' or not (
        1 <= value <= self.batch_size):
      raise ValueError(
          f'rows must be an integer from 1 to batch_size '
          f'({self.batch_size}), got {rows!r}.')
    return int(value)

  def _sample(self, replay, mode, rows, deadline):
    while True:
      if self._closing.is_set():
        raise Closing('Replay is closing.')
      wait = self.poll * 4
      if deadline is not None:
        wait = min(wait, max(0.0, deadline - time.monotonic()))
      try:
        return replay.sample(rows, mode, timeout=wait)
      except TimeoutError:
        if deadline is not None and time.monotonic() >= deadline:
          raise TimeoutError(
              f'Replay ({mode}) still holds no sequence of '
              f'{replay.length} steps.') from None

  # ---------------------------------------------------------------- waits

  def _wait(self, kind, want, timeout=None):
    """Blocks until ``want()`` allows; False if the service is closing.

    Records how long each call waited, for the limiter stats.
    """
    allowed, reason = want()
    if allowed:
      self._record(kind, 0.0)
      return True
    start = time.monotonic()
    while not allowed:
      waited = time.monotonic() - start
      if self._closing.is_set():
        self._record(kind, waited)
        return False
      if timeout is not None and waited >= timeout:
        self._record(kind, waited)
        raise TimeoutError(f'Replay {kind} waited {waited:.2f}s: {reason}')
      with self._cond:
        self._cond.wait(self.poll)
      allowed, reason = want()
    self._record(kind, time.monotonic() - start)
    return True

  def _record(self, kind, waited):
    with self._waits_lock:
      entry = self._waits[kind]
      if waited > 0:
        entry[0] += waited
        entry[1] += 1
      entry[2] += 1

  def _notify(self):
    with self._cond:
      self._cond.notify_all()

  # ----------------------------------------------------------- validation

  def _check_batch(self, trans):
    """Returns (envid, is_eval, stored columns) or raises ValueError."""
    arrays = check_rows(trans, 'add_batch', required=('is_eval',))
    envid = arrays['envid']
    is_eval = arrays['is_eval'].astype(bool)
    data = {
        key: value for key, value in arrays.items()
        if key not in ROUTING_KEYS and key not in RESERVED_KEYS
        and not is_log(key)}
    if not data:
      raise ValueError('add_batch: the batch holds no columns to store.')
    # Both replays must keep the same structure; check against whichever
    # already has one, so a bad batch is refused before any row is stored.
    for replay in (self.train, self.eval):
      if replay.spec is not None and 'version' not in replay.spec:
        data.pop('version', None)  # A replay from before versions were kept.
      if replay.spec is not None:
        problems = mismatches(replay.spec, data, rows=True)
        if problems:
          raise ValueError(
              'add_batch: batch does not match the stored structure: '
              + '; '.join(problems))
    return envid, is_eval, data

  # ---------------------------------------------------------------- stats

  def stats(self):
    """Flat scalars; counts and wait times cover the time since the last call."""
    train, evals = self.train.stats(), self.eval.stats()
    counts, last = _counts(train), self._last_counts
    delta = {key: counts[key] - last[key] for key in counts}
    self._last_counts = counts
    eval_counts = _counts(evals)
    eval_adds = eval_counts['adds'] - self._last_eval_counts['adds']
    self._last_eval_counts = eval_counts
    stats = {
        'replay/items': train['items'],
        'replay/chunks': train['chunks'],
        'replay/streams': train['streams'],
        'replay/ram_gb': train['ram_gb'],
        'replay/inserts': delta['adds'],
        'replay/samples': delta['samples'],
        'replay/updates': delta['updates'],
        'replay_eval/items': evals['items'],
        'replay_eval/inserts': eval_adds,
        'replay_eval/ram_gb': evals['ram_gb'],
        'limiter/size': self.limiter.size,
        'limiter/avail': self.limiter.avail,
    }
    if delta['adds']:
      stats['replay/replay_ratio'] = (
          self.train_length * delta['samples'] / delta['adds'])
    with self._waits_lock:
      for kind, (duration, count, calls) in self._waits.items():
        stats[f'limiter/{kind}_wait_dur'] = duration
        stats[f'limiter/{kind}_wait_count'] = count
        stats[f'limiter/{kind}_wait_frac'] = count / calls if calls else 0.0
        self._waits[kind] = [0.0, 0, 0]
    return stats

  # ---------------------------------------------------------- save / load

  def save(self):
    """Replays write changed chunks, then the limiter state and the log
    generation it covers go to ``ckpt/replay.json`` atomically; then the
    covered log segments are dropped.

    The cut comes first, under the log lock: the rows the running add_batch
    stored so far are logged, the limiter is read and the log rotated. The
    chunks are written after the cut, so they hold every row before it (and
    maybe rows after it, which a recovery recognises by row time); the json
    is only written once they are on disk, and the segments are only dropped
    once the json is. A crash at any point leaves the old json with every
    segment since its generation, or the new json with every segment since
    its own. A full or read-only disk raises a StorageFault.
    """
    with self._storage():
      self._save()

  def _save(self):
    with self._log_lock:
      if self._unlogged is not None:
        self._log(self._unlogged)
      state = {'limiter': self.limiter.save(),
               'shipments': self.shipments.save(),
               'wal_generation': self.wal.rotate(), 'time': time.time()}
    self.train.save(wait=True)
    self.eval.save(wait=True)
    write_json(self.ckpt, state)
    self.wal.drop_before(state['wal_generation'])

  def load(self):
    """Restores the newest saved sequences and the limiter state, then
    replays the write-ahead log since that checkpoint on top."""
    items = self.train.load()
    eval_items = self.eval.load()
    limiter, covered = False, 0
    if self.ckpt.exists():
      state = read_json(self.ckpt, "replay's limiter")
      self.limiter.load(state['limiter'])
      self.shipments.load(state.get('shipments', {}))
      covered = state.get('wal_generation', 0)  # Older checkpoints: no log.
      limiter = True
    with self._log_lock:
      logged_rows = self._recover(covered)
    self._last_counts = _counts(self.train.stats())
    self._last_eval_counts = _counts(self.eval.stats())
    return {'items': items, 'eval_items': eval_items, 'limiter': limiter,
            'logged_rows': logged_rows}

  def _recover(self, covered):
    """Replays the log records since generation ``covered``: re-adds the
    rows the loaded chunks lack, redoes every insert and sample in the
    limiter (the checkpoint's counts end at the cut) and brings the stored
    shipments up to date. Returns the number of rows re-added."""
    held = {False: self.train.row_times(), True: self.eval.row_times()}
    added = 0
    for record in self.wal.recover(covered):
      if 'samples' in record:
        self.limiter.sample(int(record['samples']))
        continue
      is_eval, times = record['is_eval'], record['time']
      self.limiter.insert(int(record['inserts']))
      if 'shipment' in record:
        sender, seq, rows = record['shipment'].tolist()
        self.shipments.stored((sender, seq), rows)
      columns = batch_log.columns(record)
      for evals, replay in ((False, self.train), (True, self.eval)):
        rows = np.flatnonzero(is_eval == evals)
        for row in rows[~batch_log.contains(held[evals], times[rows])]:
          step = {key: value[row] for key, value in columns.items()}
          replay.restore(step, int(record['envid'][row]), times[row])
          added += 1
    return added

  def interrupt(self):
    """Makes blocked and later waits give up (the service is stopping)."""
    self._closing.set()
    self._notify()

  def close(self):
    """Stops waits, finishes pending file writes; a batch still being
    stored stops and fails (it is not acknowledged)."""
    self._closed = True
    self.interrupt()
    with self._log_lock, contextlib.suppress(StorageFault), self._storage():
      self.wal.close()
    for replay in (self.train, self.eval):
      with contextlib.suppress(StorageFault), self._storage():
        replay.close()


# ------------------------------------------------------------------ process


def _counts(stats):
  return {key: stats[key] for key in ('adds', 'samples', 'updates')}
