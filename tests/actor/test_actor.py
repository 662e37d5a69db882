"""The actor behind the batch server: per-env carries routed by value."""

import collections
import concurrent.futures
import multiprocessing
import threading
import time

import elements
import jax.numpy as jnp
import numpy as np
import portal
import pytest

from dreamer_ver.config import loading as configlib
from dreamer_ver.envs import make_env
from dreamer_ver.actor import batching
from dreamer_ver.actor.actor import Actor, _log_keys
from dreamer_ver.rpc.batch_server import BatchServer, Request
from dreamer_ver.runtime.env_worker import run_envs
from dreamer_ver.actor.params import ParamsStore
from dreamer_ver.actor.shipping import SHIPMENT, Shipper
from dreamer_ver.rpc.addresses import free_port


class CounterAgent:
  """A stand-in policy whose carry is a per-env step counter.

  It resets on is_first and returns the counter as an output, so every
  transition shows whether the carry it got was that env's own.
  """

  def __init__(self, obs_space):
    self.obs_space = obs_space
    self.act_space = {'action': elements.Space(np.int32, (), 0, 2)}

  def init_carry(self, batch):
    return {'count': jnp.zeros((batch,), jnp.int32)}

  def policy_step(self, params, carry, obs, key, mode):
    count = jnp.where(obs['is_first'], 0, carry['count'] + 1)
    acts = {'action': (count % 2).astype(jnp.int32)}
    return {'count': count}, acts, {'carry_count': count.astype(jnp.float32)}


class Recorder:
  """Stands in for the replay client: keeps every transition batch."""

  def __init__(self):
    self.batches = []

  def add_batch(self, trans):
    self.batches.append(trans)
    future = concurrent.futures.Future()
    future.set_result(None)
    return future


def _fleet_config(port, envs):
  return configlib.compose(['debug'], {
      'task': 'synthetic_counter', 'run.actor_addr': f'127.0.0.1:{port}',
      'run.envs': envs, 'env.synthetic.step_time': 0.004,
      'env.synthetic.jitter': 0.5, 'env.synthetic.slow_frac': 0.4,
      'env.synthetic.length': 25})


@pytest.mark.parametrize('per_worker,lanes,cutoff,transport', [
    (1, 1, 'preempt', 'tcp'), (3, 1, 'ver', 'shm'), (1, 2, 'ver', 'tcp'),
    (3, 2, 'preempt', 'shm'), (1, 1, 'ver', 'shm')])
def test_carries_follow_their_env_across_varying_batches(
    per_worker, lanes, cutoff, transport):
  """Also with several envs per worker process, whose requests carry one
  row per env and are split into rows for the batch server (double
  buffered), and with several lanes (policy devices; here two on the one
  CPU device), each with its own carry table and cutoff; under both
  production cutoffs; env processes over TCP and over shared memory."""
  envs, port = 6, free_port()
  config = configlib.override(_fleet_config(port, envs), {
      'run.actor_cutoff': cutoff, 'run.actor_transport': transport})
  env = make_env(config.task, config.env)
  agent = CounterAgent(env.obs_space)
  params = {'enc': {}, 'dyn': {}, 'pol': {}}
  recorder = Recorder()
  actor = Actor(agent, ParamsStore(params, devices=[None] * lanes),
                slots=envs, buckets=[1, 2, 4, 8], replay=recorder)
  actor.compile()
  lanes_of = collections.defaultdict(set)  # envid -> lanes that served it

  def handle(requests):
    for request in requests:
      lanes_of[request.envid].add(request.lane)
    return actor.handle(requests)

  server = BatchServer(
      f'127.0.0.1:{port}', handle,
      [batching.make_cutoff(config.run, envs, actor.buckets, lanes=lanes)
       for _ in range(lanes)],
      postfn=actor.post, name='TestActor', transports=(transport,))
  server.start()
  ctx = multiprocessing.get_context('spawn')
  groups = [list(range(i, i + per_worker)) for i in range(0, envs, per_worker)]
  procs = [ctx.Process(target=run_envs, args=(config, group))
           for group in groups]
  try:
    for proc in procs:
      proc.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
      rows = sum(len(b['envid']) for b in recorder.batches)
      if rows >= 600:
        break
      time.sleep(0.2)
  finally:
    for proc in procs:
      proc.terminate()
    for proc in procs:
      proc.join(15)
    server.close()
  assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]

  per_env = collections.defaultdict(list)
  sizes = collections.Counter()
  for trans in list(recorder.batches):
    sizes[len(trans['envid'])] += 1
    for row in range(len(trans['envid'])):
      per_env[int(trans['envid'][row])].append(
          (trans['count'][row], trans['carry_count'][row],
           bool(trans['is_first'][row])))
  assert sorted(per_env) == list(range(envs))
  assert len(sizes) >= 2, sizes  # Batches of varying size were cut.
  for envid, rows in per_env.items():
    assert len(rows) >= 10, (envid, len(rows))
    counts = [r[0] for r in rows]
    # The carry each row got was its own env's: counter == env step index.
    np.testing.assert_array_equal(counts, [r[1] for r in rows])
    # And the env's sequence is unbroken: +1 per step, 0 on is_first.
    for prev, (count, _, first) in zip(counts, rows[1:]):
      assert count == (0 if first else prev + 1), (envid, prev, count)
  # Each env stays on one lane; the connections are spread over all lanes.
  assert all(len(seen) == 1 for seen in lanes_of.values()), dict(lanes_of)
  assert set().union(*lanes_of.values()) == set(range(lanes))


def test_bad_requests_get_clear_errors_and_others_keep_going():
  port = free_port()
  config = _fleet_config(port, 2)
  env = make_env(config.task, config.env)
  agent = CounterAgent(env.obs_space)
  recorder = Recorder()
  actor = Actor(agent, ParamsStore({'enc': {}, 'dyn': {}, 'pol': {}}),
                slots=4, buckets=[1, 2, 4], replay=recorder)
  actor.compile()
  server = BatchServer(f'127.0.0.1:{port}', actor.handle,
                       batching.make_cutoff(config.run, 2, actor.buckets),
                       postfn=actor.post)
  server.start()
  client = portal.Client(f'127.0.0.1:{port}', 'Bad', logging=False)
  good = portal.Client(f'127.0.0.1:{port}', 'Good', logging=False)
  try:
    obs = env.step({'action': np.int32(0), 'reset': True})
    request = {**{k: np.asarray(v) for k, v in obs.items()},
               'envid': np.int64(1), 'is_eval': np.bool_(False)}
    cases = {
        'missing key': ({k: v for k, v in request.items() if k != 'vector'}, 'vector'),
        'extra key': ({**request, 'bogus': np.zeros(3)}, 'bogus'),
        'wrong shape': ({**request, 'vector': np.zeros(5, np.float32)}, 'vector'),
        'wrong dtype': ({**request, 'vector': np.zeros(4, np.float64)}, 'float64'),
        'nan': ({**request, 'vector': np.full(4, np.nan, np.float32)}, 'finite'),
        'negative envid': ({**request, 'envid': np.int64(-3)}, 'envid'),
        'huge envid': ({**request, 'envid': np.int64(2 ** 40)}, 'envid'),
    }
    for name, (bad, needle) in cases.items():
      with pytest.raises(RuntimeError, match=needle):
        client.act(bad).result(timeout=10)
      reply = good.act({**request, 'envid': np.int64(0)}).result(timeout=10)
      assert set(reply) == {'action', 'reset'}, name
  finally:
    client.close()
    good.close()
    server.close()
  stored = [int(e) for b in recorder.batches for e in b['envid']]
  assert stored == [0] * len(cases)  # Nothing from the bad caller was kept.


class FlakyLogger:
  """Stands in for the logger link: calls whose index is in `drop` fail,
  as the link's calls do when its in-flight window is full."""

  def __init__(self, drop):
    self.drop = set(drop)
    self.calls = []

  def transitions(self, trans):
    future = concurrent.futures.Future()
    if len(self.calls) in self.drop:
      future.set_exception(RuntimeError('dropped: the logger lags'))
    else:
      future.set_result({})
    self.calls.append(trans)
    return future


def test_rows_the_logger_missed_are_reported_with_the_next_rows():
  config = _fleet_config(free_port(), 2)
  env = make_env(config.task, config.env)
  obs = {k: np.asarray(v) for k, v in
         env.step({'action': np.int32(0), 'reset': True}).items()}
  logger = FlakyLogger(drop=[1, 2])
  actor = Actor(CounterAgent(env.obs_space),
                ParamsStore({'enc': {}, 'dyn': {}, 'pol': {}}),
                slots=2, buckets=[1, 2], logger=logger)
  actor.compile()
  for envids in ([0, 1], [0], [0, 1], [1], [0, 1]):
    requests = [Request(('test', 0), bytes(8), {
        **obs, 'envid': np.int64(e), 'is_eval': np.bool_(False)}, 0.0, e)
        for e in envids]
    actor.post(requests, actor.handle(requests)[1])
  missed = [dict(zip(c['envid'].tolist(), c['missed'].tolist()))
            for c in logger.calls]
  # Call 1 (env 0) and call 2 (envs 0, 1, env 0 already owing 1) failed.
  assert missed == [{0: 0, 1: 0}, {0: 0}, {0: 1, 1: 0}, {1: 1}, {0: 2, 1: 0}]
  assert actor.shipper.errors == 2


def test_the_actor_reports_each_batchs_policy_lag():
  """A batch's lag is the updates published while it was served: the
  params it read against the store's version once its actions are back."""
  class Publishing(ParamsStore):  # a learner two updates ahead of reads
    @property
    def version(self):
      return super().version + 2

  config = _fleet_config(free_port(), 1)
  env = make_env(config.task, config.env)
  obs = {k: np.asarray(v) for k, v in
         env.step({'action': np.int32(0), 'reset': True}).items()}
  for store, lag in ((ParamsStore({'enc': {}, 'dyn': {}, 'pol': {}}, 5), 0),
                     (Publishing({'enc': {}, 'dyn': {}, 'pol': {}}, 5), 2)):
    actor = Actor(CounterAgent(env.obs_space), store, slots=2, buckets=[1, 2])
    actor.compile()
    for _ in range(3):
      trans = actor.step([{**obs, 'envid': np.int64(0)}])
      assert trans['version'].tolist() == [5]
    assert actor.take_lags() == [lag] * 3
    assert actor.take_lags() == []  # taken: the next interval starts empty


def test_shipments_carry_one_id_each_and_leave_in_seq_order():
  """ship() runs on every worker thread; the servers take a seq at or
  below the newest they stored from a sender for a resend, so the calls
  must leave in seq order, with the same id to replay and logger."""
  replay, logger = Recorder(), FlakyLogger(drop=[])
  shipper = Shipper(replay, logger)
  trans = {'envid': np.arange(2), 'is_eval': np.zeros(2, bool)}

  def ship():
    for _ in range(50):
      shipper.ship(trans, {})

  threads = [threading.Thread(target=ship) for _ in range(4)]
  for thread in threads:
    thread.start()
  for thread in threads:
    thread.join()
  ids = [batch[SHIPMENT].tolist() for batch in replay.batches]
  assert ids == [[shipper.sender, seq] for seq in range(200)]
  assert [call[SHIPMENT].tolist() for call in logger.calls] == ids
  assert replay.batches[0][SHIPMENT].dtype == np.int64
  assert SHIPMENT not in trans  # The caller's batch is left as it was.
  assert shipper.served == 400
  assert Shipper().sender != shipper.sender


def test_a_link_closed_at_shutdown_fails_the_shipment_without_raising(capsys):
  """At shutdown the agent closes its links while a worker may still be
  shipping: the call that cannot be sent counts as a failed shipment, is
  printed once, and the logger still gets the batch."""
  class ClosedReplay:
    def add_batch(self, trans):
      raise ConnectionError('ActorReplay is closed')

  logger = FlakyLogger(drop=[])
  shipper = Shipper(ClosedReplay(), logger)
  shipper.ship({'envid': np.arange(2), 'is_eval': np.zeros(2, bool)}, {})
  assert shipper.errors == 1 and len(logger.calls) == 1
  assert ('replay.add_batch failed: ActorReplay is closed'
          in capsys.readouterr().out)
  # A server that refuses every batch (a full disk) is not a flood: the
  # later failures are counted, not printed.
  for _ in range(3):
    shipper.ship({'envid': np.arange(2), 'is_eval': np.zeros(2, bool)}, {})
  assert shipper.errors == 4 and capsys.readouterr().out == ''


def test_a_new_env_beyond_the_carry_capacity_is_refused_never_mixed():
  """Two slots, three env ids: the third gets a clear error (and is
  counted); the two live envs keep their own carries throughout."""
  config = _fleet_config(free_port(), 2)
  env = make_env(config.task, config.env)
  obs = {k: np.asarray(v) for k, v in
         env.step({'action': np.int32(0), 'reset': True}).items()}
  actor = Actor(CounterAgent(env.obs_space),
                ParamsStore({'enc': {}, 'dyn': {}, 'pol': {}}),
                slots=2, buckets=[1, 2, 4])
  actor.compile()

  def request(envid, first):
    data = {**obs, 'envid': np.int64(envid), 'is_eval': np.bool_(False),
            'is_first': np.bool_(first)}
    return Request(('test', envid), bytes(8), data, 0.0, envid)

  counts = collections.defaultdict(list)
  for step in range(6):
    envids = [0, 1] if step < 3 else [2, 0, 1]
    replies, (trans, _) = actor.handle(
        [request(e, step == 0 or (e == 2 and step == 3)) for e in envids])
    for envid, count in zip(trans['envid'], trans['carry_count']):
      counts[int(envid)].append(int(count))
    if step >= 3:
      assert isinstance(replies[0], ValueError)
      assert 'env id 2' in str(replies[0]) and 'run.envs' in str(replies[0])
      assert all(isinstance(r, dict) for r in replies[1:])
  assert counts == {0: list(range(6)), 1: list(range(6))}
  assert actor.lanes[0].refused == 3


@pytest.mark.parametrize('is_eval, needle', [
    (np.array([True, False]), "'is_eval'"),  # bool() of it raises
    (np.int64(1), "'is_eval'"),
    (np.array('yes'), "'is_eval'"),
])
def test_a_bad_meta_value_is_its_senders_error_and_its_batch_is_served(
    is_eval, needle):
  config = _fleet_config(free_port(), 2)
  env = make_env(config.task, config.env)
  obs = {k: np.asarray(v) for k, v in
         env.step({'action': np.int32(0), 'reset': True}).items()}
  recorder = Recorder()
  actor = Actor(CounterAgent(env.obs_space),
                ParamsStore({'enc': {}, 'dyn': {}, 'pol': {}}),
                slots=4, buckets=[1, 2, 4], replay=recorder)
  actor.compile()
  metas = [np.bool_(False), is_eval, np.bool_(True)]
  batch = [Request(('test', e), bytes(8),
                   {**obs, 'envid': np.int64(e), 'is_eval': meta}, 0.0, e)
           for e, meta in enumerate(metas)]
  replies, context = actor.handle(batch)
  assert isinstance(replies[1], ValueError) and needle in str(replies[1])
  assert all(set(replies[i]) == {'action', 'reset'} for i in (0, 2))
  actor.post(batch, context)
  stored, = recorder.batches
  np.testing.assert_array_equal(stored['envid'], [0, 2])
  np.testing.assert_array_equal(stored['is_eval'], [False, True])


def test_the_shipper_counts_what_replay_acknowledged_and_drains_in_flight():
  """`stored` counts the train rows replay answered for (`served` counts
  them when sent); drain waits for the answers still out, up to a
  deadline, so a stop saves the count replay holds."""
  import concurrent.futures

  class SlowReplay:
    def __init__(self):
      self.futures = []

    def add_batch(self, trans):
      self.futures.append(concurrent.futures.Future())
      return self.futures[-1]

  replay = SlowReplay()
  shipper = Shipper(replay)
  shipper.served = shipper.stored = 100  # Resumed from a checkpoint.
  trans = {'envid': np.arange(3), 'is_eval': np.array([False, False, True])}
  for _ in range(3):
    shipper.ship(trans, {})
  assert shipper.served == 106 and shipper.stored == 100
  replay.futures[0].set_result({})
  replay.futures[1].set_exception(RuntimeError('rejected'))
  assert shipper.stored == 102
  assert not shipper.drain(timeout=0.1)  # The third is still out.
  threading.Timer(0.1, lambda: replay.futures[2].set_result({})).start()
  assert shipper.drain(timeout=5)
  assert shipper.stored == 104 and shipper.errors == 1


def test_drain_waits_for_a_shipment_still_waiting_to_be_sent():
  """A batch counted in `served` whose replay call is still blocked (the
  client's in-flight limit, replay's back-pressure) is waited for too: a
  stop that drained without it saved one step fewer than replay held."""
  import concurrent.futures
  sending = threading.Event()
  release = threading.Event()

  class BackPressure:
    def add_batch(self, trans):
      sending.set()
      assert release.wait(10)
      future = concurrent.futures.Future()
      future.set_result({})
      return future

  shipper = Shipper(BackPressure())
  trans = {'envid': np.arange(2), 'is_eval': np.array([False, False])}
  thread = threading.Thread(target=shipper.ship, args=(trans, {}))
  thread.start()
  assert sending.wait(10) and shipper.served == 2
  assert not shipper.drain(timeout=0.1)  # Not sent yet: not drained.
  threading.Timer(0.1, release.set).start()
  assert shipper.drain(timeout=5)
  assert shipper.stored == shipper.served == 2
  thread.join(10)


def test_log_keys_every_row_carries_are_stacked_and_the_rest_dropped():
  datas = [{'x': 0, 'log/a': np.float32(i), 'log/b': np.zeros(i + 1),
            **({'log/c': 1} if i else {})} for i in range(3)]
  logs = _log_keys(datas)
  # log/b's rows differ in shape; log/c is missing from the first row.
  assert list(logs) == ['log/a']
  np.testing.assert_array_equal(logs['log/a'], [0, 1, 2])
  datas[0]['log/c'] = 0
  np.testing.assert_array_equal(_log_keys(datas)['log/c'], [0, 1, 1])


def test_a_storage_fault_replay_refused_with_is_counted_not_printed(capsys):
  """Replay says its full disk itself, in one line; the actor adds none,
  and still prints the first failure of another kind."""
  from dreamer_ver.rpc.wire import RemoteError

  class FullReplay:
    def __init__(self, message):
      self.message = message

    def add_batch(self, trans):
      raise RemoteError(self.message)

  full = RemoteError('add_batch: StorageFault: no space left on device '
                     'writing /x/replay_wal/1.wal (0.0 MB free of 10.5 MB)')
  assert full.kind == 'StorageFault'
  batch = {'envid': np.arange(2), 'is_eval': np.zeros(2, bool)}
  shipper = Shipper(FullReplay(str(full)), FlakyLogger(drop=[]))
  for _ in range(3):
    shipper.ship(batch, {})
  assert shipper.errors == 3 and capsys.readouterr().out == ''
  shipper.replay = FullReplay('add_batch: ValueError: bad rows')
  shipper.ship(batch, {})
  shipper.ship(batch, {})
  assert shipper.errors == 5
  assert capsys.readouterr().out.count(
      'replay.add_batch failed: add_batch: ValueError: bad rows') == 1
