"""Processes as /proc shows them."""

from pathlib import Path


def process_state(pid):
  """The process state letter from /proc (T = stopped), None when gone."""
  try:
    stat = Path(f'/proc/{pid}/stat').read_text()
  except FileNotFoundError:
    return None
  return stat.rsplit(')', 1)[1].split()[0]
