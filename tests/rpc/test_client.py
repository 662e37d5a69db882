"""The futures client (rpc/client.py) against unmodified portal servers:
results by value, error replies, back-pressure, and resending what was in
flight when the server restarts."""

import os
import signal
import socket
import threading
import time
import types

import numpy as np
import portal
import pytest
from portal.client_socket import Disconnected

from dreamer_ver.rpc import client as client_module
from dreamer_ver.rpc.client import Client, Dropped
from dreamer_ver.rpc.addresses import free_port
from helpers.processes import all_stopped


def _server(port, calls=None, gate=None):
  server = portal.Server(port, 'Echo', host='127.0.0.1', errors=False,
                         logging=False)

  def add(x, y):
    if gate is not None:
      gate.wait()
    if calls is not None:
      calls.append(int(x))
    if x < 0:
      raise ValueError(f'negative x={x}')
    return {'sum': np.asarray(x + y)}

  server.bind('add', add, workers=1)
  server.start(block=False)
  return server


def test_results_errors_and_many_calls_in_flight():
  port = free_port()
  server = _server(port)
  client = Client(f'127.0.0.1:{port}', 'Test', maxinflight=4)
  try:
    futures = [client.add(i, np.arange(3)) for i in range(50)]
    for i, future in enumerate(futures):
      np.testing.assert_array_equal(
          future.result(timeout=10)['sum'], i + np.arange(3))
    with pytest.raises(RuntimeError, match='negative x=-1'):
      client.add(-1, 0).result(timeout=10)
    assert client.add(2, 3).result(timeout=10)['sum'] == 5  # still serving
    big = np.ones((1000, 1000), np.float32)  # 4 MB each way
    assert client.add(1, big).result(timeout=10)['sum'].sum() == 2e6
  finally:
    client.close(timeout=2)
    server.close()


def test_maxinflight_blocks_the_caller_until_a_reply():
  port = free_port()
  gate = threading.Event()
  server = _server(port, gate=gate)
  client = Client(f'127.0.0.1:{port}', 'Test', maxinflight=2)
  try:
    first = [client.add(i, 0) for i in range(2)]
    third = []
    thread = threading.Thread(target=lambda: third.append(client.add(7, 0)))
    thread.start()
    time.sleep(0.5)
    assert not third, 'a third call went out with two in flight'
    gate.set()
    thread.join(timeout=10)
    assert [f.result(timeout=10)['sum'] for f in first] == [0, 1]
    assert third[0].result(timeout=10)['sum'] == 7
  finally:
    gate.set()
    client.close(timeout=2)
    server.close()


def test_settle_waits_for_the_calls_in_flight_and_no_longer():
  port = free_port()
  gate = threading.Event()
  server = _server(port, gate=gate)
  client = Client(f'127.0.0.1:{port}', 'Test', maxinflight=2)
  try:
    assert client.settle(0)  # Nothing in flight.
    call = client.add(4, 0)
    started = time.monotonic()
    assert not client.settle(0.3)  # The server holds the reply.
    assert 0.3 <= time.monotonic() - started < 5 and not call.done()
    threading.Timer(0.2, gate.set).start()
    assert client.settle(10)
    assert call.result(timeout=0)['sum'] == 4
  finally:
    gate.set()
    client.close(timeout=2)
    server.close()


def _swallowing_server(port, received):
  """A raw socket that takes one connection's calls into `received` and
  dies without replying; returns its (started) thread."""
  listener = socket.create_server(('127.0.0.1', port))

  def swallow():
    conn, _ = listener.accept()
    conn.settimeout(0.5)
    try:
      while True:
        data = conn.recv(1 << 16)
        if not data:
          break
        received.append(data)
    except socket.timeout:
      pass
    conn.close()
    listener.close()

  thread = threading.Thread(target=swallow)
  thread.start()
  return thread


def test_resends_calls_in_flight_after_the_server_restarts():
  # First a server that takes the calls and dies without replying (a raw
  # socket), then a real one on the same port: the calls that were in
  # flight are answered by the second, in order, each exactly once.
  port = free_port()
  received = []
  thread = _swallowing_server(port, received)
  client = Client(f'127.0.0.1:{port}', 'Test', maxinflight=8)
  try:
    pending = [client.add(i, 100) for i in range(10, 13)]
    thread.join(timeout=10)
    assert received, 'the first server saw no requests'
    assert not any(f.done() for f in pending)
    calls = []
    server = _server(port, calls)
    try:
      assert [f.result(timeout=20)['sum'] for f in pending] == [110, 111, 112]
      assert calls == [10, 11, 12]
      assert client.add(5, 5).result(timeout=10)['sum'] == 10
    finally:
      server.close()
  finally:
    client.close(timeout=2)


def test_an_address_lookup_finds_a_server_that_moved():
  # The address is a function, asked before every connection attempt: it
  # knows no server at first (None), then the first one, which dies with
  # the calls unanswered, then a second one on another port. The calls in
  # flight are answered there, each exactly once.
  first, second = free_port(), free_port()
  where = [None]
  asked = []

  def lookup():
    asked.append(where[0])
    return where[0]

  client = Client(lookup, 'Test', maxinflight=8)
  try:
    pending = [client.add(i, 100) for i in range(3)]
    deadline = time.monotonic() + 10
    while len(asked) < 3 and time.monotonic() < deadline:
      time.sleep(0.05)
    assert len(asked) >= 3 and set(asked) == {None}  # Retries while unknown.
    received = []
    thread = _swallowing_server(first, received)
    where[0] = f'127.0.0.1:{first}'
    thread.join(timeout=10)
    assert received, 'the first server saw no requests'
    calls = []
    server = _server(second, calls)
    where[0] = f'127.0.0.1:{second}'
    try:
      assert [f.result(timeout=20)['sum'] for f in pending] == [100, 101, 102]
      assert calls == [0, 1, 2]
    finally:
      server.close()
  finally:
    client.close(timeout=2)


def test_close_fails_calls_in_flight_and_later_calls():
  port = free_port()  # Nobody listens: calls stay in flight.
  client = Client(f'127.0.0.1:{port}', 'Test')
  future = client.add(1, 2)
  client.close(timeout=2)
  with pytest.raises(Disconnected):
    future.result(timeout=1)
  with pytest.raises(Disconnected):
    client.add(1, 2)


def _thread_cpu_seconds(thread):
  """User + system CPU seconds of one thread so far (Linux /proc)."""
  with open(f'/proc/self/task/{thread.native_id}/stat') as f:
    fields = f.read().rsplit(')', 1)[1].split()
  return (int(fields[11]) + int(fields[12])) / os.sysconf('SC_CLK_TCK')


@pytest.mark.skipif(not os.path.exists('/proc/self/task'),
                    reason='per-thread CPU times come from Linux /proc')
def test_idle_client_uses_no_cpu():
  port = free_port()
  server = _server(port)
  client = Client(f'127.0.0.1:{port}', 'Test')
  try:
    for i in range(20):  # Replies, then silence: portal.Client could spin.
      client.add(i, 0)
    client.add(0, 0).result(timeout=10)
    # Only the client's own thread: the whole process also runs portal's
    # server and whatever earlier tests left winding down.
    start = _thread_cpu_seconds(client._thread)
    time.sleep(2.0)
    used = _thread_cpu_seconds(client._thread) - start
    # A spinning thread would use about 2 CPU seconds here.
    assert used < 0.2, f'{used:.2f} CPU seconds in 2 s of idling'
  finally:
    client.close(timeout=2)
    server.close()


def test_drop_mode_never_blocks_and_delivers_once_the_server_is_up():
  port = free_port()  # The logger is down.
  client = Client(f'127.0.0.1:{port}', 'Test', maxinflight=1,
                  when_full='drop')
  try:
    first = client.add(1, 1)
    started = time.monotonic()
    second = client.add(2, 2)
    assert time.monotonic() - started < 1.0  # never waits for the server
    with pytest.raises(Dropped, match='1 calls in flight, add dropped'):
      second.result(timeout=0)
    assert client.dropped == 1
    server = _server(port)  # It comes back: the call in flight arrives.
    try:
      assert first.result(timeout=20)['sum'] == 2
      assert client.add(3, 3).result(timeout=10)['sum'] == 6
    finally:
      server.close()
  finally:
    client.close(timeout=2)


def test_a_failed_receiver_fails_calls_in_flight_and_later_calls(monkeypatch):
  """A receiver that dies of an unexpected error must not leave callers
  waiting forever: the link reports the error, and the call in flight and
  later calls fail with it."""
  from dreamer_ver.rpc import wire
  port = free_port()
  server = _server(port)
  recv = wire.recv
  broken = threading.Event()

  def recv_then_fail(*args, **kwargs):
    frame = recv(*args, **kwargs)
    if frame is not None and broken.is_set():
      raise ValueError('receiver bug')
    return frame

  monkeypatch.setattr(wire, 'recv', recv_then_fail)
  client = Client(f'127.0.0.1:{port}', 'Test', maxinflight=4)
  try:
    assert client.add(1, 2).result(timeout=10)['sum'] == 3
    assert client.error is None
    broken.set()
    with pytest.raises(Disconnected, match='receiver bug'):
      client.add(2, 3).result(timeout=10)
    assert isinstance(client.error, ValueError)
    with pytest.raises(Disconnected, match='receiver bug'):
      client.add(4, 5)
  finally:
    client.close(timeout=2)
    server.close()


def test_a_connection_lost_while_resending_is_retried(monkeypatch):
  # The first connection breaks while the calls in flight are resent on
  # it (a server dying as it accepts): the client connects again and the
  # call is answered, instead of its receiver dying with the link.
  port = free_port()
  server = _server(port)
  real_connect = client_module.wire.connect
  connects = []
  queued = threading.Event()

  def connect(addr, handshake, stop, retry=0.1):
    connects.append(addr)
    if len(connects) == 1:
      queued.wait(10)  # The call is in flight before this connection.
      mine, other = socket.socketpair()
      other.close()  # Sending on `mine` now fails (a broken pipe).
      return mine
    return real_connect(addr, handshake, stop, retry)

  monkeypatch.setattr(client_module.wire, 'connect', connect)
  client = Client(f'127.0.0.1:{port}', 'Test', maxinflight=4)
  try:
    future = client.add(2, 3)
    queued.set()
    assert future.result(timeout=10)['sum'] == 5
    assert client.error is None and len(connects) >= 2
  finally:
    client.close(timeout=2)
    server.close()


def send_large(client):
  """A started thread whose call of 256 MiB blocks in its send to a peer
  that never reads; `outcome` gets what call() returned or raised."""
  outcome = []

  def send():
    try:
      outcome.append(client.call('put', np.zeros(256 << 20, np.uint8)))
    except Exception as e:
      outcome.append(e)

  sender = threading.Thread(target=send, daemon=True)
  sender.start()
  return sender, outcome


def error_of(outcome):
  """What call() raised, or the exception of the future it returned."""
  error = outcome[0]
  return error if isinstance(error, Exception) else error.exception(5)


def test_close_returns_while_a_call_is_stuck_sending_to_a_peer_that_stopped_reading():
  # The peer takes the connection (and the handshake) and never reads: a
  # large call fills the socket buffers and blocks in its send, holding the
  # send lock. close() must cut it off, not wait for it forever.
  listener = socket.create_server(('127.0.0.1', 0))
  listener.settimeout(5)
  client = Client(f'127.0.0.1:{listener.getsockname()[1]}', 'Stuck')
  peer, _ = listener.accept()
  deadline = time.monotonic() + 5
  while not client.connected and time.monotonic() < deadline:
    time.sleep(0.01)
  sender, outcome = send_large(client)
  sender.join(0.5)
  assert sender.is_alive()  # Blocked in the send.
  closer = threading.Thread(target=client.close, kwargs={'timeout': 1},
                            daemon=True)
  closer.start()
  closer.join(10)
  try:
    assert not closer.is_alive(), 'close() hung behind a blocked send'
    sender.join(5)
    assert not sender.is_alive()
    assert isinstance(error_of(outcome), Disconnected)
  finally:
    peer.close()
    listener.close()


def _serve_in_child(port, ready):
  from dreamer_ver.rpc.server import Server
  server = Server(port, 'Child', host='127.0.0.1')
  server.bind('add', lambda x, y: x + y)
  server.start()
  ready.set()
  threading.Event().wait(60)  # Until the test kills it.


def test_a_stopped_peer_fails_the_link_by_name_within_peer_timeout(capsys):
  # The peer process is SIGSTOPped while a call waits: its kernel still
  # holds the connection, so nothing but a deadline can tell.
  import multiprocessing
  ctx = multiprocessing.get_context('spawn')
  port = free_port()
  ready = ctx.Event()
  child = ctx.Process(target=_serve_in_child, args=(port, ready), daemon=True)
  child.start()
  client = Client(f'127.0.0.1:{port}', 'ToChild', peer_timeout=1.5)
  try:
    assert ready.wait(30)
    assert client.add(2, 3).result(timeout=10) == 5
    os.kill(child.pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while not all_stopped(child.pid) and time.monotonic() < deadline:
      time.sleep(0.01)  # Until no thread of it can answer any more.
    assert all_stopped(child.pid)
    future = client.add(1, 1)
    with pytest.raises(Disconnected, match=f'PeerStalled.*127.0.0.1:{port}'):
      future.result(timeout=10)
    assert isinstance(client.error, client_module.PeerStalled)
    assert f'ToChild: 127.0.0.1:{port} has answered nothing' in (
        capsys.readouterr().out)
  finally:
    os.kill(child.pid, signal.SIGCONT)
    child.kill()
    child.join(5)
    client.close(timeout=2)


def test_time_this_process_did_not_run_is_not_the_peers_silence(
    monkeypatch, capsys):
  """The whole run SIGSTOPped for longer than peer_timeout (a benchmark's
  pause, a suspended machine), then continued: the receiver's first look
  at the clock must not fail the link, as nobody answered because nobody
  ran. A peer that stays silent afterwards still fails it, after
  peer_timeout of watched time. A fake clock; `is_set` is what the
  receiver calls each poll."""
  clock = types.SimpleNamespace(now=0.0)
  monkeypatch.setattr(client_module, 'time', types.SimpleNamespace(
      monotonic=lambda: clock.now))
  link = types.SimpleNamespace(
      peer_timeout=6.0, when_full='block', _inflight={1: None},
      _stop=threading.Event(), name='ToReplay', addr='127.0.0.1:1',
      _sock=None)  # No socket: no heartbeat is sent.
  quiet = client_module._Quiet(link)
  assert quiet.poll == 0.5

  def watch(seconds):
    """The receiver's polls over `seconds`; the time of the first that
    says stop, else None."""
    for _ in range(int(seconds / quiet.poll)):
      clock.now += quiet.poll
      if quiet.is_set():
        return clock.now
    return None

  assert watch(3.0) is None  # Silent 3 s of 6.
  clock.now += 600.0  # Stopped with its peer; both continue.
  assert not quiet.is_set()
  quiet.check()  # Raises nothing.
  # Still silent: 3 s before and 3 s after the pause make the stall.
  assert watch(10.0) == 606.0
  with pytest.raises(client_module.PeerStalled, match='for 6 s'):
    quiet.check()
  assert 'has answered nothing for 1 s' in capsys.readouterr().out


def test_a_slow_reply_under_back_pressure_is_not_a_stall():
  # The method holds its reply for 4 peer_timeouts (replay's limiter while
  # the learner compiles); the receive loop answers the heartbeats.
  from dreamer_ver.rpc.server import Server
  port = free_port()
  gate = threading.Event()
  server = Server(port, 'Slow', host='127.0.0.1')
  server.bind('add', lambda x, y: (gate.wait(10), x + y)[1])
  server.start()
  client = Client(f'127.0.0.1:{port}', 'ToSlow', peer_timeout=0.5)
  try:
    future = client.add(2, 3)
    threading.Timer(2.0, gate.set).start()
    assert future.result(timeout=10) == 5
    assert client.error is None
    assert server.stats()['errors'] == 0  # Heartbeats are no calls.
  finally:
    gate.set()
    client.close(timeout=2)
    server.close()


def test_a_peer_that_never_comes_up_fails_waiting_calls():
  client = Client(f'127.0.0.1:{free_port()}', 'Nobody', peer_timeout=1.0)
  try:
    with pytest.raises(Disconnected, match='PeerStalled'):
      client.add(1, 2).result(timeout=10)
    with pytest.raises(Disconnected, match='Nobody failed'):
      client.add(1, 2)
  finally:
    client.close(timeout=2)


def test_a_portal_server_answers_heartbeats_too():
  # portal's own servers reply to the heartbeat with "unknown method": alive.
  port = free_port()
  gate = threading.Event()
  server = _server(port, gate=gate)
  client = Client(f'127.0.0.1:{port}', 'ToPortal', peer_timeout=0.5)
  try:
    future = client.add(2, 3)
    threading.Timer(2.0, gate.set).start()
    assert future.result(timeout=10)['sum'] == 5
    assert client.error is None
  finally:
    gate.set()
    client.close(timeout=2)
    server.close()


def test_a_drop_link_to_a_silent_peer_reports_but_never_fails(capsys):
  # Nothing waits on a metrics link: its peer's supervisor deals with a hang.
  listener = socket.create_server(('127.0.0.1', 0))  # Accepts, never answers.
  port = listener.getsockname()[1]
  client = Client(f'127.0.0.1:{port}', 'Metrics', maxinflight=1,
                  when_full='drop', peer_timeout=0.5)
  try:
    future = client.add(1, 2)
    time.sleep(2.0)
    assert client.error is None and not future.done()
    with pytest.raises(Dropped):
      client.add(1, 2).result(timeout=1)
    assert f'Metrics: 127.0.0.1:{port} has answered nothing' in (
        capsys.readouterr().out)
  finally:
    client.close(timeout=2)
    listener.close()


def test_the_peer_deadline_fails_a_link_whose_call_is_stuck_sending():
  # The peer takes the connection and never reads or answers: a large call
  # blocks in its send, holding the send lock, when peer_timeout fires.
  # Failing the calls in flight waited for that lock without limit.
  listener = socket.create_server(('127.0.0.1', 0))
  listener.settimeout(5)
  client = Client(f'127.0.0.1:{listener.getsockname()[1]}', 'Stuck',
                  peer_timeout=1.0)
  peer, _ = listener.accept()
  try:
    deadline = time.monotonic() + 5
    while not client.connected and time.monotonic() < deadline:
      time.sleep(0.01)
    sender, outcome = send_large(client)
    sender.join(10)
    assert not sender.is_alive(), 'the call stayed stuck in its send'
    error = error_of(outcome)
    assert isinstance(error, Disconnected) and 'PeerStalled' in str(error)
    assert isinstance(client.error, client_module.PeerStalled)
  finally:
    peer.close()
    listener.close()
    client.close(timeout=2)
