"""Processes as /proc shows them."""

from pathlib import Path


def process_state(pid):
  """The process state letter from /proc (T = stopped), None when gone."""
  try:
    stat = Path(f'/proc/{pid}/stat').read_text()
  except FileNotFoundError:
    return None
  return stat.rsplit(')', 1)[1].split()[0]


def running(pid):
  """Whether process `pid` has a thread that has not exited: its main thread
  shows as a zombie (Z) while its other threads still exit and hold its
  files and locks."""
  for task in Path(f'/proc/{pid}/task').glob('*'):
    try:
      if (task / 'stat').read_text().rsplit(')', 1)[1].split()[0] not in (
          'Z', 'X'):
        return True
    except FileNotFoundError:
      continue  # A thread that just ended.
  return False


def all_stopped(pid):
  """Whether every thread of process `pid` is stopped (SIGSTOP reaches a
  process's threads one by one: until then a running thread still serves)."""
  states = []
  for task in Path(f'/proc/{pid}/task').glob('*'):
    try:
      states.append((task / 'stat').read_text().rsplit(')', 1)[1].split()[0])
    except FileNotFoundError:
      continue  # A thread that just ended.
  return bool(states) and all(state == 'T' for state in states)
