"""File writes every layer may use (plain Python, no JAX): atomic JSON, lines
appended to a JSONL file, the one-line error a write gets when the disk is
full or read-only, and the one-line error a run's state file gets when it
cannot be read back."""

import errno
import json
import os
import shutil
from pathlib import Path

from dreamer_ver.config.validation import ConfigError

# The errors after which no write to that file system will succeed until
# an operator acts: the run stops in order instead of retrying.
STORAGE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS)


class StateUnreadable(ConfigError):
  """A state file the run wrote cannot be read back at start (a partial
  copy, a flipped byte): the user must act, as on a config error (exit
  code 2, not a restart). Its message names the file and what to do."""


class StorageFault(RuntimeError):
  """A write failed because its file system is full or read-only. Its
  message is one line: what failed, the path, and the space left there."""


def storage_fault(error, path=None):
  """A StorageFault for `error` (an exception, or one it was raised from)
  when it is a full or read-only file system's, else None. `path` names
  the file where the error does not."""
  seen = error
  while seen is not None:
    if isinstance(seen, StorageFault):
      return seen
    if isinstance(seen, OSError) and seen.errno in STORAGE_ERRNOS:
      where = seen.filename or path or '?'
      fault = StorageFault(
          f'{os.strerror(seen.errno).lower()} writing {where} '
          f'({_space(where)})')
      fault.__cause__ = seen
      return fault
    seen = seen.__cause__ or seen.__context__
  return None


def with_path(error, path):
  """Names `path` in an OSError that names no file (a buffered file's
  write or flush does not), so that its one-line message says where."""
  if isinstance(error, OSError) and error.filename is None:
    error.filename = str(path)
  return error


def _space(path):
  """'N MB free of M MB' on the file system holding `path`."""
  folder = Path(path)
  while not folder.exists() and folder != folder.parent:
    folder = folder.parent
  try:
    usage = shutil.disk_usage(folder)
  except OSError:
    return 'free space unknown'
  return f'{usage.free / 1e6:.1f} MB free of {usage.total / 1e6:.1f} MB'


def write_atomically(path, write):
  """Calls `write(file)` on `<path>.tmp` opened for binary writing, then
  renames it over `path`: a reader never sees a half file, after a killed
  process or a lost machine (the data reaches the disk before the name
  does, and the rename before this returns). On failure the temporary
  file is removed (a full disk gets its space back) and an OSError names
  it."""
  path = Path(path)
  tmp = path.with_name(path.name + '.tmp')
  try:
    with open(tmp, 'wb') as file:
      write(file)
      file.flush()
      os.fsync(file.fileno())
    os.replace(tmp, path)
  except BaseException as error:
    tmp.unlink(missing_ok=True)
    raise with_path(error, tmp)
  folder = os.open(path.parent, os.O_RDONLY)
  try:
    os.fsync(folder)
  finally:
    os.close(folder)


def write_json(path, data):
  """Writes `data` as JSON atomically (`write_atomically`)."""
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  write_atomically(path, lambda file: file.write(json.dumps(data).encode()))


def read_json(path, afresh):
  """The JSON state saved at `path`; StateUnreadable naming it when it
  does not parse, where `afresh` says what moving it away starts afresh."""
  try:
    return json.loads(Path(path).read_text())
  except (UnicodeDecodeError, ValueError) as error:
    raise StateUnreadable(
        f'{path} cannot be read ({type(error).__name__}: {error}). Put back '
        f'an intact copy, or move it away to start {afresh} afresh.') from None


def append_line(path, line):
  """Appends `line` and a newline to the text file `path`. A last line that
  a kill cut short gets its newline first, so that it does not swallow
  this one (readers skip the cut line alone). A failed write's error
  names `path`, as a buffered file's does not (`with_path`)."""
  try:
    with open(path, 'a+b') as file:
      if file.tell() and (file.seek(-1, os.SEEK_END), file.read(1))[1] != b'\n':
        file.write(b'\n')
      file.write(line.encode() + b'\n')
  except OSError as error:
    raise with_path(error, path)
