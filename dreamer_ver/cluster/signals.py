"""A component's main loop: a graceful stop on SIGINT/SIGTERM, and its
periodic work."""

import os
import signal
import threading

import elements

from dreamer_ver.cluster.supervisor import when_stop_ordered


class StopSignal:
  """An event set by SIGINT/SIGTERM (or by hand), so loops can save and exit.
  In a supervised child the signal sets it once the supervisor orders the
  stop (`supervisor.when_stop_ordered`), so children stop in order.

  The handler only writes a byte to a pipe, and a thread sets the event: a
  signal can land while the handler of another runs (Ctrl-C and `timeout`
  together, a scheduler that signals every process), and a handler that
  takes a lock (`Event.set`) would wait for good for the one it interrupted.

  Installing handlers only works in the main thread; elsewhere the event is
  still usable and set by whoever owns the process.
  """

  def __init__(self, install=True):
    self.event = threading.Event()
    self.previous = {}  # signal -> the handler it replaced
    self.pipe = None  # (read, write) descriptors while installed
    if install and threading.current_thread() is threading.main_thread():
      self.pipe = os.pipe()
      os.set_blocking(self.pipe[1], False)
      threading.Thread(target=self._relay, args=(self.pipe[0],),
                       name='StopSignal', daemon=True).start()
      for sig in (signal.SIGINT, signal.SIGTERM):
        self.previous[sig] = signal.signal(sig, self._handle)

  def restore(self):
    """Puts back the handlers it replaced (a loop run inside a longer-lived
    process: a notebook, a test session)."""
    for sig, handler in self.previous.items():
      signal.signal(sig, handler)
    self.previous = {}
    if self.pipe is not None:
      os.close(self.pipe[1])  # Ends the relay.
      self.pipe = None

  def _handle(self, signum, frame):
    del signum, frame
    try:
      os.write(self.pipe[1], b'.')
    except OSError:
      pass  # The pipe is full: a stop is on its way already.

  def _relay(self, read):
    """Sets the event (as the supervisor orders) at the first signal."""
    relayed = False
    while os.read(read, 64):
      if not relayed:
        relayed = True
        when_stop_ordered(self.event.set)
    os.close(read)

  def __bool__(self):
    return self.event.is_set()

  def is_set(self):
    return self.event.is_set()

  def set(self):
    self.event.set()

  def wait(self, timeout):
    return self.event.wait(timeout)


def every(seconds, first=True):
  """A clock (`elements.when.Clock`) that fires every `seconds` (at its
  first call too if `first`), and never when `seconds` <= 0: Clock(0) would
  fire on every call, and the config's `<= 0` means off everywhere."""
  return elements.when.Clock(seconds if seconds > 0 else -1, first=first)


def run_periodically(stop, tasks, poll=0.5, servers=()):
  """A server process's main loop: calls each `fn` of `tasks`, a list of
  (seconds, fn), every that many seconds (never when <= 0) until `stop` is
  set, checking twice a second. Raises RuntimeError once one of `servers`
  (rpc Servers) stopped serving, so that the process ends non-zero and its
  supervisor restarts it, instead of living on and serving no one."""
  clocks = [(every(seconds, first=False), fn) for seconds, fn in tasks]
  for clock, _ in clocks:
    clock()  # starts counting now
  while not stop.wait(poll):
    for server in servers:
      if server.error is not None:
        raise RuntimeError(
            f'{server.name} stopped serving: {server.error!r}')
    for clock, fn in clocks:
      if clock():
        fn()
