"""A batch-server transport over Ray, for env clients on Ray workers whose
nodes cannot open sockets to each other (only to Ray).

  transport = RayTransport()                # in the server's process
  server = BatchServer(addr, handler, cutoff, transports=['tcp', transport])
  client = transport.client()               # picklable: send it to a worker
  action = client.call(obs)                 # on the worker

Calls go through a Ray actor, the inbox, that the transport owns: a client
call is one Ray call that returns the reply; the server takes the queued
calls in batches and hands each reply back to the inbox. A client that
closes frees its env ids at once; one that dies without closing (its worker
killed) is dropped after `expire` seconds without a call. Closing the
transport kills the inbox; waiting callers then get Ray's RayActorError.
Errors come back as RemoteError with the server's message.
"""

import itertools
import time
import uuid

import numpy as np

from .transport import Transport
from .wire import RemoteError


class RayTransport(Transport):

  kind = 'ray'

  def __init__(self, method='act', expire=60.0, name=None, **options):
    """`name` names the inbox (a Ray named actor, so clients elsewhere can
    find it); `options` are Ray actor options for it (e.g. resources)."""
    import ray
    super().__init__()
    self.method = method
    if name is not None:
      options['name'] = name
    self.inbox = ray.remote(_Inbox).options(**options).remote(expire)
    self._closed = False

  def client(self):
    """A new client of this server (picklable, for a Ray task or actor)."""
    return RayClient(self.inbox)

  def receive(self, timeout):
    import ray
    if self._closed:
      time.sleep(timeout)
      return []
    try:
      calls, gone = ray.get(self.inbox.take.remote(timeout))
    except Exception as error:  # The inbox died: this transport is done.
      if not self._closed:
        self.error = error
      return []
    for conn in gone:
      if conn in self.conns:
        self.conns.discard(conn)
        self.disconnects += 1
    self.conns.update(conn for conn, _, _ in calls)
    return [call for call in calls if self.admit(*call)]

  def reply(self, conn, reqnum, value):
    if conn not in self.conns:
      return False
    self.inbox.answer.remote(conn, reqnum, True, value)
    return True

  def error_reply(self, conn, reqnum, status, message):
    self.inbox.answer.remote(conn, reqnum, False, message)
    return conn in self.conns

  def shutdown(self):
    self.inbox.shutdown.remote()

  def close(self, timeout):
    import ray
    if self._closed:
      return
    self._closed = True
    try:
      ray.get(self.inbox.shutdown.remote(), timeout=timeout)
    except Exception:  # Already gone: nothing to let go of.
      pass
    ray.kill(self.inbox)


class RayClient:
  """A caller of a BatchServer through its RayTransport's inbox."""

  def __init__(self, inbox):
    self.inbox = inbox
    self.conn = ('ray', uuid.uuid4().hex)

  def submit(self, data):
    """Sends a call (a dict of arrays; numpy scalars and lists become
    arrays); returns its Ray ObjectRef."""
    if isinstance(data, dict):
      data = {k: np.asarray(v) for k, v in data.items()}
    return self.inbox.call.remote(self.conn, data)

  def call(self, data, timeout=None):
    """Waits for the reply to one call: the value, or RemoteError with the
    server's message."""
    import ray
    ok, value = ray.get(self.submit(data), timeout=timeout)
    if not ok:
      raise RemoteError(value)
    return value

  def close(self):
    """Leaves the server: the env ids of this client are free again."""
    import ray
    ray.get(self.inbox.disconnect.remote(self.conn))

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()


class _Inbox:
  """The Ray actor between clients and the server (an asyncio actor: every
  waiting call is a coroutine, not a thread)."""

  def __init__(self, expire):
    import asyncio
    self.asyncio = asyncio
    self.expire = expire
    self.calls = asyncio.Queue()
    self.waiting = {}  # (conn, reqnum) -> the caller's asyncio Future
    self.seen = {}  # conn -> time of its latest call
    self.gone = []  # conns closed or expired, not yet told to the server
    self.reqnums = itertools.count()
    self.closed = False

  async def call(self, conn, data):
    if self.closed:
      return False, 'the server is closed'
    reqnum = next(self.reqnums)
    future = self.asyncio.get_running_loop().create_future()
    self.waiting[conn, reqnum] = future
    self.seen[conn] = time.monotonic()
    self.calls.put_nowait((conn, reqnum, data))
    return await future

  async def take(self, timeout):
    """The queued calls (waiting up to `timeout` for the first) and the
    conns gone since the last take."""
    calls = []
    try:
      calls.append(await self.asyncio.wait_for(self.calls.get(), timeout))
    except self.asyncio.TimeoutError:
      pass
    while calls and len(calls) < 256 and not self.calls.empty():
      calls.append(self.calls.get_nowait())
    now = time.monotonic()
    busy = {conn for conn, _ in self.waiting}
    for conn, seen in list(self.seen.items()):
      if now - seen > self.expire and conn not in busy:
        self._drop(conn, 'expired')
    gone, self.gone = self.gone, []
    return [c for c in calls if c[0] not in gone], gone

  async def answer(self, conn, reqnum, ok, value):
    future = self.waiting.pop((conn, reqnum), None)
    if future is not None and not future.done():
      future.set_result((ok, value))

  async def disconnect(self, conn):
    self._drop(conn, 'the client closed')

  async def shutdown(self):
    self.closed = True

  def _drop(self, conn, why):
    self.seen.pop(conn, None)
    self.gone.append(conn)
    for key in [k for k in self.waiting if k[0] == conn]:
      future = self.waiting.pop(key)
      if not future.done():
        future.set_result((False, why))
