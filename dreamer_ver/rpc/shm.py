"""The batch server's shared-memory transport, for callers on its host.

On one host, packing every call into portal's frame, pushing it through TCP
and unpacking it on both sides costs more than a fast env step
(bench/README.md). Here a caller writes its arrays into a slot of memory it
shares with the server and sends a 13-byte message; the server hands views
of the slot to the batch, writes the reply arrays into the same slot and
answers with a 17-byte message. Habitat VER's transfer buffers and TorchRL's
slot transport work the same way.

Messages go over a Unix SOCK_SEQPACKET connection to a socket file named
after the port of the server's TCP address (`endpoint`), in a folder only
this user may enter (mode 0700, checked on both sides): another local user
can neither bind it first nor connect, and a client also checks that the
server runs as its own user before it sends the token. (An abstract socket
name, which anyone may bind, would hand the token to a squatter.)

  H handshake                    client hello: the run token, as over TCP;
                                 answered A, or the connection is closed
  S slot:u32 layout(json) + fd   a new slot: a sealed memfd holding the
                                 request arrays, then the reply arrays;
                                 answered A slot, or E slot why
  R slot:u32 reqnum:u64          a call: the slot's request arrays are
                                 written
  P reqnum:u64 status:u64 [why]  its reply: status 0, the slot's reply
                                 arrays are written; else an error message

The memory is a memfd passed with SCM_RIGHTS: it has no name, so nothing is
left behind when a process dies (`multiprocessing.shared_memory` names each
segment and relies on a tracker process to remove it), and the kernel frees
it once both sides unmapped it. The client seals its size, so it cannot
shrink the memory under the server's mapping (a read past the end would
kill the server with SIGBUS).

Torn observations cannot reach a batch: a client writes a slot only while
no call is in flight in it, and sends R after the write; the server reads a
slot only between R and its reply. A client that dies mid-write never sent
R. The server forgets a client's slots when its connection closes; the
memory goes with the last view of it.

Linux only (memfd, abstract sockets).
"""

import errno
import fcntl
import hmac
import itertools
import json
import mmap
import os
import selectors
import socket
import stat
import struct
import tempfile
import threading

import numpy as np
from portal.client_socket import Disconnected

from .addresses import HANDSHAKE, split_addr
from .wire import Refusals

_CALL = struct.Struct('<cIQ')
_REPLY = struct.Struct('<cQQ')
_SLOT = struct.Struct('<I')
_SEALS = getattr(fcntl, 'F_SEAL_SHRINK', 0) | getattr(
    fcntl, 'F_SEAL_GROW', 0) | getattr(fcntl, 'F_SEAL_SEAL', 0)  # Linux
_ALIGN = 64
# A connection's slots are memory the server maps for it: a slot holds at
# most MAX_ROWS env rows (one env process's envs; the per-row byte limit
# scales with them), and a connection maps at most MAX_SLOTS slots.
MAX_ROWS = 1024
MAX_SLOTS = 64
_DTYPE_KINDS = 'biuf'  # bool, signed and unsigned ints, floats


def endpoint(addr):
  """The socket file of the server whose TCP address is `addr`."""
  _, port = split_addr(addr)
  return os.path.join(socket_folder(), f'batch-{port}.sock')


def socket_folder():
  """This user's folder of sockets in the temporary folder (the same for
  the server and its env processes, however they were started): made with
  mode 0700; PermissionError if it exists otherwise (a folder someone else
  made, or others may enter)."""
  folder = os.path.join(tempfile.gettempdir(), f'dreamer_ver-{os.getuid()}')
  try:
    os.mkdir(folder, 0o700)
  except FileExistsError:
    pass
  info = os.lstat(folder)
  if (not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid()
      or info.st_mode & 0o077):
    raise PermissionError(
        f'{folder} must be a folder of this user with mode 0700; remove it '
        'or chmod 700 it')
  return folder


def _bind(sock, path):
  """Binds `path`, replacing the file a killed server left behind (nobody
  listens on it); OSError if a live server holds it."""
  try:
    sock.bind(path)
  except OSError as e:
    if e.errno != errno.EADDRINUSE:
      raise
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
      probe.connect(path)
      raise  # Someone serves there.
    except ConnectionRefusedError:
      os.unlink(path)
      sock.bind(path)
    finally:
      probe.close()


def _same_user(sock):
  """Whether the peer of a Unix socket runs as this user."""
  creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                          struct.calcsize('3i'))
  return struct.unpack('3i', creds)[1] == os.getuid()


def available():
  """Whether this platform has what the transport needs (Linux does)."""
  return hasattr(os, 'memfd_create') and hasattr(fcntl, 'F_ADD_SEALS')


class ShmTransport:

  kind = 'shm'

  def __init__(self, addr, method, name, handshake=None, max_msg_size=None,
               envid_key='envid'):
    self.method = method
    self.envid_key = envid_key
    self.name = name
    self.handshake = (handshake or HANDSHAKE).encode('utf-8')
    self.max_bytes = max_msg_size or 2 ** 30  # per env row
    self.conns = {}  # conn id -> _Peer, once its handshake passed
    self.disconnects = 0
    self.error = None
    self.refused = 0
    self._ids = itertools.count()
    self._selector = selectors.DefaultSelector()
    self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    self._path = endpoint(addr)
    _bind(self._listener, self._path)
    self._listener.listen(128)
    self._listener.setblocking(False)
    self._selector.register(self._listener, selectors.EVENT_READ, None)
    self._lock = threading.Lock()

  def receive(self, timeout):
    """The calls received within `timeout` seconds: (conn, reqnum, data),
    `data` the views of the slot's request arrays."""
    calls = []
    for key, _ in self._selector.select(timeout):
      if key.data is None:
        self._accept()
      else:
        self._read(key.data, calls)
    return calls

  def reply(self, conn, reqnum, value):
    peer = self.conns.get(conn)
    slot = peer and peer.inflight.pop(reqnum, None)
    if slot is None:
      return False
    problem = _fill(slot.reply, value)
    if problem:
      self._send(peer, _reply(reqnum, 4, problem))
      return False
    return self._send(peer, _reply(reqnum, 0))

  def error_reply(self, conn, reqnum, status, message):
    peer = self.conns.get(conn)
    if peer is not None:
      peer.inflight.pop(reqnum, None)
      self._send(peer, _reply(reqnum, status, message))
    return False

  def shutdown(self):
    """No new connections; calls of open ones are still received."""
    with self._lock:
      if self._listener is not None:
        self._selector.unregister(self._listener)
        self._listener.close()
        self._listener = None
        try:
          os.unlink(self._path)
        except FileNotFoundError:
          pass

  def close(self, timeout):
    del timeout
    self.shutdown()
    for peer in list(self.conns.values()):
      self._drop(peer)
    self._selector.close()

  # ------------------------------------------------------------ internals

  def _accept(self):
    with self._lock:
      if self._listener is None:
        return
      try:
        sock, _ = self._listener.accept()
      except BlockingIOError:
        return
    sock.setblocking(False)
    self._selector.register(sock, selectors.EVENT_READ, _Peer(
        ('shm', next(self._ids)), sock))

  def _read(self, peer, calls):
    while True:
      try:
        msg, fds, flags, _ = socket.recv_fds(peer.sock, 65536, 1)
      except BlockingIOError:
        return
      except OSError:
        return self._drop(peer)
      try:
        if not msg or flags & socket.MSG_TRUNC:
          return self._drop(peer)
        call = self._handle(peer, msg, fds)
        if call is False:
          return self._drop(peer)
        if call is not None:
          calls.append(call)
      finally:
        for fd in fds:
          os.close(fd)

  def _handle(self, peer, msg, fds):
    """A call to queue, None, or False to drop the connection."""
    kind, body = msg[:1], msg[1:]
    if peer.conn not in self.conns:
      if kind != b'H' or not hmac.compare_digest(body, self.handshake):
        print(f'{self.name}: refused a shared-memory client with a wrong '
              'handshake (another run, or no token)', flush=True)
        return False
      self.conns[peer.conn] = peer
      self._send(peer, b'A')
      return None
    if kind == b'R' and len(msg) == _CALL.size:
      _, index, reqnum = _CALL.unpack(msg)
      slot = peer.slots.get(index)
      why = ('no such slot' if slot is None else
             'the slot has a call in flight' if slot in peer.inflight.values()
             else None)
      if why:
        self.refused += 1
        self._send(peer, _reply(reqnum, 4, why))
        return None
      peer.inflight[reqnum] = slot
      return peer.conn, reqnum, slot.request
    if kind == b'S' and len(body) >= _SLOT.size:
      index, = _SLOT.unpack(body[:_SLOT.size])
      why = self._attach(peer, index, body[_SLOT.size:], fds)
      if why:
        self.refused += 1
        self._send(peer, b'E' + _SLOT.pack(index) + why.encode('utf-8'))
      else:
        self._send(peer, b'A' + _SLOT.pack(index))
      return None
    return False  # Not this protocol.

  def _attach(self, peer, index, spec, fds):
    """Maps a client's slot; why not, if it cannot be."""
    if len(fds) != 1:
      return 'a slot needs one memory file descriptor'
    if index in peer.slots:
      return f'slot {index} exists'
    if len(peer.slots) >= MAX_SLOTS:
      return f'a connection may map at most {MAX_SLOTS} slots'
    try:
      spec = json.loads(spec)
      method = spec['method']
      request, reply = _layout(spec['request']), _layout(spec['reply'])
    except (ValueError, KeyError, TypeError) as e:
      return f'bad slot layout ({e})'
    if method != self.method:
      return f'Unknown method {method}'
    rows = max([1] + [shape[0] for key, shape, _ in request
                      if key == self.envid_key and len(shape) == 1])
    if rows > MAX_ROWS:
      return f'a slot of {rows} rows exceeds the limit of {MAX_ROWS}'
    for part, layout in (('call', request), ('reply', reply)):
      if _nbytes(layout) > self.max_bytes * rows:
        return (f'a {part} of {_nbytes(layout)} bytes exceeds the limit of '
                f'{self.max_bytes} per row')
    size = _nbytes(request + reply)
    try:
      if fcntl.fcntl(fds[0], fcntl.F_GET_SEALS) & _SEALS != _SEALS:
        return 'the memory must be sealed against resizing'
      if os.fstat(fds[0]).st_size < size:
        return 'the memory is smaller than its layout'
      buffer = mmap.mmap(fds[0], max(size, 1))
    except OSError as e:
      return f'cannot map the slot ({e})'
    views, end = _views(buffer, request, 0)
    peer.slots[index] = _Slot(views, _views(buffer, reply, end)[0])
    return None

  def _send(self, peer, msg):
    try:
      peer.sock.send(msg)
      return True
    except OSError:
      # A client that does not read its replies, or one that is gone: its
      # connection ends; the receive thread forgets it on EOF.
      try:
        peer.sock.shutdown(socket.SHUT_RDWR)
      except OSError:
        pass
      return False

  def _drop(self, peer):
    try:
      self._selector.unregister(peer.sock)
    except (KeyError, ValueError):
      pass
    peer.sock.close()
    if self.conns.pop(peer.conn, None) is not None:
      self.disconnects += 1


class _Peer:

  def __init__(self, conn, sock):
    self.conn = conn
    self.sock = sock
    self.slots = {}
    self.inflight = {}  # reqnum -> _Slot


class _Slot:

  def __init__(self, request, reply, index=None):
    self.request = request
    self.reply = reply
    self.index = index


class ShmClient:
  """A caller on the server's host, with BlockingClient's calls.

  `reply_space`: key -> (shape, dtype) of one env's reply (the actor: the
  action keys and `reset`), or a function of the request data that returns
  it; a call with a vector under `envid_key` gets one row per env. A slot
  is made for each request layout in flight (an env worker's halves: two).
  """

  def __init__(self, addr, reply_space, handshake=HANDSHAKE,
               envid_key='envid'):
    self.endpoint = endpoint(addr)
    self.reply_space = reply_space
    self.handshake = handshake.encode('utf-8')
    self.envid_key = envid_key
    self.sock = None
    self.reqnums = itertools.count()
    self._reset()

  def connect(self, stop=None, retry=0.1):
    """Retries until connected; False if `stop` (an Event) was set first.
    A refused handshake (a wrong token) counts in `wire.Refusals`."""
    # Not `stop or Event()`: a StopSignal is falsy until it is set.
    stop = threading.Event() if stop is None else stop
    self.close()
    refusals = Refusals(self.endpoint, retry)
    while not stop.is_set():
      sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
      try:
        sock.settimeout(5.0)
        sock.connect(self.endpoint)
        if not _same_user(sock):
          raise PermissionError(f'{self.endpoint} is served by another user')
        sock.send(b'H' + self.handshake)
        if sock.recv(16) == b'A':
          self.sock = sock
          return True
        refusals.refused()
      except OSError:
        pass
      sock.close()
      stop.wait(refusals.delay() or retry)
    return False

  def call(self, method, data, stop=None):
    return self.recv(self.send(method, data), stop)

  def send(self, method, data):
    """Writes `data` (a dict of arrays) into a free slot and sends the call;
    returns its number for `recv`."""
    if self.sock is None:
      raise Disconnected
    data = {k: np.asarray(v) for k, v in data.items()}
    layout = (method, *((k, v.shape, v.dtype.str) for k, v in data.items()))
    free = self._free.setdefault(layout, [])
    slot = free.pop() if free else self._attach(method, data)
    for key, value in data.items():
      slot.request[key][...] = value
    reqnum = next(self.reqnums)
    self._inflight[reqnum] = (layout, slot)
    self._send(_CALL.pack(b'R', slot.index, reqnum))
    return reqnum

  def recv(self, reqnum, stop=None, poll=0.5):
    """The reply to `reqnum` (copies of the slot's reply arrays). None once
    `stop` is set while waiting; Disconnected if the server goes away;
    RuntimeError with the server's message for an error reply."""
    while reqnum not in self._replies:
      if not self._read(stop, poll):
        return None
    status, message = self._replies.pop(reqnum)
    layout, slot = self._inflight.pop(reqnum)
    self._free[layout].append(slot)
    if status:
      raise RuntimeError(message)
    return {k: v.copy() for k, v in slot.reply.items()}

  def close(self):
    if self.sock is not None:
      self.sock.close()
      self.sock = None
    self._reset()

  def _reset(self):
    self._slots = 0
    self._free = {}  # request layout -> slots without a call in flight
    self._inflight = {}  # reqnum -> (request layout, slot)
    self._replies = {}  # reqnum -> (status, message)
    self._attached = {}  # slot index -> None, or why it was refused

  def _attach(self, method, data):
    envids = data.get(self.envid_key)
    rows = (len(envids),) if envids is not None and envids.ndim == 1 else ()
    request = [(k, list(v.shape), v.dtype.str) for k, v in data.items()]
    space = self.reply_space
    space = space(data) if callable(space) else space
    reply = [(k, [*rows, *shape], np.dtype(dtype).str)
             for k, (shape, dtype) in space.items()]
    size = max(_nbytes(_layout(request + reply)), 1)
    index, self._slots = self._slots, self._slots + 1
    fd = os.memfd_create(f'dreamer_ver-slot{index}',
                         os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
      os.ftruncate(fd, size)
      fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)
      buffer = mmap.mmap(fd, size)
      spec = json.dumps({'method': method, 'request': request, 'reply': reply})
      try:
        socket.send_fds(self.sock, [
            b'S' + _SLOT.pack(index) + spec.encode('utf-8')], [fd])
      except OSError as e:
        self.close()
        raise Disconnected from e
    finally:
      os.close(fd)
    while index not in self._attached:
      self._read(None, 0.5)
    why = self._attached.pop(index)
    if why is not None:
      raise RuntimeError(why)
    views, end = _views(buffer, _layout(request), 0)
    return _Slot(views, _views(buffer, _layout(reply), end)[0], index)

  def _send(self, msg):
    try:
      self.sock.send(msg)
    except OSError as e:
      self.close()
      raise Disconnected from e

  def _read(self, stop, poll):
    """Reads one message from the server; False once `stop` is set."""
    while True:
      if self.sock is None:
        raise Disconnected
      if stop is not None and stop.is_set():
        return False
      self.sock.settimeout(poll)
      try:
        msg = self.sock.recv(65536)
        break
      except TimeoutError:
        continue
      except OSError as e:
        self.close()
        raise Disconnected from e
    if not msg:
      self.close()
      raise Disconnected
    if msg[:1] == b'P':
      _, reqnum, status = _REPLY.unpack(msg[:_REPLY.size])
      self._replies[reqnum] = (status, msg[_REPLY.size:].decode('utf-8'))
    elif msg[:1] in (b'A', b'E'):
      index, = _SLOT.unpack(msg[1:1 + _SLOT.size])
      self._attached[index] = (
          None if msg[:1] == b'A' else msg[1 + _SLOT.size:].decode('utf-8'))
    return True


def _reply(reqnum, status, message=''):
  return _REPLY.pack(b'P', reqnum, status) + message.encode('utf-8')[:32768]


def _layout(spec):
  """[(key, shape, dtype)] checked: string keys, small non-negative shapes,
  plain numeric dtypes."""
  layout = []
  for key, shape, dtype in spec:
    dtype = np.dtype(dtype)
    if not isinstance(key, str) or dtype.kind not in _DTYPE_KINDS:
      raise ValueError(f'key {key!r}: dtype {dtype} is not a plain number')
    shape = tuple(int(n) for n in shape)
    if len(shape) > 8 or any(n < 0 or n > 2 ** 31 for n in shape):
      raise ValueError(f'key {key!r}: bad shape {list(shape)}')
    layout.append((key, shape, dtype))
  return layout


def _nbytes(layout):
  return _views(None, layout, 0)[1]


def _views(buffer, layout, offset):
  """Arrays laid out one after the other from `offset` (aligned), as views
  of `buffer` (or only the end offset, for None)."""
  views = {}
  for key, shape, dtype in layout:
    offset = -(-offset // _ALIGN) * _ALIGN
    count = int(np.prod(shape, dtype=np.int64))
    if buffer is not None:
      views[key] = np.frombuffer(
          buffer, dtype, count, offset).reshape(shape)
    offset += count * dtype.itemsize
  return views, offset


def _fill(arrays, value):
  """Writes a reply into the slot's reply arrays; why not, if it does not
  fit their layout."""
  if not isinstance(value, dict) or set(value) != set(arrays):
    keys = sorted(value) if isinstance(value, dict) else type(value).__name__
    return (f'the reply {keys} does not match the slot layout '
            f'{sorted(arrays)}')
  for key, target in arrays.items():
    source = np.asarray(value[key])
    if source.shape != target.shape or not np.can_cast(
        source.dtype, target.dtype, 'same_kind'):
      return (f'reply key {key!r}: {source.dtype}{list(source.shape)} does '
              f'not fit {target.dtype}{list(target.shape)}')
    target[...] = source
  return None
