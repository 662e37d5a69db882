"""A full disk, emulated at the write calls (no test may mount a small file
system everywhere): `FullDisk(monkeypatch, service)` for the replay,
`full_appends(monkeypatch)` for the lines `atomic.append_line` appends; and
`can_mount()`, whether this process may mount a real one."""

import errno
import functools
import os
import subprocess
import tempfile

from dreamer_ver.core import atomic
from dreamer_ver.replay import chunk as chunklib
from dreamer_ver.replay import service as replay_service
from dreamer_ver.replay import wal as wallib


@functools.cache
def can_mount():
  """Whether this process may mount a tmpfs (root with CAP_SYS_ADMIN; a
  root container without it may not), tried once."""
  if os.geteuid() != 0:
    return False
  with tempfile.TemporaryDirectory() as folder:
    mounted = subprocess.run(
        ['mount', '-t', 'tmpfs', '-o', 'size=1m', 'tmpfs', folder],
        capture_output=True).returncode == 0
    if mounted:
      subprocess.run(['umount', folder], check=True)
  return mounted


def refuse(path):
  raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))


class HalfWrites:
  """An open file on a disk that fills up: half of each write lands, then
  ENOSPC without a file name (as a buffered file's write raises it)."""

  def __init__(self, file):
    self.file = file

  def write(self, data):
    self.file.write(bytes(data)[:len(data) // 2])
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

  def __getattr__(self, name):
    return getattr(self.file, name)

  def __enter__(self):
    return self

  def __exit__(self, *exc_info):
    self.file.close()


def full_appends(monkeypatch):
  """From now on each file `atomic.append_line` opens takes half of each
  write and fails (`HalfWrites`)."""
  builtin_open = open
  monkeypatch.setattr(atomic, 'open', lambda path, mode='r': (
      HalfWrites(builtin_open(path, mode)) if 'a' in mode
      else builtin_open(path, mode)), raising=False)


class FullDisk:
  """From now on every write of the replay `service` fails as on a full
  file system: the log's open segment takes half a record and fails, as
  do new segments, chunk files and the checkpoint's json. `monkeypatch`
  undoes it (the space is freed)."""

  def __init__(self, monkeypatch, service):
    if service.wal._file is not None:
      service.wal._file = HalfWrites(service.wal._file)
    builtin_open = open
    monkeypatch.setattr(wallib, 'open', lambda path, mode='r': (
        refuse(path) if set(mode) & set('wa') else builtin_open(path, mode)),
        raising=False)
    monkeypatch.setattr(chunklib, 'write_npz', lambda path, *a, **k: refuse(
        path))
    monkeypatch.setattr(replay_service, 'write_json', lambda path, _: refuse(
        path))
