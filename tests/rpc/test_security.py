"""Who may connect: loopback binding, the run token, and frame size limits."""

import os
import secrets
import socket
import stat
import threading
import time

import numpy as np
import portal
import pytest
from portal.client_socket import Disconnected
from helpers.sockets import closed_by_peer
from test_shm import Waits

from dreamer_ver.config import loading as configlib
from dreamer_ver.actor import batching
from dreamer_ver.rpc.batch_server import BatchServer
from dreamer_ver.rpc.blocking_client import BlockingClient
from dreamer_ver.rpc.client import Client
from dreamer_ver.rpc.server import Server
from dreamer_ver.rpc import auth
from dreamer_ver.rpc.server_socket import ServerSocket
from dreamer_ver.rpc.addresses import (
    HANDSHAKE, bind_host, free_port, handshake)
from dreamer_ver.cluster.links import Links
from dreamer_ver.cluster.signals import StopSignal
from dreamer_ver.cluster.token import with_token


def server_kwargs(config):
  return Links.of(config).server_kwargs()


def client_kwargs(config):
  return Links.of(config).client_kwargs()


def _handshake(config):
  """What an env process's client sends: the run's token handshake."""
  return client_kwargs(config)['handshake']


def _config(tmp_path, token=''):
  return configlib.compose(['debug'], {
      'logdir': str(tmp_path), 'run.token': token})


def _echo_server(port, config, **kwargs):
  def handler(requests):
    return [{'y': np.asarray(r.data['x']) * 2} for r in requests], None
  server = BatchServer(
      f'127.0.0.1:{port}', handler,
      batching.make_cutoff(config.run, 4, [1, 2, 4]),
      **server_kwargs(config), **kwargs)
  return server.start() or server


def test_token_is_made_once_per_run_with_owner_only_permissions(tmp_path, monkeypatch):
  monkeypatch.delenv('DREAMER_VER_TOKEN', raising=False)
  first = with_token(_config(tmp_path)).run.token
  again = with_token(_config(tmp_path)).run.token
  assert first == again and len(first) == 32
  mode = stat.S_IMODE(os.stat(tmp_path / 'token').st_mode)
  assert mode == 0o600
  assert with_token(_config(tmp_path, 'given')).run.token == 'given'
  monkeypatch.setenv('DREAMER_VER_TOKEN', 'fromenv')
  assert with_token(_config(tmp_path / 'other')).run.token == 'fromenv'


def test_localhost_binds_loopback_only(tmp_path):
  config = _config(tmp_path)
  assert bind_host('localhost:1234') == '127.0.0.1'
  assert 'host' not in server_kwargs(config)  # The address's host decides.
  multi = configlib.override(config, {'run.bind_host': '0.0.0.0'})
  assert server_kwargs(multi)['host'] == '0.0.0.0'


class Squatter:
  """What holds a stopped server's port: a plain loopback listener that
  records everything each connection sends and answers with random bytes
  (no server proof), until the connection closes."""

  def __init__(self):
    self.listener = socket.create_server(('127.0.0.1', 0))
    self.addr = f'127.0.0.1:{self.listener.getsockname()[1]}'
    self.received = []  # bytes, one entry per closed connection
    self.cond = threading.Condition()
    threading.Thread(target=self._serve, daemon=True).start()

  def _serve(self):
    while True:
      try:
        conn, _ = self.listener.accept()
      except OSError:
        return
      data = b''
      with conn:
        conn.settimeout(2)
        try:
          data += conn.recv(4096)
          conn.sendall(secrets.token_bytes(auth.ANSWER))
          while chunk := conn.recv(4096):
            data += chunk
        except OSError:
          pass
      with self.cond:
        self.received.append(data)
        self.cond.notify_all()

  def wait_for(self, count, timeout):
    """Whether `count` connections closed within `timeout` seconds."""
    with self.cond:
      return self.cond.wait_for(lambda: len(self.received) >= count, timeout)

  def close(self):
    self.listener.shutdown(socket.SHUT_RDWR)  # Wakes the blocked accept().
    self.listener.close()


def test_a_squatter_on_the_port_never_receives_the_token(capfd):
  token = 'secret-5d1e0b'
  squatter = Squatter()
  blocking = BlockingClient(squatter.addr, handshake=handshake(token))
  link = None
  try:
    assert not blocking.connect(Waits(limit=2))
    link = Client(squatter.addr, 'Link', handshake=handshake(token))
    assert squatter.wait_for(3, 20), 'the link never gave up its connection'
  finally:
    blocking.close()
    if link is not None:
      link.close(timeout=2)
    squatter.close()
  for sent in squatter.received:
    assert token.encode() not in sent
    assert sent[:len(auth.HELLO_TAG)] == auth.HELLO_TAG
    assert len(sent) == auth.HELLO  # a hello, then no proof
  out = capfd.readouterr().out
  assert 'did not prove it knows the run token' in out, out
  assert token not in out


@pytest.mark.parametrize('cutoff', ['ver', 'preempt'])
def test_a_server_of_another_token_is_refused_by_the_client(
    tmp_path, cutoff, capfd):
  port = free_port()
  right, wrong = 'right-7f3a9c', 'wrong-2e81d4'
  config = configlib.override(
      _config(tmp_path, right), {'run.actor_cutoff': cutoff})
  server = _echo_server(port, config)
  stop = StopSignal(install=False)
  addr = f'127.0.0.1:{port}'
  good = BlockingClient(addr, handshake=_handshake(_config(tmp_path, right)))
  bad = BlockingClient(addr, handshake=_handshake(_config(tmp_path, wrong)))
  waits = Waits(limit=5)
  try:
    assert not bad.connect(waits)
    # Refused each time, it asks again twice as late, and says so once.
    assert waits.seconds == pytest.approx([0.2, 0.4, 0.8, 1.6, 3.2])
    assert good.connect(stop)
    reply = good.call('act', {'x': np.ones(2)}, stop=stop)
    np.testing.assert_array_equal(reply['y'], [2, 2])
  finally:
    good.close()
    bad.close()
    server.close()
  log = capfd.readouterr().out
  assert log.count('did not prove it knows the run token') == 1, log
  # The client stopped before its proof: the server had none to refuse.
  assert 'wrong handshake' not in log, log
  assert right not in log and wrong not in log, log


def test_a_client_with_a_wrong_proof_is_refused_by_the_server(
    tmp_path, capfd):
  port = free_port()
  right = 'right-7f3a9c'
  server = _echo_server(port, _config(tmp_path, right))
  stop = StopSignal(install=False)
  good = BlockingClient(f'127.0.0.1:{port}', handshake=handshake(right))
  try:
    with socket.create_connection(('127.0.0.1', port), timeout=5) as sock:
      nonce = secrets.token_bytes(auth.NONCE)
      sock.sendall(auth.HELLO_TAG + nonce)
      answer = auth._read(sock, auth.ANSWER)
      # A proof under another token, for this very exchange.
      sock.sendall(auth._mac('wrong', auth.CLIENT_TAG, nonce,
                             answer[:auth.NONCE]))
      assert sock.recv(1) == b''  # closed
    assert good.connect(stop)
    reply = good.call('act', {'x': np.ones(2)}, stop=stop)
    np.testing.assert_array_equal(reply['y'], [2, 2])
  finally:
    good.close()
    server.close()
  log = capfd.readouterr().out
  assert 'wrong handshake (a client without the run token)' in log, log
  assert right not in log, log


def test_a_plain_handshake_takes_the_option_and_tells_nothing(tmp_path):
  """A token sent in clear (an unmodified portal client) is closed unless
  the server takes plain handshakes. With the option, a guessed start of
  the handshake gets the same answer, none, whether it is right or wrong
  (closing at the first wrong byte would let a caller find the token a
  byte at a time); a complete wrong one is closed."""
  port = free_port()
  config = _config(tmp_path, 'right-7f3a9c')
  server = _echo_server(port, config)
  try:
    for plain in (handshake('right-7f3a9c'), handshake('wrong-2e81d4')):
      with socket.create_connection(('127.0.0.1', port), timeout=5) as sock:
        sock.sendall(plain.encode())
        with pytest.raises(ConnectionResetError):  # closed, bytes unread
          sock.recv(1)
  finally:
    server.close()
  server = _echo_server(port, config, plain_handshake=True)
  try:
    for guess in (handshake('r'), handshake('x')):
      with socket.create_connection(('127.0.0.1', port), timeout=5) as sock:
        sock.sendall(guess.encode())
        sock.settimeout(0.5)
        with pytest.raises(TimeoutError):  # still open, nothing said
          sock.recv(1)
    with socket.create_connection(('127.0.0.1', port), timeout=5) as sock:
      sock.sendall(handshake('wrong-2e81d4').encode())
      assert sock.recv(1) == b''  # closed
  finally:
    server.close()


def test_the_plain_option_lets_an_unmodified_portal_client_in(tmp_path):
  port = free_port()
  config = configlib.override(
      _config(tmp_path, 'right-7f3a9c'), {'run.plain_handshake': True})
  server = Server(f'127.0.0.1:{port}', 'Replay', **server_kwargs(config))
  server.bind('echo', lambda x: {'x': np.asarray(x) + 1})
  server.start()
  theirs = portal.Client(f'127.0.0.1:{port}', 'Theirs', logging=False,
                         handshake=handshake('right-7f3a9c'))
  ours = Client(f'127.0.0.1:{port}', 'Ours', **client_kwargs(config))
  try:
    assert theirs.echo(np.int64(1)).result(timeout=20)['x'] == 2
    assert ours.echo(np.int64(2)).result(timeout=20)['x'] == 3
  finally:
    theirs.close()
    ours.close(timeout=2)
    server.close()


def test_a_refused_link_reconnects_less_often(tmp_path, capfd):
  """The same for the agent's links to replay and logger (`Client`, whose
  receiver thread reconnects by itself)."""
  port = free_port()
  server = Server(f'127.0.0.1:{port}', 'Replay',
                  **server_kwargs(_config(tmp_path, 'right-7f3a9c')))
  server.bind('echo', lambda x: x)
  server.start()
  link = Client(f'127.0.0.1:{port}', 'Link',
                **client_kwargs(_config(tmp_path, 'wrong-2e81d4')))
  try:
    deadline = time.monotonic() + 30
    while server.socket.disconnects < 3 and time.monotonic() < deadline:
      time.sleep(0.01)
    # Waits of 0.2 and 0.4 s came before the 2nd and 3rd connection; the
    # 4th is 0.8 s away (in a tight loop there would be hundreds by now).
    assert server.socket.disconnects in (3, 4)
  finally:
    link.close()
    server.close()
  out = capfd.readouterr().out
  assert out.count('did not prove it knows the run token') == 1, out
  assert out.count('closed 3 connections in a row') == 1, out


def test_oversized_frame_is_refused_before_buffering(tmp_path):
  port = free_port()
  config = _config(tmp_path, 'tok')
  server = _echo_server(port, config, max_msg_size=4096)
  stop = StopSignal(install=False)
  good = BlockingClient(f'127.0.0.1:{port}', handshake=_handshake(config))
  try:
    raw = socket.create_connection(('127.0.0.1', port), timeout=5)
    auth.introduce(raw, client_kwargs(config)['handshake'])
    raw.sendall((1 << 40).to_bytes(8, 'little'))  # Claims a 1 TiB message.
    raw.settimeout(5)
    start = time.monotonic()
    try:
      closed = raw.recv(1) == b''
    except ConnectionResetError:
      closed = True
    assert closed and time.monotonic() - start < 5
    raw.close()
    # Too large but well framed: refused the same way, others still served.
    assert good.connect(stop)
    with pytest.raises(Disconnected):
      good.call('act', {'x': np.zeros(10_000)}, stop=stop)
    assert good.connect(stop)
    reply = good.call('act', {'x': np.ones(3)}, stop=stop)
    np.testing.assert_array_equal(reply['y'], [2, 2, 2])
  finally:
    good.close()
    server.close()


def _sharray_payload(name='dreamer_ver_test_segment', shape=(1 << 40,)):
  """portal's packing of {'x': <a shared-memory array>}: the spec names a
  segment (any size the sender likes) instead of carrying bytes."""
  import msgpack
  from portal import packlib
  leaves, treedef = packlib.tree_flatten({'x': 0})
  specs = [['sharray', name, list(shape), '<f4']]
  buffers = [msgpack.packb(treedef), msgpack.packb(specs), b'\x00']
  header = [len(buffers).to_bytes(8, 'little'),
            b''.join(len(b).to_bytes(8, 'little') for b in buffers)]
  return b''.join(header + buffers)


def test_shared_memory_leaves_are_refused_by_servers_and_clients(monkeypatch):
  # Unpacking a 'sharray' leaf maps the segment it names, of any size:
  # a peer could make a server (or a client, with a reply) map terabytes.
  from portal import packlib
  from dreamer_ver.rpc import wire
  from dreamer_ver.rpc.server_socket import BadCall, parse_call
  attached = []
  monkeypatch.setattr(packlib.sharray, 'SharedArray',
                      lambda *a: attached.append(a))
  call = (7).to_bytes(8, 'little') + (3).to_bytes(8, 'little') + b'act'
  with pytest.raises(BadCall):
    parse_call(call + _sharray_payload())
  reply = (7).to_bytes(8, 'little') + (0).to_bytes(8, 'little')
  with pytest.raises(ValueError, match='shared-memory'):
    wire.reply(reply + _sharray_payload())
  assert attached == []
  # Plain arrays still unpack.
  packed = b''.join(bytes(memoryview(b).cast('B'))
                    for b in packlib.pack({'x': np.arange(3)}))
  assert wire.reply(reply + packed)[1]['x'].tolist() == [0, 1, 2]


FLOODED_SERVER = '''
import resource, sys, time
import numpy as np
resource.setrlimit(resource.RLIMIT_NOFILE, (128, 128))
from dreamer_ver.rpc.server import Server
server = Server(sys.argv[1], 'Flooded', handshake=sys.argv[2], logging=False)
server.bind('echo', lambda x: {'x': np.asarray(x) + 1})
server.start()
print('ready', flush=True)
sys.stdin.readline()
print('error', repr(server.error), flush=True)
'''


def test_connections_that_never_handshake_cannot_starve_a_server():
  # 200 connections that never send the token, against a server that may
  # open 128 files: it must keep serving a client that does present it.
  import subprocess
  import sys
  addr, token = f'127.0.0.1:{free_port()}', handshake('flood-test-token')
  proc = subprocess.Popen(
      [sys.executable, '-c', FLOODED_SERVER, addr, token],
      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
  silent = []
  try:
    assert proc.stdout.readline().strip() == 'ready'
    for _ in range(200):
      try:
        silent.append(socket.create_connection(('127.0.0.1', int(
            addr.split(':')[1])), timeout=5))
      except OSError:
        pass  # The backlog may refuse some: it is their loss only.
    client = Client(addr, 'Honest', handshake=token)
    try:
      assert client.echo(np.int64(41)).result(timeout=20)['x'] == 42
    finally:
      client.close(timeout=1)
    proc.stdin.write('\n')
    proc.stdin.flush()
    assert proc.stdout.readline().strip() == 'error None'
  finally:
    for sock in silent:
      sock.close()
    proc.kill()
    proc.wait()


def _silent_connections(port, count):
  """`count` connections that never present the token."""
  return [socket.create_connection(('127.0.0.1', port), timeout=5)
          for _ in range(count)]


def test_a_silent_connection_is_closed_at_its_deadline_with_no_one_connecting(
    monkeypatch):
  # The deadline used to be checked only when the next connection came.
  monkeypatch.setattr(ServerSocket, 'HANDSHAKE_SECONDS', 0.5)
  port = free_port()
  server = Server(f'127.0.0.1:{port}', 'Deadline', logging=False).start()
  silent = _silent_connections(port, 3)
  try:
    assert all(closed_by_peer(sock) for sock in silent)
  finally:
    for sock in silent:
      sock.close()
    server.close()


def test_at_most_so_many_connections_wait_for_their_handshake(monkeypatch):
  # The oldest waiting connection makes room for a newcomer, long before
  # file descriptors run out (and before its deadline).
  monkeypatch.setattr(ServerSocket, 'MAX_HANDSHAKING', 4)
  monkeypatch.setattr(ServerSocket, 'HANDSHAKE_SECONDS', 60.0)
  port = free_port()
  server = Server(f'127.0.0.1:{port}', 'Capped', logging=False).start()
  silent = _silent_connections(port, 6)  # Accepted in this order.
  try:
    assert [closed_by_peer(sock, 1.0) for sock in silent] == [
        True, True, False, False, False, False]
  finally:
    for sock in silent:
      sock.close()
    server.close()


def test_refused_connections_are_logged_a_few_then_counted(
    monkeypatch, capfd):
  monkeypatch.setattr(ServerSocket, 'LOG_BURST', 3, raising=False)
  monkeypatch.setattr(ServerSocket, 'LOG_PERIOD', 3.0, raising=False)
  port = free_port()
  server = Server(f'127.0.0.1:{port}', 'Refusing').start()
  try:
    for _ in range(20):  # Each a wrong plain handshake, then closed.
      with socket.create_connection(('127.0.0.1', port), timeout=5) as sock:
        sock.sendall(b'x' * len(HANDSHAKE))
        assert sock.recv(1) == b''
    out, deadline = '', time.monotonic() + 20
    while 'more like these' not in out and time.monotonic() < deadline:
      out += capfd.readouterr().out
      time.sleep(0.05)
  finally:
    server.close()
  assert out.count('wrong handshake') == 3 + 1, out  # 3 lines, 1 summary
  assert '17 more like these' in out, out
