"""The servers' main loop: periodic tasks until stopped; the stop signal."""

import os
import signal
import threading
import time

from dreamer_ver.runtime.process import StopSignal, run_periodically


def test_run_periodically_calls_each_task_at_its_interval_until_stopped():
  stop = StopSignal(install=False)
  calls = {'fast': [], 'slow': [], 'never': []}
  tasks = [(0.05, lambda: calls['fast'].append(time.monotonic())),
           (0.3, lambda: calls['slow'].append(time.monotonic())),
           (0, lambda: calls['never'].append(time.monotonic()))]
  threading.Timer(1.0, stop.set).start()
  start = time.monotonic()
  run_periodically(stop, tasks, poll=0.01)
  elapsed = time.monotonic() - start
  assert 1.0 <= elapsed < 3.0
  assert calls['never'] == []
  assert 2 <= len(calls['slow']) <= 3  # At 0.3, 0.6, 0.9 s (late at worst).
  assert len(calls['fast']) >= 8
  gaps = [b - a for a, b in zip(calls['slow'], calls['slow'][1:])]
  assert all(gap >= 0.3 for gap in gaps), gaps


def test_a_stop_signal_is_set_by_sigterm_and_restores_the_handlers_it_replaced():
  before = signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)
  stop = StopSignal()
  try:
    assert not stop
    os.kill(os.getpid(), signal.SIGTERM)
    assert stop.wait(5)
  finally:
    stop.restore()
  assert (signal.getsignal(signal.SIGINT),
          signal.getsignal(signal.SIGTERM)) == before
