"""A batch-server transport over multiprocessing queues, for callers in
processes that this process starts (TorchRL's MPTransport).

  transport = MPTransport()                 # in the server's process
  server = BatchServer(addr, handler, cutoff, transports=[transport])
  client = transport.client()               # before the process starts
  ctx.Process(target=work, args=(client,)).start()
  reply = client.call(obs)                  # in that process

Calls of every client go through one queue to the server; each client has
a reply queue of its own. A client reaches another process only as an
argument of a process it starts (multiprocessing's rule for its queues),
so it is made in the server's process first. `client.close()` frees its
env ids at once; a client whose process dies without closing keeps them
until `expire` seconds without a call have passed. Closing the transport
wakes every waiting caller with Disconnected; errors come back as
RemoteError with the server's message. Replies are pickled: for callers
on the server's host, the 'shm' transport copies less.
"""

import multiprocessing
import queue
import time

import numpy as np
from portal.client_socket import Disconnected

from .transport import LocalTransport, drain
from .wire import RemoteError

_CLOSE = -1  # the reqnum of a client's goodbye
_GONE = -2  # the reqnum of the server's goodbye to a waiting client


class MPTransport(LocalTransport):

  kind = 'mp'

  def __init__(self, ctx=None, method='act', expire=60.0):
    """`ctx`: the multiprocessing context of the callers' processes
    (default 'spawn', which never inherits the server's threads)."""
    super().__init__()
    self.ctx = ctx or multiprocessing.get_context('spawn')
    self.method = method
    self.expire = expire
    self._calls = self.ctx.Queue()
    self._replies = {}  # conn -> that client's reply queue
    self._heard = {}  # conn -> time.monotonic() of its latest call

  def client(self):
    """A new caller, to hand to a process this process starts."""
    def setup(conn):
      self._replies[conn] = self.ctx.Queue()
      self._heard[conn] = time.monotonic()
    conn = self._connect(setup)
    return MPClient(self._calls, self._replies[conn], conn)

  def receive(self, timeout):
    self._expire()
    calls = []
    for conn, reqnum, data in drain(self._calls, timeout):
      if conn not in self.conns:
        continue  # Closed, or expired: its calls are dropped.
      if reqnum == _CLOSE:
        self._disconnect(conn)
        continue
      self._heard[conn] = time.monotonic()
      if self.admit(conn, reqnum, data):
        calls.append((conn, reqnum, data))
    return calls

  def reply(self, conn, reqnum, value):
    return self._send(conn, (reqnum, True, value))

  def error_reply(self, conn, reqnum, status, message):
    del status
    return self._send(conn, (reqnum, False, message))

  def close(self, timeout):
    del timeout
    with self._lock:
      self._closed = True
    for conn in list(self.conns):
      self._send(conn, (_GONE, False, 'the server closed'))
      self._disconnect(conn)
    self._calls.cancel_join_thread()
    self._calls.close()

  def _send(self, conn, message):
    replies = self._replies.get(conn)
    if replies is None:
      return False
    replies.put(message)
    return True

  def _disconnect(self, conn):
    with self._lock:
      if conn not in self.conns:
        return
      self.conns.discard(conn)
      self.disconnects += 1
      self._heard.pop(conn, None)
      replies = self._replies.pop(conn)
    replies.cancel_join_thread()
    replies.close()

  def _expire(self):
    now = time.monotonic()
    for conn, heard in list(self._heard.items()):
      if now - heard > self.expire:
        self._disconnect(conn)


class MPClient:
  """A caller of a BatchServer through its MPTransport (picklable while
  its process starts; one call at a time)."""

  def __init__(self, calls, replies, conn):
    self.calls = calls
    self.replies = replies
    self.conn = conn
    self.reqnum = 0

  def call(self, data, timeout=None):
    """The reply to one call (a dict of arrays); RemoteError with the
    server's message, TimeoutError after `timeout` seconds, Disconnected
    once the server closed."""
    self.reqnum += 1
    data = {k: np.asarray(v) for k, v in data.items()}
    self.calls.put((self.conn, self.reqnum, data))
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
      left = None if deadline is None else max(
          0.0, deadline - time.monotonic())
      try:
        reqnum, ok, value = self.replies.get(timeout=left)
      except queue.Empty:
        raise TimeoutError(f'no reply within {timeout} s') from None
      if reqnum == _GONE:
        raise Disconnected(value)
      if reqnum == self.reqnum:  # Not the late reply of a timed-out call.
        break
    if not ok:
      raise RemoteError(value)
    return value

  def close(self):
    """Leaves the server: its env ids are free again."""
    self.calls.put((self.conn, _CLOSE, None))
