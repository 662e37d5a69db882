"""The server side of portal's wire protocol, on a hardened portal socket.

Both of the project's servers read calls and send replies through this: the
batch server (`batch_server.py`, the actor) and the RPC server (`server.py`,
replay and logger). A call is (8-byte request number, 8-byte method-name
length, method name, portal's packed args); a reply is (request number,
8-byte status, packed result or, for status != 0, an error message):

  status 1  message too short      status 3  unknown method
  status 2  could not decode it    status 4  bad argument or method error
"""

import collections
import hmac
import os
import queue
import selectors
import socket as socketlib
import sys
import threading
import time

import numpy as np
import portal

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
  handshake or a broken frame is still printed, the first LOG_BURST of
  each LOG_PERIOD seconds, then how many more there were.

  The socket thread's loop is this class's own (`_loop`): upstream's
  retries a write that fails for good (e.g. of more than 1,024 buffers)
  for ever, so the connection's later replies never leave, and it caps
  the replies queued for all connections together, so one client that
  never reads its replies makes every other lose theirs. Here replies go
  out as `wire.Frame`s, a failed write closes its connection, and each
  connection may queue `max_send_queue` replies: a connection past that
  is closed (its client reconnects and resends its calls), the others are
  unaffected. Likewise upstream stops its socket thread (serving no one)
  once `max_recv_queue` calls of all connections together wait to be taken;
  here that limit is per connection, and a connection past it is closed.
  The loop checks the handshake deadlines every TICK seconds, so that they
  hold while no one else connects.

  Calls too: upstream reads a call's length and body in two rounds of the
  loop and queues each call alone (a lock and a wake-up each); here a
  connection is read until it would block (READ_BURST calls or READ_BYTES
  at most) and a round's calls are queued as one list, which `receive`
  returns (portal's `recv`, a call at a time, is not served).
  """

  HANDSHAKE_SECONDS = 10.0
  MAX_HANDSHAKING = 64
  LOG_BURST = 5
  LOG_PERIOD = 60.0
  TICK = 0.2  # Seconds between the loop's checks of deadlines.
  READ_BURST = 16  # Calls read from one connection in one round at most.
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
    self._problems = LogLimit(
        lambda line: super(ServerSocket, self)._log(line),
        self.LOG_BURST, self.LOG_PERIOD)
    self.max_recv_queue = kwargs.pop('max_recv_queue', None) or (
        portal.server_socket.Options.max_recv_queue)
    self._received = collections.Counter()  # addr -> calls not yet taken
    self._received_lock = threading.Lock()
    self._inbox = queue.SimpleQueue()  # lists of (addr, call), a round's
    self._round = []  # the calls read in the loop's current round
    self._pending = set()  # connections with frames to write, or to drop
    _, port = split_addr(addr)
    host = kwargs.pop('host', None) or bind_host(addr)
    # portal's own handshake check is off (an empty one): `_recv` runs ours.
    super().__init__(port, name, host=host, ipv6=':' in host, handshake='',
                     max_recv_queue=sys.maxsize, **kwargs)  # (Ours counts.)

  def _log(self, *args, **kwargs):
    message = ' '.join(map(str, args))
    if message.startswith(self.ROUTINE) or (
        message.startswith('Closed connection') and (
            '(' not in message or any(g in message for g in self.GONE))):
      return
    if message.startswith('Closed connection'):
      self._problems(message, message[message.index('(') + 1:-1])
      return
    super()._log(*args, **kwargs)

  def _loop(self):
    try:
      ticked = 0.0
      while self.running or self._numsending():
        for key, mask in self.sel.select(timeout=self.TICK):
          if key.data == 'signal':
            os.read(self.get_signal, 4096)
          elif key.data is None:
            if self.reading:
              self._accept(key.fileobj)
          elif (mask & selectors.EVENT_READ and self.reading
                and self.conns.get(key.data.addr) is key.data):
            self._recv(key.data)  # (Unless closed earlier in this round.)
        if self._round:
          self._inbox.put(self._round)
          self._round = []
        # Only those `send` queued for, not a scan of every connection on
        # every wake: taken out before the flush, so that a frame queued
        # meanwhile (`send` appends, then adds) stays.
        for conn in list(self._pending):
          self._pending.discard(conn)
          if self.conns.get(conn.addr) is conn:
            self._flush(conn)
            if conn.sendbufs:
              self._pending.add(conn)
        if time.monotonic() - ticked >= self.TICK:
          ticked = time.monotonic()
          self._waiting(ticked)
          self._problems.flush(ticked)
    except Exception as e:
      # After `close`: the sockets and selector it closed under a loop
      # still flushing (its wait for the loop timed out), not a failure.
      if self.running:
        self.error = e

  def _flush(self, conn):
    """Writes `conn`'s queued frames until the kernel takes no more, and
    has the loop woken when it takes more. A write that fails other than
    for room closes the connection: retrying it would fail again."""
    if getattr(conn, 'overflowed', False):
      self._drop(conn, BufferError(
          f'{self.options.max_send_queue} replies queued; the client does '
          'not read them'))
      return
    try:
      while conn.sendbufs:
        conn.sendbufs[0].send(conn.sock)
        if conn.sendbufs[0].done():
          conn.sendbufs.popleft()
    except BlockingIOError:
      pass
    except OSError as e:
      self._drop(conn, e)
      return
    events = selectors.EVENT_READ | (
        selectors.EVENT_WRITE if conn.sendbufs else 0)
    if events != getattr(conn, 'events', selectors.EVENT_READ):
      self.sel.modify(conn.sock, events, conn)
    conn.events = events

  def _waiting(self, now):
    """Closes the connections past their handshake deadline; returns those
    still handshaking, oldest first."""
    for conn in self.conns.values():
      if not hasattr(conn, 'opened'):  # Missed in _accept (a replaced entry).
        conn.opened = now
    waiting = sorted((c for c in self.conns.values() if self._handshaking(c)),
                     key=lambda c: c.opened)
    late = [c for c in waiting if now - c.opened > self.HANDSHAKE_SECONDS]
    for conn in late:
      self._drop(conn, TimeoutError('no handshake in time'))
    return waiting[len(late):]

  def _accept(self, sock):
    waiting = self._waiting(time.monotonic())
    while len(waiting) >= self.MAX_HANDSHAKING:
      self._drop(waiting.pop(0), TimeoutError('too many handshakes waiting'))
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
    wire.keep_alive(conn.sock)

  def _handshaking(self, conn):
    """Whether `conn` has yet to pass its handshake."""
    return not getattr(conn, 'trusted', False)

  def send_reply(self, addr, reqnum, value):
    """Sends a method's result; False if the caller got an error instead
    (the result could not be packed) or nothing (it is gone)."""
    try:
      buffers = wire.pack(value)
    except Exception as e:
      return self.send_error(addr, reqnum, 4,
                        f'Could not pack reply: {type(e).__name__}: {e}')
    return self.send(addr, reqnum, _status(0), *buffers)

  def send_error(self, addr, reqnum, status, message):
    """Sends an error reply. Returns False (the call was not served)."""
    self.send(addr, reqnum, _status(status), message.encode('utf-8'))
    return False

  def send(self, addr, *buffers):
    """Queues one frame for `addr`; False if that connection is gone, or
    has `max_send_queue` frames queued (the loop then closes it)."""
    if self.error:
      print(f'{self.name}: could not send reply ({self.error!r})')
    conn = self.conns.get(addr) if self.running and not self.error else None
    if conn is None or getattr(conn, 'overflowed', False):
      return False
    full = len(conn.sendbufs) >= self.options.max_send_queue
    if full:
      conn.overflowed = True  # The loop closes the connection.
    else:
      conn.sendbufs.append(wire.Frame(buffers))
    self._pending.add(conn)
    os.write(self.set_signal, bytes(1))
    return not full

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
    with self._received_lock:
      room = self.max_recv_queue - self._received[conn.addr]
    if room <= 0:
      self._drop(conn, BufferError(
          f'{self.max_recv_queue} calls wait to be taken; the client sends '
          'more than it waits for'))
      return
    calls, error = _read_calls(conn, self.options.max_msg_size,
                               min(room, self.READ_BURST))
    if calls:  # Served even when the peer closed right after sending them.
      with self._received_lock:
        self._received[conn.addr] += len(calls)
      self._round += [(conn.addr, call) for call in calls]
    if error is not None:
      self._drop(conn, error)

  def receive(self, timeout=None):
    """The calls of the next socket round, and of any others queued
    behind it: [(the connection's address, the call's bytes)]. Raises
    TimeoutError after `timeout` seconds without one (0: no wait)."""
    if self.error:
      raise self.error
    try:
      calls = self._inbox.get(block=timeout != 0, timeout=timeout)
    except queue.Empty:
      raise TimeoutError from None
    try:
      while True:
        calls += self._inbox.get_nowait()
    except queue.Empty:
      pass
    with self._received_lock:  # (A Counter's -= drops the zeros.)
      self._received -= collections.Counter(addr for addr, _ in calls)
    return calls

  def recv(self, timeout=None):
    raise NotImplementedError('calls are read with receive(), a list at once')

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


class LogLimit:
  """Writes the first `burst` lines of each `period` seconds; at the end
  of a period (`flush`), one line says how many more there were, by kind,
  so that a flood of refused connections cannot flood the log."""

  def __init__(self, write, burst, period):
    self.write = write
    self.burst = burst
    self.period = period
    self.start = time.monotonic()
    self.written = 0
    self.held = collections.Counter()  # kind -> lines not written

  def __call__(self, line, kind):
    if self.written < self.burst:
      self.written += 1
      self.write(line)
    else:
      self.held[kind] += 1

  def flush(self, now):
    if now - self.start < self.period:
      return
    if self.held:
      kinds = ', '.join(f'{n} x {kind}' for kind, n in self.held.items())
      self.write(f'{sum(self.held.values())} more like these in the last '
                 f'{now - self.start:.0f} s: {kinds}')
    self.start, self.written, self.held = now, 0, collections.Counter()


READ_BYTES = 1 << 20  # Of one connection per round: then the others' turn.


def _read_calls(conn, max_size, burst, budget=READ_BYTES):
  """(the calls `conn` completes now, why it must close or None), reading
  until it would block or `burst` calls or `budget` bytes are read; a
  partial call waits on `conn`. It must close at the peer's close, a
  length outside [1, max_size] (ValueError) or another OSError."""
  calls = []
  read = 0
  try:
    while len(calls) < burst and read < budget:
      if getattr(conn, 'body', None) is None:
        head = getattr(conn, 'head', b'')
        got = conn.sock.recv(8 - len(head))
        if not got:
          raise ConnectionResetError('closed by the peer')
        conn.head = head + got
        if len(conn.head) < 8:
          continue
        size = int.from_bytes(conn.head, 'little')
        if not 1 <= size <= max_size:
          raise ValueError(f'invalid frame length {size}')
        conn.head, conn.pos = b'', 0
        conn.body = memoryview(np.empty(size, np.uint8).data)
      got = conn.sock.recv_into(conn.body[conn.pos:])
      if not got:
        raise ConnectionResetError('closed by the peer')
      conn.pos += got
      read += got
      if conn.pos == len(conn.body):
        calls.append(conn.body)
        conn.body = None
  except BlockingIOError:
    pass
  except (OSError, ValueError) as e:
    return calls, e
  return calls, None


def _status(code):
  return code.to_bytes(8, 'little')
