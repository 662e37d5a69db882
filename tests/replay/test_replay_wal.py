"""The replay server's write-ahead log, checked by value.

Rows carry ``count = 1000 * envid + t``, so the rows a replay holds name
themselves: a test compares them, with repeats, to the rows that were
acknowledged. A "kill" of an in-process service is ``close()`` without
``save()``: what is on disk is what a SIGKILL leaves (add_batch commits its
record before it returns). The last test kills a real server process.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import pytest

from dreamer_ver.config import validation
from dreamer_ver.core.atomic import StateUnreadable, StorageFault
from dreamer_ver.actor.shipping import SHIPMENT
from dreamer_ver.config.loading import compose
from dreamer_ver.replay import Unlimited
from dreamer_ver.replay import wal as wallib
from dreamer_ver.rpc.addresses import free_port
from dreamer_ver.rpc.client import Client
from dreamer_ver.replay import service as replay_service
from dreamer_ver.replay.service import Closing, ReplayService
from helpers.storage import FullDisk

B, T, C, R = 2, 4, 1, 2  # batch size, batch length, context, report length
TRAIN_ENVS, EVAL_ENV = (0, 1, 2), 9
# run.train_ratio of the tests that check the limiter: 0.125 credit per
# insert (exact in binary, so redone counts compare equal), and the fills
# below never reach the tolerance, so no insert waits for a learner.
RATIO = 0.5
# The limiter counts sequences: per env stream, the first rows complete none.
UNCOUNTED = T + C - 1


def config_values(tmp_path, **overrides):
  return {
      'logdir': str(tmp_path), 'batch_size': B, 'batch_length': T,
      'replay_context': C, 'report_length': R, 'replay.size': 1000,
      'replay.chunksize': 8, 'run.train_ratio': 0.0, **overrides}


def make_config(tmp_path, **overrides):
  return compose(['debug'], config_values(tmp_path, **overrides))


def trans(envids, ts, is_eval=False):
  """A transition batch: row i is step ts[i] of env envids[i]."""
  envids = np.asarray(envids, np.int64)
  ts = np.asarray(ts, np.int64)
  n = len(envids)
  return {
      'envid': envids, 'is_eval': np.full(n, is_eval),
      'version': np.zeros(n, np.int64), 'count': 1000 * envids + ts,
      'reward': ts.astype(np.float32), 'is_first': ts == 0,
      'is_last': np.zeros(n, bool), 'is_terminal': np.zeros(n, bool),
      'action': np.zeros((n, 2), np.float32),
      'dyn/deter': np.zeros((n, 3), np.float32)}


def fill(add_batch, steps, start=0):
  """Train steps start.. of every train env and one eval env; returns the
  counts of the rows sent (train, eval)."""
  train, evals = [], []
  for t in range(start, start + steps):
    add_batch(trans(TRAIN_ENVS, [t] * len(TRAIN_ENVS)))
    add_batch(trans([EVAL_ENV], [t], is_eval=True))
    train += [1000 * e + t for e in TRAIN_ENVS]
    evals.append(1000 * EVAL_ENV + t)
  return train, evals


class Shipments:
  """Passes batches on to ``add_batch`` as the actor's Shipper sends them,
  with shipment ids of seqs 0, 1, ..., and keeps them: what a client
  resends after a reconnect."""

  def __init__(self, add_batch, sender=7):
    self.add_batch, self.sender = add_batch, sender
    self.sent = []

  def __call__(self, batch):
    self.sent.append({**batch, SHIPMENT: np.array(
        [self.sender, len(self.sent)], np.int64)})
    return self.add_batch(self.sent[-1])


def held(replay):
  """The counts of every row the replay holds, with repeats, sorted (read
  from its chunks: no public call lists every row)."""
  counts = []
  for chunk in replay._chunks.values():
    counts += chunk.data['count'][:chunk.length].tolist()
  return sorted(counts)


def check_sequences(batch, length):
  count = batch['count']
  assert count.shape[1] == length
  assert (count // 1000 == count[:, :1] // 1000).all(), count
  assert (np.diff(count, axis=1) == 1).all(), count


def limiter_state(service):
  return service.limiter.size, service.limiter.avail


def wait_until(predicate, timeout=10):
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if predicate():
      return True
    time.sleep(0.01)
  return predicate()


def reopen(config):
  service = ReplayService.of(config)
  loaded = service.load()
  return service, loaded


# ------------------------------------------------------------- the log

def records_of(log, covered=0):
  return [{k: v.tolist() for k, v in r.items()} for r in log.recover(covered)]


def segment_files(directory):
  return sorted(p.name for p in directory.glob('*' + wallib.SUFFIX))


def record(i):
  return {'time': np.arange(i, i + 3, dtype=np.int64), 'count': i}


def expected(indices):
  return [{'time': list(range(i, i + 3)), 'count': i} for i in indices]


@pytest.mark.parametrize('tear', [
    'half payload', 'half header', 'bad checksum', 'zeros', 'huge length'])
def test_a_torn_last_record_is_dropped_and_the_rest_recovered(tmp_path, tear):
  log = wallib.WriteAheadLog(tmp_path, 'flush')
  for i in range(3):
    log.append(record(i))
  log.commit()
  (path,) = tmp_path.glob('*.wal')
  whole = path.stat().st_size
  log.append(record(3))
  log.close()
  data = path.read_bytes()
  data, last = data[:whole], data[whole:]
  header = wallib.HEADER.size
  torn = {
      'half payload': last[:header + (len(last) - header) // 2],
      'half header': last[:header // 2],
      'bad checksum': last[:-1] + bytes([last[-1] ^ 1]),
      'zeros': bytes(len(last)),
      'huge length': wallib.HEADER.pack(2 ** 60, 0) + last[header:],
  }[tear]
  path.write_bytes(data + torn)
  assert records_of(wallib.WriteAheadLog(tmp_path)) == expected(range(3))


def test_a_failed_write_abandons_its_segment(tmp_path):
  """A write that fails midway leaves a torn record in the middle of the
  log's history; the records after it go to the next segment and come
  back."""
  log = wallib.WriteAheadLog(tmp_path, 'flush')
  log.append(record(0))
  log.commit()

  class Full:  # The disk fills up in the middle of the record.
    def __init__(self, file):
      self.file = file

    def write(self, data):
      self.file.write(bytes(data)[:len(data) // 2])
      raise OSError(28, 'No space left on device')

    def __getattr__(self, name):
      return getattr(self.file, name)

  log._file = Full(log._file)
  with pytest.raises(OSError):
    log.append(record(1))
  log.append(record(2))
  log.close()
  assert len(segment_files(tmp_path)) == 2
  assert records_of(wallib.WriteAheadLog(tmp_path)) == expected([0, 2])


def test_rotation_truncation_and_recovery_generations(tmp_path):
  log = wallib.WriteAheadLog(tmp_path, 'fsync')
  log.append(record(0))
  covered = log.rotate()  # A checkpoint holds record 0 from here on.
  log.append(record(1))
  log.commit()
  # A crash before the checkpoint names `covered`: both come back.
  assert records_of(wallib.WriteAheadLog(tmp_path), 0) == expected([0, 1])
  # A crash after it, before drop_before: recovery skips and deletes 0.
  again = wallib.WriteAheadLog(tmp_path)
  assert records_of(again, covered) == expected([1])
  assert segment_files(tmp_path) == [f'{covered:012d}.wal']
  # Recovery reads without changing anything, and appends go after it, so
  # a crash right after a recovery finds the same records and the new ones.
  again.append(record(2))
  again.close()
  assert records_of(wallib.WriteAheadLog(tmp_path), covered) == expected(
      [1, 2])
  log.close()
  log = wallib.WriteAheadLog(tmp_path, 'fsync')
  list(log.recover(covered))
  log.drop_before(log.rotate())
  assert segment_files(tmp_path) == []
  # A checkpoint may name a generation past every file: appends go there.
  log = wallib.WriteAheadLog(tmp_path)
  assert list(log.recover(7)) == []
  log.append(record(3))
  log.close()
  assert segment_files(tmp_path) == [f'{7:012d}.wal']


def test_mode_off_writes_nothing(tmp_path):
  log = wallib.WriteAheadLog(tmp_path / 'wal', 'off')
  log.append(record(0))
  log.commit()
  log.rotate()
  log.close()
  assert not (tmp_path / 'wal').exists()
  with pytest.raises(ValueError, match='flush'):
    wallib.WriteAheadLog(tmp_path, 'sometimes')


def test_config_key_is_validated():
  assert compose(['debug']).replay.wal == 'flush'
  validation.validate(compose(['debug'], {'replay.wal': 'off'}))
  with pytest.raises(validation.ConfigError, match='replay.wal'):
    validation.validate(compose(['debug'], {'replay.wal': 'sometimes'}))


# ---------------------------------------------------------- the service

def test_acknowledged_rows_survive_a_kill_between_saves(tmp_path):
  config = make_config(tmp_path, **{'run.train_ratio': RATIO})
  service = ReplayService.of(config)
  # 3 * (8 - UNCOUNTED) = 12 sequences: minsize 8, credit -8 + 5 / 8.
  train, evals = fill(service.add_batch, 8)
  service.sample_batch_train(timeout=5)
  service.save()
  # 15 more: the credit is back above -8 (the sample took 2).
  more_train, more_evals = fill(service.add_batch, 5, start=8)
  service.sample_batch_train(timeout=5)
  state = limiter_state(service)
  service.close()  # Killed: the last 5 steps are in the log only.

  service, loaded = reopen(config)
  try:
    assert loaded['logged_rows'] == len(more_train) + len(more_evals)
    assert held(service.train) == sorted(train + more_train)
    assert held(service.eval) == sorted(evals + more_evals)
    assert limiter_state(service) == state
    # Recovered rows are not queued as fresh data (the queue is not saved).
    assert service.train.stats()['online_queue'] == 0
    # The streams go on: new steps join the recovered ones in sequences.
    fill(service.add_batch, 3, start=13)
    batch = service.train.sample(200)
    check_sequences(batch, T + C)
    steps = batch['count'] % 1000
    assert ((steps[:, 0] < 13) & (steps[:, -1] >= 13)).any()
  finally:
    service.close()


def test_save_interrupted_before_its_checkpoint_adds_no_row_twice(
    tmp_path, monkeypatch):
  """The chunk files are written, the json is not: every logged row is
  both in the files and in the log, and comes back once."""
  config = make_config(tmp_path, **{'run.train_ratio': RATIO})
  service = ReplayService.of(config)
  train, evals = fill(service.add_batch, 7)
  service.sample_batch_train(timeout=5)

  def crash(path, data):
    raise KeyboardInterrupt('killed before the json')
  monkeypatch.setattr(replay_service, 'write_json', crash)
  with pytest.raises(KeyboardInterrupt):
    service.save()
  monkeypatch.undo()
  assert list((tmp_path / 'replay').glob('*.npz'))
  more_train, more_evals = fill(service.add_batch, 2, start=7)
  state = limiter_state(service)
  service.close()

  service, loaded = reopen(config)
  try:
    assert loaded['logged_rows'] == len(more_train) + len(more_evals)
    assert held(service.train) == sorted(train + more_train)
    assert held(service.eval) == sorted(evals + more_evals)
    assert not loaded['limiter'] and limiter_state(service) == state
  finally:
    service.close()


def test_kill_after_the_checkpoint_before_truncation(tmp_path, monkeypatch):
  config = make_config(tmp_path, **{'run.train_ratio': RATIO})
  service = ReplayService.of(config)
  train, evals = fill(service.add_batch, 7)
  service.sample_batch_train(timeout=5)
  monkeypatch.setattr(service.wal, 'drop_before', lambda generation: None)
  service.save()
  state = limiter_state(service)
  service.close()
  assert segment_files(tmp_path / 'replay_wal')  # Not truncated.

  service, loaded = reopen(config)
  try:
    assert loaded['logged_rows'] == 0
    assert held(service.train) == sorted(train)
    assert held(service.eval) == sorted(evals)
    assert limiter_state(service) == state
    assert segment_files(tmp_path / 'replay_wal') == []
  finally:
    service.close()


def test_a_save_whose_cut_falls_inside_a_batch(tmp_path):
  """add_batch waits in the limiter after its first row while a save runs:
  the cut logs that row into the checkpoint's generation, so the rows after
  it are logged (and counted) once, after the cut."""
  # Train ratio 32: 8 credit per insert from the 8th on (credit 8 * size
  # - 64), so the 17th insert waits (credit 64). 9 steps of 3 envs make
  # 15 sequences, and every row of the next batch completes one.
  config = make_config(tmp_path, **{'run.train_ratio': 32.0})
  service = ReplayService.of(config)
  train, _ = fill(service.add_batch, 9)
  assert service.limiter.size == 3 * (9 - UNCOUNTED) == 15
  adder = threading.Thread(
      target=service.add_batch, args=(trans(TRAIN_ENVS, [9, 9, 9]),))
  adder.start()
  assert wait_until(lambda: service.limiter.size == 16)
  time.sleep(0.2)  # Row 1 waits for the learner.
  assert service.limiter.size == 16
  service.save()
  while adder.is_alive():  # The learner samples; rows 1 and 2 go in.
    service.sample_batch_train(timeout=5)
    adder.join(0.2)
  assert service.limiter.size == 18
  state = limiter_state(service)
  service.close()
  ckpt = json.loads((tmp_path / 'ckpt' / 'replay.json').read_text())
  assert ckpt['limiter']['size'] == 16

  service, loaded = reopen(config)
  try:
    assert loaded['logged_rows'] == 2
    assert held(service.train) == sorted(train + [9, 1009, 2009])
    assert limiter_state(service) == state
  finally:
    service.close()


def test_a_recovery_interrupted_by_a_kill_adds_no_row_twice(
    tmp_path, monkeypatch):
  """Recovered rows keep their row times: a save after a recovery that is
  killed before its json writes them to chunk files under new step ids,
  and the next recovery still knows them."""
  config = make_config(tmp_path)
  service = ReplayService.of(config)
  train, evals = fill(service.add_batch, 6)
  service.close()
  service, loaded = reopen(config)
  assert loaded['logged_rows'] == len(train) + len(evals)
  more_train, _ = fill(service.add_batch, 2, start=6)
  monkeypatch.setattr(replay_service, 'write_json', lambda path, data: 1 / 0)
  with pytest.raises(ZeroDivisionError):
    service.save()
  monkeypatch.undo()
  service.close()

  service, loaded = reopen(config)
  try:
    assert loaded['items'] > 0 and loaded['logged_rows'] == 0
    assert held(service.train) == sorted(train + more_train)
    assert isinstance(service.limiter, Unlimited)
    # 8 steps per env, from the log (all segments: no json names a later
    # generation) and as items of the chunk files alike.
    assert service.limiter.size == 3 * (8 - UNCOUNTED) == len(service.train)
    service.save()
  finally:
    service.close()
  service, loaded = reopen(config)
  try:
    assert held(service.train) == sorted(train + more_train)
  finally:
    service.close()


def test_a_torn_record_at_the_kill_is_dropped(tmp_path):
  config = make_config(tmp_path)
  service = ReplayService.of(config)
  train, _ = fill(service.add_batch, 5)
  service.close()
  (path,) = (tmp_path / 'replay_wal').glob('*.wal')
  with path.open('ab') as file:  # Killed in the middle of the next batch.
    file.write(wallib.HEADER.pack(1000, 0) + b'partial')
  service, _ = reopen(config)
  try:
    assert held(service.train) == sorted(train)
  finally:
    service.close()


def test_a_resent_shipment_is_stored_once_across_kills(tmp_path):
  """A batch logged before a kill but not answered comes back with the
  recovery; the client's resend of it, and of any call it had in flight,
  stores nothing, whether the checkpoint or the log holds the batch."""
  config = make_config(tmp_path, **{'run.train_ratio': RATIO})
  service = ReplayService.of(config)
  ship = Shipments(service.add_batch)
  train, evals = fill(ship, 8)
  service.save()
  more_train, more_evals = fill(ship, 2, start=8)
  state = limiter_state(service)
  service.close()  # Killed: the last 4 batches are in the log only.

  for kill in range(2):
    service, loaded = reopen(config)
    try:
      for batch in ship.sent[-8:]:  # 4 in the checkpoint, 4 in the log.
        assert service.add_batch(batch) == {}
      assert held(service.train) == sorted(train + more_train)
      assert held(service.eval) == sorted(evals + more_evals)
      assert limiter_state(service) == state
      # New shipments are stored, and logged with their ids.
      ship.add_batch = service.add_batch
      newer_train, newer_evals = fill(ship, 1, start=10 + kill)
      more_train += newer_train
      more_evals += newer_evals
      assert held(service.train) == sorted(train + more_train)
      state = limiter_state(service)
    finally:
      service.close()  # Killed again.


def test_a_batch_cut_short_by_a_kill_stores_the_rest_when_resent(tmp_path):
  """A save's cut falls inside a batch whose second row waits for the
  learner, and the server is killed before the batch is done: its first
  row is in the checkpoint, with the shipment's progress, and the resend
  stores only the rows after it."""
  config = make_config(tmp_path, **{'run.train_ratio': 32.0})
  service = ReplayService.of(config)
  ship = Shipments(service.add_batch)
  train, _ = fill(ship, 9)  # 15 sequences: the 17th insert waits.
  failed = []

  def add():
    try:
      ship(trans(TRAIN_ENVS, [9] * 3))
    except Closing as e:  # No reply but an error: nothing acknowledged.
      failed.append(e)

  adder = threading.Thread(target=add)
  adder.start()
  assert wait_until(lambda: service.limiter.size == 16)
  time.sleep(0.2)  # Row 1 waits for the learner.
  service.save()
  service.close()  # Killed: the adder gives up without storing row 1.
  adder.join(5)
  assert len(failed) == 1
  seq = len(ship.sent) - 1
  ckpt = json.loads((tmp_path / 'ckpt' / 'replay.json').read_text())
  assert ckpt['shipments'] == {'7': [seq, 1]}

  service, loaded = reopen(config)
  try:
    assert loaded['logged_rows'] == 0
    assert held(service.train) == sorted(train + [9])
    assert service.add_batch(ship.sent[-1]) == {}
    assert held(service.train) == sorted(train + [9, 1009, 2009])
    # Rows 1 and 2 begin their envs' streams anew after the restart, so
    # they complete no sequence.
    assert service.limiter.size == 16
    assert service.add_batch(ship.sent[-1]) == {}
    assert held(service.train) == sorted(train + [9, 1009, 2009])
  finally:
    service.close()


def test_mode_off_loses_what_was_not_saved(tmp_path):
  config = make_config(tmp_path, **{'replay.wal': 'off'})
  service = ReplayService.of(config)
  train, _ = fill(service.add_batch, 5)
  service.save()
  fill(service.add_batch, 3, start=5)
  service.close()
  assert not (tmp_path / 'replay_wal').exists()
  service, loaded = reopen(config)
  try:
    assert loaded['logged_rows'] == 0
    assert held(service.train) == sorted(train)
  finally:
    service.close()


# ------------------------------------------------------------ a process

SERVE = (
    'import sys, json\n'
    'from dreamer_ver.config.loading import compose\n'
    'from dreamer_ver.runtime.replay_process import serve_replay\n'
    'sys.exit(serve_replay(compose(["debug"], json.loads(sys.argv[1]))))\n')


def start_server(values, log):
  return subprocess.Popen(
      [sys.executable, '-c', SERVE, json.dumps(values)], stdout=log,
      stderr=subprocess.STDOUT, env={**os.environ, 'PYTHONUNBUFFERED': '1'})


def stop(proc):
  if proc.poll() is None:
    proc.kill()
  proc.wait(timeout=10)


def wait_for_line(path, prefix, timeout=30):
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    lines = [l for l in path.read_text().splitlines() if l.startswith(prefix)]
    if lines:
      return lines[-1]
    time.sleep(0.05)
  raise AssertionError(f'no {prefix!r} line in {path}:\n{path.read_text()}')


def test_a_sigkilled_server_keeps_every_acknowledged_row(tmp_path):
  """serve_replay as a process: SIGKILL it after acknowledged add_batch
  calls (no save in between), restart it on the same logdir, add more,
  SIGKILL it again; every acknowledged row is held exactly once."""
  logdir = tmp_path / 'run'
  port = free_port()
  values = config_values(logdir, **{
      'run.replay_addr': f'127.0.0.1:{port}',
      'run.logger_addr': f'127.0.0.1:{free_port()}',  # Nobody listens.
      'run.save_every': 1e6, 'run.log_every': 1e6})
  procs = []
  acked_train, acked_eval = [], []

  def serve_and_fill(name, steps, start):
    log = tmp_path / f'{name}.log'
    with log.open('w') as file:
      procs.append(start_server(values, file))
    client = Client(f'127.0.0.1:{port}', name, maxinflight=1)
    try:
      train, evals = fill(
          lambda batch: client.add_batch(batch).result(30), steps, start)
      acked_train.extend(train)
      acked_eval.extend(evals)
      check_sequences(client.sample_batch_train().result(30), T + C)
    finally:
      client.close(timeout=2)
    os.kill(procs[-1].pid, signal.SIGKILL)
    assert procs[-1].wait(timeout=10) == -signal.SIGKILL
    return wait_for_line(log, '[replay] loaded')

  try:
    first = serve_and_fill('first', 8, 0)
    second = serve_and_fill('second', 5, 8)
  finally:
    for proc in procs:
      stop(proc)
  assert ' 0 logged rows ' in first, first
  assert f' {8 * 4} logged rows ' in second, second
  assert not list((logdir / 'replay').glob('*.npz'))  # Never saved.

  service, loaded = reopen(make_config(logdir))
  try:
    assert loaded['logged_rows'] == len(acked_train) + len(acked_eval)
    assert held(service.train) == sorted(acked_train)
    assert held(service.eval) == sorted(acked_eval)
  finally:
    service.close()


def test_a_call_resent_after_a_sigkill_stores_its_rows_once(tmp_path):
  """The kill falls after the server logged part of a batch (a periodic
  save cut it while its second row waited for the learner) and before it
  replied. The client resends the call to the restarted server, which
  stores only the rows it lacks; a repeat of an acknowledged shipment over
  the same connection stores nothing."""
  logdir = tmp_path / 'run'
  port = free_port()
  values = config_values(logdir, **{
      'run.train_ratio': 32.0, 'run.replay_addr': f'127.0.0.1:{port}',
      'run.logger_addr': f'127.0.0.1:{free_port()}',  # Nobody listens.
      'run.save_every': 0.2, 'run.log_every': 1e6})
  ckpt = logdir / 'ckpt' / 'replay.json'
  procs = []
  client = Client(f'127.0.0.1:{port}', 'Resender', maxinflight=2)

  def serve(name):
    with (tmp_path / f'{name}.log').open('w') as file:
      procs.append(start_server(values, file))

  def kill():
    os.kill(procs[-1].pid, signal.SIGKILL)
    assert procs[-1].wait(timeout=10) == -signal.SIGKILL

  def saved_progress():
    return json.loads(ckpt.read_text())['shipments'] if (
        ckpt.exists()) else None

  try:
    serve('first')
    ship = Shipments(lambda batch: client.add_batch(batch).result(30))
    train, evals = fill(ship, 9)  # 15 sequences: the 17th insert waits.
    assert client.add_batch(ship.sent[3]).result(30) == {}
    ship.add_batch = client.add_batch
    pending = ship(trans(TRAIN_ENVS, [9] * 3))
    seq = len(ship.sent) - 1
    deadline = time.monotonic() + 30
    while saved_progress() != {'7': [seq, 1]}:
      assert time.monotonic() < deadline, saved_progress()
      # Saves only follow new calls: one that stores nothing.
      client.sample_batch_report().result(30)
      time.sleep(0.3)
    assert not pending.done()
    kill()
    serve('second')
    assert pending.result(30) == {}  # Resent after the reconnect.
    kill()
  finally:
    client.close(timeout=2)
    for proc in procs:
      stop(proc)
  second = wait_for_line(tmp_path / 'second.log', '[replay] loaded')
  assert ' 0 logged rows ' in second, second

  service, loaded = reopen(make_config(logdir))
  try:
    assert held(service.train) == sorted(train + [9, 1009, 2009])
    assert held(service.eval) == sorted(evals)
  finally:
    service.close()


# ------------------------------------------------------ a full disk

def test_a_full_disk_refuses_batches_in_one_line_and_loses_nothing_acknowledged(
    tmp_path, monkeypatch, caplog):
  config = make_config(tmp_path)
  service = ReplayService.of(config)
  train, evals = fill(service.add_batch, 6)
  service.save()
  logged_train, logged_evals = fill(service.add_batch, 3, start=6)
  disk = FullDisk(monkeypatch, service)

  with pytest.raises(StorageFault) as refused:
    service.add_batch(trans(TRAIN_ENVS, [9] * 3))  # not acknowledged
  message = str(refused.value)
  assert 'no space left on device writing' in message
  assert str(tmp_path / 'replay_wal') in message and 'MB free of' in message
  assert '\n' not in message
  # Refused at once from now on, before a row is stored: no retry loop
  # fills memory with rows that no log holds.
  rows = held(service.train)
  with pytest.raises(StorageFault, match='replay stopped storing: no space'):
    service.add_batch(trans(TRAIN_ENVS, [10] * 3))
  assert held(service.train) == rows
  with pytest.raises(StorageFault):
    service.save()  # the chunks' write fails, the checkpoint stays
  service.close()  # says nothing more
  assert not [r for r in caplog.records if r.exc_info]  # no traceback
  del disk
  monkeypatch.undo()  # space freed

  service, loaded = reopen(config)
  try:
    assert held(service.train) == sorted(train + logged_train)
    assert held(service.eval) == sorted(evals + logged_evals)
    fill(service.add_batch, 1, start=9)  # and it stores again
  finally:
    service.close()


def test_a_damaged_replay_json_at_start_is_one_line_naming_it(tmp_path):
  config = make_config(tmp_path)
  service = ReplayService.of(config)
  fill(service.add_batch, 3)
  service.save()
  service.close()
  path = tmp_path / 'ckpt' / 'replay.json'
  data = bytearray(path.read_bytes())
  data[0] ^= 0xFF  # a flipped byte
  path.write_bytes(bytes(data))
  service = ReplayService.of(config)
  try:
    with pytest.raises(StateUnreadable, match=(
        rf"^{path} cannot be read \(UnicodeDecodeError: .*move it away to "
        r"start replay's limiter afresh\.$")):
      service.load()
  finally:
    service.close()
