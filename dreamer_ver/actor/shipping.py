"""Shipping of served transitions to the replay and logger servers.

After the replies of a batch are out, its transitions go to replay and
logger through clients with bounded in-flight calls: nobody waits for the
replies. Back-pressure from replay (its limiter) blocks the replay client,
so a full replay slows the actor down and never loses data; the logger link
drops calls when the logger lags, and the rows it missed are reported with
the next rows of the same env so the logger still counts every env step and
never logs an episode with a hole in it.

Every batch carries a shipment id, ``SHIPMENT``: ``[sender, seq]`` (int64),
a random sender id fixed per Shipper and a counter. A client resends its
calls in flight after a reconnect, so a server that took a batch but was
killed before it replied gets it again; the id lets replay and logger take
each shipment once. They treat a seq at or below the newest they took from
its sender as a resend, so the calls leave in the order of their seqs.
"""

import concurrent.futures
import itertools
import secrets
import threading
import time

import numpy as np

from dreamer_ver.core.atomic import StorageFault
from dreamer_ver.core.transitions import SHIPMENT


class Shipper:
  """`replay` and `logger`: futures clients (`rpc.client.Client`) or None."""

  def __init__(self, replay=None, logger=None):
    self.replay = replay
    self.logger = logger
    self.sender = secrets.randbits(63)  # Positive as an int64.
    self.served = 0  # train env steps shipped (eval rows excluded)
    self.stored = 0  # of those, the ones replay acknowledged
    self._unanswered = set()  # add_batch futures replay has not answered
    self._sending = 0  # ship() calls counted in `served`, not yet sent
    self.errors = 0  # add_batch / transitions calls that came back failed
    self._told = False  # whether a failure was printed
    self._missed = {}  # envid -> its rows the logger has not received
    self._lock = threading.Lock()  # ship() runs on every worker thread
    self._sent = threading.Condition(self._lock)  # `_sending` went down
    self._seqs = itertools.count()
    # Held from taking a seq until its calls are sent (while the replay
    # call blocks on back-pressure, too); never taken by a done callback.
    self._send_order = threading.Lock()

  def ship(self, trans, logs):
    """Sends one batch's transitions (and its `log/` columns to the logger)."""
    with self._lock:
      self.served += int((~trans['is_eval']).sum())
      self._sending += 1
    try:
      with self._send_order:
        trans = {**trans, SHIPMENT: np.array(
            [self.sender, next(self._seqs)], np.int64)}
        if self.replay is not None:
          future = self._call(self.replay.add_batch, trans)
          self._count_stored(future, int((~trans['is_eval']).sum()))
          self._watch(future, 'replay.add_batch')
        if self.logger is not None:
          self._ship_log(trans, logs)
    finally:
      with self._lock:
        self._sending -= 1
        self._sent.notify_all()

  def drain(self, timeout):
    """Waits up to `timeout` seconds for replay's answers to every batch
    shipped, the ones still waiting to be sent too (back-pressure); True
    if none is left unanswered."""
    deadline = time.monotonic() + timeout
    with self._lock:
      if not self._sent.wait_for(lambda: not self._sending, timeout):
        return False
      waiting = list(self._unanswered)
    left = max(0.0, deadline - time.monotonic())
    return not concurrent.futures.wait(waiting, left).not_done

  def _count_stored(self, future, rows):
    with self._lock:
      self._unanswered.add(future)

    def done(future):
      with self._lock:
        self._unanswered.discard(future)
        if future.exception() is None:
          self.stored += rows
    future.add_done_callback(done)

  def _ship_log(self, trans, logs):
    envids = trans['envid'].tolist()
    with self._lock:
      missed = [self._missed.pop(e, 0) for e in envids]
    future = self._call(
        self.logger.transitions,
        {**trans, **logs, 'missed': np.array(missed, np.int64)})

    def done(future):
      if future.exception() is not None:  # These rows are missed too.
        with self._lock:
          for envid, count in zip(envids, missed):
            self._missed[envid] = self._missed.get(envid, 0) + count + 1
    future.add_done_callback(done)
    self._watch(future, 'logger.transitions')

  @staticmethod
  def _call(method, *args):
    """A call's future; a call that cannot be sent (its link closed at
    shutdown, or failed) becomes a failed future, reported as one."""
    try:
      return method(*args)
    except Exception as error:
      future = concurrent.futures.Future()
      future.set_exception(error)
      return future

  def _watch(self, future, what):
    """A failed call is counted (the metric `actor/ship_errors`) and the
    first is printed, so a rejected batch is never silent and a server
    that refuses every batch (a full disk) does not flood the terminal. A
    storage fault is not printed: the server that met it says it."""
    def done(future):
      error = future.exception()
      if error is not None:
        said = getattr(error, 'kind', None) == StorageFault.__name__
        with self._lock:
          self.errors += 1
          tell = not (said or self._told)
          self._told |= tell
        if tell:
          print(f'[actor] {what} failed: {error} (later failures are '
                'counted in actor/ship_errors)', flush=True)
    future.add_done_callback(done)
