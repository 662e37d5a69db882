"""Tests for the batch server and its cutoff policies.

Replies are checked by value (each client sends its own counter and expects
exactly twice that back), so a reply routed to the wrong caller fails. Every
server runs on a loopback port and is closed in a finally block; every wait
has a timeout.
"""

import collections
import concurrent.futures
import contextlib
import functools
import socket
import threading
import time
import types

import numpy as np
import portal
import pytest

from dreamer_ver.actor import preemption
from dreamer_ver.rpc.batch_server import ENV_ID_TAKEN, BatchServer
from dreamer_ver.rpc.addresses import PING, free_port
from dreamer_ver.rpc.client import Client
from dreamer_ver.rpc.shm_client import ShmClient
from dreamer_ver.rpc.wire import RemoteError

TIMEOUT = 5.0
TRANSPORTS = ('tcp', 'shm', 'thread')
Pending = collections.namedtuple('Pending', 'arrival envid')


# ------------------------------------------------------------------ cutoffs

class FakeClock:

  def __init__(self):
    self.now = 100.0

  def advance(self, seconds):
    self.now += seconds


def arrive(queue, clock, envid=0):
  queue.append(Pending(clock.now, envid))


def test_fixed_cutoff_waits_for_a_full_batch_however_long():
  clock, queue = FakeClock(), []
  policy = preemption.Fixed(3)
  for _ in range(2):
    arrive(queue, clock)
    clock.advance(1000.0)
    assert policy.decide(queue, clock.now) is None
  arrive(queue, clock)
  assert policy.decide(queue, clock.now) == (3, 'fixed')
  arrive(queue, clock)
  assert policy.decide(queue, clock.now) == (3, 'fixed')


def test_cutoff_arguments_are_checked():
  makers = (preemption.VER, lambda lo, hi: preemption.Preempt(lo, hi, [1, 2, 4]))
  for make in makers:
    with pytest.raises(ValueError):
      make(5, 4)
    with pytest.raises(ValueError):
      make(0, 4)
  with pytest.raises(ValueError):
    preemption.Fixed(0)


# ------------------------------------------------------------------ helpers

PRODUCTION = ('ver', 'preempt')


def production_cutoff(name, min_batch=1, max_batch=4, max_wait=0.005):
  """A cutoff the runtime uses (`make_cutoff`'s rules), with test sizes."""
  if name == 'ver':
    return preemption.VER(min_batch, max_batch, max_wait=max_wait)
  buckets = [1 << i for i in range(max_batch.bit_length()) if 1 << i < max_batch]
  return preemption.Preempt(
      min_batch, max_batch, buckets + [max_batch], max_wait=max_wait)


class Doubler:
  """Handler: {'y': 2x} per request; records what each batch held."""

  def __init__(self, delay=0.0):
    self.delay = delay
    self.batches = []
    self.lock = threading.Lock()

  def __call__(self, requests):
    with self.lock:
      self.batches.append([r.data['x'].copy() for r in requests])
    if self.delay:
      time.sleep(self.delay)
    return [{'y': r.data['x'] * 2} for r in requests], None

  @property
  def sizes(self):
    return [len(b) for b in self.batches]


@contextlib.contextmanager
def serving(handler, cutoff, **kwargs):
  addr = f'127.0.0.1:{free_port()}'
  server = BatchServer(addr, handler, cutoff, logging=False, **kwargs)
  try:
    server.start()
    yield server, addr
  finally:
    server.close(timeout=TIMEOUT)


@contextlib.contextmanager
def connected(addr, count=1, server=None, reply=None, **kwargs):
  """`count` clients of the server's transport (portal.Client for tcp), all
  with portal.Client's `act(data)` -> future (`wait`, `result`)."""
  kind = 'tcp' if server is None else next(iter(server.transports))
  kwargs = {'maxinflight': 1, 'autoconn': False, 'logging': False, **kwargs}
  clients = []
  try:
    for _ in range(count):
      if kind == 'tcp':
        client = portal.Client(addr, 'TestClient', **kwargs)
        assert client.connect(timeout=TIMEOUT)
      elif kind == 'shm':
        client = ShmCaller(addr, reply)
      else:
        client = ThreadCaller(server.client())
      clients.append(client)
    yield clients
  finally:
    for client in clients:
      client.close(timeout=1)


def like_x(data):
  """The reply space of Doubler: y has the shape and dtype of one row of x."""
  x = data['x']
  rows = 'envid' in data and data['envid'].ndim == 1
  return {'y': (x.shape[1:] if rows else x.shape, x.dtype)}


class ShmCaller:
  """A ShmClient with portal.Client's act(); one thread per caller."""

  def __init__(self, addr, reply=None):
    self.client = ShmClient(addr, reply or like_x)
    assert self.client.connect(threading.Event())

  def act(self, data):
    return _ShmFuture(self.client, self.client.send('act', data))

  def close(self, timeout):
    self.client.close()


class _ShmFuture:

  def __init__(self, client, reqnum):
    self.client, self.reqnum, self.outcome = client, reqnum, None

  def wait(self, timeout):
    if self.outcome is None:
      deadline = time.monotonic() + timeout
      stop = types.SimpleNamespace(is_set=lambda: time.monotonic() > deadline)
      try:
        value = self.client.recv(self.reqnum, stop, poll=0.01)
      except Exception as e:
        value = e
      if value is None:
        return False
      self.outcome = value
    return True

  def result(self, timeout=TIMEOUT):
    assert self.wait(timeout), 'no reply'
    if isinstance(self.outcome, Exception):
      raise self.outcome
    return self.outcome


class ThreadCaller:
  """A ThreadClient with portal.Client's act()."""

  def __init__(self, client):
    self.client = client

  def act(self, data):
    future = self.client.submit(data)
    future.wait = lambda timeout: concurrent.futures.wait(
        [future], timeout).done != set()
    return future

  def close(self, timeout):
    self.client.close()


def result(future, timeout=TIMEOUT):
  """future.result with a deadline; waits in slices because portal's
  Future.wait can miss a notify that lands between its check and its wait."""
  deadline = time.monotonic() + timeout
  while not future.wait(0.05):
    if time.monotonic() > deadline:
      raise TimeoutError('no reply')
  return future.result(0)


def wait_until(predicate, timeout=TIMEOUT):
  deadline = time.monotonic() + timeout
  while not predicate():
    if time.monotonic() > deadline:
      raise TimeoutError('condition not reached')
    time.sleep(0.01)


def run_clients(clients, steps, first=0):
  """Each client asks for 2x its own counter; returns per-client failures."""
  failures = collections.defaultdict(list)

  def loop(index, client):
    try:
      for step in range(first, first + steps):
        x = np.array([index, step], np.int64)
        reply = result(client.act({'x': x, 'envid': np.int64(index)}))
        if not np.array_equal(reply['y'], 2 * x):
          failures[index].append((step, reply['y']))
    except Exception as e:
      failures[index].append(repr(e))

  threads = [threading.Thread(target=loop, args=(i, c), daemon=True)
             for i, c in enumerate(clients)]
  [t.start() for t in threads]
  [t.join(TIMEOUT * 4) for t in threads]
  assert not any(t.is_alive() for t in threads), 'client threads hung'
  return dict(failures)


# ------------------------------------------------------------------ serving

class Recording:
  """A cutoff that remembers what the server told it, then passes it on."""

  def __init__(self, cutoff):
    self.cutoff = cutoff
    self.batches, self.replies = [], collections.Counter()

  def decide(self, pending, now):
    return self.cutoff.decide(pending, now)

  def observe_batch(self, size, inference_seconds):
    assert inference_seconds >= 0
    self.batches.append(size)
    self.cutoff.observe_batch(size, inference_seconds)

  def observe_reply(self, envid, time):
    self.replies[envid] += 1
    self.cutoff.observe_reply(envid, time)


@pytest.mark.parametrize('transport', TRANSPORTS)
@pytest.mark.parametrize('name', PRODUCTION)
@pytest.mark.parametrize('workers', [1, 2])
def test_replies_are_routed_by_value_in_varying_batches(
    workers, name, transport):
  handler = Doubler(delay=0.003)
  policy = Recording(production_cutoff(name, 2, 4))
  with serving(handler, policy, workers=workers,
               transports=(transport,)) as (server, addr):
    with connected(addr, count=6, server=server) as clients:
      assert not run_clients(clients, steps=25)
  stats = server.stats()  # After close: every batch is counted.
  sizes = handler.sizes
  assert sum(sizes) == 6 * 25
  assert all(1 <= size <= 4 for size in sizes)
  assert max(sizes) > 1, 'nothing was batched'
  assert sorted(policy.batches) == sorted(sizes)
  assert policy.replies == {i: 25 for i in range(6)}  # Env ids from 'envid'.
  assert stats['requests'] == 150
  assert stats['batches'] == len(sizes)
  assert stats['batch_sizes'] == dict(collections.Counter(sizes))
  assert stats['batch_size_max'] == max(sizes)
  assert stats['batch_size_mean'] == pytest.approx(150 / len(sizes))
  assert sum(v for k, v in stats.items() if k.startswith('cut/')) == len(sizes)
  assert stats['errors'] == stats['dropped'] == stats['pending'] == 0
  assert stats['inference_ms_mean'] >= 3
  for name in ('queue_wait_ms', 'latency_ms'):
    assert 0 <= stats[f'{name}/p50'] <= stats[f'{name}/p95'] <= stats[
        f'{name}/p99']
  assert stats['latency_ms/p50'] >= stats['queue_wait_ms/p50']


def test_stats_reset_on_read():
  with serving(Doubler(), production_cutoff('ver')) as (server, addr):
    with connected(addr) as (client,):
      x = np.arange(3)
      assert np.array_equal(result(client.act({'x': x}))['y'], 2 * x)
  # After close: the reply can reach the client before the worker thread
  # has counted its batch.
  first, second = server.stats(), server.stats()
  assert first['requests'] == 1 and first['batches'] == 1
  assert second['requests'] == 0 and second['batches'] == 0
  assert second['latency_ms/p99'] == 0.0


@pytest.mark.parametrize('transport', TRANSPORTS)
@pytest.mark.parametrize('name', PRODUCTION)
def test_fewer_clients_than_min_batch_still_progress(name, transport):
  """What portal.BatchServer lacks: 2 clients, min batch 8."""
  handler = Doubler()
  with serving(handler, production_cutoff(name, 8, 8, 0.01),
               transports=(transport,)) as (server, addr):
    with connected(addr, count=2, server=server) as clients:
      assert not run_clients(clients, steps=5)
  stats = server.stats()  # After close: every batch is counted.
  cuts = {k: v for k, v in stats.items() if k.startswith('cut/')}
  assert sum(cuts.values()) == len(handler.sizes) == stats['batches']
  assert not cuts.get('cut/min') and not cuts.get('cut/max'), cuts
  assert max(handler.sizes) <= 2


# ------------------------------------------------------------------ faults

@pytest.mark.parametrize('name', PRODUCTION)
def test_invalid_requests_error_only_their_caller(name):
  handler = Doubler()
  with serving(handler, production_cutoff(name)) as (server, addr):
    with connected(addr, count=4) as clients:
      bad, good = clients[0], clients[1:]
      outcome = {}
      thread = threading.Thread(
          target=lambda: outcome.update(run_clients(good, steps=30)),
          daemon=True)
      thread.start()
      cases = [
          (lambda: bad.act(np.arange(3)), 'dict of numpy arrays; got ndarray'),
          (lambda: bad.act({'x': 'text'}), "str under key 'x'"),
          (lambda: bad.act({'x': np.zeros(1)}, {'x': np.zeros(1)}),
           '2 arguments'),
          (lambda: bad.call('nope', {'x': np.zeros(1)}), 'Unknown method nope'),
      ]
      for call, message in cases:
        with pytest.raises(RuntimeError, match=message):
          result(call())
      x = np.array([7])  # The bad caller is still served afterwards.
      assert np.array_equal(result(bad.act({'x': x}))['y'], 2 * x)
      thread.join(TIMEOUT * 4)
      assert not thread.is_alive()
      assert outcome == {}
  stats = server.stats()  # After close: every batch is counted.
  assert stats['errors'] == 4
  assert stats['requests'] == 3 * 30 + 1


@pytest.mark.parametrize('transport', TRANSPORTS)
def test_client_disconnecting_while_queued_is_dropped(transport):
  handler = Doubler()
  with serving(handler, preemption.Fixed(2),
               transports=(transport,)) as (server, addr):
    with connected(addr, server=server) as (leaver,):
      wait_until(lambda: len(server.connections) == 1)  # Accepted.
      leaver_addr, = server.connections
      leaver.act({'x': np.array([-1])})
      wait_until(lambda: server.stats()['pending'] == 1)
    wait_until(lambda: leaver_addr not in server.connections)
    with connected(addr, count=2, server=server) as clients:
      assert not run_clients(clients, steps=10)
  stats = server.stats()  # After close: every batch is counted.
  values = [int(x[0]) for batch in handler.batches for x in batch]
  assert -1 not in values
  assert handler.sizes == [2] * 10
  assert stats['dropped'] == 1


@pytest.mark.parametrize('transport', TRANSPORTS)
def test_handler_exception_errors_that_batch_only(transport):
  def handler(requests):
    if any(r.data['x'][0] < 0 for r in requests):
      raise ValueError('boom: negative input')
    return [{'y': r.data['x'] * 2} if r.data['x'][0] != 13
            else KeyError('unlucky') for r in requests], None

  with serving(handler, preemption.Fixed(2),
               transports=(transport,)) as (server, addr):
    with connected(addr, count=2, server=server) as (a, b):
      poisoned = a.act({'x': np.array([-1])})
      innocent = b.act({'x': np.array([5])})
      for future in (poisoned, innocent):
        with pytest.raises(RuntimeError, match='boom'):
          result(future)
      unlucky = a.act({'x': np.array([13])})
      fine = b.act({'x': np.array([6])})
      with pytest.raises(RuntimeError, match='unlucky'):
        result(unlucky)
      assert np.array_equal(result(fine)['y'], [12])
      assert not run_clients([a, b], steps=5, first=100)
  stats = server.stats()  # After close: every batch is counted.
  assert stats['errors'] == 3
  assert stats['batches'] == 2 + 5


@pytest.mark.parametrize('transport', ['thread', 'tcp'])
def test_postfn_runs_in_cut_order_with_several_workers(transport):
  """A batch cut first but served slowly still reaches the postfn before a
  later batch that finished first (an env's transitions are shipped in
  its step order), and a batch whose handler raised does not hold up the
  ones after it."""
  first_running, second_served = threading.Event(), threading.Event()
  served, posted = [], []

  def handler(requests):
    x = int(requests[0].data['x'][0])
    if x < 0:
      raise ValueError('bad x')
    if x == 1:
      first_running.set()
      # The later batch is served meanwhile, by the other worker.
      assert second_served.wait(TIMEOUT), 'the later batch waited'
    served.append(x)
    if x == 2:
      second_served.set()
    return [{'y': r.data['x'] * 2} for r in requests], x

  with serving(handler, preemption.Fixed(1), postfn=lambda b, x: posted.append(x),
               workers=2, transports=(transport,)) as (server, addr):
    with connected(addr, count=2, server=server) as (a, b):
      slow = a.act({'x': np.array([1])})
      assert first_running.wait(TIMEOUT)
      assert np.array_equal(result(b.act({'x': np.array([2])}))['y'], [4])
      result(slow)
      with pytest.raises(RuntimeError, match='bad x'):
        result(b.act({'x': np.array([-1])}))
      result(b.act({'x': np.array([4])}))
  assert served == [2, 1, 4]  # The second batch finished first ...
  assert posted == [1, 2, 4]  # ... and was posted second.


def read_frame(sock):
  """One length-prefixed frame from a raw socket; b'' once it is closed."""
  data = b''
  while True:
    try:
      chunk = sock.recv(4096)
    except ConnectionResetError:
      return b''
    if not chunk:
      return b''
    data += chunk
    if len(data) >= 8 and len(data) >= 8 + int.from_bytes(data[:8], 'little'):
      return data[8:]


def raw_connection(addr, handshake=b'portal_handshake'):
  host, port = addr.rsplit(':', 1)
  sock = socket.create_connection((host, int(port)), timeout=TIMEOUT)
  sock.sendall(handshake)
  return sock


@pytest.mark.parametrize('name', PRODUCTION)
def test_garbage_on_the_wire_costs_only_that_connection(name):
  with serving(Doubler(), production_cutoff(name)) as (server, addr):
    with connected(addr, count=2) as clients:
      assert not run_clients(clients, steps=3)
      with contextlib.closing(raw_connection(addr)) as sock:
        # Well framed but too short: status 1.
        sock.sendall((4).to_bytes(8, 'little') + b'abcd')
        reply = read_frame(sock)
        assert int.from_bytes(reply[8:16], 'little') == 1
        # Well framed garbage: status 2 with the caller's request number.
        sock.sendall((24).to_bytes(8, 'little') + b'\x07' * 8 + b'\xee' * 16)
        reply = read_frame(sock)
        assert reply[:8] == b'\x07' * 8
        assert int.from_bytes(reply[8:16], 'little') == 2
        assert not run_clients(clients, steps=3, first=10)
        # A nonsense length prefix: the server closes this connection.
        sock.sendall(b'\xff' * 8 + b'garbage')
        assert read_frame(sock) == b''
      with contextlib.closing(raw_connection(addr, b'hello_there_what')) as sock:
        assert read_frame(sock) == b''  # Wrong handshake: closed.
      raw_connection(addr, b'portal').close()  # Gone mid-handshake.
      with contextlib.closing(raw_connection(addr)) as sock:
        sock.sendall(bytes(8))  # A zero length prefix.
        assert read_frame(sock) == b''
      assert not run_clients(clients, steps=5, first=20)
      wait_until(lambda: len(server.connections) == 2)
    assert server.error is None
  stats = server.stats()  # After close: every batch is counted.
  assert stats['errors'] == 2


@pytest.mark.parametrize('transport', TRANSPORTS)
def test_closing_the_server_disconnects_waiting_clients(transport):
  """A request stuck in a Fixed(2) queue when the server closes: the
  unmodified portal.Client reports Disconnected, as with portal's servers,
  and so do the other transports' clients."""
  with serving(Doubler(), preemption.Fixed(2),
               transports=(transport,)) as (server, addr):
    with connected(addr, server=server) as (client,):
      future = client.act({'x': np.array([1])})
      wait_until(lambda: server.stats()['pending'] == 1)
      server.close(timeout=TIMEOUT)
      with pytest.raises(portal.Disconnected):
        result(future)


class CrashesAt:
  """A cutoff with a bug: decide() raises once `queued` calls wait, so the
  worker loop that asked dies."""

  def __init__(self, cutoff, queued):
    self.cutoff, self.queued, self.crashed = cutoff, queued, False

  def decide(self, pending, now):
    if len(pending) >= self.queued:
      self.crashed = True
      raise ZeroDivisionError('a bug in the cutoff')
    return self.cutoff.decide(pending, now)

  def observe_batch(self, size, inference_seconds):
    self.cutoff.observe_batch(size, inference_seconds)

  def observe_reply(self, envid, time):
    self.cutoff.observe_reply(envid, time)


@pytest.mark.parametrize('transport', TRANSPORTS)
def test_a_crashed_worker_loop_errors_every_queued_and_later_caller(transport):
  """Calls queued when a worker loop dies get an error at once, naming the
  cause, and so does every later call: none waits for close()."""
  # Fixed(3): the first two calls wait in the queue, where the (buggy)
  # cutoff raises; the third caller calls after that.
  cutoff = CrashesAt(preemption.Fixed(3), queued=2)
  with serving(Doubler(), cutoff, transports=(transport,)) as (server, addr):
    with connected(addr, 3, server=server) as clients:
      first = [c.act({'x': np.array([i]), 'envid': np.int64(i)})
               for i, c in enumerate(clients[:2])]
      # The loop's death is handled once `error` is set (after the raise).
      wait_until(lambda: server.error is not None)
      assert cutoff.crashed and isinstance(server.error, ZeroDivisionError)
      for future in first:
        with pytest.raises(Exception, match='a bug in the cutoff|Disconn'):
          result(future)
      with pytest.raises(Exception) as later:
        result(clients[2].act({'x': np.array([2]), 'envid': np.int64(2)}))
      assert not isinstance(later.value, TimeoutError)


def test_server_binds_loopback_for_localhost():
  server = BatchServer(
      f'localhost:{free_port()}', Doubler(), preemption.Fixed(1), logging=False)
  try:
    assert server.transports['tcp'].socket.addr[0] == '127.0.0.1'
  finally:
    server.close(timeout=TIMEOUT)


@pytest.mark.parametrize('transport', TRANSPORTS)
def test_multi_env_call_is_split_into_rows_and_replied_stacked(transport):
  seen = []

  def handler(requests):
    seen.append(sorted(r.envid for r in requests))
    return [{'y': np.asarray(r.data['x']) * 10 + r.envid}
            for r in requests], None

  # max 2 rows per batch: a 3-env call must span two batches.
  with serving(handler, production_cutoff('ver', 1, 2),
               transports=(transport,)) as (server, addr):
    with connected(addr, server=server) as (client,):
      data = {'envid': np.array([4, 5, 6]), 'x': np.array([1.0, 2.0, 3.0])}
      reply = result(client.act(data))
      np.testing.assert_array_equal(reply['y'], [14, 25, 36])
      assert sorted(e for batch in seen for e in batch) == [4, 5, 6]
      assert max(len(b) for b in seen) <= 2
      bad = {'envid': np.array([1, 2]), 'x': np.zeros(3)}
      with pytest.raises(RuntimeError, match="'x' has shape"):
        result(client.act(bad))
      # The connection keeps working after the error.
      reply = result(client.act({'envid': np.int64(9), 'x': np.float64(1.0)}))
      assert float(reply['y']) == 19.0


@pytest.mark.parametrize('transport', TRANSPORTS)
def test_lanes_each_cut_their_own_connections_batches(transport):
  """Two lanes (e.g. two policy devices): a connection stays on one lane,
  the lanes get connections in turn, and a lane whose connection left gets
  the next newcomer. Lane 0 cuts pairs, lane 1 single requests."""
  lanes = collections.defaultdict(set)  # lane -> values it served

  def handler(requests):
    for request in requests:
      lanes[request.lane].add(int(request.data['x'][0]))
    return [{'y': r.data['x'] * 2, 'n': np.array(len(requests))}
            for r in requests], None

  policies = [preemption.Fixed(2), preemption.Fixed(1)]
  reply = lambda data: {**like_x(data), 'n': ((), np.int64)}
  with serving(handler, policies, transports=(transport,)) as (server, addr):
    link = functools.partial(connected, addr, server=server, reply=reply)
    with link(count=2) as (a, b):
      ra = a.act({'x': np.array([1])})
      wait_until(lambda: server.stats()['pending'] == 1)  # a is routed.
      rb = b.act({'x': np.array([2])})
      # a went to lane 0, which waits for a pair; b to lane 1, served alone.
      assert int(result(rb)['n']) == 1
      assert not ra.wait(0.2)
      with link() as (c,):
        rc = c.act({'x': np.array([3])})  # Lane 0 now has its pair.
        assert int(result(ra)['n']) == 2 and int(result(rc)['n']) == 2
      wait_until(lambda: len(server.connections) == 2)
      with link() as (d,):  # Lane 0 lost c, so d joins lane 0.
        rd = d.act({'x': np.array([4])})
        ra = a.act({'x': np.array([5])})
        assert int(result(rd)['y'][0]) == 8 and int(result(ra)['y'][0]) == 10
  assert lanes == {0: {1, 3, 4, 5}, 1: {2}}


@pytest.mark.parametrize('transport', TRANSPORTS)
def test_an_env_id_belongs_to_one_connection_at_a_time(transport):
  handler = Doubler()
  x = np.array([1, 2], np.int64)
  with serving(handler, production_cutoff('ver'),
               transports=(transport,)) as (server, addr):
    with connected(addr, server=server) as (second,):
      with connected(addr, server=server) as (first,):
        reply = result(first.act({'x': x, 'envid': np.int64(5)}))
        np.testing.assert_array_equal(reply['y'], 2 * x)
        # A second connection with the same id (alone or in a multi-env
        # call) is refused, and never reaches the handler.
        with pytest.raises(RuntimeError, match='env id 5 is already used') as (
            taken):
          result(second.act({'x': 3 * x, 'envid': np.int64(5)}))
        # Its kind, as our clients read it (portal.Client's is RuntimeError).
        assert RemoteError(str(taken.value)).kind == ENV_ID_TAKEN
        with pytest.raises(RuntimeError, match='env id 5 is already used'):
          result(second.act({'x': np.stack([3 * x, 3 * x]),
                             'envid': np.array([6, 5])}))
        assert not any(b[0] == 3 for batch in handler.batches for b in batch)
        # The owner goes on being served; other ids work on the other link.
        reply = result(first.act({'x': 2 * x, 'envid': np.int64(5)}))
        np.testing.assert_array_equal(reply['y'], 4 * x)
        reply = result(second.act({'x': x, 'envid': np.int64(6)}))
        np.testing.assert_array_equal(reply['y'], 2 * x)
      # Once the owner disconnects, the id is free (a restarted env).
      wait_until(lambda: len(server.connections) == 1)
      reply = result(second.act({'x': 5 * x, 'envid': np.int64(5)}))
      np.testing.assert_array_equal(reply['y'], 10 * x)


def test_a_heartbeat_is_answered_while_the_handler_is_busy():
  # The tcp transport's receive loop answers a client's PING itself (as
  # the RPC server does), so a busy batch server is not taken for a hung one.
  gate = threading.Event()

  def handler(requests):
    gate.wait(TIMEOUT)
    return [{'y': r.data['x'] * 2} for r in requests], None

  with serving(handler, production_cutoff('ver')) as (_, addr):
    with connected(addr) as (busy,):
      link = Client(addr, 'Heartbeat')
      try:
        pending = busy.act({'x': np.array([3])})
        assert link.call(PING).result(timeout=TIMEOUT) is None
        assert not pending.done()
        gate.set()
        assert result(pending)['y'].tolist() == [6]
      finally:
        gate.set()
        link.close(timeout=1)
