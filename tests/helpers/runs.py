"""A run of `python -m dreamer_ver.main` as a user starts and stops one, for
tests that stop it on a condition (a logged metric) instead of a duration."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from helpers import ROOT


def children_alive(logdir):
  """Child processes of the run (from `logdir/pids`) still alive."""
  alive = []
  for path in (logdir / 'pids').glob('*'):
    try:
      os.kill(int(path.read_text()), 0)
      alive.append(path.name)
    except ProcessLookupError:
      pass
  return alive


def start(args, log, env=None):
  """The run with `args`, its output to the file `log`; CPU only. It leads
  a process group of its own, so `stop` can end every process it started."""
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu', 'PYTHONUNBUFFERED': '1',
         **(env or {})}
  with open(log, 'w') as output:
    return subprocess.Popen(
        [sys.executable, '-m', 'dreamer_ver.main', *args], cwd=ROOT, env=env,
        stdout=output, stderr=subprocess.STDOUT, start_new_session=True)


def stop(proc, timeout=120):
  """SIGTERM to the run, as a user stops one; its exit code. After
  `timeout` seconds its whole process group is killed (the code is then
  -9, and the test fails on it)."""
  if proc.poll() is None:
    proc.send_signal(signal.SIGTERM)
  try:
    return proc.wait(timeout=timeout)
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    return proc.wait()


def metrics(logdir):
  """The rows of `logdir/metrics.jsonl` written so far."""
  path = Path(logdir) / 'metrics.jsonl'
  rows = []
  if path.exists():
    for line in path.read_text().splitlines():
      try:
        rows.append(json.loads(line))
      except ValueError:  # The line being written.
        pass
  return rows


def wait_until(predicate, timeout, what, log=None, poll=0.5):
  """Polls `predicate` until it returns a true value, which it returns;
  fails naming `what` (and the end of `log`) after `timeout` seconds."""
  deadline = time.monotonic() + timeout
  while not (value := predicate()):
    if time.monotonic() > deadline:
      tail = Path(log).read_text()[-3000:] if log else ''
      raise AssertionError(f'timed out waiting for {what}\n{tail}')
    time.sleep(poll)
  return value
