"""The batch server's in-process transport: callers in the server's own
process (tests, notebooks, a user's own loop), without sockets or copies.

A `ThreadClient` hands its dict of numpy arrays to the server without a copy
(do not write to the arrays until the reply came) and gets a Future for the
reply: the value, RemoteError with the server's message for an error, or
portal's Disconnected when the client or the server closed first.
"""

import itertools
import queue
from concurrent.futures import Future

import numpy as np
from portal.client_socket import Disconnected

from .transport import LocalTransport, drain
from .wire import RemoteError


class ThreadTransport(LocalTransport):

  kind = 'thread'

  def __init__(self, method):
    super().__init__()
    self.method = method
    self._calls = queue.SimpleQueue()
    self._futures = {}  # (conn, reqnum) -> the caller's Future
    self._reqnums = itertools.count()

  def client(self):
    return ThreadClient(self, self._connect())

  def submit(self, conn, data):
    future = Future()
    reqnum = next(self._reqnums)
    with self._lock:
      if conn not in self.conns:
        raise Disconnected('the client or the server is closed')
      self._futures[conn, reqnum] = future
    self._calls.put((conn, reqnum, data))
    return future

  def receive(self, timeout):
    return [call for call in drain(self._calls, timeout)
            if self.admit(*call)]

  def reply(self, conn, reqnum, value):
    future = self._pop(conn, reqnum)
    if future is None:
      return False
    future.set_result(value)
    return True

  def error_reply(self, conn, reqnum, status, message):
    future = self._pop(conn, reqnum)
    if future is not None:
      future.set_exception(RemoteError(message))
    return False

  def disconnect(self, conn):
    with self._lock:
      if conn not in self.conns:
        return
      self.conns.discard(conn)
      self.disconnects += 1
      futures = [self._futures.pop(k) for k in list(self._futures)
                 if k[0] == conn]
    for future in futures:
      future.set_exception(Disconnected('the client closed'))

  def close(self, timeout):
    del timeout
    with self._lock:
      self._closed = True
      conns = list(self.conns)
    for conn in conns:
      self.disconnect(conn)

  def _pop(self, conn, reqnum):
    with self._lock:
      return self._futures.pop((conn, reqnum), None)


class ThreadClient:
  """An in-process caller of a BatchServer (`BatchServer.client()`)."""

  def __init__(self, transport, conn):
    self.transport = transport
    self.conn = conn

  def submit(self, data):
    """Queues a call (a dict of arrays; numpy scalars and lists become
    arrays, arrays are not copied); returns a Future of its reply."""
    if isinstance(data, dict):
      data = {k: np.asarray(v) for k, v in data.items()}
    return self.transport.submit(self.conn, data)

  def call(self, data, timeout=None):
    """Waits for the reply to one call."""
    return self.submit(data).result(timeout)

  def close(self):
    """Leaves the server: the env ids of this client are free again and
    its calls still waiting fail with Disconnected."""
    self.transport.disconnect(self.conn)

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()
