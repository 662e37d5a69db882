"""What a transport of the batch server is: the interface a user implements
to bring calls in by another route (queues, Ray, a message bus), as
TorchRL's InferenceTransport. The built-in ones are `TcpTransport` (any
host, portal's protocol), `ShmTransport` (this host, shared-memory slots)
and `ThreadTransport` (this process).

The server runs one receive thread per transport, calling `receive` in a
loop, and answers from its worker threads with `reply` or `error_reply`.
One transport carries the calls of one method (`BatchServer`'s `method`).

  kind         a short name, unique among a server's transports (stats,
               thread names)
  conns        the ids of the open connections: hashable, and never equal
               to another transport's (tag them, e.g. ('mine', n)); a call
               from a conn that is not in it any more is dropped
  disconnects  a count that grows with every connection that closes (a dead
               peer included): the server then frees that connection's env
               ids and drops its queued calls
  refused      calls the transport answered with an error itself (a
               malformed call never reaches the server)
  error        why the transport stopped working, else None: the server
               fails then, and every queued caller gets the error

  receive(timeout) -> [(conn, reqnum, data)]   the calls that arrived within
      `timeout` seconds (wait at most that long); `data` is a dict of numpy
      arrays, kept untouched until its reply is sent
  reply(conn, reqnum, value) -> bool           sends a reply (a dict of
      numpy arrays); False if that caller is gone
  error_reply(conn, reqnum, status, message) -> bool   the same for an
      error (status 1 too short, 2 undecodable, 3 unknown method, 4 bad
      argument or handler error)
  shutdown()       takes no new calls (replies still go out)
  close(timeout)   lets go of everything; a second call does nothing

A client is whatever the transport's callers use; the built-in ones are
`BlockingClient` / `portal.Client`, `ShmClient` and `ThreadClient`.
"""

import abc
import itertools
import queue
import threading

from portal.client_socket import Disconnected

from .server_socket import check_args

ATTRIBUTES = ('kind', 'conns', 'disconnects', 'refused', 'error')
METHODS = ('receive', 'reply', 'error_reply', 'shutdown', 'close')


class Transport(abc.ABC):
  """A base for a user's transport: the methods a subclass must write, and
  defaults for the rest (it sets `conns` and counts `disconnects`)."""

  kind = 'custom'

  def __init__(self):
    self.conns = set()
    self.disconnects = 0
    self.refused = 0
    self.error = None

  @abc.abstractmethod
  def receive(self, timeout):
    """The calls that arrived within `timeout` seconds."""

  @abc.abstractmethod
  def reply(self, conn, reqnum, value):
    """Sends `value` to the call; False if its caller is gone."""

  @abc.abstractmethod
  def error_reply(self, conn, reqnum, status, message):
    """Sends an error to the call; False if its caller is gone."""

  def admit(self, conn, reqnum, data):
    """Whether `data` is a dict of numpy arrays; if not, the call is
    refused (an error reply to its caller, counted in `refused`)."""
    problem = check_args([data])
    if problem is None:
      return True
    self.refused += 1
    self.error_reply(conn, reqnum, 4, (
        f'{self.method}() expects a dict of numpy arrays; got {problem}'))
    return False

  def shutdown(self):
    """Takes no new calls."""

  def close(self, timeout):
    """Lets go of everything; a second call does nothing."""


class LocalTransport(Transport):
  """The base of the transports whose callers the server makes itself
  (`client()`: threads of this process, or processes it starts): each
  caller's connection is registered under the transport's lock, until
  `shutdown`."""

  def __init__(self):
    super().__init__()
    self._lock = threading.Lock()
    self._closed = False
    self._ids = itertools.count()

  def _connect(self, setup=None):
    """A new caller's connection id, (kind, n), in `conns` (with
    `setup(conn)` run under the same lock); Disconnected once closed."""
    with self._lock:
      if self._closed:
        raise Disconnected('the server is closed')
      conn = (self.kind, next(self._ids))
      if setup is not None:
        setup(conn)
      self.conns.add(conn)
    return conn

  def shutdown(self):
    with self._lock:
      self._closed = True


def drain(calls, timeout, most=256):
  """Up to `most` items of the queue `calls`: the first within `timeout`
  seconds (else none), then those already there."""
  try:
    items = [calls.get(timeout=timeout)]
  except queue.Empty:
    return []
  while len(items) < most:
    try:
      items.append(calls.get_nowait())
    except queue.Empty:
      break
  return items


def missing(transport):
  """The names of the interface that `transport` lacks (empty if none)."""
  return [name for name in ATTRIBUTES + METHODS
          if not hasattr(transport, name)
          or (name in METHODS and not callable(getattr(transport, name)))]
