"""An RPC server for portal's clients whose threads sleep while no call comes.

portal.Server's loop polls its socket and its running jobs every 0.1 ms, so
even an idle replay or logger server keeps about a seventh of a core busy:
on a 2-core machine, CPU the learner needs. This server serves the same
calls -- `bind(name, fn, workers)`, portal's framing, an error to the one
caller whose call failed -- with a receive thread blocked on the socket and
worker threads blocked on their queues.

Each bound method runs on a pool: its own of `workers` threads, or the
server's shared pool. A pool starts calls in arrival order, so a one-thread
pool serves its methods one call at a time, in order (the replay's
`add_batch` sees each env's steps in order; the logger's `add` and `transitions`
never overlap). A heartbeat (`addresses.PING`) is answered by the receive
thread itself, so a client can tell a busy server from a stopped one.
"""

import collections
import functools
import queue
import threading
import time
import traceback

from .addresses import PING
from .server_socket import BadCall, ServerSocket, parse_call
from .wire import failure


class Server:
  """`quiet`: exception types a method may raise as part of its contract
  (e.g. the replay's Closing at shutdown): the caller gets them like any
  error, without a log line here."""

  def __init__(self, addr, name, workers=1, quiet=(), **socket_kwargs):
    self.name = name
    self.quiet = tuple(quiet)
    self.socket = ServerSocket(addr, name, **socket_kwargs)
    self.shared = _Pool(f'{name}Worker', workers)
    self.pools = [self.shared]
    self.methods = {}  # name -> (function, pool)
    self._counts = collections.Counter()
    self._lock = threading.Lock()
    self._running = False
    self._closed = False
    self._failed = None  # The receive loop's exception; serving stopped.
    self._receiver = threading.Thread(
        target=self._guard, name=f'{name}Recv', daemon=True)

  @property
  def error(self):
    """Why serving stopped (the socket's thread or the receive loop died),
    else None. The owner must end its process then: it serves no one."""
    return self._failed or self.socket.error

  def bind(self, method, function, workers=None):
    """Serves `method` with `function`, on a pool of its own with `workers`
    threads, or on the shared pool."""
    assert not self._running, 'bind before start'
    pool = self.shared
    if workers is not None:
      pool = _Pool(f'{self.name}{method}', workers)
      self.pools.append(pool)
    self.methods[method] = (function, pool)

  def start(self):
    self._running = True
    for pool in self.pools:
      pool.start()
    self._receiver.start()
    return self

  def close(self, timeout=5.0):
    """Stops reading calls, lets the accepted ones run and reply (for up to
    `timeout` seconds), then closes the socket."""
    if self._closed:
      return
    self._closed = True
    deadline = time.monotonic() + timeout
    remaining = lambda: max(0.0, deadline - time.monotonic())
    started, self._running = self._running, False
    self.socket.shutdown()
    if started:
      self._receiver.join(remaining())
      for pool in self.pools:
        pool.close(deadline)
    self.socket.close(remaining())

  def stats(self):
    """Calls received, replies and errors sent since the last call; calls
    accepted but not finished."""
    with self._lock:
      counts, self._counts = self._counts, collections.Counter()
    return {
        'requests': counts['requests'], 'replies': counts['replies'],
        'errors': counts['errors'],
        'pending': sum(pool.pending for pool in self.pools)}

  def _guard(self):
    try:
      self._receive()
    except Exception as e:
      self._failed = e

  def _receive(self):
    while self._running:
      try:
        calls = self.socket.receive(timeout=0.2)
      except TimeoutError:
        continue
      for addr, msg in calls:
        self._serve(addr, msg)

  def _serve(self, addr, msg):
    """Answers a bad call or a ping here; queues any other call on its
    method's pool."""
    try:
      reqnum, method, args = parse_call(msg)
    except BadCall as e:
      self._refuse(addr, e)
      return
    if method == PING:  # Answered here, even while every worker waits.
      self.socket.send_reply(addr, reqnum, None)
      return
    if method not in self.methods:
      self._refuse(addr, BadCall(reqnum, 3, f'Unknown method {method}'))
      return
    self._count('requests')
    function, pool = self.methods[method]
    pool.submit(functools.partial(
        self._call, method, function, addr, reqnum, args))

  def _refuse(self, addr, error):
    self._count('requests')
    self._count('errors')
    self.socket.send_error(addr, error.reqnum, error.status, str(error))

  def _call(self, method, function, addr, reqnum, args):
    try:
      result = function(*args)
    except Exception as e:
      message = failure(method, type(e).__name__, e)
      if not isinstance(e, self.quiet):
        print(f'[{self.name}] {message}', flush=True)
      self._count('errors')
      self.socket.send_error(addr, reqnum, 4, message)
      return
    self._count('replies' if self.socket.send_reply(addr, reqnum, result)
                else 'errors')

  def _count(self, key):
    with self._lock:
      self._counts[key] += 1


class _Pool:
  """Threads that run submitted calls, started in arrival order."""

  def __init__(self, name, workers):
    if workers < 1:
      raise ValueError(f'workers must be >= 1, got {workers}')
    self.queue = queue.SimpleQueue()
    self.threads = [
        threading.Thread(target=self._work, name=f'{name}{i}', daemon=True)
        for i in range(workers)]
    self.pending = 0  # Submitted and not finished.
    self._lock = threading.Lock()

  def start(self):
    for thread in self.threads:
      thread.start()

  def submit(self, job):
    with self._lock:
      self.pending += 1
    self.queue.put(job)

  def close(self, deadline):
    """Runs the calls already submitted, then stops (waits until
    `deadline`, a time.monotonic() value)."""
    for _ in self.threads:
      self.queue.put(None)
    for thread in self.threads:
      thread.join(max(0.0, deadline - time.monotonic()))

  def _work(self):
    while (job := self.queue.get()) is not None:
      try:
        job()
      except Exception:  # A failed reply must not end the pool.
        traceback.print_exc()
      finally:
        with self._lock:
          self.pending -= 1
