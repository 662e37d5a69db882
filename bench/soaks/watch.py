"""Watching a run from outside, through its logdir: the soak benchmarks'
shared helpers (bench/soaks/soak.py, bench/soaks/chaos.py)."""

import json
import os
import time
from pathlib import Path


def pids(logdir):
  """{child name: pid} from `logdir/pids` (a file being rewritten by a
  restart is skipped)."""
  found = {}
  for path in (Path(logdir) / 'pids').glob('*'):
    try:
      found[path.name] = int(path.read_text())
    except (OSError, ValueError):
      pass
  return found


def alive(pid):
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    return False
  # A zombie is dead too (its parent has not reaped it yet).
  try:
    stat = Path(f'/proc/{pid}/stat').read_text()
  except FileNotFoundError:
    return False
  return stat.rsplit(')', 1)[1].split()[0] != 'Z'


def logger_step(logdir):
  """The logger's env step from the last metrics line (0 before any)."""
  path = Path(logdir) / 'metrics.jsonl'
  if not path.exists():
    return 0
  with path.open('rb') as file:
    file.seek(max(0, path.stat().st_size - 65536))
    lines = [l for l in file.read().splitlines() if l.strip()]
  for line in reversed(lines):
    try:
      return json.loads(line)['step']
    except (ValueError, KeyError):
      continue
  return 0


def read_json(path):
  """A saved json file ({} if it does not exist)."""
  path = Path(path)
  return json.loads(path.read_text()) if path.exists() else {}


def wait(predicate, timeout, poll=0.5):
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if predicate():
      return True
    time.sleep(poll)
  return False
