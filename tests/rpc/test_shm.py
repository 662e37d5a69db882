"""The shared-memory transport's own contract (`rpc/shm*.py`): what a bad or
dying client can and cannot do to the server and to everyone else.

The transport-independent behaviour (routing by value, cutoffs, errors,
env-id ownership, lanes) runs on every transport in test_batch_server.py.
"""

import contextlib
import json
import mmap
import multiprocessing
import os
import signal
import socket
import threading

import numpy as np
import portal
import pytest

from dreamer_ver.actor import preemption
from dreamer_ver.rpc import shm_protocol as protocol
from dreamer_ver.rpc.shm_client import ShmClient
from dreamer_ver.rpc.addresses import free_port
from dreamer_ver.rpc.batch_server import BatchServer

TIMEOUT = 10.0
SPACE = {'y': ((2,), np.int64)}


class Recorder:
  """Doubles x and remembers every x it was given."""

  def __init__(self):
    self.seen = []

  def __call__(self, requests):
    self.seen.extend(np.array(r.data['x']) for r in requests)
    return [{'y': r.data['x'] * 2} for r in requests], None


@contextlib.contextmanager
def serving(handler, transports=('shm',), **kwargs):
  addr = f'127.0.0.1:{free_port()}'
  server = BatchServer(addr, handler, preemption.Fixed(1),
                       transports=transports, **kwargs).start()
  try:
    yield server, addr
  finally:
    server.close(timeout=TIMEOUT)


def client(addr, space=SPACE, handshake='portal_handshake'):
  """A ShmClient and whether it connected within 2 s."""
  c = ShmClient(addr, space, handshake)
  give_up = threading.Event()
  timer = threading.Timer(2.0, give_up.set)
  timer.start()
  try:
    return c, c.connect(give_up)
  finally:
    timer.cancel()


def call(c, x, envid):
  return c.call('act', {'x': np.asarray(x, np.int64), 'envid': np.int64(envid)})


def wait_until(predicate, timeout=TIMEOUT):
  event = threading.Event()
  for _ in range(int(timeout / 0.01)):
    if predicate():
      return
    event.wait(0.01)
  raise TimeoutError('condition not reached')


class Waits:
  """A stop that is set after `limit` waits; records each wait's seconds
  and returns at once."""

  def __init__(self, limit):
    self.seconds = []
    self.limit = limit

  def is_set(self):
    return len(self.seconds) >= self.limit

  def wait(self, seconds):
    self.seconds.append(seconds)
    return self.is_set()


def test_a_wrong_token_is_refused_and_others_are_served(capfd):
  with serving(Recorder(), handshake='dreamer_ver:secret') as (server, addr):
    intruder = ShmClient(addr, SPACE, 'dreamer_ver:guess')
    waits = Waits(5)
    assert not intruder.connect(waits)
    # Refused each time, it asks again twice as late, and says so once.
    assert waits.seconds == pytest.approx([0.2, 0.4, 0.8, 1.6, 3.2])
    out = capfd.readouterr().out
    assert out.count('closed 3 connections in a row') == 1, out
    good, connected = client(addr, handshake='dreamer_ver:secret')
    assert connected
    np.testing.assert_array_equal(call(good, [1, 2], 0)['y'], [2, 4])
    good.close()


def test_a_client_sends_no_token_to_a_server_of_another_user(monkeypatch):
  # Whoever serves the socket would get the run token: a client checks the
  # server's user first (here the kernel's answer is made another user's).
  with serving(Recorder(), handshake='dreamer_ver:secret') as (server, addr):
    monkeypatch.setattr(protocol, 'peer_uid', lambda sock: os.getuid() + 1)
    tricked = ShmClient(addr, SPACE, 'dreamer_ver:secret')
    assert not tricked.connect(Waits(3))
    assert tricked.sock is None and server.connections == []
    monkeypatch.undo()  # The server's own user: served.
    c, connected = client(addr, handshake='dreamer_ver:secret')
    assert connected
    np.testing.assert_array_equal(call(c, [1, 2], 0)['y'], [2, 4])
    c.close()


def _dies_mid_write(addr, ready):
  c, connected = client(addr)
  assert connected
  call(c, [3, 4], 7)  # A served call, then a write that is never sent.
  slot = next(s for slots in c._free.values() for s in slots)
  slot.request['x'][0] = -999
  ready.set()
  signal.pause()


def test_a_client_killed_mid_write_hands_nothing_over_and_frees_its_id():
  handler = Recorder()
  with serving(handler) as (server, addr):
    ctx = multiprocessing.get_context('spawn')
    ready = ctx.Event()
    proc = ctx.Process(target=_dies_mid_write, args=(addr, ready), daemon=True)
    proc.start()
    try:
      assert ready.wait(60)
      assert len(server.connections) == 1
      os.kill(proc.pid, signal.SIGKILL)
      proc.join(TIMEOUT)
      wait_until(lambda: not server.connections)
    finally:
      proc.kill()
    assert [list(x) for x in handler.seen] == [[3, 4]]
    # Its env id is free for the restarted worker.
    again, _ = client(addr)
    np.testing.assert_array_equal(call(again, [5, 6], 7)['y'], [10, 12])
    again.close()
  assert server.error is None


def raw(addr, handshake=b'portal_handshake'):
  sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
  sock.settimeout(TIMEOUT)
  sock.connect(protocol.endpoints(addr, handshake)[0])
  sock.send(b'H' + handshake)
  assert sock.recv(16) == b'A'
  return sock


def attach(sock, layout, sealed=True, size=4096, method='act', index=0,
           spec=None):
  """Offers a slot of `size` bytes with `layout` (or the raw `spec` bytes);
  the server's answer and the memory (None if empty)."""
  fd = os.memfd_create('test', os.MFD_ALLOW_SEALING)
  try:
    os.ftruncate(fd, size)
    if sealed:
      import fcntl
      fcntl.fcntl(fd, fcntl.F_ADD_SEALS, protocol.SEALS)
    if spec is None:
      spec = json.dumps({'method': method, **layout}).encode()
    socket.send_fds(sock, [b'S' + protocol.SLOT.pack(index) + spec], [fd])
    return sock.recv(4096), size and mmap.mmap(fd, size)
  finally:
    os.close(fd)


LAYOUT = {'request': [['x', [2], '<i8'], ['envid', [], '<i8']],
          'reply': [['y', [2], '<i8']]}


@pytest.mark.parametrize('case, answer', [
    (dict(sealed=False), b'the memory must be sealed'),
    (dict(size=8), b'the memory is smaller than its layout'),
    (dict(method='nope'), b'Unknown method nope'),
    (dict(layout={'request': [['x', [2], '|O']], 'reply': []}),
     b'is not a plain number'),
])
def test_bad_slots_are_refused_with_a_reason(case, answer):
  with serving(Recorder()) as (server, addr):
    with contextlib.closing(raw(addr)) as sock:
      got, _ = attach(sock, **{'layout': LAYOUT, **case})
      assert got[:1] == b'E' and answer in got, got
      # The connection stays usable: a good slot, then a call.
      got, _ = attach(sock, LAYOUT)
      assert got == b'A' + protocol.SLOT.pack(0)
    assert server.error is None
    assert server.stats()['errors'] == 1


def nested(depth):
  """A slot spec nested `depth` lists deep: JSON, but too deep to parse."""
  return (b'{"method": "act", "request": ' + b'[' * depth + b']' * depth
          + b', "reply": []}')


@pytest.mark.parametrize('case', [
    dict(size=0, layout={'request': [], 'reply': []}),  # an empty memfd
    dict(layout={'request': [['x', [float('inf')], '<i8']], 'reply': []}),
    dict(layout={'request': [['x', [float('nan')], '<i8']], 'reply': []}),
    dict(layout={'request': [['x', [2.5], '<i8']], 'reply': []}),
    dict(layout={'request': [['x', [2 ** 64], '<i8']], 'reply': []}),
    # 2**248 elements: int64 arithmetic wraps to 0 and passes a size check.
    dict(layout={'request': [['x', [2 ** 31] * 8, '|u1']], 'reply': []}),
    dict(layout={'request': [['x', [2 ** 31] * 4, '<i8']], 'reply': []}),
    dict(layout={'request': [['x', '12', '<i8']], 'reply': []}),
    dict(layout={'request': [['x', [2], ['<i8']]], 'reply': []}),
    dict(layout={'request': {'x': 1}, 'reply': []}),
    dict(layout={'request': [['x', [2]]], 'reply': []}),
    dict(layout={'request': [], 'reply': []}, method=['act']),
    dict(layout=None, spec=b'[1, 2]'),
    dict(layout=None, spec=nested(5000)),
], ids=['empty-memfd', 'inf', 'nan', 'float', 'huge', 'overflow-u1',
        'overflow-i8', 'str-shape', 'list-dtype', 'dict-layout', 'two-fields',
        'list-method', 'not-a-dict', 'deep-json'])
def test_a_malformed_layout_is_its_senders_error_and_others_are_served(case):
  with serving(Recorder(), transports=('tcp', 'shm')) as (server, addr):
    with contextlib.closing(raw(addr)) as sock:
      got, _ = attach(sock, **case)
      assert got[:1] == b'E', got
    serves_tcp_and_shm_callers(server, addr)


def serves_tcp_and_shm_callers(server, addr):
  """Asserts that a TCP caller and an shm caller of a server with both
  transports are served, and that serving never stopped."""
  assert server.error is None
  tcp = portal.Client(addr, 'Honest', logging=False)
  try:
    reply = tcp.act({'x': np.array([5, 6]), 'envid': np.int64(1)})
    np.testing.assert_array_equal(reply.result(timeout=TIMEOUT)['y'],
                                  [10, 12])
  finally:
    tcp.close()
  good, connected = client(addr)
  assert connected
  np.testing.assert_array_equal(call(good, [1, 2], 0)['y'], [2, 4])
  good.close()
  assert server.error is None


def test_a_slot_of_more_rows_than_the_cap_is_refused():
  # The per-row byte limit scales with the rows a client declares: without
  # a cap, one slot could be any size (the memory is sparse until used).
  rows = protocol.MAX_ROWS + 1
  layout = {'request': [['x', [rows, 2], '<i8'], ['envid', [rows], '<i8']],
            'reply': [['y', [rows, 2], '<i8']]}
  with serving(Recorder()) as (server, addr):
    with contextlib.closing(raw(addr)) as sock:
      got, _ = attach(sock, layout, size=64 * rows)
      assert got[:1] == b'E' and b'rows' in got, got


def test_a_connection_may_map_only_so_many_slots():
  with serving(Recorder()) as (server, addr):
    with contextlib.closing(raw(addr)) as sock:
      for index in range(protocol.MAX_SLOTS):
        got, _ = attach(sock, LAYOUT, index=index)
        assert got == b'A' + protocol.SLOT.pack(index)
      got, _ = attach(sock, LAYOUT, index=protocol.MAX_SLOTS)
      assert got[:1] == b'E' and b'slots' in got, got


def test_a_second_call_in_a_busy_slot_and_garbage_cost_only_the_caller():
  gate = threading.Event()

  def slow(requests):
    gate.wait(TIMEOUT)
    return [{'y': r.data['x'] * 2} for r in requests], None

  with serving(slow) as (server, addr):
    with contextlib.closing(raw(addr)) as sock:
      assert attach(sock, LAYOUT)[0] == b'A' + protocol.SLOT.pack(0)
      sock.send(protocol.CALL.pack(b'R', 0, 1))
      sock.send(protocol.CALL.pack(b'R', 0, 2))  # Same slot, still in flight.
      reply = sock.recv(4096)
      assert protocol.REPLY.unpack(reply[:17])[1:] == (2, 4)
      assert b'in flight' in reply
      sock.send(protocol.CALL.pack(b'R', 9, 3))  # No such slot.
      assert b'no such slot' in sock.recv(4096)
      gate.set()
      assert protocol.REPLY.unpack(sock.recv(4096)[:17])[1:] == (1, 0)
      sock.send(b'?garbage')  # Not the protocol: only this link closes.
      assert sock.recv(4096) == b''
    good, _ = client(addr)
    np.testing.assert_array_equal(call(good, [1, 1], 1)['y'], [2, 2])
    good.close()
    assert server.error is None


def test_a_reply_that_does_not_fit_the_slot_is_an_error_for_its_caller():
  with serving(Recorder()) as (server, addr):
    wrong, _ = client(addr, space={'y': ((3,), np.int64)})
    with pytest.raises(RuntimeError, match="reply key 'y'"):
      call(wrong, [1, 2], 0)
    wrong.close()
    right, _ = client(addr)
    np.testing.assert_array_equal(call(right, [1, 2], 0)['y'], [2, 4])
    right.close()


def test_env_processes_use_shm_only_for_an_actor_on_loopback():
  from types import SimpleNamespace as Run
  from dreamer_ver.runtime.env_worker import uses_shm
  assert uses_shm(Run(actor_transport='auto', actor_addr='localhost:5000'))
  assert uses_shm(Run(actor_transport='auto', actor_addr='127.0.0.1:5000'))
  assert not uses_shm(Run(actor_transport='auto', actor_addr='10.0.0.7:5000'))
  assert not uses_shm(Run(actor_transport='tcp', actor_addr='localhost:5000'))
  assert uses_shm(Run(actor_transport='shm', actor_addr='10.0.0.7:5000'))


def test_the_socket_is_a_path_only_this_user_can_reach_and_goes_with_its_server():
  # An abstract socket name can be bound by any local user first: that
  # squatter would receive the token of every env client.
  with serving(Recorder()) as (server, addr):
    path = protocol.endpoints(addr, b'portal_handshake')[0]
    folder = os.path.dirname(path)
    info = os.stat(folder)
    assert path.startswith('/') and os.path.exists(path)
    assert info.st_uid == os.getuid() and info.st_mode & 0o777 == 0o700
    c, ok = client(addr)
    assert ok
    c.close()
  assert not os.path.exists(path)


@pytest.fixture
def private_tmp(monkeypatch):
  """A temporary folder of the test's own as tempfile's (short: a socket
  path has at most 107 bytes)."""
  import shutil
  import tempfile
  folder = tempfile.mkdtemp(prefix='shm')
  monkeypatch.setattr(tempfile, 'tempdir', folder)
  yield folder
  shutil.rmtree(folder)


@pytest.mark.parametrize('squat', ['open', 'symlink'])
def test_a_run_starts_when_another_user_made_the_uid_named_folder(
    private_tmp, squat):
  # The folder name of the uid alone is predictable: another local user
  # could make it first (here: one anyone may enter, or a symlink to theirs).
  predictable = os.path.join(private_tmp, f'dreamer_ver-{os.getuid()}')
  if squat == 'open':
    os.mkdir(predictable)
    os.chmod(predictable, 0o777)
  else:
    os.mkdir(predictable + '-theirs', 0o700)
    os.symlink(predictable + '-theirs', predictable)
  token = 'dreamer_ver:run-token'
  with serving(Recorder(), handshake=token) as (server, addr):
    c, connected = client(addr, handshake=token)
    assert connected
    np.testing.assert_array_equal(call(c, [1, 2], 0)['y'], [2, 4])
    c.close()
  assert server.error is None


def test_a_server_leaves_nothing_in_the_temporary_folder(private_tmp):
  """Its socket file goes when it closes, and the run's own folder of
  sockets is made only when this user's is unusable: one per token would
  pile up (every library InferenceServer has a token of its own)."""
  for token in ('dreamer_ver:first-token', 'dreamer_ver:second-token'):
    with serving(Recorder(), handshake=token) as (server, addr):
      c, connected = client(addr, handshake=token)
      assert connected
      c.close()
  assert os.listdir(private_tmp) == [f'dreamer_ver-{os.getuid()}']
  assert os.listdir(os.path.join(private_tmp, os.listdir(private_tmp)[0])) == []


@pytest.mark.parametrize('change', ['open', 'symlink'])
def test_socket_folders_others_can_enter_are_refused(private_tmp, change):
  token = b'dreamer_ver:run-token'
  for folder in protocol.socket_folders(token):
    if change == 'open':
      os.mkdir(folder)
      os.chmod(folder, 0o777)
    else:  # A symlink, even to a folder of ours, may be swapped under us.
      os.mkdir(folder + '-real', 0o700)
      os.symlink(folder + '-real', folder)
  assert protocol.endpoints('127.0.0.1:1234', token, make=True) == []
  with pytest.raises(PermissionError, match='0700'):
    BatchServer('127.0.0.1:1234', Recorder(), preemption.Fixed(1),
                transports=('shm',), handshake=token.decode())


def test_a_stale_socket_file_of_a_killed_server_does_not_block_the_next():
  addr = f'127.0.0.1:{free_port()}'
  stale = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
  # Left behind: nobody listens on it.
  stale.bind(protocol.endpoints(addr, b'portal_handshake', make=True)[0])
  stale.close()
  server = BatchServer(addr, Recorder(), preemption.Fixed(1),
                       transports=('shm',)).start()
  try:
    c, ok = client(addr)
    assert ok
    np.testing.assert_array_equal(call(c, [1, 2], 3)['y'], [2, 4])
    c.close()
  finally:
    server.close(timeout=TIMEOUT)
