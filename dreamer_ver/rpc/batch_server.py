"""A batch server whose cutoff is a policy, not a fixed size.

portal.BatchServer dispatches only when exactly N requests are queued, so
stragglers hold back everyone and fewer live clients than N hang it. This
server speaks portal's request/response framing on portal's own ServerSocket
(hardened: `server_socket.py`), so an unmodified `portal.Client` talks to it
(errors arrive as RuntimeError, a closed server as Disconnected), but it
keeps its own queue and asks a cutoff policy when the queue becomes a batch.

  receive thread:   socket -> decode -> Request -> its lane's pending queue
  worker threads:   cutoff.decide(pending) -> handler(batch) -> replies
                    -> cutoff.observe_*(...) -> postfn(batch, context)

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
import dataclasses
import threading
import time
import traceback

import numpy as np

from .server_socket import BadCall, ServerSocket, parse_call

# Recent samples kept for the percentiles between two stats() calls.
_SAMPLES = 65536
_FAILED = object()  # the context of a batch whose handler raised


@dataclasses.dataclass(eq=False, slots=True)
class Request:
  """One queued call: who sent it, its number, its argument, when it came.

  `data` is the caller's dict of numpy arrays; the arrays are read-only views
  into the receive buffer (copy before writing). `envid` is the integer under
  the server's `envid_key` when the request carries one, else `addr`.
  `lane` is the index of the lane (and cutoff policy) that serves it.

  A call whose `envid` is a vector carries several envs (an env worker with
  `run.envs_per_worker > 1`): it is split into one Request per env, sharing
  a `group`, so the cutoff and the handler see every env as its own row. The
  caller gets one reply, the rows' replies stacked, once all rows are served.
  """
  addr: tuple
  reqnum: bytes
  data: dict
  arrival: float
  envid: object = None
  group: object = None
  index: int = 0
  lane: int = 0


class Group:
  """The rows of one multi-env call and their replies so far."""

  def __init__(self, envids):
    self.envids = envids
    self.replies = [None] * len(envids)
    self.missing = len(envids)

  def fill(self, index, reply):
    """Stores a row's reply; True once every row has one."""
    self.replies[index] = reply
    self.missing -= 1
    return self.missing == 0

  def result(self):
    """The stacked reply, or the first row's error for the whole call."""
    for reply in self.replies:
      if isinstance(reply, BaseException):
        return reply
    keys = self.replies[0].keys()
    return {k: np.stack([np.asarray(r[k]) for r in self.replies]) for k in keys}


class BatchServer:
  """Serves one method; `handler` gets batches chosen by `cutoff`.

  handler(requests: list[Request]) -> (replies, context): one reply per
    request (a dict of numpy arrays, sent to that caller, or an Exception
    instance, sent to that caller only as an error with its message), and
    anything the postfn needs. If the handler raises, every request of that
    batch gets the error and the postfn is not called.
  postfn(requests, context): optional; runs on the same worker thread after
    the replies went out (e.g. to ship transitions). With workers > 1, calls
    from different workers may overlap and finish out of order.
  cutoff: a cutoff policy (see the module docstring), or a list of them:
    one lane each, every lane with `workers` threads of its own.
  """

  def __init__(
      self, addr, handler, cutoff, postfn=None, workers=1, method='act',
      envid_key='envid', name='BatchServer', nodelay=True, **socket_kwargs):
    if workers < 1:
      raise ValueError(f'workers must be >= 1, got {workers}')
    self.handler = handler
    cutoffs = list(cutoff) if isinstance(cutoff, (list, tuple)) else [cutoff]
    if not cutoffs:
      raise ValueError('need at least one cutoff policy')
    self.lanes = [_Queue(i, c) for i, c in enumerate(cutoffs)]
    self.postfn = postfn
    self.method = method
    self.envid_key = envid_key
    self.name = name
    self.error = None  # Set if the socket or a loop failed; serving stops.
    self.socket = ServerSocket(addr, name, nodelay=nodelay, **socket_kwargs)
    self._cond = threading.Condition()
    self._lane_of = {}  # addr -> the _Queue serving that connection
    self._owner = {}  # env id -> addr of the connection that uses it
    self._disconnects = 0  # socket.disconnects when the queue was last pruned
    self._stats = _Stats()
    self._running = False
    self._started = False
    self._closed = False
    self._threads = [threading.Thread(
        target=self._guard, args=(self._receive,), name=f'{name}Recv',
        daemon=True)]
    for lane in self.lanes:
      for i in range(workers):
        suffix = f'{i}' if len(self.lanes) == 1 else f'{lane.index}.{i}'
        self._threads.append(threading.Thread(
            target=self._guard, args=(self._work, lane),
            name=f'{name}Worker{suffix}', daemon=True))

  @property
  def connections(self):
    return self.socket.connections

  def start(self):
    assert not self._started, 'already started'
    self._started = True
    self._running = True
    for thread in self._threads:
      thread.start()
    return self

  def close(self, timeout=5.0):
    """Stops reading, lets running batches reply, then closes the socket.

    Queued requests that were not dispatched get no reply: their clients see
    the connection close (portal.Disconnected, or a resend after reconnect).
    """
    if self._closed:
      return
    self._closed = True
    deadline = time.monotonic() + timeout
    self.socket.shutdown()
    with self._cond:
      self._running = False
      self._cond.notify_all()
    if self._started:
      for thread in self._threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    self.socket.close(max(0.0, deadline - time.monotonic()))

  def __enter__(self):
    return self.start()

  def __exit__(self, *exc):
    self.close()

  def stats(self):
    """Counters and percentiles since the last call (which they reset)."""
    with self._cond:
      stats, self._stats = self._stats, _Stats()
      pending = sum(len(lane.pending) for lane in self.lanes)
      extra = {}
      for lane in self.lanes:
        prefix = '' if len(self.lanes) == 1 else f'lane{lane.index}/'
        if hasattr(lane.cutoff, 'stats'):
          extra.update({prefix + k: v for k, v in lane.cutoff.stats().items()})
    return {**stats.result(pending), **extra}

  # ---------------------------------------------------------- receive side

  def _receive(self):
    while self._running:
      try:
        messages = [self.socket.recv(timeout=0.05)]
      except TimeoutError:
        continue
      while len(messages) < 256:  # Drain a burst under one lock.
        try:
          messages.append(self.socket.recv(timeout=0))
        except TimeoutError:
          break
      requests = [r for addr, msg in messages
                  for r in self._decode(addr, msg)]
      with self._cond:
        live = [r for r in requests if r.addr in self.socket.conns]
        self._stats.requests += len(requests)
        self._stats.errors += len(messages) - len(requests)
        self._stats.dropped += len(requests) - len(live)
        for request in live:
          lane = self._route(request.addr)
          request.lane = lane.index
          lane.pending.append(request)
        self._cond.notify_all()

  def _route(self, addr):
    """The lane of a connection: fixed on its first call, the lane with
    the fewest connections then."""
    lane = self._lane_of.get(addr)
    if lane is None:
      # Count open connections only: a lane's addrs are pruned after the
      # socket counts a disconnect, which may lag the close by a moment.
      conns = self.socket.conns
      lane = min(self.lanes, key=lambda lane: sum(a in conns for a in lane.addrs))
      lane.addrs.add(addr)
      self._lane_of[addr] = lane
    return lane

  def _decode(self, addr, msg):
    """The call's Requests (one per env row); none after sending the caller
    an error."""
    arrival = time.monotonic()
    try:
      reqnum, name, args = parse_call(msg)
    except BadCall as e:
      self.socket.send_error(addr, e.reqnum, e.status, str(e))
      return []
    if name != self.method:
      self.socket.send_error(addr, reqnum, 3, f'Unknown method {name}')
      return []
    problem = _check_args(args)
    if problem:
      self.socket.send_error(addr, reqnum, 4, (
          f'{self.method}() expects one argument, a dict of numpy arrays; '
          f'got {problem}'))
      return []
    data = args[0]
    rows = self._rows(data)
    if isinstance(rows, str):
      self.socket.send_error(addr, reqnum, 4, rows)
      return []
    if rows is None:
      envids, rows = [self._envid(addr, data)], None
    else:
      rows = [{k: v[i] for k, v in data.items()} for i in range(rows)]
      envids = [self._envid(addr, row) for row in rows]
    taken = self._claim(addr, envids)
    if taken:
      self.socket.send_error(addr, reqnum, 4, taken)
      return []
    if rows is None:
      return [Request(addr, reqnum, data, arrival, envids[0])]
    group = Group(envids)
    return [Request(addr, reqnum, row, arrival, envid, group, i)
            for i, (row, envid) in enumerate(zip(rows, envids))]

  def _claim(self, addr, envids):
    """Marks the env ids as this connection's; an error message instead if
    another open connection uses one of them."""
    conns = self.socket.conns
    for envid in envids:
      owner = self._owner.get(envid, addr)
      if owner != addr and owner in conns:
        return (f'env id {envid} is already used by another connection '
                f'({owner}); every env needs an id of its own (give each '
                f'host its own run.envid_offset)')
    for envid in envids:
      if not isinstance(envid, tuple):  # An id, not the addr stand-in.
        self._owner[envid] = addr
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


  def _envid(self, addr, data):
    value = data.get(self.envid_key) if self.envid_key else None
    if value is not None and value.shape == () and value.dtype.kind in 'iu':
      return int(value)
    return addr

  # ----------------------------------------------------------- worker side

  def _work(self, lane):
    while True:
      batch = self._next_batch(lane)
      if batch is None:
        return
      self._serve(lane, batch)

  def _next_batch(self, lane):
    """Blocks until the lane's policy cuts a batch; None once closing."""
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
            return batch
          decision = None
        self._cond.wait(None if decision is None else max(0.0, decision))
    return None

  def _drop_disconnected(self):
    """Requests of clients that left while queued are not worth serving.

    Scans the queue only after a disconnect, so the hot path stays O(1);
    requests that arrive from a closed connection are dropped on receipt.
    """
    disconnects = self.socket.disconnects
    if disconnects == self._disconnects:
      return
    self._disconnects = disconnects
    conns = self.socket.conns
    for addr in [a for a in self._lane_of if a not in conns]:
      self._lane_of.pop(addr).addrs.discard(addr)
    for lane in self.lanes:
      keep = [r for r in lane.pending if r.addr in conns]
      self._stats.dropped += len(lane.pending) - len(keep)
      lane.pending.clear()
      lane.pending.extend(keep)

  def _serve(self, lane, batch):
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
    if self.postfn and context is not _FAILED:
      try:
        self.postfn(batch, context)
      except Exception:
        traceback.print_exc()
        with self._cond:
          self._stats.postfn_errors += 1

  def _reply(self, request, reply):
    """Sends one reply; False if the caller got an error (or nothing)."""
    if isinstance(reply, BaseException):
      return self.socket.send_error(
          request.addr, request.reqnum, 4, str(reply) or type(reply).__name__)
    return self.socket.send_reply(request.addr, request.reqnum, reply)

  # ---------------------------------------------------------------- helpers

  def _guard(self, loop, *args):
    """A crashed loop stops the server instead of hanging its clients."""
    try:
      loop(*args)
    except Exception as e:
      traceback.print_exc()
      self.error = self.error or e
      with self._cond:
        self._running = False
        self._cond.notify_all()


class _Queue:
  """One lane of the server: its pending requests, its cutoff policy, and
  the connections routed to it."""

  def __init__(self, index, cutoff):
    self.index = index
    self.cutoff = cutoff
    self.pending = collections.deque()
    self.addrs = set()


class _Stats:

  def __init__(self):
    self.requests = 0
    self.batches = 0
    self.sizes = collections.Counter()
    self.cuts = collections.Counter()
    self.waits = collections.deque(maxlen=_SAMPLES)
    self.latencies = collections.deque(maxlen=_SAMPLES)
    self.inference = 0.0
    self.dropped = 0
    self.errors = 0
    self.postfn_errors = 0

  def cut(self, reason, waits):
    self.cuts[reason] += 1
    self.waits.extend(waits)

  def served(self, batch, sent, inference, errors):
    self.batches += 1
    self.sizes[len(batch)] += 1
    self.latencies.extend(t - r.arrival for r, t in zip(batch, sent))
    self.inference += inference
    self.errors += errors

  def result(self, pending):
    total = sum(size * count for size, count in self.sizes.items())
    stats = {
        'requests': self.requests,
        'batches': self.batches,
        'batch_size_mean': total / self.batches if self.batches else 0.0,
        'batch_size_max': max(self.sizes, default=0),
        'batch_sizes': dict(sorted(self.sizes.items())),
        'inference_ms_mean': (
            1000 * self.inference / self.batches if self.batches else 0.0),
        'dropped': self.dropped,
        'errors': self.errors,
        'postfn_errors': self.postfn_errors,
        'pending': pending,
    }
    stats.update({f'cut/{k}': v for k, v in sorted(self.cuts.items())})
    for name, values in (('queue_wait_ms', self.waits),
                         ('latency_ms', self.latencies)):
      for q in (50, 95, 99):
        value = np.percentile(values, q) * 1000 if values else 0.0
        stats[f'{name}/p{q}'] = float(value)
    return stats


def _check_args(args):
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
