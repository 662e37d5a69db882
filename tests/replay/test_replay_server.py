"""Tests for the replay server, checked by value.

Transitions carry a per-env counter ``count = 1000 * envid + t`` so a sampled
sequence can be checked to be consecutive and from a single env.
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import numpy as np
import portal
import pytest

from dreamer_ver.actor.shipping import SHIPMENT
from dreamer_ver.config.loading import compose
from dreamer_ver.replay import Unlimited
from dreamer_ver.runtime import logger_process, replay_process
from dreamer_ver.rpc.addresses import free_port
from dreamer_ver.cluster.signals import StopSignal
from dreamer_ver.replay.service import Closing, ReplayService
from helpers.storage import FullDisk

B, T, C, R = 2, 4, 1, 2  # batch size, batch length, context, report length


def make_config(tmp_path, **overrides):
  values = {
      'logdir': str(tmp_path), 'batch_size': B, 'batch_length': T,
      'replay_context': C, 'report_length': R, 'replay.size': 1000,
      'replay.chunksize': 8, 'run.train_ratio': 0.0}
  values.update(overrides)
  return compose(['debug'], values)


def trans(envids, ts, is_eval=False, action_dim=2):
  """A transition batch: row i is step ts[i] of env envids[i]."""
  envids = np.asarray(envids, np.int64)
  ts = np.asarray(ts, np.int64)
  n = len(envids)
  return {
      'envid': envids,
      'is_eval': np.full(n, is_eval),
      'version': ts // 2,  # the params version that acted
      'count': 1000 * envids + ts,
      'reward': ts.astype(np.float32),
      'is_first': ts == 0,
      'is_last': np.zeros(n, bool),
      'is_terminal': np.zeros(n, bool),
      'action': np.zeros((n, action_dim), np.float32),
      'dyn/deter': np.zeros((n, 3), np.float32),
      'dyn/stoch': np.zeros((n, 2, 2), np.float32),
  }


def fill(service, steps, envids=(0, 1, 2), start=0, is_eval=False):
  for t in range(start, start + steps):
    service.add_batch(trans(envids, [t] * len(envids), is_eval))


def check_sequences(batch, length, envids=None):
  count = batch['count']
  assert count.shape == (B, length)
  envs = count // 1000
  assert (envs == envs[:, :1]).all(), count  # One env per sequence.
  assert (np.diff(count, axis=1) == 1).all(), count  # Consecutive steps.
  if envids is not None:
    assert set(envs[:, 0].tolist()) <= set(envids)


@pytest.fixture
def service(tmp_path):
  service = ReplayService.of(make_config(tmp_path))
  yield service
  service.close()


def test_train_sequences_are_consecutive_and_single_env(service):
  # Batches mix envs in varying order and sizes, as the actor's cuts do.
  steps = {0: 0, 1: 0, 2: 0}
  rng = np.random.default_rng(0)
  for _ in range(40):
    envids = rng.permutation(3)[:rng.integers(1, 4)]
    service.add_batch(trans(envids, [steps[e] for e in envids]))
    for e in envids:
      steps[e] += 1
  assert isinstance(service.limiter, Unlimited)
  for _ in range(20):
    batch = service.sample_batch_train(timeout=5)
    check_sequences(batch, T + C)
    assert batch['stepid'].shape == (B, T + C, 20)
    assert batch['consec'].shape == (B, T + C)
    assert 'envid' not in batch and 'is_eval' not in batch
    # The version that acted comes back with its row (the learner's lag).
    np.testing.assert_array_equal(batch['version'], batch['count'] % 1000 // 2)
    assert batch['is_first'][:, 0].all()
  report = service.sample_batch_report(timeout=5)
  check_sequences(report, R + C)
  assert all(value.flags['C_CONTIGUOUS'] for value in report.values())


def test_eval_rows_go_to_the_eval_replay_only(service):
  assert service.sample_batch_eval() == {}  # Never blocks while empty.
  fill(service, 10, envids=(0,))
  items = len(service.train)
  fill(service, 10, envids=(7, 8), is_eval=True)
  assert len(service.train) == items  # Train data untouched by eval rows.
  assert len(service.eval) == 2 * (10 - (R + C) + 1)
  batch = service.sample_batch_eval()
  check_sequences(batch, R + C, envids=(7, 8))
  for _ in range(10):
    check_sequences(service.sample_batch_train(timeout=5), T + C, envids=(0,))
  stats = service.stats()
  assert stats['replay_eval/items'] == len(service.eval)
  assert stats['replay/items'] == items
  assert stats['replay/inserts'] == 10
  assert stats['replay_eval/inserts'] == 20


def test_limiter_blocks_sampling_before_minsize(tmp_path):
  # s = 4 / T = 1 sequence per insert, tolerance 4 * B = 8, minsize B * T = 8.
  # The limiter counts sequences: 11 steps of one env make 11 - (T + C - 1)
  # = 7 of them.
  service = ReplayService.of(make_config(tmp_path, **{"run.train_ratio": 4.0}))
  try:
    fill(service, 11, envids=(0,))
    with pytest.raises(TimeoutError, match='too few steps'):
      service.sample_batch_train(timeout=0.2)
    stats = service.stats()
    assert stats['limiter/sample_wait_count'] == 1
    assert stats['limiter/sample_wait_dur'] >= 0.2
    fill(service, 3, envids=(0,), start=11)  # size 10: credit -8 + 3 = -5.
    check_sequences(service.sample_batch_train(timeout=5), T + C)
    assert service.limiter.avail == -5 - B
  finally:
    service.close()


def test_a_batch_share_counts_the_whole_batch_once(tmp_path):
  """A multi-host learner's processes sample shares of one batch: the
  first through the limiter, which takes one batch's credit (B sequences)
  whatever its share, the others without touching the limiter."""
  service = ReplayService.of(make_config(tmp_path, **{"run.train_ratio": 4.0}))
  try:
    fill(service, 7)  # 12 rows that complete a sequence: past minsize 8.
    before = service.limiter.avail
    first = service.sample_batch_train(B // 2, timeout=5)
    assert service.limiter.avail == before - B
    second = service.sample_share_train(B // 2)
    assert service.limiter.avail == before - B
    for share in (first, second):
      assert share['count'].shape == (B // 2, T + C)
      assert (np.diff(share['count'], axis=1) == 1).all()
    assert service.sample_batch_report(1)['count'].shape == (1, R + C)
    for bad in (0, B + 1, 2.0, 'two', np.array([1, 2])):
      with pytest.raises(ValueError, match='rows must be an integer from 1 '
                         f'to batch_size \\({B}\\)'):
        service.sample_share_train(bad)
    assert service.limiter.avail == before - B
  finally:
    service.close()


def test_limiter_blocks_inserts_when_learner_is_behind(tmp_path):
  service = ReplayService.of(make_config(tmp_path, **{"run.train_ratio": 4.0}))
  # Inserts (sequences; the first T + C - 1 rows complete none) earn credit
  # from the 8th on; they stop at credit 8 = size 23.
  rows = trans([0] * 40, range(40))
  done = threading.Event()

  def add():
    service.add_batch(rows)
    done.set()

  thread = threading.Thread(target=add, daemon=True)
  thread.start()
  try:
    assert wait_until(lambda: service.limiter.size == 23, 5)
    time.sleep(0.3)
    assert service.limiter.size == 23 and not done.is_set()
    service.sample_batch_train(timeout=5)  # Takes 2 credit: 2 more inserts.
    assert wait_until(lambda: service.limiter.size == 25, 5)
    time.sleep(0.2)
    assert service.limiter.size == 25 and not done.is_set()
    stats = service.stats()
    assert stats['limiter/insert_wait_count'] >= 1
    assert 0 < stats['limiter/insert_wait_frac'] < 1
  finally:
    service.interrupt()  # A stop releases the blocked add_batch.
  thread.join(timeout=5)
  assert done.is_set()
  with pytest.raises(Closing):
    service.sample_batch_train(timeout=1)
  service.close()


def test_many_envs_never_block_before_their_first_sequence(tmp_path):
  """Rows that complete no sequence are not counted by the limiter, so more
  envs than the limiter's fill and tolerance allow cannot stall the run
  before the learner can sample anything (as counting steps did)."""
  service = ReplayService.of(make_config(tmp_path, **{"run.train_ratio": 4.0}))
  envids = range(40)  # 40 * (T + C - 1) = 160 rows: past minsize + tolerance.
  done = threading.Event()

  def add():
    fill(service, T + C - 1, envids=envids)
    done.set()

  thread = threading.Thread(target=add, daemon=True)
  thread.start()
  try:
    thread.join(timeout=10)
    assert done.is_set(), 'add_batch blocked before any sequence existed'
    assert service.limiter.size == 0 and len(service.train) == 0
    # One sequence each for 10 envs (minsize 8 + tolerance 8 would let 16).
    fill(service, 1, envids=range(10), start=T + C - 1)
    assert service.limiter.size == 10
    check_sequences(service.sample_batch_train(timeout=5), T + C, range(10))
  finally:
    service.close()


def test_nothing_blocks_without_a_train_ratio(service):
  fill(service, 60)
  assert service.limiter.size == 3 * (60 - (T + C - 1))  # Sequences.
  start = time.monotonic()
  for _ in range(50):
    service.sample_batch_train(timeout=1)
  assert time.monotonic() - start < 2
  stats = service.stats()
  assert stats['limiter/insert_wait_count'] == 0
  assert stats['limiter/sample_wait_count'] == 0
  assert stats['replay/samples'] == 50 * B


def test_update_writes_latents_seen_by_later_samples(service):
  fill(service, 8, envids=(0,))  # Items start at t = 0 .. 3: heavy overlap.
  first = service.sample_batch_train(timeout=5)
  latent = first['count'][..., None].astype(np.float32) + 0.5
  service.update({
      'stepid': first['stepid'][:, C:],
      'dyn/deter': np.repeat(latent[:, C:], 3, axis=-1)})
  updated = set(first['count'][:, C:].ravel().tolist())
  seen = 0
  for _ in range(10):
    batch = service.sample_batch_train(timeout=5)
    for count, deter in zip(batch['count'].ravel(),
                            batch['dyn/deter'].reshape(-1, 3)):
      expected = count + 0.5 if count in updated else 0.0
      np.testing.assert_array_equal(deter, np.full(3, expected, np.float32))
      seen += count in updated
  assert seen > 0
  assert service.stats()['replay/updates'] == B * T


@pytest.mark.parametrize('break_batch, message', [
    (lambda b: b.pop('reward'), r"missing keys \['reward'\]"),
    (lambda b: b.pop('envid'), r"missing keys \['envid'\]"),
    (lambda b: b.update(action=np.zeros((3, 5), np.float32)),
     r"'action': expected rows of shape \(2,\) float32, received rows of "
     r"shape \(5,\) float32"),
    (lambda b: b.update(reward=np.zeros(2, np.float32)),
     r"'reward': expected leading dim N=3 .* received 2"),
    (lambda b: b.update(count=b['count'].astype(np.float64)),
     r"'count': expected rows of shape \(\) int64, received rows of shape "
     r"\(\) float64"),
    (lambda b: b.update(extra=np.zeros(3)), r"unexpected keys \['extra'\]"),
    (lambda b: b.update({SHIPMENT: np.zeros(3, np.int64)}),
     r"'shipment' must be an int array \[sender, seq\], received int64 "
     r"\(3,\)"),
])
def test_malformed_batch_raises_and_changes_nothing(
    service, break_batch, message):
  fill(service, 6)
  before = (service.train.stats()['adds'], service.eval.stats()['adds'],
            service.limiter.size, len(service.train))
  bad = trans([0, 1, 5], [6, 6, 0])
  bad['is_eval'][2] = True  # Rows for both replays.
  break_batch(bad)
  with pytest.raises(ValueError, match=message):
    service.add_batch(bad)
  after = (service.train.stats()['adds'], service.eval.stats()['adds'],
           service.limiter.size, len(service.train))
  assert after == before
  fill(service, 1, start=6)  # Still serving good batches.
  check_sequences(service.sample_batch_train(timeout=5), T + C)


def shipped(batch, seq, sender=7):
  """The batch as the actor's Shipper sends it: with a shipment id."""
  return {**batch, SHIPMENT: np.array([sender, seq], np.int64)}


def test_a_resent_shipment_is_stored_once(service):
  """A client resends its calls in flight after a reconnect, in order:
  batches the service stored come again with their shipment ids."""
  sent = [shipped(trans([0, 1], [t, t]), seq=t) for t in range(6)]
  for batch in sent + sent[3:]:
    assert service.add_batch(batch) == {}
  # Another sender numbers its shipments from 0 too; a batch without an id
  # is stored as it comes.
  service.add_batch(shipped(trans([2], [0]), seq=0, sender=8))
  service.add_batch(trans([2], [1]))
  assert service.add_batch(shipped(trans([2], [0]), seq=0, sender=8)) == {}
  # 6 steps of envs 0 and 1 (2 sequences each), 2 of env 2.
  assert service.train.stats()['adds'] == 14
  assert len(service.train) == service.limiter.size == 4
  for _ in range(10):  # A stored repeat would break a sequence.
    check_sequences(service.sample_batch_train(timeout=5), T + C, (0, 1))


def test_save_and_load_restore_items_and_limiter(tmp_path):
  config = make_config(tmp_path, **{'run.train_ratio': 4.0})
  service = ReplayService.of(config)
  fill(service, 11)  # 3 * (11 - 4) = 21 sequences: credit -8 + 14 = 6.
  fill(service, 6, envids=(9,), is_eval=True)
  service.sample_batch_train(timeout=5)
  state = (service.limiter.size, service.limiter.avail)
  items, eval_items = len(service.train), len(service.eval)
  service.save()
  service.close()
  assert json.loads((tmp_path / 'ckpt' / 'replay.json').read_text())[
      'limiter'] == {'size': state[0], 'avail': state[1]}

  restored = ReplayService.of(config)
  try:
    loaded = restored.load()
    assert loaded == {'items': items, 'eval_items': eval_items,
                      'limiter': True, 'logged_rows': 0}
    assert (restored.limiter.size, restored.limiter.avail) == state
    assert len(restored.train) == items and len(restored.eval) == eval_items
    check_sequences(restored.sample_batch_train(timeout=5), T + C)
    check_sequences(restored.sample_batch_eval(), R + C, envids=(9,))
    # Accepts data within the restored credit (4 + 3 < 8). Each env's stream
    # starts anew after a load: its first T + C - 1 rows complete none.
    fill(restored, 5, start=11)
    assert restored.limiter.size == state[0] + 3 * (5 - (T + C - 1))
  finally:
    restored.close()


def test_a_replay_saved_without_versions_goes_on_without_them(tmp_path):
  config = make_config(tmp_path)
  service = ReplayService.of(config)
  for t in range(6):  # As a run from before versions were stored sent them.
    service.add_batch({k: v for k, v in trans((0, 1), [t, t]).items()
                       if k != 'version'})
  service.save()
  service.close()
  restored = ReplayService.of(config)
  try:
    restored.load()
    fill(restored, 6, envids=(0, 1), start=6)  # with versions: accepted
    batch = restored.sample_batch_train(timeout=5)
    check_sequences(batch, T + C)
    assert 'version' not in batch
  finally:
    restored.close()


# The logger server runs in a plain thread here; portal warns about that.
@pytest.mark.filterwarnings('ignore:Using Portal from plain Python threads')
def test_server_round_trip_and_sigterm(tmp_path):
  """serve_replay in its own process, reporting to a logger thread."""
  replay_port, logger_port = free_port(), free_port()
  overrides = {
      'run.replay_addr': f'127.0.0.1:{replay_port}',
      'run.logger_addr': f'127.0.0.1:{logger_port}',
      'run.log_every': 0.5, 'run.save_every': 0.5}
  config = make_config(tmp_path, **overrides)
  stop_logger = StopSignal(install=False)
  logger = threading.Thread(
      target=logger_process.serve_logger, args=(config, stop_logger),
      daemon=True)
  logger.start()
  code = (
      'import sys, json\n'
      'from dreamer_ver.config.loading import compose\n'
      'from dreamer_ver.runtime.replay_process import serve_replay\n'
      'sys.exit(serve_replay(compose(["debug"], json.loads(sys.argv[1]))))\n')
  values = {
      'logdir': str(tmp_path), 'batch_size': B, 'batch_length': T,
      'replay_context': C, 'report_length': R, 'replay.size': 1000,
      'replay.chunksize': 8, 'run.train_ratio': 0.0, **overrides}
  log = (tmp_path / 'replay.log').open('w')
  proc = subprocess.Popen(
      [sys.executable, '-c', code, json.dumps(values)], stdout=log,
      stderr=subprocess.STDOUT, env={**os.environ, 'PYTHONUNBUFFERED': '1'})
  client = portal.Client(f'127.0.0.1:{replay_port}', 'TestReplay')
  try:
    assert client.connect(timeout=20), 'replay server did not come up'
    for t in range(6):
      assert client.add_batch(trans([0, 1, 2], [t] * 3)).result(10) == {}
    client.add_batch(trans([4], [0], is_eval=True)).result(10)
    batch = client.sample_batch_train().result(10)
    check_sequences(batch, T + C)
    assert batch['stepid'].shape == (B, T + C, 20)
    report = client.sample_batch_report().result(10)
    check_sequences(report, R + C)
    assert client.sample_batch_eval().result(10) == {}
    assert client.update({'stepid': batch['stepid'],
                          'dyn/deter': np.ones((B, T + C, 3), np.float32)
                          }).result(10) == {}
    # A bad batch is an error for its caller only; the server keeps serving.
    bad = trans([0], [6], action_dim=3)
    with pytest.raises(RuntimeError, match="'action'"):
      client.add_batch(bad).result(10)
    check_sequences(client.sample_batch_train().result(10), T + C)
    # The replay's stats reach the logger.
    metrics = tmp_path / 'metrics.jsonl'
    assert wait_until(lambda: metrics.exists() and any(
        'replay/items' in json.loads(line)
        for line in metrics.read_text().splitlines()), 10)
  finally:
    client.close(timeout=2)
    proc.send_signal(signal.SIGTERM)
    try:
      returncode = proc.wait(timeout=15)
    finally:
      if proc.poll() is None:
        proc.kill()
        proc.wait(timeout=5)
      log.close()
      stop_logger.set()
      logger.join(timeout=10)
  output = (tmp_path / 'replay.log').read_text()
  assert returncode == 0, output
  assert not logger.is_alive()
  state = json.loads((tmp_path / 'ckpt' / 'replay.json').read_text())
  assert state['limiter']['size'] == 3 * (6 - (T + C - 1))  # Sequences.
  assert list((tmp_path / 'replay').glob('*.npz'))
  assert list((tmp_path / 'replay_eval').glob('*.npz'))


def wait_until(predicate, timeout):
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if predicate():
      return True
    time.sleep(0.02)
  return predicate()


class Serving:
  """serve_replay(config) on a thread with no logger listening, and a
  client connected to it; `result` gets its exit code. A context: on exit
  the client closes and the server is stopped."""

  def __init__(self, tmp_path, log_every):
    port = free_port()
    self.config = make_config(tmp_path, **{
        'run.replay_addr': f'127.0.0.1:{port}',
        'run.logger_addr': f'127.0.0.1:{free_port()}',  # Nobody listens.
        'run.log_every': log_every})
    self.stop = StopSignal(install=False)
    self.result = []
    self.thread = threading.Thread(target=lambda: self.result.append(
        replay_process.serve_replay(self.config, self.stop)), daemon=True)
    self.client = portal.Client(f'127.0.0.1:{port}', 'TestReplay')

  def __enter__(self):
    self.thread.start()
    assert self.client.connect(timeout=15)
    return self

  def __exit__(self, *exc):
    self.client.close(timeout=2)
    self.stop.set()
    self.thread.join(timeout=10)


@pytest.mark.filterwarnings('ignore:Using Portal from plain Python threads')
def test_server_survives_a_missing_logger(tmp_path):
  """Stats go nowhere; the replay keeps serving and still stops promptly."""
  with Serving(tmp_path, log_every=0.2) as serving:
    for t in range(6):
      serving.client.add_batch(trans([0], [t])).result(10)
    time.sleep(0.6)  # Several stats rounds while the logger is down.
    check_sequences(serving.client.sample_batch_train().result(10), T + C)
  assert serving.result == [0]


def test_a_batch_blocked_in_the_limiter_at_a_stop_is_stored_before_its_reply(
    tmp_path):
  """A stop releases add_batch from the limiter's wait; the rows it took
  are stored (and saved) before it replies, since a reply means stored:
  the caller never sends them again."""
  config = make_config(tmp_path, **{'run.train_ratio': 4.0})
  service = ReplayService.of(config)
  rows = trans([0] * 40, range(40))
  replies = []
  thread = threading.Thread(
      target=lambda: replies.append(service.add_batch(rows)), daemon=True)
  thread.start()
  assert wait_until(lambda: service.limiter.size == 23, 5)  # Blocked.
  service.interrupt()  # What a graceful stop does first.
  thread.join(timeout=5)
  assert replies == [{}]
  service.save()
  service.close()
  again = ReplayService.of(config)
  try:
    again.load()
    assert again.stats()['replay/items'] == 40 - (T + C - 1)
  finally:
    again.close()


def test_released_shipments_are_stored_without_waiting_for_the_learner(
    tmp_path):
  """An agent that stops has its last batches stored at once
  (release_inserts): its learner no longer samples, so the limiter would
  hold them for ever. Other senders still wait."""
  service = ReplayService.of(make_config(tmp_path, **{"run.train_ratio": 4.0}))
  try:
    rows = {**trans([0] * 40, range(40)), 'shipment': np.array([7, 0])}
    replies = []
    thread = threading.Thread(
        target=lambda: replies.append(service.add_batch(rows)), daemon=True)
    thread.start()
    assert wait_until(lambda: service.limiter.size == 23, 5)  # Blocked.
    assert service.release_inserts(np.int64(7)) == {}
    thread.join(timeout=5)
    assert replies == [{}] and service.stats()['replay/items'] == 36
    other = {**trans([1] * 40, range(40)), 'shipment': np.array([8, 0])}
    outcome = []

    def add_other():
      try:
        outcome.append(service.add_batch(other))
      except Closing as error:
        outcome.append(error)
    blocked = threading.Thread(target=add_other, daemon=True)
    blocked.start()
    blocked.join(timeout=0.5)
    assert blocked.is_alive()  # Sender 8 was not released.
  finally:
    service.close()
  blocked.join(timeout=5)
  assert len(outcome) == 1 and isinstance(outcome[0], Closing), outcome


@pytest.mark.filterwarnings('ignore:Using Portal from plain Python threads')
def test_a_full_disk_is_one_line_and_an_ordered_stop(
    tmp_path, monkeypatch, capfd):
  """The replay process after its disk filled: the batch it could not log
  is refused to its sender, later ones at once; it says so in one line
  naming the file and the space left, serves samples until it is stopped
  (without a supervisor: by itself), and exits 2 without a traceback."""
  services = []
  build = ReplayService.of.__func__
  monkeypatch.setattr(ReplayService, 'of', classmethod(
      lambda cls, config: services.append(build(cls, config)) or services[-1]))
  with Serving(tmp_path, log_every=0) as serving:
    for t in range(6):
      serving.client.add_batch(trans([0], [t])).result(10)
    FullDisk(monkeypatch, services[0])
    for t in (6, 7):
      with pytest.raises(RuntimeError, match='StorageFault: '):
        serving.client.add_batch(trans([0], [t])).result(10)
    serving.thread.join(timeout=10)
    assert serving.result == [2]  # it stopped by itself
  out, err = capfd.readouterr()
  (line,) = [x for x in err.splitlines() if x.startswith('error: replay:')]
  assert line.startswith(
      f'error: replay: no space left on device writing {tmp_path}/replay_wal/')
  assert 'MB free of' in line and line.endswith(
      'free space there (or make it writable), then run the same command '
      'again to resume')
  assert 'Traceback' not in out + err and '[Replay] add_batch' not in out
