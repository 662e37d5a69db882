"""A futures client for portal's wire protocol: the agent's links to the
replay and logger servers, and the replay server's link to the logger.

portal.Client's socket thread busy-polls after some replies: it can stay in
its "writing" state with nothing left to send until the next call. Measured
on this project's runs, its loops took about two thirds of the agent
process's Python samples and half a core in the replay server, CPU that the
learner needs on a small machine. This client keeps what the runtime relies
on from portal.Client -- `client.method(*args)` returns a future, at most
`maxinflight` calls are outstanding (more block the caller), and it
reconnects by itself and resends the calls still in flight -- with one
receiver thread that sleeps in `select` until a reply arrives (waking twice
a second to see whether the client was closed). Should the receiver itself
fail, `error` says why, the calls in flight and every later call fail with
it, and the owner (the agent's health check) sees a dead link instead of
calls that never return. A connection that closes before its first reply
counts as refused (`wire.Refusals`): the next one waits longer.

A peer that stops answering (stopped, hung, its host gone) is told apart
from one that is only slow to reply (replay's limiter holding inserts back
while the learner compiles) by a heartbeat: while calls wait and the peer
is quiet, the client sends `PING`, which servers answer from their receive
loop, not their workers (portal's own servers answer it with an "unknown
method" error, which shows they are alive just as well). Quiet for
`peer_timeout / 6` is reported by name, for `peer_timeout` the link fails
with PeerStalled -- unless it is a `when_full='drop'` link, on which
nothing waits: that one only reports (its peer's supervisor restarts a
server that hangs). Time this process itself did not run (the whole run
SIGSTOPped, its machine suspended) is no silence of the peer's.

Locks: `_send_lock` orders every write to the socket (calls, and the resend
after a reconnect, so no call is sent twice on one connection); `_cond`
guards the table of calls in flight. The receiver never takes `_send_lock`
while it reads, so a caller blocked in a large send cannot stop replies from
being read.
"""

import concurrent.futures
import functools
import itertools
import socket
import threading
import time

from portal.client_socket import Disconnected

from . import wire
from .addresses import HANDSHAKE, PING, client_addr, describe


class Dropped(RuntimeError):
  """A call that a `when_full='drop'` client did not send."""


class PeerStalled(Disconnected):
  """The peer answered nothing, not even a heartbeat, for `peer_timeout`."""


class Client:
  """`when_full` says what a call does while `maxinflight` calls are
  outstanding: 'block' waits (back-pressure: transitions to replay), 'drop'
  returns a future failed with Dropped at once, counted in `dropped`
  (metrics to the logger: a logger that is down or slow must never hold up
  acting or training). `peer_timeout` (seconds; None: never) bounds how
  long the peer may stay silent while calls wait (the module says how)."""

  def __init__(self, addr, name='Client', maxinflight=16, when_full='block',
               handshake=HANDSHAKE, max_msg_size=2 ** 32, peer_timeout=None):
    if maxinflight < 1:
      raise ValueError(f'maxinflight must be >= 1, got {maxinflight}')
    if when_full not in ('block', 'drop'):
      raise ValueError(f"when_full must be 'block' or 'drop', not {when_full!r}")
    self.addr = client_addr(addr)
    self.name = name
    self.maxinflight = maxinflight
    self.when_full = when_full
    self.dropped = 0
    self.handshake = handshake
    self.max_msg_size = max_msg_size
    self._reqnums = itertools.count()
    self._inflight = {}  # reqnum -> (request parts, future), oldest first
    self._cond = threading.Condition()
    self._send_lock = threading.Lock()
    self._sock = None
    self._refusals = wire.Refusals(name)
    self._stop = threading.Event()
    self.error = None  # Why the receiver died; the link is dead then.
    self.peer_timeout = peer_timeout
    self._quiet = _Quiet(self)
    self._thread = threading.Thread(
        target=self._guard, name=f'{name}Receiver', daemon=True)
    self._thread.start()

  @property
  def connected(self):
    return self._sock is not None

  def __getattr__(self, name):
    if name.startswith('_'):
      raise AttributeError(name)
    return functools.partial(self.call, name)

  def call(self, method, *args):
    """Sends `method(*args)`; returns a concurrent.futures.Future of the
    result (an error reply raises RemoteError from `result()`). While
    `maxinflight` calls are outstanding it blocks or drops (`when_full`)."""
    future = concurrent.futures.Future()
    with self._cond:
      while len(self._inflight) >= self.maxinflight and not self._stop.is_set():
        if self.when_full == 'drop':
          self.dropped += 1
          future.set_exception(Dropped(
              f'{self.name}: {self.maxinflight} calls in flight, '
              f'{method} dropped'))
          return future
        self._cond.wait(0.2)
    reqnum = next(self._reqnums)
    parts = wire.request(reqnum, method, args)
    with self._send_lock:
      if self.error is not None:
        raise Disconnected(f'{self.name} failed: {self.error!r}')
      if self._stop.is_set():
        raise Disconnected(f'{self.name} is closed')
      with self._cond:
        if not self._inflight:
          self._quiet.waiting()
        self._inflight[reqnum] = (parts, future)
      if self._sock is not None:
        try:
          wire.send(self._sock, parts)
        except OSError:
          # The receiver sees the broken connection, reconnects and
          # resends this call with the others in flight.
          _shutdown(self._sock)
    return future

  def settle(self, timeout):
    """Waits up to `timeout` seconds until no call is in flight (every
    one answered or failed); True if none is left. Before a `close`, which
    fails what is still in flight and may cut off what is still being
    sent."""
    with self._cond:
      return self._cond.wait_for(lambda: not self._inflight, timeout)

  def close(self, timeout=None):
    """Stops the receiver; calls still in flight fail with Disconnected. A
    call blocked in its send (a peer that stopped reading) is cut off: the
    socket is shut down first, which ends the send with an error."""
    self._stop.set()
    sock = self._sock
    if sock is not None:
      _shutdown(sock)
    self._thread.join(timeout)
    self._fail_inflight(Disconnected(f'{self.name} closed'),
                        -1 if timeout is None else timeout)

  def _fail_inflight(self, error, wait=-1):
    """Fails the calls in flight. A send in progress (blocked, if the peer
    stopped reading) is cut off by shutting the socket down first, then
    waited for at most `wait` seconds (-1: until it ends)."""
    sock = self._sock
    if sock is not None:
      _shutdown(sock)
    locked = self._send_lock.acquire(timeout=wait)
    try:
      with self._cond:
        if self._sock is not None:
          self._sock.close()
          self._sock = None
        inflight, self._inflight = self._inflight, {}
        self._cond.notify_all()
    finally:
      if locked:
        self._send_lock.release()
    for _, future in inflight.values():
      future.set_exception(error)

  # ------------------------------------------------------------ receiver

  def _guard(self):
    try:
      self._receive()
    except Exception as error:
      self.error = error
      self._stop.set()  # Blocked callers wake up; later calls raise.
      self._fail_inflight(Disconnected(f'{self.name} failed: {error!r}'))

  def _receive(self):
    while not self._stop.is_set():
      if self._sock is None:
        self._quiet.wait(self._refusals.delay())
        if not self._connect():
          self._quiet.check()  # Raises PeerStalled if that ended it.
          return
        if self._sock is None:  # Lost again while resending: retry.
          self._stop.wait(0.1)
        continue
      try:
        frame = wire.recv(self._sock, self._quiet, self.max_msg_size,
                          self._quiet.poll)
      except (OSError, EOFError):
        self._refusals.closed()
        with self._send_lock:
          self._sock.close()
          self._sock = None
        continue
      if frame is None:
        self._quiet.check()
        return
      self._quiet.heard()
      self._refusals.answered()
      with self._cond:
        entry = self._inflight.pop(wire.reqnum_of(frame), None)
        self._cond.notify_all()
      if entry is None:
        continue  # A heartbeat's, or a reply to a call answered already.
      try:
        result = wire.reply(frame)[1]
      except Exception as error:  # An error reply, or one that won't unpack.
        entry[1].set_exception(error)
      else:
        entry[1].set_result(result)

  def _connect(self):
    """Connects (retrying until closed) and resends the calls in flight, in
    their order. Returns False if the client was closed first."""
    sock = wire.connect(self.addr, self.handshake, self._quiet)
    if sock is None:
      return False
    with self._send_lock:
      with self._cond:
        resend = [parts for parts, _ in self._inflight.values()]
      try:
        for parts in resend:
          wire.send(sock, parts)
      except OSError:
        sock.close()
        return True  # Lost again at once: the next round retries.
      self._sock = sock
      self._refusals.opened()
    return True


class _Quiet:
  """How long the peer has been silent while calls wait. The receiver waits
  on this instead of the client's stop event: `is_set` is also where the
  clock is read between polls, a heartbeat sent, a stall reported, and
  (past `peer_timeout`) the wait ended so that `check` raises PeerStalled."""

  def __init__(self, client):
    self.client = client
    self.since = time.monotonic()  # The last frame, or the first call after.
    self.looked = self.since  # The receiver's last look at the clock.
    self.pinged = 0.0
    self.reported = False
    self.stalled = None  # Seconds of silence that ended the link.
    timeout = client.peer_timeout
    self.poll = 0.5 if timeout is None else min(0.5, timeout / 12)

  def waiting(self):
    """A call was added to an empty table: the clock starts now."""
    self.since = time.monotonic()

  def heard(self):
    silence = time.monotonic() - self.since
    if self.reported:
      print(f'{self.client.name}: {describe(self.client.addr)} answers '
            f'again after '
            f'{silence:.0f} s.', flush=True)
    self.since, self.reported = time.monotonic(), False

  def is_set(self):
    client = self.client
    now = time.monotonic()
    unseen, self.looked = now - self.looked, now
    if unseen > max(5.0, 10 * self.poll):
      # This process did not run (SIGSTOPped with its run, its machine
      # suspended): no one ran to answer, so that time is no silence. (A
      # look waits at most a poll, or a connect's 1 s timeouts.)
      self.since += unseen
    if client._stop.is_set():
      return True
    if client.peer_timeout is None or not client._inflight:
      return False
    silence = now - self.since
    if silence >= client.peer_timeout and client.when_full == 'block':
      self.stalled = silence
      return True
    if silence >= client.peer_timeout / 6 and not self.reported:
      self.reported = True
      then = (f'; the link fails after {client.peer_timeout:g} s '
              '(run.peer_timeout)' if client.when_full == 'block' else '')
      print(f'{client.name}: {describe(client.addr)} has answered nothing for '
            f'{silence:.0f} s ({len(client._inflight)} calls waiting){then}.',
            flush=True)
    interval = client.peer_timeout / 12
    if silence >= interval and now - self.pinged >= interval:
      self.pinged = now
      self._ping()
    return False

  def wait(self, seconds):
    """Sleeps up to `seconds`, in steps short enough to keep the clock."""
    deadline = time.monotonic() + seconds
    while not self.is_set() and time.monotonic() < deadline:
      self.client._stop.wait(
          min(self.poll, max(0.0, deadline - time.monotonic())))
    return self.is_set()

  def check(self):
    if self.stalled is not None:
      raise PeerStalled(
          f'{describe(self.client.addr)} answered nothing, not even a '
          f'heartbeat, for '
          f'{self.stalled:.0f} s (run.peer_timeout '
          f'{self.client.peer_timeout:g} s)')

  def _ping(self):
    """Sends a heartbeat unless a send is in progress (which, blocked,
    already shows the peer stopped reading)."""
    client = self.client
    if client._sock is None or not client._send_lock.acquire(blocking=False):
      return
    try:
      wire.send(client._sock, wire.request(next(client._reqnums), PING, ()))
    except OSError:
      pass  # The next read sees the broken connection.
    finally:
      client._send_lock.release()


def _shutdown(sock):
  try:
    sock.shutdown(socket.SHUT_RDWR)
  except OSError:
    pass
