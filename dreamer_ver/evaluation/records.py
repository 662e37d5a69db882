"""The file that tells other processes where an eval worker listens
(`logdir/eval_workers/<name>.json`: name, addr, pid, process identity),
shared by the worker's server, which writes it, and the handles that read
it; and the modes a worker evaluates in.
"""

import json
import os
import time
from pathlib import Path

MODES = ('greedy', 'sample')


def record_path(logdir, name):
  """The file that tells other processes where worker `name` listens."""
  return Path(logdir) / 'eval_workers' / f'{name}.json'


def remove_record(path, pid):
  """Removes `path` if process `pid` wrote it (a newer worker's stays)."""
  try:
    if json.loads(path.read_text())['pid'] == pid:
      path.unlink()
  except (FileNotFoundError, ValueError, KeyError):
    pass


def process_identity(pid):
  """[boot id, start time in clock ticks] of process `pid`: no other
  process shares it, not even a later one with the same pid (after a
  restart of the machine or container). None where /proc cannot tell."""
  try:
    stat = Path(f'/proc/{pid}/stat').read_text()
    boot = Path('/proc/sys/kernel/random/boot_id').read_text().strip()
  except OSError:
    return None
  return [boot, int(stat.rsplit(')', 1)[1].split()[19])]  # field 22


def clear_stale_record(path):
  """Refuses a name that a live worker holds; forgets the file of a dead
  one, or of one whose pid another process has now."""
  try:
    record = json.loads(path.read_text())
    pid = record['pid']
  except (FileNotFoundError, ValueError, KeyError):
    return
  identity = record.get('identity')
  if identity is not None and process_identity(pid) not in (None, identity):
    path.unlink(missing_ok=True)
    return
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    path.unlink(missing_ok=True)
    return
  except PermissionError:
    pass  # Alive, someone else's.
  raise RuntimeError(
      f'an eval worker named {path.stem!r} already runs (pid {pid}, {path}); '
      'shut it down or pick another name')


def wait_for_record(path, proc, timeout, cancel=None):
  """The worker's record once the process `proc` has written it."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if cancel is not None and cancel.is_set():
      raise RuntimeError('cancelled while the eval worker started')
    try:
      info = json.loads(path.read_text())
      if info['pid'] == proc.pid:
        return info
    except (FileNotFoundError, ValueError, KeyError):
      pass
    if not proc.is_alive():
      raise RuntimeError(
          f'the eval worker exited with code {proc.exitcode} before it '
          'served (its error is above, on stderr)')
    time.sleep(0.1)
  raise TimeoutError(f'the eval worker did not serve within {timeout} s')


def recorded_addr(path):
  """A client address that reads where the worker of record `path` serves
  (None while there is no record), asked again at every reconnect."""
  def addr():
    try:
      return json.loads(path.read_text())['addr']
    except (OSError, ValueError, KeyError, TypeError):
      return None  # No record (yet), or a partial one: asked again soon.
  return addr
