"""The batch server's shared-memory transport, for callers on its host: the
server side (`shm_protocol.py` has the protocol and why, `shm_client.py`
the client).
"""

import fcntl
import hmac
import itertools
import mmap
import os
import selectors
import socket
import threading

from .addresses import HANDSHAKE
from .shm_protocol import (
    CALL, MAX_ROWS, MAX_SLOTS, SEALS, SLOT, Slot, array_views, bind,
    endpoints, fill, nbytes, reply, slot_spec, socket_folders, text)
from .transport import Transport


class ShmTransport(Transport):

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
    paths = endpoints(addr, self.handshake, make=True)
    if not paths:
      raise PermissionError(
          f'{" or ".join(socket_folders(self.handshake))} must be a folder '
          'of this user with mode 0700; remove it or chmod 700 it')
    self._path = paths[0]
    bind(self._listener, self._path)
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
    problem = fill(slot.reply, value)
    if problem:
      self._send(peer, reply(reqnum, 4, problem))
      return False
    return self._send(peer, reply(reqnum, 0))

  def error_reply(self, conn, reqnum, status, message):
    peer = self.conns.get(conn)
    if peer is not None:
      peer.inflight.pop(reqnum, None)
      self._send(peer, reply(reqnum, status, message))
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
    if kind == b'R' and len(msg) == CALL.size:
      _, index, reqnum = CALL.unpack(msg)
      slot = peer.slots.get(index)
      why = ('no such slot' if slot is None else
             'the slot has a call in flight' if slot in peer.inflight.values()
             else None)
      if why:
        self.refused += 1
        self._send(peer, reply(reqnum, 4, why))
        return None
      peer.inflight[reqnum] = slot
      return peer.conn, reqnum, slot.request
    if kind == b'S' and len(body) >= SLOT.size:
      index, = SLOT.unpack(body[:SLOT.size])
      why = self._attach(peer, index, body[SLOT.size:], fds)
      if why:
        self.refused += 1
        self._send(peer, b'E' + SLOT.pack(index) + text(why))
      else:
        self._send(peer, b'A' + SLOT.pack(index))
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
      method, request, reply = slot_spec(spec)
    except ValueError as e:
      return f'bad slot layout ({e})'
    if method != self.method:
      return f'Unknown method {method}'
    rows = max([1] + [shape[0] for key, shape, _ in request
                      if key == self.envid_key and len(shape) == 1])
    if rows > MAX_ROWS:
      return f'a slot of {rows} rows exceeds the limit of {MAX_ROWS}'
    for part, layout in (('call', request), ('reply', reply)):
      if nbytes(layout) > self.max_bytes * rows:
        return (f'a {part} of {nbytes(layout)} bytes exceeds the limit of '
                f'{self.max_bytes} per row')
    size = nbytes(request + reply)
    try:
      if fcntl.fcntl(fds[0], fcntl.F_GET_SEALS) & SEALS != SEALS:
        return 'the memory must be sealed against resizing'
      if os.fstat(fds[0]).st_size < max(size, 1):  # mmap needs a byte
        return 'the memory is smaller than its layout'
      buffer = mmap.mmap(fds[0], max(size, 1))
    except OSError as e:
      return f'cannot map the slot ({e})'
    views, end = array_views(buffer, request, 0)
    peer.slots[index] = Slot(views, array_views(buffer, reply, end)[0])
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
    self.inflight = {}  # reqnum -> Slot
