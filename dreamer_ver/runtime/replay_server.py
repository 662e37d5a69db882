"""The replay server: stores transitions from the actor, serves batches to the learner.

``ReplayService`` holds the logic and is usable without sockets:

* a train replay (sequences of ``batch_length + replay_context`` steps, one
  stream per env id, online queue), an eval replay (sequences of
  ``report_length + replay_context`` steps) and the samples-per-insert
  limiter that turns ``run.train_ratio`` into back-pressure;
* ``add_batch`` waits in the limiter before each train row, so a learner that
  falls behind slows the actor down; sampling waits when the learner runs
  ahead of the data;
* every wait gives up when the service is closing, so a stop never hangs on a
  blocked caller.

``serve_replay(config)`` is the process: it exposes the service over portal's
protocol (``rpc_server.py``; one worker per method, so a blocked
``add_batch`` never blocks sampling),
saves periodically and sends stats to the logger without ever waiting on it.

What is stored: every column of the transition batch except ``envid`` and
``is_eval`` (they route the row: env id = replay stream, is_eval = which
replay) and ``version`` (the policy version is a logging concern; dropping it
keeps int64 columns out of the learner's jitted batch). ``log/*`` keys are
dropped too. The learner's batches hold the stored keys plus ``stepid`` and
``consec``.

This module imports neither JAX nor the agent.
"""

import json
import threading
import time
from pathlib import Path

import numpy as np

from dreamer_ver.files import write_json
from dreamer_ver.replay import build
from dreamer_ver.replay.replay import RESERVED_KEYS, mismatches
from dreamer_ver.rpc.client import Client
from dreamer_ver.runtime.process import (
    StopSignal, client_kwargs, run_periodically, server_kwargs)
from dreamer_ver.rpc.server import Server
from dreamer_ver.runtime.transitions import check_rows

# Columns of a transition batch that route rows and are never stored.
ROUTING_KEYS = ('envid', 'is_eval', 'version')

METHODS = (
    'add_batch', 'sample_batch_train', 'sample_batch_report',
    'sample_batch_eval', 'update')


class Closing(RuntimeError):
  """Raised to a caller whose wait was cut short because the service stops."""


class ReplayService:
  """Train and eval replays plus the limiter, with the server's methods."""

  def __init__(self, config, logdir=None, poll=0.05):
    logdir = Path(logdir if logdir is not None else config.logdir)
    self.logdir = logdir
    self.batch_size = int(config.batch_size)
    self.batch_length = int(config.batch_length)
    context = int(config.replay_context)
    self.train_length = self.batch_length + context
    self.report_length = int(config.report_length) + context
    if self.report_length > self.train_length:
      raise ValueError(
          f'report_length + replay_context ({self.report_length}) must not '
          f'exceed batch_length + replay_context ({self.train_length}).')
    self.train = build.train_replay(config, logdir)
    self.eval = build.eval_replay(config, logdir)
    self.limiter = build.make_limiter(config)
    self.ckpt = logdir / 'ckpt' / 'replay.json'

    self.poll = poll
    self._closing = threading.Event()
    self._cond = threading.Condition()  # Wakes waiters on insert/sample/close.
    self._waits = {kind: [0.0, 0, 0] for kind in ('insert', 'sample')}
    self._waits_lock = threading.Lock()
    self._last_counts = _counts(self.train.stats())
    self._last_eval_counts = _counts(self.eval.stats())
    self.activity = 0  # RPCs so far; the server saves only after new ones.

  # -------------------------------------------------------------- writing

  def add_batch(self, trans):
    """Stores a transition batch; train rows wait for the limiter.

    The whole batch is checked before any row is stored, so a malformed
    batch raises ValueError and changes nothing. Returns {}.
    """
    self.activity += 1
    envid, is_eval, data = self._check_batch(trans)
    for index in range(len(envid)):
      step = {key: value[index] for key, value in data.items()}
      worker = int(envid[index])
      if is_eval[index]:
        self.eval.add(step, worker=worker)
        continue
      if not self._wait('insert', self.limiter.want_insert):
        return {}  # Closing: the rest of the batch is not stored.
      self.train.add(step, worker=worker)
      self.limiter.insert()
      self._notify()
    return {}

  def update(self, data):
    """Writes values (the learner's latents) back at their step ids."""
    self.activity += 1
    self.train.update(data)
    return {}

  # ------------------------------------------------------------- sampling

  def sample_batch_train(self, timeout=None):
    """[batch_size, batch_length + replay_context] sequences for training.

    Waits while the limiter refuses (too little data, or the learner is too
    far ahead), then while the buffer has no sequence yet. Raises
    TimeoutError after ``timeout`` seconds and Closing when the service stops.
    """
    self.activity += 1
    deadline = None if timeout is None else time.monotonic() + timeout
    if not self._wait('sample', self.limiter.want_sample, timeout):
      raise Closing('Replay is closing.')
    self.limiter.sample(self.batch_size)  # The limiter counts sequences.
    self._notify()
    return self._sample(self.train, 'train', deadline)

  def sample_batch_report(self, timeout=None):
    """[batch_size, report_length + replay_context]: the first steps of
    train sequences (no limiter: reports do not count as training)."""
    self.activity += 1
    deadline = None if timeout is None else time.monotonic() + timeout
    batch = self._sample(self.train, 'report', deadline)
    return {
        key: np.ascontiguousarray(value[:, :self.report_length])
        for key, value in batch.items()}

  def sample_batch_eval(self):
    """Like the report batch, from eval episodes; {} while there are none
    (the learner's eval stream must never block)."""
    self.activity += 1
    if not len(self.eval):
      return {}
    return self.eval.sample(self.batch_size, 'eval', timeout=0)

  def _sample(self, replay, mode, deadline):
    while True:
      if self._closing.is_set():
        raise Closing('Replay is closing.')
      wait = self.poll * 4
      if deadline is not None:
        wait = min(wait, max(0.0, deadline - time.monotonic()))
      try:
        return replay.sample(self.batch_size, mode, timeout=wait)
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
        and not key.startswith('log/')}
    if not data:
      raise ValueError('add_batch: the batch holds no columns to store.')
    # Both replays must keep the same structure; check against whichever
    # already has one, so a bad batch is refused before any row is stored.
    for replay in (self.train, self.eval):
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
    """Replays write changed chunks, then the limiter state goes to
    ``ckpt/replay.json`` atomically.

    The limiter is read before the chunks are written, and the json is only
    written once they are on disk, so a crash at any point leaves a saved
    insert count no larger than the saved rows (writing the json while the
    chunks were still queued let a kill leave a count ahead of the data).
    """
    state = {'limiter': self.limiter.save(), 'time': time.time()}
    self.train.save(wait=True)
    self.eval.save(wait=True)
    write_json(self.ckpt, state)

  def load(self):
    """Restores the newest saved sequences and the limiter state."""
    items = self.train.load()
    eval_items = self.eval.load()
    limiter = False
    if self.ckpt.exists():
      self.limiter.load(json.loads(self.ckpt.read_text())['limiter'])
      limiter = True
    self._last_counts = _counts(self.train.stats())
    self._last_eval_counts = _counts(self.eval.stats())
    return {'items': items, 'eval_items': eval_items, 'limiter': limiter}

  def interrupt(self):
    """Makes blocked and later waits give up (the service is stopping)."""
    self._closing.set()
    self._notify()

  def close(self):
    """Stops waits, finishes pending file writes."""
    self.interrupt()
    self.train.close()
    self.eval.close()


# ------------------------------------------------------------------ process

def serve_replay(config, stop=None):
  """Process entry point: serve until SIGINT/SIGTERM (or ``stop``), save, exit 0."""
  stop = stop if stop is not None else StopSignal()
  service = ReplayService(config)
  loaded = service.load()
  print(
      f'[replay] loaded {loaded["items"]} train and {loaded["eval_items"]} '
      f'eval sequences from {service.logdir}', flush=True)
  addr = config.run.replay_addr
  server = Server(addr, 'Replay', quiet=(Closing,),
                  **server_kwargs(config))
  for name in METHODS:
    server.bind(name, getattr(service, name), workers=1)
  server.start()
  logger = Client(config.run.logger_addr, 'ReplayLogger', maxinflight=1,
                  when_full='drop', **client_kwargs(config))
  saved_activity = [service.activity]

  def save():
    if service.activity == saved_activity[0]:
      return  # Nothing new since the last save.
    saved_activity[0] = service.activity
    try:
      service.save()
    except Exception as error:  # E.g. a full disk: keep serving.
      print(f'[replay] save failed: {error!r}', flush=True)

  def log():
    stats = service.stats()
    stats.update(_prefix(server.stats(), 'server/replay'))
    logger.add(stats)

  try:
    run_periodically(stop, [(config.run.save_every, save),
                            (config.run.log_every, log)])
  finally:
    print('[replay] stopping: saving', flush=True)
    service.interrupt()
    server.close(timeout=5)
    service.save()
    service.close()
    logger.close(timeout=1)
  print('[replay] stopped', flush=True)
  return 0


# ------------------------------------------------------------------ helpers

def _counts(stats):
  return {key: stats[key] for key in ('adds', 'samples', 'updates')}


def _prefix(mapping, prefix):
  return {f'{prefix}/{key}': value for key, value in mapping.items()}

