"""portal's wire protocol, client side, as plain functions on a socket.

A frame is an 8-byte little-endian length and that many bytes. A request is
(8-byte request number, 8-byte method-name length, method name, portal's
packed args); a reply is (request number, 8-byte status, packed result or,
for status != 0, an error message). A new connection first sends the
handshake (`auth.py`: a plain string, or the token exchange). portal's
servers read exactly this with a plain handshake, and our own servers with
either, so clients built on these functions need no change on their side.
"""

import itertools
import re
import select
import socket

import msgpack
import numpy as np
from portal import packlib

from . import auth
from .addresses import current


class RemoteError(RuntimeError):
  """An error reply, raised where its call's result is read: the server's
  message, and `kind`, the name of the error its method raised (None where
  the message is not `failure`'s form, say a portal server's), so that a
  caller tells faults apart by name, not by their words."""

  def __init__(self, message):
    super().__init__(message)
    found = re.match(r'[^:\s]+: ([A-Za-z_]\w*): ', message)
    self.kind = found.group(1) if found else None


def failure(method, kind, detail):
  """An error reply's message: `<method>: <kind>: <detail>`."""
  return f'{method}: {kind}: {detail}'


class Refusals:
  """Connections in a row that a server closed before answering.

  portal's protocol has no handshake reply: a server that refuses a
  client's token (one of another run) just closes the connection. After
  each such connection the client waits twice as long before the next
  (from 2 x `retry` up to `longest` seconds), and the third in a row is
  reported once, so a refused client neither spins nor stays silent.
  """

  def __init__(self, where, retry=0.1, longest=5.0):
    self.where = where  # names the server in the report
    self.retry = retry
    self.longest = longest
    self.count = 0
    self.answering = False  # whether the current connection answered

  def opened(self):
    self.answering = False

  def answered(self):
    self.answering = True
    self.count = 0

  def closed(self):
    """The current connection ended: a refusal if it never answered."""
    if not self.answering:
      self.refused()

  def refused(self):
    self.count += 1
    if self.count == 3:
      print(f'{self.where}: the server closed 3 connections in a row before '
            'answering (a server of another run, or a wrong token?); '
            'connecting less often.', flush=True)

  def delay(self):
    """Seconds to wait before the next connection."""
    return min(self.retry * 2 ** self.count, self.longest) if self.count else 0


# How each end of a connection finds out that the other is gone: TCP
# keepalive (idle seconds, seconds between probes, probes) and the longest
# that sent data may stay unacknowledged (seconds; without it a reply sent
# into a cut-off link is resent for about 15 minutes). A peer whose host
# vanished (or was cut off while its process died) sends no close, and an
# end that gave up on a cut link (ETIMEDOUT) sends none either: the other
# end would wait on it for good (a server keeping its env ids, a client
# waiting for a reply). This ends it within 25 s, and at the first probe
# that reaches a host without the connection (it answers a reset).
KEEPALIVE = (10, 5, 3)
UNACKNOWLEDGED = 25


def keep_alive(sock):
  """Has the kernel probe `sock`'s peer after KEEPALIVE's silent seconds
  and end the connection once sent data waits UNACKNOWLEDGED seconds."""
  tcp = socket.IPPROTO_TCP
  idle, interval, probes = KEEPALIVE
  try:
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    sock.setsockopt(tcp, socket.TCP_KEEPIDLE, idle)
    sock.setsockopt(tcp, socket.TCP_KEEPINTVL, interval)
    sock.setsockopt(tcp, socket.TCP_KEEPCNT, probes)
    sock.setsockopt(tcp, socket.TCP_USER_TIMEOUT, 1000 * UNACKNOWLEDGED)
  except (OSError, AttributeError):  # Closed already, or not Linux.
    pass


def connect(addr, handshake, stop, retry=0.1):
  """A connected socket that has passed the handshake (`auth.introduce`);
  retries until `stop` (a threading.Event or anything with `is_set` and
  `wait`) is set, then returns None. `addr` is (host, port) or a lookup
  (`addresses.current`). A server that fails the token exchange is
  reported the first time, and asked again less and less often."""
  refusals = Refusals('', retry)  # named at its first refusal
  while not stop.is_set():
    sock = None
    target = current(addr)
    if target is None:
      stop.wait(retry)
      continue
    try:
      sock = socket.create_connection(target, timeout=1.0)
      sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
      keep_alive(sock)
      auth.introduce(sock, handshake)
      sock.settimeout(None)  # blocking; `recv` polls with select
    except auth.Refused as e:
      sock.close()
      refusals.where = f'{target[0]}:{target[1]}'
      if not refusals.count:
        print(f'{refusals.where}: {e}; it was not sent the token.',
              flush=True)
      refusals.refused()
      stop.wait(refusals.delay())
      continue
    except OSError:
      # Refused, or reset by a server that is shutting down while it
      # accepts (an agent being killed): both mean "try again later".
      if sock is not None:
        sock.close()
      stop.wait(retry)
      continue
    return sock
  return None


def request(reqnum, method, args):
  """The parts of one request frame (without the length prefix)."""
  name = method.encode('utf-8')
  return [reqnum.to_bytes(8, 'little'), len(name).to_bytes(8, 'little'),
          name, *pack(args)]


def pack(data):
  """portal's `packlib.pack(data)`, byte for byte, as its parts (`unpack`
  and packlib.unpack read it), with arrays that are not C-contiguous
  copied first. Its own encoder because packlib's two recursive tree maps
  made a server's replies cost 9-12 us each, several times this. Trees of
  other containers or leaves (packlib's shared arrays) go to packlib."""
  leaves = []
  try:
    tree = _flatten(data, leaves)
  except _Unusual:
    return packlib.pack(packlib.tree_map(_contiguous, data))
  specs, buffers = [], []
  for value in leaves:  # In packlib's order: np.str_ is a str, not an array.
    if value is None:
      specs.append(['none'])
      buffers.append(b'\x00')
    elif isinstance(value, str):
      specs.append(['utf8'])
      buffers.append(value.encode('utf-8'))
    elif isinstance(value, (bytes, bytearray, memoryview)):
      specs.append(['bytes'])
      buffers.append(value.cast('c') if isinstance(value, memoryview)
                     else value)
    else:  # An array, a numpy scalar, an int or a float.
      value = _contiguous(np.asarray(value))
      if value.dtype == object:
        raise TypeError(f'cannot pack an object array: {data!r}')
      specs.append(['array', value.shape, value.dtype.str])
      buffers.append(value.data.cast('c') if value.size else b'\x00')
  buffers = [msgpack.packb(tree), msgpack.packb(specs), *buffers]
  sizes = np.array([len(b) for b in buffers], '<u8').tobytes()
  return [len(buffers).to_bytes(8, 'little'), sizes, *buffers]


class _Unusual(Exception):
  """A tree `pack` leaves to packlib."""


_LEAVES = (np.ndarray, np.generic, int, float, str, bytes, bytearray,
           memoryview, type(None))


def _flatten(tree, leaves):
  """packlib's structure of `tree` (its leaves replaced by None), the
  leaves appended to `leaves` in packlib's order."""
  if isinstance(tree, dict):
    return {k: _flatten(v, leaves) for k, v in tree.items()}
  if isinstance(tree, (list, tuple)):
    return [_flatten(v, leaves) for v in tree]
  if not isinstance(tree, _LEAVES):
    raise _Unusual
  leaves.append(tree)
  return None


def _contiguous(value):
  if isinstance(value, np.ndarray) and not value.flags.c_contiguous:
    return np.ascontiguousarray(value)
  return value


def send(sock, parts):
  """Sends one frame on a blocking socket; raises OSError when the
  connection is gone."""
  frame = Frame(parts)
  while not frame.done():
    frame.send(sock)


IOV_MAX = 512  # Buffers per write: the kernel refuses more than 1,024.
JOIN_BELOW = 1 << 16  # Parts smaller than this are copied into one buffer.


class Frame:
  """One frame on its way out (length prefix and `parts`), for clients and
  servers alike. portal packs each leaf of a message as its own buffer,
  and a write of more than 1,024 buffers fails, so here runs of small
  parts are joined into one buffer (large arrays are still sent without a
  copy), each write passes at most IOV_MAX buffers, and a write that the
  kernel takes only in part continues where it stopped."""

  def __init__(self, parts):
    views = [memoryview(part).cast('B') for part in parts]
    size = sum(len(view) for view in views)
    self.buffers = []
    runs = itertools.groupby(
        [size.to_bytes(8, 'little'), *views], lambda b: len(b) >= JOIN_BELOW)
    for large, run in runs:
      joined = list(run) if large else [memoryview(b''.join(run))]
      # No empty buffer: a write of one sends 0 bytes and never gets past.
      self.buffers += [buffer for buffer in joined if len(buffer)]
    self.next = 0  # The first buffer not yet sent in full.

  def send(self, sock):
    """One write; raises BlockingIOError on a non-blocking socket that is
    full, and OSError when the connection is gone."""
    sent = sock.sendmsg(self.buffers[self.next:self.next + IOV_MAX])
    while sent:
      head = self.buffers[self.next]
      if sent < len(head):
        self.buffers[self.next] = head[sent:]
        return
      sent -= len(head)
      self.next += 1

  def done(self):
    """Whether every byte of the frame has been written."""
    return self.next == len(self.buffers)


def recv(sock, stop, max_size, poll=0.5):
  """The next frame, as a memoryview; None once `stop` is set while waiting
  (checked every `poll` seconds). Raises EOFError or OSError when the
  connection closes or sends a frame size outside [16, max_size]."""
  header = _recv_exact(sock, 8, stop, poll)
  if header is None:
    return None
  size = int.from_bytes(header, 'little')
  if not 16 <= size <= max_size:
    raise EOFError(f'bad frame size {size}')
  return _recv_exact(sock, size, stop, poll)


def reply(frame):
  """A reply frame -> (request number, result); an error reply raises
  RemoteError with the server's message."""
  reqnum = int.from_bytes(frame[:8], 'little')
  status = int.from_bytes(frame[8:16], 'little')
  if status:
    raise RemoteError(bytes(frame[16:]).decode('utf-8', 'replace'))
  return reqnum, unpack(frame[16:])


def unpack(payload):
  """What portal's packlib.pack packed, from a peer's bytes: the same tree
  of None, str, bytes (memoryviews) and numpy arrays (views of `payload`).
  Its own decoder rather than packlib.unpack, which trusts the peer (any
  buffer count is allocated; a 'sharray' leaf maps the shared-memory
  segment it names, of any size) and costs a server twice this per call
  (it decodes the specs again and rebuilds the tree in two recursive
  passes). Anything malformed raises an Exception (ValueError, mostly)."""
  count = int.from_bytes(payload[:8], 'little')
  if len(payload) < 8 or count < 2 or 8 + 8 * count > len(payload):
    raise ValueError('bad packlib header')
  ends = list(itertools.accumulate(
      np.frombuffer(payload[8:8 + 8 * count], '<u8').tolist(),
      initial=8 + 8 * count))
  if ends[-1] > len(payload):
    raise ValueError('bad packlib header')
  tree = msgpack.unpackb(payload[ends[0]:ends[1]])
  specs = msgpack.unpackb(payload[ends[1]:ends[2]])
  if not isinstance(specs, list) or len(specs) != count - 2:
    raise ValueError('bad packlib specs')
  leaves = iter([_leaf(spec, payload[start:end]) for spec, start, end in zip(
      specs, ends[2:], ends[3:])])
  data = _unflatten(tree, leaves)
  if next(leaves, _MISSING) is not _MISSING:
    raise ValueError('more leaves than the tree has')
  return data


def _leaf(spec, buffer):
  kind = spec[0]
  if kind == 'array':
    _, shape, dtype = spec
    if 0 in shape:  # packlib sends one placeholder byte (and a product
      buffer = b''  # of a peer's list could be a string of any length)
    return np.frombuffer(buffer, _DTYPES.get(dtype) or np.dtype(dtype)
                         ).reshape(shape)
  if kind == 'none':
    return None
  if kind == 'utf8':
    return bytes(buffer).decode('utf-8')
  if kind == 'bytes':
    return buffer
  raise ValueError(f'shared-memory or unknown leaves ({kind!r}) are not '
                   'accepted')


_DTYPES = {np.dtype(t).str: np.dtype(t) for t in (
    np.bool_, np.uint8, np.int32, np.int64, np.float16, np.float32,
    np.float64)}


def _unflatten(tree, leaves):
  """`tree` (packlib's structure: lists and dicts, None at the leaves)
  with its Nones replaced by `leaves` in order."""
  if tree is None:
    leaf = next(leaves, _MISSING)
    if leaf is _MISSING:
      raise ValueError('fewer leaves than the tree has')
    return leaf
  if isinstance(tree, list):
    return [_unflatten(node, leaves) for node in tree]
  if isinstance(tree, dict):
    return {key: _unflatten(node, leaves) for key, node in tree.items()}
  raise ValueError(f'bad packlib tree node {tree!r}')


_MISSING = object()


def reqnum_of(frame):
  return int.from_bytes(frame[:8], 'little')


def _recv_exact(sock, size, stop, poll):
  buffer = memoryview(np.empty(size, np.uint8).data)
  pos = 0
  while pos < size:
    if not select.select([sock], [], [], poll)[0]:
      if stop is not None and stop.is_set():
        return None
      continue
    got = sock.recv_into(buffer[pos:])
    if not got:
      raise EOFError('connection closed')
    pos += got
  return buffer
