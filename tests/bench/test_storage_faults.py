"""The chaos soak's storage faults (bench/soaks/faults.py): a filled file
system refuses the next write and takes it again once freed; a damaged
checkpoint is skipped and an older save resumed."""

import errno

import numpy as np
import pytest

from bench.soaks import faults
from dreamer_ver.agent.checkpoint import Checkpoint, newest_intact
from helpers.storage import can_mount


def _state(step):
  return {'params': {'w': np.full((4096,), step, np.float32),
                     'b': np.full((3,), step, np.float32)}}


def test_a_damaged_checkpoint_resumes_from_the_save_before_it(
    tmp_path, capsys):
  ckpt = Checkpoint(tmp_path, keep=3)
  for step in (100, 200, 300):
    ckpt.save(_state(step), {'steps': step, 'version': step // 100})
  assert faults.damage_checkpoint(tmp_path) == 300
  state, counters = newest_intact(ckpt, _state(0))
  # The newest kept save is the same file as the latest: damaged too.
  assert counters == {'steps': 200, 'version': 2}
  np.testing.assert_array_equal(state['params']['w'], 200)
  said = capsys.readouterr().out
  assert said.count('Skipped the unreadable checkpoint') == 1
  assert said.count('agent.npz (') == 2, said


@pytest.mark.skipif(not can_mount(), reason='mounting a tmpfs needs root')
def test_a_filled_file_system_refuses_the_next_write_until_freed(tmp_path):
  with faults.mounted(tmp_path / 'disk', 4) as disk:
    (disk / 'kept').write_bytes(b'x' * 100_000)
    filled = faults.fill(disk)
    assert 3_500_000 < filled < 4 * 2 ** 20
    with pytest.raises(OSError) as refused:
      with open(disk / 'next', 'wb') as file:
        file.write(b'y' * 8192)
    assert refused.value.errno == errno.ENOSPC
    faults.free(disk)
    (disk / 'next').write_bytes(b'y' * 1_000_000)
    assert (disk / 'kept').read_bytes() == b'x' * 100_000
  assert not (tmp_path / 'disk' / 'kept').exists()  # unmounted
