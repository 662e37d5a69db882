"""A component's main loop: a graceful stop on SIGINT/SIGTERM, and its
periodic work."""

import signal
import threading

import elements

from dreamer_ver.cluster.supervisor import when_stop_ordered


class StopSignal:
  """An event set by SIGINT/SIGTERM (or by hand), so loops can save and exit.
  In a supervised child the signal sets it once the supervisor orders the
  stop (`supervisor.when_stop_ordered`), so children stop in order.

  Installing handlers only works in the main thread; elsewhere the event is
  still usable and set by whoever owns the process.
  """

  def __init__(self, install=True):
    self.event = threading.Event()
    self.previous = {}  # signal -> the handler it replaced
    if install and threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGINT, signal.SIGTERM):
        self.previous[sig] = signal.signal(sig, self._handle)

  def restore(self):
    """Puts back the handlers it replaced (a loop run inside a longer-lived
    process: a notebook, a test session)."""
    for sig, handler in self.previous.items():
      signal.signal(sig, handler)
    self.previous = {}

  def _handle(self, signum, frame):
    del signum, frame
    when_stop_ordered(self.event.set)

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
