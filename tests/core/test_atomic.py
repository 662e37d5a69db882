"""dreamer_ver/core/atomic.py: atomic writes and the one-line storage fault."""

import errno
import os

import pytest

from dreamer_ver.core import atomic

from dreamer_ver.config import validation
from helpers.storage import full_appends


@pytest.mark.parametrize('code', [errno.ENOSPC, errno.EDQUOT, errno.EROFS])
def test_a_full_or_read_only_disk_is_a_one_line_fault_naming_the_file(
    tmp_path, code):
  try:
    try:
      raise OSError(code, os.strerror(code))  # a buffered write's: no name
    except OSError as error:
      raise RuntimeError('2 replay file operations failed') from (
          atomic.with_path(error, tmp_path / 'replay_wal' / 'x.wal'))
  except RuntimeError as wrapped:
    fault = atomic.storage_fault(wrapped)
  message = str(fault)
  assert isinstance(fault, atomic.StorageFault) and '\n' not in message
  assert message.startswith(
      f'{os.strerror(code).lower()} writing {tmp_path}/replay_wal/x.wal (')
  assert ' MB free of ' in message  # of the folder that exists
  assert atomic.storage_fault(OSError(errno.EACCES, 'denied')) is None
  assert atomic.storage_fault(ValueError('no')) is None


def test_a_failed_atomic_write_leaves_the_old_file_and_no_temporary(
    tmp_path):
  path = tmp_path / 'state.json'
  atomic.write_json(path, {'step': 1})

  def fail(file):
    file.write(b'{"st')
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
  with pytest.raises(OSError) as raised:
    atomic.write_atomically(path, fail)
  assert raised.value.filename == str(path) + '.tmp'
  assert path.read_text() == '{"step": 1}'
  assert sorted(p.name for p in tmp_path.iterdir()) == ['state.json']


def test_the_data_reaches_the_disk_before_the_name_and_the_name_before_return(
    tmp_path, monkeypatch):
  # What a lost machine (not just a killed process) needs: the temporary
  # file's data synced before the rename, the folder's entry after it.
  calls = []
  real_fsync, real_replace = os.fsync, os.replace
  monkeypatch.setattr(os, 'fsync', lambda fd: (
      calls.append(('fsync', os.readlink(f'/proc/self/fd/{fd}'))),
      real_fsync(fd)))
  monkeypatch.setattr(os, 'replace', lambda a, b: (
      calls.append(('replace', str(b))), real_replace(a, b)))
  path = tmp_path / 'state.json'
  atomic.write_json(path, {'step': 1})
  assert calls == [('fsync', f'{path}.tmp'), ('replace', str(path)),
                   ('fsync', str(tmp_path))]
  assert path.read_text() == '{"step": 1}'


@pytest.mark.parametrize('damage', [lambda text: text[:len(text) // 2],
                                    lambda text: text.replace('{', '\xff')])
def test_a_state_file_that_does_not_read_back_is_one_line_naming_it(
    tmp_path, damage):
  path = tmp_path / 'ckpt' / 'logger.json'
  atomic.write_json(path, {'step': 12, 'episodes': 3})
  assert atomic.read_json(path, 'the counts') == {'step': 12, 'episodes': 3}
  path.write_bytes(damage(path.read_text()).encode('latin-1'))
  with pytest.raises(validation.ConfigError) as raised:  # exit code 2
    atomic.read_json(path, 'the counts')
  message = str(raised.value)
  assert isinstance(raised.value, atomic.StateUnreadable)
  assert '\n' not in message and message.startswith(f'{path} cannot be read (')
  assert message.endswith(
      'Put back an intact copy, or move it away to start the counts afresh.')


def test_a_line_the_disk_refuses_names_its_file(tmp_path, monkeypatch):
  """A buffered file's failed write names no file: the error names it, so
  its storage fault's one line does."""
  full_appends(monkeypatch)
  path = tmp_path / 'scores.jsonl'
  with pytest.raises(OSError) as raised:
    atomic.append_line(path, '{"step": 1}')
  assert raised.value.errno == errno.ENOSPC
  assert raised.value.filename == str(path)
  assert str(path) in str(atomic.storage_fault(raised.value))


def test_a_line_appended_after_one_a_kill_cut_short_is_read_whole(tmp_path):
  path = tmp_path / 'scores.jsonl'
  atomic.append_line(path, '{"step": 1}')
  with path.open('ab') as file:
    file.write(b'{"step": 2, "sc')  # the process killed mid-write
  atomic.append_line(path, '{"step": 3}')
  assert path.read_text().splitlines() == [
      '{"step": 1}', '{"step": 2, "sc', '{"step": 3}']
