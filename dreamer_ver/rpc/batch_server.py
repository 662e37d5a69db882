"""A batch server whose cutoff is a policy, not a fixed size.

portal.BatchServer dispatches only when exactly N requests are queued, so
stragglers hold back everyone and fewer live clients than N hang it. This
server keeps its own queue and asks a cutoff policy when the queue becomes a
batch. Calls reach it through one or more transports at once:

  tcp     portal's protocol on a hardened portal socket (`tcp_transport.py`):
          any host; an unmodified `portal.Client` talks to it (errors arrive
          as RuntimeError, a closed server as Disconnected)
  shm     shared-memory slots on the server's host (`shm.py`): no
          serialisation, a 13-byte message per call
  thread  in-process callers (`thread_transport.py`)

  receive thread per transport:  calls -> Requests -> their lane's queue
  worker threads:   cutoff.decide(pending) -> handler(batch) -> replies
                    -> cutoff.observe_*(...) -> postfn(batch, context)

A transport is any object with the interface of `transport.Transport`
(its docstring is the contract): the built-in ones by name, or a user's
own, e.g. over multiprocessing queues or Ray.

A cutoff policy is any object with these methods (the actor's preemption
module provides them; all calls happen under the server's lock, with times
from time.monotonic(), so a policy needs no locking and no clock of its own):

  decide(pending, now) -> (count, reason) to dispatch the `count` oldest
      requests now | seconds to wait at most | None to wait for a request
  observe_batch(size, inference_seconds)   after each handler call
  observe_reply(envid, time)               after each reply is sent
  stats() -> dict                          optional, merged into stats()

Given several cutoff policies, the server runs that many lanes (one per
policy device): each has its own queue, policy and worker threads, so each
cuts its own batches. A connection is routed to one lane for its lifetime
(the lane with the fewest connections when it first calls), so the carries
of its envs stay on one device.

An env id belongs to one connection at a time: a call naming an id that
another open connection uses gets an error (two env processes sharing an id
would read and overwrite each other's carry); once that connection closes,
the id is free for whoever calls with it next (a restarted env process).

Bad input gets an error reply to the one caller that sent it (status 1 too
short, 2 undecodable, 3 unknown method, 4 bad argument or handler error); the
server keeps serving everyone else.
"""

import collections
import threading
import time
import traceback

from .batch_requests import Group, Request
from .batch_stats import Stats
from .shm import ShmTransport
from .tcp_transport import TcpTransport
from .thread_transport import ThreadTransport
from .transport import missing
from .wire import failure

_FAILED = object()  # the context of a batch whose handler raised
# What the refusal of an env id that another open connection holds says.
# The kind of error (`wire.RemoteError.kind`) an env gets for an env id
# that another open connection holds.
ENV_ID_TAKEN = 'EnvIdTaken'


class BatchServer:
  """Serves one method; `handler` gets batches chosen by `cutoff`.

  handler(requests: list[Request]) -> (replies, context): one reply per
    request (a dict of numpy arrays, sent to that caller, or an Exception
    instance, sent to that caller only as an error with its message), and
    anything the postfn needs. If the handler raises, every request of that
    batch gets the error and the postfn is not called.
  postfn(requests, context): optional; runs on the same worker thread after
    the replies went out (e.g. to ship transitions). Within a lane, postfn
    calls run one at a time in the order the batches were cut, also with
    workers > 1 (a worker whose batch was cut later waits its turn), so a
    caller's consecutive calls reach the postfn in order.
  cutoff: a cutoff policy (see the module docstring), or a list of them:
    one lane each, every lane with `workers` threads of its own.
  transports: which ones serve calls: 'tcp' on `addr` ('host:port');
    'shm' for clients on this host (`shm.py`; they find it by the port of
    `addr`); 'thread' for in-process callers (`client()`); or transport
    objects of your own (`transport.Transport`).
  socket_kwargs: `handshake` (the token every transport checks),
    `max_msg_size` (the largest call, per env row for shm), and for tcp
    the socket's options (`host`, `logging`, ...).
  """

  def __init__(
      self, addr, handler, cutoff, postfn=None, workers=1, method='act',
      envid_key='envid', name='BatchServer', transports=('tcp',),
      nodelay=True, **socket_kwargs):
    if workers < 1:
      raise ValueError(f'workers must be >= 1, got {workers}')
    if not transports:
      raise ValueError('need at least one transport')
    for transport in transports:
      if isinstance(transport, str):
        if transport not in ('tcp', 'shm', 'thread'):
          raise ValueError(f'transports are tcp, shm, thread or transport '
                           f'objects; got {transport!r}')
      elif missing(transport):
        raise TypeError(f'{transport!r} is not a transport: it lacks '
                        f'{missing(transport)} (see rpc/transport.py)')
    self.handler = handler
    cutoffs = list(cutoff) if isinstance(cutoff, (list, tuple)) else [cutoff]
    if not cutoffs:
      raise ValueError('need at least one cutoff policy')
    self.lanes = [_Queue(i, c) for i, c in enumerate(cutoffs)]
    self.postfn = postfn
    self.method = method
    self.envid_key = envid_key
    self.name = name
    self.transports = {}
    if 'tcp' in transports:
      self.transports['tcp'] = TcpTransport(
          addr, method, name, nodelay=nodelay, **socket_kwargs)
    if 'shm' in transports:
      self.transports['shm'] = ShmTransport(
          addr, method, name, socket_kwargs.get('handshake'),
          socket_kwargs.get('max_msg_size'), envid_key)
    if 'thread' in transports:
      self.transports['thread'] = ThreadTransport(method)
    for transport in transports:
      if not isinstance(transport, str):
        if transport.kind in self.transports:
          raise ValueError(f'two transports of kind {transport.kind!r}')
        self.transports[transport.kind] = transport
    self._failed = None  # A loop's exception; serving stops.
    self._cond = threading.Condition()
    self._lane_of = {}  # conn -> the _Queue serving that connection
    self._owner = {}  # env id -> conn of the connection that uses it
    self._disconnects = 0  # disconnects when the queues were last pruned
    self._stats = Stats()
    self._refused = 0  # the transports' refused calls at the last stats()
    self._running = False
    self._started = False
    self._closed = False
    self._threads = [
        threading.Thread(target=self._guard, args=(self._receive, transport),
                         name=f'{name}Recv{kind}', daemon=True)
        for kind, transport in self.transports.items()]
    for lane in self.lanes:
      for i in range(workers):
        suffix = f'{i}' if len(self.lanes) == 1 else f'{lane.index}.{i}'
        self._threads.append(threading.Thread(
            target=self._guard, args=(self._work, lane),
            name=f'{name}Worker{suffix}', daemon=True))

  @property
  def error(self):
    """Why serving stopped (a loop or a transport failed), else None."""
    if self._failed is not None:
      return self._failed
    return next((t.error for t in self.transports.values()
                 if t.error is not None), None)

  @property
  def connections(self):
    """The open connections of every transport."""
    return [c for t in self.transports.values() for c in list(t.conns)]

  def client(self):
    """A new in-process client (`thread_transport.ThreadClient`); needs the
    'thread' transport."""
    if 'thread' not in self.transports:
      raise ValueError("client() needs transports=(..., 'thread')")
    return self.transports['thread'].client()

  def start(self):
    assert not self._started, 'already started'
    self._started = True
    self._running = True
    for thread in self._threads:
      thread.start()
    return self

  def close(self, timeout=5.0):
    """Stops receiving, lets running batches reply, then closes the
    transports.

    Queued requests that were not dispatched get no reply: their clients see
    the connection close (portal.Disconnected, or a resend after reconnect).
    """
    if self._closed:
      return
    self._closed = True
    deadline = time.monotonic() + timeout
    for transport in self.transports.values():
      transport.shutdown()
    with self._cond:
      self._running = False
      self._cond.notify_all()
    if self._started:
      for thread in self._threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    for transport in self.transports.values():
      transport.close(max(0.0, deadline - time.monotonic()))

  def __enter__(self):
    return self.start()

  def __exit__(self, *exc):
    self.close()

  def stats(self):
    """Counters and percentiles since the last call (which they reset)."""
    with self._cond:
      stats, self._stats = self._stats, Stats()
      refused = sum(t.refused for t in self.transports.values())
      stats.errors += refused - self._refused
      self._refused = refused
      pending = sum(len(lane.pending) for lane in self.lanes)
      extra = {}
      for lane in self.lanes:
        prefix = '' if len(self.lanes) == 1 else f'lane{lane.index}/'
        if hasattr(lane.cutoff, 'stats'):
          extra.update({prefix + k: v for k, v in lane.cutoff.stats().items()})
    return {**stats.result(pending), **extra}

  # ---------------------------------------------------------- receive side

  def _receive(self, transport):
    while self._running:
      calls = transport.receive(timeout=0.05)
      if not calls:
        continue
      with self._cond:
        for conn, reqnum, data in calls:
          if conn not in transport.conns:  # It left after sending.
            self._stats.requests += 1
            self._stats.dropped += 1
            continue
          requests = self._requests(transport, conn, reqnum, data)
          self._stats.requests += len(requests)
          for request in requests:
            lane = self._route(request.conn)
            request.lane = lane.index
            lane.pending.append(request)
        self._cond.notify_all()

  def _route(self, conn):
    """The lane of a connection: fixed on its first call, the lane with
    the fewest connections then."""
    lane = self._lane_of.get(conn)
    if lane is None:
      # Count open connections only: a lane's conns are pruned after a
      # transport counts a disconnect, which may lag the close by a moment.
      lane = min(self.lanes,
                 key=lambda lane: sum(map(self._is_open, lane.conns)))
      lane.conns.add(conn)
      self._lane_of[conn] = lane
    return lane

  def _is_open(self, conn):
    return any(conn in t.conns for t in self.transports.values())

  def _requests(self, transport, conn, reqnum, data):
    """The call's Requests (one per env row); none after sending the caller
    an error."""
    arrival = time.monotonic()
    rows = self._rows(data)
    if rows is None:
      envids, rows = [self._envid(conn, data)], None
    elif isinstance(rows, str):
      return self._refuse(transport, conn, reqnum, rows)
    else:
      rows = [{k: v[i] for k, v in data.items()} for i in range(rows)]
      envids = [self._envid(conn, row) for row in rows]
    taken = self._claim(conn, envids)
    if taken:
      return self._refuse(transport, conn, reqnum, taken)
    if rows is None:
      return [Request(conn, reqnum, data, arrival, envids[0], transport)]
    group = Group(envids)
    return [Request(conn, reqnum, row, arrival, envid, transport, group, i)
            for i, (row, envid) in enumerate(zip(rows, envids))]

  def _refuse(self, transport, conn, reqnum, message):
    self._stats.errors += 1
    transport.error_reply(conn, reqnum, 4, message)
    return []

  def _claim(self, conn, envids):
    """Marks the env ids as this connection's; an error message instead if
    another open connection uses one of them."""
    for envid in envids:
      owner = self._owner.get(envid, conn)
      if owner != conn and self._is_open(owner):
        return failure(
            self.method, ENV_ID_TAKEN, f'env id {envid} is already used by '
            f'another connection ({owner}); every env needs an id of its '
            'own (give each host its own run.envid_offset)')
    for envid in envids:
      if not isinstance(envid, tuple):  # An id, not the conn stand-in.
        self._owner[envid] = conn
    return None

  def _rows(self, data):
    """None for a one-env call, the row count for a multi-env call, or an
    error message when the rows do not line up."""
    envids = data.get(self.envid_key) if self.envid_key else None
    if envids is None or envids.ndim != 1:
      return None
    rows = len(envids)
    for key, value in data.items():
      if value.ndim < 1 or len(value) != rows:
        return (f'a call with {rows} env ids needs every value to have '
                f'{rows} rows; {key!r} has shape {list(value.shape)}')
    return rows if rows else 'a multi-env call needs at least one env id'

  def _envid(self, conn, data):
    value = data.get(self.envid_key) if self.envid_key else None
    if value is not None and value.shape == () and value.dtype.kind in 'iu':
      return int(value)
    return conn

  # ----------------------------------------------------------- worker side

  def _work(self, lane):
    while True:
      cut = self._next_batch(lane)
      if cut is None:
        return
      self._serve(lane, *cut)

  def _next_batch(self, lane):
    """Blocks until the lane's policy cuts a batch: (batch, its number in
    the lane's cut order); None once closing."""
    pending = lane.pending
    with self._cond:
      while self._running:
        self._drop_disconnected()
        now = time.monotonic()
        decision = lane.cutoff.decide(pending, now)
        if isinstance(decision, tuple):
          count, reason = decision
          count = min(int(count), len(pending))
          if count > 0:
            batch = [pending.popleft() for _ in range(count)]
            self._stats.cut(reason, [now - r.arrival for r in batch])
            if pending:
              self._cond.notify_all()  # Another worker may take the rest.
            lane.cuts += 1
            return batch, lane.cuts - 1
          decision = None
        self._cond.wait(None if decision is None else max(0.0, decision))
    return None

  def _drop_disconnected(self):
    """Requests of clients that left while queued are not worth serving.

    Scans the queue only after a disconnect, so the hot path stays O(1);
    requests that arrive from a closed connection are dropped on receipt.
    """
    disconnects = sum(t.disconnects for t in self.transports.values())
    if disconnects == self._disconnects:
      return
    self._disconnects = disconnects
    for conn in [c for c in self._lane_of if not self._is_open(c)]:
      self._lane_of.pop(conn).conns.discard(conn)
    for lane in self.lanes:
      keep = [r for r in lane.pending if r.conn in r.transport.conns]
      self._stats.dropped += len(lane.pending) - len(keep)
      lane.pending.clear()
      lane.pending.extend(keep)

  def _serve(self, lane, batch, number):
    context = _FAILED
    try:
      context = self._answer(lane, batch)
    finally:
      # Every cut batch takes its turn, also one whose serving raised:
      # a skipped number would stall the lane's later postfn calls.
      with lane.post_turn:
        while lane.posted != number:
          lane.post_turn.wait()
      try:
        if self.postfn and context is not _FAILED:
          self._post(batch, context)
      finally:
        with lane.post_turn:
          lane.posted += 1
          lane.post_turn.notify_all()

  def _answer(self, lane, batch):
    """Runs the handler on a batch and sends its replies; returns the
    handler's context for the postfn (_FAILED if the handler raised)."""
    start = time.monotonic()
    try:
      replies, context = self.handler(batch)
      replies = list(replies)
      if len(replies) != len(batch):
        raise ValueError(
            f'handler returned {len(replies)} replies for {len(batch)} '
            'requests')
    except Exception as e:
      traceback.print_exc()
      replies, context = [e] * len(batch), _FAILED
    inference = time.monotonic() - start
    sent, errors, replied = [], 0, []  # replied: env ids whose call is done
    for request, reply in zip(batch, replies):
      if request.group is None:
        errors += not self._reply(request, reply)
        replied.append(request.envid)
      elif request.group.fill(request.index, reply):
        # The call's last row: send the stacked reply of all its rows.
        errors += not self._reply(request, request.group.result())
        replied.extend(request.group.envids)
      sent.append(time.monotonic())
    with self._cond:
      lane.cutoff.observe_batch(len(batch), inference)
      now = time.monotonic()
      for envid in replied:
        lane.cutoff.observe_reply(envid, now)
      self._stats.served(batch, sent, inference, errors)
      self._cond.notify_all()
    return context

  def _post(self, batch, context):
    try:
      self.postfn(batch, context)
    except Exception:
      traceback.print_exc()
      with self._cond:
        self._stats.postfn_errors += 1

  def _reply(self, request, reply):
    """Sends one reply; False if the caller got an error (or nothing)."""
    if isinstance(reply, BaseException):
      return request.transport.error_reply(
          request.conn, request.reqnum, 4, str(reply) or type(reply).__name__)
    return request.transport.reply(request.conn, request.reqnum, reply)

  # ---------------------------------------------------------------- helpers

  def _guard(self, loop, *args):
    """A crashed loop stops the server: every queued caller gets the error
    at once, and every later one finds the transports closed."""
    try:
      loop(*args)
    except Exception as e:
      traceback.print_exc()
      self._fail(e)

  def _fail(self, error):
    with self._cond:
      self._failed = self._failed or error
      self._running = False
      queued = [r for lane in self.lanes for r in lane.pending]
      for lane in self.lanes:
        lane.pending.clear()
      self._cond.notify_all()
    message = f'{self.name} stopped: {type(error).__name__}: {error}'
    answered = set()
    for request in queued:  # A multi-env call's rows share one reply.
      key = (id(request.transport), request.conn, request.reqnum)
      if key not in answered:
        answered.add(key)
        request.transport.error_reply(
            request.conn, request.reqnum, 4, message)
    for transport in self.transports.values():
      transport.close(timeout=1.0)


class _Queue:
  """One lane of the server: its pending requests, its cutoff policy, and
  the connections routed to it."""

  def __init__(self, index, cutoff):
    self.index = index
    self.cutoff = cutoff
    self.pending = collections.deque()
    self.conns = set()
    self.cuts = 0  # batches cut so far (numbered under the server's lock)
    self.posted = 0  # batches whose postfn turn is over, in cut order
    self.post_turn = threading.Condition()
