"""A blocking client for portal's wire protocol, for env processes.

An env worker has at most two requests in flight (one per half of its envs),
so it needs no background thread: it sends frames and reads the replies on
the same socket when it needs them. This
keeps an idle env process at zero CPU (portal.Client's socket thread can keep
spinning after a reply until the next send) and saves a thread hop per step.
The frames are portal's (8-byte length, request number, method name, packed
args / status, packed result), so the servers cannot tell the difference.
"""

import itertools
import socket

import numpy as np
from portal import packlib
from portal.client_socket import Disconnected

from dreamer_ver.runtime.process import split_addr

HANDSHAKE = 'portal_handshake'


class EnvClient:

  def __init__(self, addr, handshake=HANDSHAKE, max_msg_size=2 ** 30):
    self.addr = split_addr(addr)
    self.handshake = handshake.encode('utf-8')
    self.max_msg_size = max_msg_size
    self.sock = None
    self.reqnums = itertools.count()
    self.early = {}  # replies that arrived before they were asked for

  def connect(self, stop, retry=0.1):
    """Retries until connected; returns False if `stop` (a StopSignal) was
    set first."""
    self.close()
    while not stop:
      sock = None
      try:
        sock = socket.create_connection(self.addr, timeout=1.0)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.sendall(self.handshake)
      except OSError:
        # Refused, or reset by a server that is shutting down while it
        # accepts (an agent being killed): both mean "try again later".
        if sock is not None:
          sock.close()
        stop.wait(retry)
        continue
      self.sock = sock
      return True
    return False

  def call(self, method, *args, stop=None):
    """Sends one request and waits for its reply (see `send` and `recv`)."""
    return self.recv(self.send(method, *args), stop)

  def send(self, method, *args):
    """Sends a request; returns its number for `recv`."""
    if self.sock is None:
      raise Disconnected
    reqnum = next(self.reqnums).to_bytes(8, 'little')
    name = method.encode('utf-8')
    parts = [reqnum, len(name).to_bytes(8, 'little'), name,
             *packlib.pack(args)]
    size = sum(len(memoryview(p).cast('B')) for p in parts)
    try:
      self.sock.settimeout(None)
      self.sock.sendmsg([size.to_bytes(8, 'little'), *parts])
    except OSError as e:
      self.close()
      raise Disconnected from e
    return reqnum

  def recv(self, reqnum, stop=None, poll=0.5):
    """Waits for the reply to `reqnum`. Returns None once `stop` is set while
    waiting; raises Disconnected if the server goes away and RuntimeError
    with the server's message for an error reply."""
    while reqnum not in self.early:
      if self.sock is None:
        raise Disconnected
      try:
        self.sock.settimeout(poll)
        reply = self._recv_frame(stop)
      except (OSError, EOFError) as e:
        self.close()
        raise Disconnected from e
      if reply is None:
        return None
      self.early[bytes(reply[:8])] = reply
    reply = self.early.pop(reqnum)
    status = int.from_bytes(reply[8:16], 'little')
    if status:
      raise RuntimeError(bytes(reply[16:]).decode('utf-8', 'replace'))
    return packlib.unpack(reply[16:])

  def close(self):
    self.early.clear()
    if self.sock is not None:
      self.sock.close()
      self.sock = None

  def _recv_frame(self, stop):
    header = self._recv_exact(8, stop)
    if header is None:
      return None
    size = int.from_bytes(header, 'little')
    if not 16 <= size <= self.max_msg_size:
      raise EOFError(f'bad frame size {size}')
    return self._recv_exact(size, stop)

  def _recv_exact(self, size, stop):
    buffer = memoryview(np.empty(size, np.uint8).data)
    pos = 0
    while pos < size:
      try:
        got = self.sock.recv_into(buffer[pos:])
      except socket.timeout:
        if stop:
          return None
        continue
      if not got:
        raise EOFError('connection closed')
      pos += got
    return buffer
