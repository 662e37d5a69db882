"""The server side of portal's wire protocol, on a hardened portal socket.

Both of the project's servers read calls and send replies through this: the
batch server (`batch_server.py`, the actor) and the RPC server (`server.py`,
replay and logger). A call is (8-byte request number, 8-byte method-name
length, method name, portal's packed args); a reply is (request number,
8-byte status, packed result or, for status != 0, an error message):

  status 1  message too short      status 3  unknown method
  status 2  could not decode it    status 4  bad argument or method error
"""

import hmac
import socket as socketlib
import time

import numpy as np
import portal
from portal import packlib

from . import auth, wire
from .addresses import HANDSHAKE, bind_host, split_addr


class BadCall(Exception):
  """A call that cannot be served; its caller gets `status` and the message."""

  def __init__(self, reqnum, status, message):
    super().__init__(message)
    self.reqnum = reqnum
    self.status = status


def parse_call(msg):
  """(request number, method name, args list) of one received call, or
  BadCall (status 1 or 2)."""
  if len(msg) < 16:
    raise BadCall(bytes(msg[:8]).ljust(8, b'\0'), 1, 'Message too short')
  reqnum = bytes(msg[:8])
  try:
    size = int.from_bytes(msg[8:16], 'little')
    if 16 + size > len(msg):
      raise ValueError('method name exceeds message')
    name = bytes(msg[16:16 + size]).decode('utf-8')
    args = wire.unpack(msg[16 + size:])
  except Exception:
    raise BadCall(reqnum, 2, 'Could not decode message') from None
  return reqnum, name, args


def check_args(args):
  """None if `args` is [dict of numpy arrays], else what it was instead."""
  if not isinstance(args, list) or len(args) != 1:
    count = len(args) if isinstance(args, list) else 0
    return f'{count} arguments'
  data = args[0]
  if not isinstance(data, dict):
    return type(data).__name__
  for key, value in data.items():
    if not isinstance(value, np.ndarray) or value.dtype == object:
      return f'{type(value).__name__} under key {key!r}'
  return None


class ServerSocket(portal.ServerSocket):
  """portal's ServerSocket, where a misbehaving peer only loses itself.

  Upstream, a frame whose length prefix is 0 or above max_msg_size fails an
  assert on the socket thread and kills the socket for every client, and a
  peer that closes mid-handshake makes the socket thread spin. Here both
  just close that connection. With a token (`handshake` names one,
  `addresses.handshake`) a client must pass the exchange of `auth.py`,
  which never sends the token; the plain `dreamer_ver:<token>` of an
  unmodified portal client is taken only with `plain_handshake=True`.
  Without one, portal's plain handshake is the only one. A plain handshake
  is compared once it is complete, in constant time: upstream compares
  each prefix as it arrives and closes at the first wrong byte, which
  tells a caller how much of a guess was right; and its log line quotes
  both handshakes.
  Accepted connections get TCP_NODELAY, so small replies are not
  held back by Nagle's algorithm.

  Connections that never finish their handshake cost a file descriptor
  each; upstream keeps them for ever, and once descriptors run out its
  accept() raises EMFILE and ends the socket thread for everyone. Here a
  connection gets HANDSHAKE_SECONDS to present the token, at most
  MAX_HANDSHAKING wait at a time (the oldest is closed for a newcomer),
  and a failed accept() closes the oldest waiting connection, or else
  pauses accepting briefly, instead of ending the thread.

  Only problems are printed: portal's lines for binding, every accepted
  connection, a peer that went away (reset, end of file) and replies
  dropped for it are routine and would bury a run's progress; a refused
  handshake or a broken frame is still printed.
  """

  HANDSHAKE_SECONDS = 10.0
  MAX_HANDSHAKING = 64
  ROUTINE = ('Binding to', 'Listening at', 'Accepted connection', 'Dropping')
  GONE = ('ConnectionResetError', 'BrokenPipeError', 'EOFError')

  def __init__(self, addr, name, nodelay=True, plain_handshake=False,
               handshake=None, **kwargs):
    """Listens on the port of `addr` ('host:port'), on the interface its
    host names unless `host` says otherwise (e.g. `0.0.0.0`)."""
    # Before super() starts the socket thread:
    self.nodelay = nodelay
    self.disconnects = 0  # Counts closed connections, for queue pruning.
    self.plain = (handshake or HANDSHAKE).encode('utf-8')
    self.token = auth.token_of(handshake or HANDSHAKE)
    self.plain_handshake = plain_handshake or self.token is None
    _, port = split_addr(addr)
    host = kwargs.pop('host', None) or bind_host(addr)
    # portal's own handshake check is off (an empty one): `_recv` runs ours.
    super().__init__(port, name, host=host, ipv6=':' in host, handshake='',
                     **kwargs)

  def _log(self, *args, **kwargs):
    message = ' '.join(map(str, args))
    if message.startswith(self.ROUTINE) or (
        message.startswith('Closed connection') and (
            '(' not in message or any(g in message for g in self.GONE))):
      return
    super()._log(*args, **kwargs)

  def _accept(self, sock):
    now = time.monotonic()
    for conn in self.conns.values():
      if not hasattr(conn, 'opened'):  # Missed below (a replaced entry).
        conn.opened = now
    waiting = sorted((c for c in self.conns.values() if self._handshaking(c)),
                     key=lambda c: c.opened)
    for conn in waiting:
      if (now - conn.opened > self.HANDSHAKE_SECONDS
          or len(waiting) >= self.MAX_HANDSHAKING):
        waiting = waiting[1:]
        self._drop(conn, TimeoutError('no handshake in time'))
    try:
      super()._accept(sock)
    except OSError as e:  # EMFILE, ENFILE, ECONNABORTED, ...
      if waiting:
        self._drop(waiting[0], TimeoutError('room for a new connection'))
      else:
        now = time.monotonic()
        if now - getattr(self, '_accept_failed', 0.0) > 60:
          self._log(f'accept failed ({e}); pausing new connections')
        self._accept_failed = now
        time.sleep(0.05)  # The listener stays readable: do not spin.
      return
    conn = next(reversed(self.conns.values()))
    conn.opened = time.monotonic()

  def _handshaking(self, conn):
    return not getattr(conn, 'trusted', False)

  def send_reply(self, addr, reqnum, value):
    """Sends a method's result; False if the caller got an error instead
    (the result could not be packed) or nothing (it is gone)."""
    try:
      buffers = packlib.pack(packlib.tree_map(_contiguous, value))
    except Exception as e:
      return self.send_error(addr, reqnum, 4,
                        f'Could not pack reply: {type(e).__name__}: {e}')
    return self._send(addr, reqnum, _status(0), *buffers)

  def send_error(self, addr, reqnum, status, message):
    """Sends an error reply. Returns False (the call was not served)."""
    self._send(addr, reqnum, _status(status), message.encode('utf-8'))
    return False

  def _send(self, addr, *buffers):
    for _ in range(3):
      try:
        self.send(addr, *buffers)
        return True
      except RuntimeError as e:
        # ServerSocket.send counts queued messages by iterating its
        # connection table, which its own thread may resize meanwhile.
        if 'changed size' in str(e):
          continue
        print(f'{self.name}: could not send reply ({e})')
        return False
      except Exception as e:
        print(f'{self.name}: could not send reply ({type(e).__name__}: {e})')
        return False
    return False

  def _recv(self, conn):
    if self.nodelay and not getattr(conn, 'nodelay', False):
      conn.nodelay = True
      try:
        conn.sock.setsockopt(socketlib.IPPROTO_TCP, socketlib.TCP_NODELAY, 1)
      except OSError:
        pass
    if self._handshaking(conn):
      try:
        self._handshake(conn)
      except OSError as e:
        self._drop(conn, e)
      return
    try:
      super()._recv(conn)
    except AssertionError as e:
      self._drop(conn, ValueError(f'invalid frame length ({e})'))

  def _handshake(self, conn):
    """Reads what the peer sent of its handshake; answers a hello, and
    trusts or closes the connection once the handshake is complete."""
    got = conn.sock.recv(self._expected(conn) - len(conn.handshake))
    if not got:
      raise ConnectionResetError('closed during handshake')
    conn.handshake += got
    if len(conn.handshake) < self._expected(conn):
      return
    if self.token is not None and auth.is_hello(conn.handshake):
      self._challenge(conn)
    elif self.plain_handshake and hmac.compare_digest(
        conn.handshake, self.plain):
      conn.trusted = True
    else:
      self._disconnect(conn, ValueError(
          'wrong handshake (another run, no token, or a plain one, which '
          'takes plain_handshake)' if self.token else
          'wrong handshake (another run, or no token)'))

  def _expected(self, conn):
    """How many bytes of handshake the peer sends, as far as is known."""
    if self.token is None:
      return len(self.plain)
    if len(conn.handshake) < auth.PEEK:
      return auth.PEEK
    if auth.is_hello(conn.handshake):
      return auth.HELLO + (auth.PROOF if hasattr(conn, 'nonce') else 0)
    return len(self.plain) if self.plain_handshake else auth.PEEK

  def _challenge(self, conn):
    """Answers a complete hello, or checks the client's proof after it."""
    hello = conn.handshake[:auth.HELLO]
    if not hasattr(conn, 'nonce'):
      try:
        conn.nonce, answer = auth.answer(self.token, hello)
      except auth.Refused as e:
        return self._disconnect(conn, ValueError(f'wrong handshake ({e})'))
      # A new connection's send buffer takes these few bytes at once.
      if conn.sock.send(answer) < len(answer):
        self._disconnect(conn, ConnectionResetError('handshake not sent'))
    elif auth.proven(self.token, hello, conn.nonce,
                     conn.handshake[auth.HELLO:]):
      conn.trusted = True
    else:
      self._disconnect(conn, ValueError(
          'wrong handshake (a client without the run token)'))

  def _drop(self, conn, error):
    if self.conns.get(conn.addr) is conn:
      self._disconnect(conn, error)

  def _disconnect(self, conn, error):
    super()._disconnect(conn, error)
    self.disconnects += 1


def _status(code):
  return code.to_bytes(8, 'little')


def _contiguous(value):
  if isinstance(value, np.ndarray) and not value.flags.c_contiguous:
    return np.ascontiguousarray(value)
  return value
