"""The shared-memory transport's protocol: messages, slot layouts, and the
socket folder. The server is `shm.py` (ShmTransport), the client
`shm_client.py` (ShmClient).

On one host, packing every call into portal's frame, pushing it through TCP
and unpacking it on both sides costs more than a fast env step
(docs/benchmarks.md). Here a caller writes its arrays into a slot of memory it
shares with the server and sends a 13-byte message; the server hands views
of the slot to the batch, writes the reply arrays into the same slot and
answers with a 17-byte message. Habitat VER's transfer buffers and TorchRL's
slot transport work the same way.

Messages go over a Unix SOCK_SEQPACKET connection to a socket file named
after the port of the server's TCP address (`endpoints`), in a folder only
this user may enter (mode 0700, checked on both sides): another local user
can neither bind it first nor connect, and a client also checks that the
server runs as its own user before it sends the token. (An abstract socket
name, which anyone may bind, would hand the token to a squatter.) If
another user made the folder's predictable name first, the server uses a
folder named after a digest of the run token instead, and clients look in
both.

  H handshake                    client hello: the handshake string (the
                                 run token in clear: only the same user
                                 can be at the other end);
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
import hashlib
import json
import math
import os
import socket
import stat
import struct
import tempfile

import numpy as np

from .addresses import split_addr

CALL = struct.Struct('<cIQ')
REPLY = struct.Struct('<cQQ')
SLOT = struct.Struct('<I')
SEALS = getattr(fcntl, 'F_SEAL_SHRINK', 0) | getattr(
    fcntl, 'F_SEAL_GROW', 0) | getattr(fcntl, 'F_SEAL_SEAL', 0)  # Linux
ALIGN = 64
# A connection's slots are memory the server maps for it: a slot holds at
# most MAX_ROWS env rows (one env process's envs; the per-row byte limit
# scales with them), and a connection maps at most MAX_SLOTS slots.
MAX_ROWS = 1024
MAX_SLOTS = 64
DTYPE_KINDS = 'biuf'  # bool, signed and unsigned ints, floats


def endpoints(addr, handshake, make=False):
  """The socket files a server of TCP address `addr` and handshake (bytes)
  `handshake` may listen at, in the order a server picks the first and a
  client tries them: in this user's folder of sockets, then in the run's
  own (see `socket_folders`). Only folders of this user with mode 0700;
  with `make`, the first such folder is made if none is there yet (the
  run's own only when this user's is unusable: one per token would pile
  up)."""
  _, port = split_addr(addr)
  paths = []
  for folder in socket_folders(handshake):
    if private_folder(folder, make and not paths):
      paths.append(os.path.join(folder, f'batch-{port}.sock'))
  return paths


def socket_folders(handshake):
  """The candidate folders of sockets, in the temporary folder (the same
  for the server and its env processes, however they were started): the
  folder of this user's id, and one named after a digest of the handshake
  too, for when another local user made the first one (a name anyone can
  predict): without the run token, nobody else can make that one first."""
  digest = hashlib.sha256(handshake).hexdigest()[:16]
  folder = os.path.join(tempfile.gettempdir(), f'dreamer_ver-{os.getuid()}')
  return [folder, f'{folder}-{digest}']


def private_folder(folder, make=False):
  """Whether `folder` is a folder (not a symlink) of this user that others
  may not enter (mode 0700); made so first if `make` and it is missing."""
  if make:
    try:
      os.mkdir(folder, 0o700)
    except FileExistsError:
      pass
  try:
    info = os.lstat(folder)
  except FileNotFoundError:
    return False
  return (stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid()
          and not info.st_mode & 0o077)


def bind(sock, path):
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


def same_user(sock):
  """Whether the peer of a Unix socket runs as this user."""
  return peer_uid(sock) == os.getuid()


def peer_uid(sock):
  """The user id the peer of a Unix socket runs as (its credentials at
  connect time, from the kernel)."""
  creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                          struct.calcsize('3i'))
  return struct.unpack('3i', creds)[1]


def available():
  """Whether this platform has what the transport needs (Linux does)."""
  return hasattr(os, 'memfd_create') and hasattr(fcntl, 'F_ADD_SEALS')


def reply(reqnum, status, message=''):
  return REPLY.pack(b'P', reqnum, status) + text(message)


def text(message):
  """A message's bytes, cut to fit one read of the peer (whole
  characters: a cut one would not decode)."""
  return message[:8192].encode('utf-8')


def slot_spec(raw):
  """(method, request layout, reply layout) of a slot's JSON spec;
  ValueError if it is not one (one nested too deep to parse included)."""
  try:
    spec = json.loads(raw)
  except RecursionError:
    raise ValueError('the spec is nested too deep') from None
  if not isinstance(spec, dict) or not isinstance(spec.get('method'), str):
    raise ValueError('a slot spec is {"method": name, "request": layout, '
                     '"reply": layout}')
  return (spec['method'], layout_of(spec.get('request')),
          layout_of(spec.get('reply')))


def layout_of(spec):
  """[(key, shape, dtype)] of a list of [key, shape, dtype]; ValueError
  unless the keys are strings, the shapes at most 8 integers in [0, 2**31]
  and the dtypes plain numbers (a float or a string shape is not silently
  truncated: the client would lay its arrays out otherwise)."""
  if not isinstance(spec, (list, tuple)):
    raise ValueError('a layout is a list of [key, shape, dtype]')
  layout = []
  for leaf in spec:
    if not isinstance(leaf, (list, tuple)) or len(leaf) != 3:
      raise ValueError('a layout entry is [key, shape, dtype]')
    key, shape, dtype = leaf
    if not isinstance(key, str):
      raise ValueError('a layout key must be a string')
    if not isinstance(shape, (list, tuple)) or len(shape) > 8 or not all(
        type(n) is int and 0 <= n <= 2 ** 31 for n in shape):
      raise ValueError(f'key {key!r}: a shape is at most 8 integers in '
                       '[0, 2**31]')
    try:
      dtype = np.dtype(dtype) if isinstance(dtype, str) else None
    except (TypeError, ValueError):
      dtype = None
    if dtype is None or dtype.kind not in DTYPE_KINDS:
      raise ValueError(f'key {key!r}: the dtype is not a plain number')
    layout.append((key, tuple(shape), dtype))
  return layout


def nbytes(layout):
  return array_views(None, layout, 0)[1]


def array_views(buffer, layout, offset):
  """Arrays laid out one after the other from `offset` (aligned), as views
  of `buffer` (or only the end offset, for None). Sizes are Python ints:
  int64 arithmetic would wrap a huge layout to a small one."""
  views = {}
  for key, shape, dtype in layout:
    offset = -(-offset // ALIGN) * ALIGN
    count = math.prod(shape)
    if buffer is not None:
      views[key] = np.frombuffer(
          buffer, dtype, count, offset).reshape(shape)
    offset += count * dtype.itemsize
  return views, offset


def fill(arrays, value):
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


class Slot:
  """A slot's request and reply arrays (views of its memory); `index`: the
  client's number for it."""

  def __init__(self, request, reply, index=None):
    self.request = request
    self.reply = reply
    self.index = index
