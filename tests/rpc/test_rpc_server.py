"""The RPC server (rpc/server.py) with unmodified portal clients and
our own: results by value, errors to the one caller that caused them, call
order per pool, pools that do not block each other, and a close that lets
accepted calls reply."""

import contextlib
import errno
import os
import socket
import threading
import time

import numpy as np
import portal
import pytest
from helpers.sockets import closed_by_peer

from dreamer_ver.rpc import wire
from dreamer_ver.rpc.client import Client
from dreamer_ver.rpc.addresses import HANDSHAKE, free_port
from dreamer_ver.rpc.server import Server
from dreamer_ver.rpc.server_socket import (
    READ_BYTES, ServerSocket, parse_call)


@contextlib.contextmanager
def _serving(methods, workers=None, **kwargs):
  """A started server with `methods` ({name: function}, each on its own
  pool of `workers` threads, or all on the shared one) and a client of it;
  yields (server, client, port) and closes both."""
  port = free_port()
  server = Server(f'127.0.0.1:{port}', 'Test', logging=False, **kwargs)
  for name, function in methods.items():
    server.bind(name, function, workers)
  server.start()
  client = Client(f'127.0.0.1:{port}', 'Ours', maxinflight=64)
  try:
    yield server, client, port
  finally:
    client.close(timeout=2)
    server.close()


def test_results_by_value_and_errors_to_their_caller_only():

  def add(x, y):
    if x < 0:
      raise ValueError(f'negative x={x}')
    return {'sum': np.asarray(x + y)}

  methods = {'add': add, 'lookup': lambda key: {'x': 1}[key]}
  with _serving(methods, quiet=(KeyError,)) as (server, ours, port):
    theirs = portal.Client(f'127.0.0.1:{port}', 'Theirs', logging=False)
    try:
      futures = [ours.add(i, np.arange(3)) for i in range(20)]
      bad = theirs.add(-1, 0)
      good = theirs.add(5, np.ones(2))
      for i, future in enumerate(futures):
        np.testing.assert_array_equal(
            future.result(timeout=10)['sum'], i + np.arange(3))
      with pytest.raises(RuntimeError, match='add: ValueError: negative x=-1'):
        bad.result(timeout=10)
      np.testing.assert_array_equal(good.result(timeout=10)['sum'], [6, 6])
      with pytest.raises(wire.RemoteError, match="KeyError: 'y'") as raised:
        ours.lookup('y').result(timeout=10)
      # Our clients name the error's kind; a message of another form none.
      assert raised.value.kind == 'KeyError'
      assert wire.RemoteError('Unknown method nope').kind is None
      assert ours.lookup('x').result(timeout=10) == 1
    finally:
      theirs.close()
  # After close: a reply can reach its caller before the worker counts it.
  stats = server.stats()
  assert (stats['requests'], stats['replies'], stats['errors']) == (24, 22, 2)
  assert server.stats()['requests'] == 0  # Counts reset on each read.


def test_bad_frames_get_errors_and_the_server_keeps_serving():
  with _serving({'echo': lambda x: x}) as (_, client, port):
    with pytest.raises(RuntimeError, match='Unknown method nope'):
      client.nope(1).result(timeout=10)
    # A frame: 8-byte length, then request number 7, a 4-byte method name
    # and a payload that is not portal's packing.
    body = (7).to_bytes(8, 'little') + (4).to_bytes(8, 'little') + b'echo'
    body += b'\xff' * 8
    with socket.create_connection(('127.0.0.1', port), timeout=5) as raw:
      raw.sendall(b'portal_handshake')
      raw.sendall(len(body).to_bytes(8, 'little') + body)
      reply = b''
      while len(reply) < 8 or len(reply) < 8 + int.from_bytes(
          reply[:8], 'little'):
        reply += raw.recv(1024)
    assert int.from_bytes(reply[8:16], 'little') == 7
    assert int.from_bytes(reply[16:24], 'little') == 2  # Could not decode.
    assert reply[24:] == b'Could not decode message'
    np.testing.assert_array_equal(
        client.echo(np.arange(4)).result(timeout=10), np.arange(4))


def test_a_pool_serves_in_order_and_pools_do_not_block_each_other():
  gate, order = threading.Event(), []

  def blocked(x):
    gate.wait(10)
    return x

  def append(x):
    order.append(int(x))
    return len(order)

  methods = {'blocked': blocked, 'append': append}
  with _serving(methods, workers=1) as (_, client, _):
    try:
      waiting = client.blocked(42)
      counts = [client.append(i) for i in range(40)]
      # The blocked call holds its own pool only: appends go on, in order.
      assert [f.result(timeout=10) for f in counts] == list(range(1, 41))
      assert order == list(range(40))
      assert not waiting.done()
      gate.set()
      assert waiting.result(timeout=10) == 42
    finally:
      gate.set()


def test_close_lets_accepted_calls_reply():
  started = threading.Event()

  def slow(x):
    started.set()
    time.sleep(0.5)
    return x + 1

  with _serving({'slow': slow}) as (server, client, _):
    future = client.slow(1)
    assert started.wait(10)
    server.close(timeout=5)
    assert future.result(timeout=10) == 2


def test_only_problems_reach_the_terminal(capfd):
  """Binding, each accepted connection and a client that went away are
  routine: not printed. A refused handshake is."""
  port = free_port()
  server = Server(port, 'Quiet', host='127.0.0.1').start()
  client = Client(f'127.0.0.1:{port}', 'Polite')
  try:
    with pytest.raises(RuntimeError, match='Unknown method'):
      client.nothing().result(timeout=10)
    client.close(timeout=2)
    rude = socket.create_connection(('127.0.0.1', port))
    rude.sendall(b'x' * len('portal_handshake'))
    assert rude.recv(1) == b''  # Closed on the wrong handshake.
    rude.close()
  finally:
    server.close()
  out = capfd.readouterr().out
  for routine in ('Binding to', 'Listening at', 'Accepted connection',
                  'ConnectionResetError'):
    assert routine not in out, out
  assert 'wrong handshake' in out, out


def _leaves(count):
  return {f'k{i}': np.full(i % 3 + 1, i) for i in range(count)}


def _check_leaves(tree, count):
  assert sorted(tree) == sorted(f'k{i}' for i in range(count))
  for i in range(count):
    np.testing.assert_array_equal(tree[f'k{i}'], np.full(i % 3 + 1, i))


def test_a_frame_with_empty_parts_after_a_large_one_is_sent_whole():
  # An empty part left standalone (after one of 64 KiB or more) made
  # every later write send 0 bytes: the frame never finished.
  big = np.arange(1 << 14, dtype=np.float32)  # 64 KiB: sent as it is
  parts = [b'head', big, b'', np.zeros(0, np.uint8), b'']
  left, right = socket.socketpair()
  with left, right:
    sender = threading.Thread(target=wire.send, args=(left, parts),
                              daemon=True)
    sender.start()
    sender.join(5)
    assert not sender.is_alive(), 'the frame never finished'
    right.settimeout(5)
    expected = b''.join(bytes(memoryview(p).cast('B')) for p in parts)
    got = b''
    while len(got) < 8 + len(expected):
      got += right.recv(1 << 20)
  assert got == len(expected).to_bytes(8, 'little') + expected


def test_a_call_of_thousands_of_leaves_is_served():
  # Each leaf used to be a buffer of its own, and one write takes at most
  # 1,024: the client's send failed, it reconnected and resent for ever.
  with _serving({'total': lambda tree: sum(int(v.sum()) for v in
                                           tree.values())}) as (_, client, _):
    expected = sum(int(v.sum()) for v in _leaves(3000).values())
    assert client.total(_leaves(3000)).result(timeout=20) == expected


def test_a_reply_of_thousands_of_leaves_arrives():
  # The server's write of it failed the same way, and the reply stayed at
  # the head of the connection's queue for ever.
  with _serving({'leaves': lambda n: _leaves(int(n))}) as (_, client, _):
    _check_leaves(client.leaves(3000).result(timeout=20), 3000)
    assert client.leaves(2).result(timeout=20)['k1'].tolist() == [1, 1]


def test_a_write_that_keeps_failing_closes_its_connection(monkeypatch):
  # A reply the kernel refuses (not for lack of room) would be refused
  # again: the connection is closed, not kept with its queue stuck.

  def refuse(*args):
    raise OSError(errno.EINVAL, 'Invalid argument')

  with _serving({'echo': lambda x: x}) as (_, _, port):
    sock = _connect(port)
    with contextlib.closing(sock):
      monkeypatch.setattr(os, 'writev', refuse)  # portal's way to write
      monkeypatch.setattr(socket.socket, 'sendmsg', refuse)
      body = b''.join(bytes(memoryview(part).cast('B'))
                      for part in wire.request(1, 'echo', (1,)))
      sock.sendall(len(body).to_bytes(8, 'little') + body)
      assert closed_by_peer(sock, 10)


def test_a_client_that_never_reads_its_replies_loses_only_its_connection():
  # Replies queued for one connection count against that connection's
  # limit only: before, the limit was shared, and every other caller's
  # replies (heartbeat answers too) were dropped while it was full.
  big = np.ones(1 << 20, np.uint8)
  methods = {'big': lambda: big, 'add': lambda x, y: x + y}
  with _serving(methods, max_send_queue=8) as (server, client, port):
    sock = _connect(port)
    with contextlib.closing(sock):
      try:
        for reqnum in range(64):  # More than the socket buffers can hold.
          wire.send(sock, wire.request(reqnum, 'big', ()))
      except (ConnectionResetError, BrokenPipeError):
        pass  # Dropped already: a busy machine sends the calls slower.
      # Until its replies are all queued or dropped, or it was closed.
      served, deadline = 0, time.monotonic() + 20
      while served < 64 and not server.socket.disconnects and (
          time.monotonic() < deadline):
        stats = server.stats()
        served += stats['replies'] + stats['errors']
        time.sleep(0.01)
      assert client.add(2, 3).result(timeout=10) == 5
      assert closed_by_peer(sock, 10)


def test_a_client_that_floods_calls_loses_only_its_connection():
  # Calls received and not yet taken by the server count against their
  # connection's limit only: before, the limit was shared, and the socket
  # thread stopped (serving no one) once all connections together passed it.
  port = free_port()
  server = ServerSocket(f'127.0.0.1:{port}', 'Slow', logging=False,
                        max_recv_queue=16)  # Nobody takes calls meanwhile.
  try:
    honest = _connect(port)
    flood = _connect(port)
    with contextlib.closing(honest), contextlib.closing(flood):
      for reqnum in range(3):
        wire.send(honest, wire.request(reqnum, 'add', (1, 2)))
      try:
        for reqnum in range(40):
          wire.send(flood, wire.request(reqnum, 'add', (1, 2)))
      except (ConnectionResetError, BrokenPipeError):
        pass  # Dropped already.
      assert closed_by_peer(flood, 10)
      assert server.error is None
      wire.send(honest, wire.request(3, 'add', (1, 2)))
      received = []
      while len(received) < 16 + 4:
        received += server.receive(timeout=10)
      assert len(received) == 16 + 4
      local = honest.getsockname()
      assert sum(addr == local for addr, _ in received) == 4
  finally:
    server.close(timeout=5)


@contextlib.contextmanager
def _reading():
  """A bare ServerSocket nobody takes calls from, and its port."""
  port = free_port()
  server = ServerSocket(f'127.0.0.1:{port}', 'Reader', logging=False)
  try:
    yield server, port
  finally:
    server.close(timeout=5)


def _connect(port):
  """A raw connection past portal's plain handshake."""
  return wire.connect(('127.0.0.1', port), 'portal_handshake',
                      threading.Event())


def test_calls_sent_together_or_a_byte_at_a_time_arrive_whole_in_order():
  framed = [wire.Frame(wire.request(n, 'add', (n, np.arange(n))))
            for n in range(6)]
  frames = [b''.join(bytes(b) for b in frame.buffers) for frame in framed]
  with _reading() as (server, port):
    together, dribble = _connect(port), _connect(port)
    with contextlib.closing(together), contextlib.closing(dribble):
      together.sendall(b''.join(frames[:3]))  # three calls in one write
      for byte in b''.join(frames[3:]):
        dribble.sendall(bytes([byte]))
        time.sleep(0.0005)
      calls = {together.getsockname(): [], dribble.getsockname(): []}
      deadline = time.monotonic() + 10
      while sum(map(len, calls.values())) < 6:
        assert time.monotonic() < deadline
        for addr, msg in server.receive(timeout=1):
          reqnum, method, args = parse_call(msg)
          calls[addr].append((int.from_bytes(reqnum, 'little'), method,
                              args[0], args[1].tolist()))
      assert calls[together.getsockname()] == [
          (n, 'add', n, list(range(n))) for n in range(3)]
      assert calls[dribble.getsockname()] == [
          (n, 'add', n, list(range(n))) for n in range(3, 6)]


def test_a_call_sent_just_before_its_connection_closes_is_received():
  with _reading() as (server, port):
    sock = _connect(port)
    server.reading = False  # So that the call and the close are read as one.
    wire.send(sock, wire.request(9, 'add', (1, 2)))
    sock.close()
    server.reading = True
    ((_, msg),) = server.receive(timeout=10)
    assert parse_call(msg)[1:] == ('add', [1, 2])


def test_a_call_larger_than_a_rounds_read_arrives_whole():
  big = np.random.default_rng(0).integers(0, 255, 3 * READ_BYTES, np.uint8)
  with _reading() as (server, port), contextlib.closing(_connect(port)) as sock:
    wire.send(sock, wire.request(4, 'add', (big, 1)))
    ((_, msg),) = server.receive(timeout=10)
    _, method, (got, one) = parse_call(msg)
    assert method == 'add' and one == 1
    np.testing.assert_array_equal(got, big)


def test_the_kernel_probes_every_connection_for_a_vanished_peer():
  """A peer whose host is gone sends no close, and neither does an end
  that gave up on a cut link: keepalive probes end the connection at both
  ends, so neither waits on it for good (tests/system/test_hosts.py cuts
  hosts off for real)."""
  with _serving({'add': lambda x, y: x + y}) as (server, client, port):
    assert client.add(1, 2).result(timeout=10) == 3
    (conn,) = server.socket.conns.values()
    options = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
               (socket.IPPROTO_TCP, socket.TCP_KEEPIDLE),
               (socket.IPPROTO_TCP, socket.TCP_KEEPINTVL),
               (socket.IPPROTO_TCP, socket.TCP_KEEPCNT),
               (socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT)]
    want = [1, *wire.KEEPALIVE, 1000 * wire.UNACKNOWLEDGED]
    assert [conn.sock.getsockopt(*o) for o in options] == want
    stop = threading.Event()
    with contextlib.closing(wire.connect(
        ('127.0.0.1', port), HANDSHAKE, stop)) as ours:  # a client's end
      assert [ours.getsockopt(*o) for o in options] == want


def test_a_close_that_cuts_the_loop_off_is_no_failure_of_the_server():
  # portal's close waits `timeout` for the loop, then closes the sockets
  # and the selector under it; a loop still flushing replies (a client
  # that stopped reading) then fails on them. That is the close, not a
  # failure: `error` is what a supervisor restarts the process for.
  port = free_port()
  server = ServerSocket(f'127.0.0.1:{port}', 'Closing', logging=False)
  server._numsending = lambda: 1  # A reply that never leaves.
  server.close(timeout=0.3)
  server.thread.join(timeout=10)
  assert server.error is None, repr(server.error)
