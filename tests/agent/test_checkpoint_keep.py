"""Kept checkpoints (`agent/checkpoint.py`, `run.keep_checkpoints`): the
latest and the saves before it, each loadable with its own values; a
damaged latest (cut, flipped) resumes from the newest save that reads."""

import numpy as np
import pytest

from dreamer_ver.agent.checkpoint import (
    Checkpoint, CheckpointMismatch, CheckpointUnreadable, newest_intact)


def state(value):
  return {'params': {'w': np.full((3,), value, np.float32)},
          'step': np.int64(value)}


def test_the_latest_and_the_keep_minus_one_before_it_are_kept(tmp_path):
  ckpt = Checkpoint(tmp_path, keep=3)
  for step in (100, 200, 300, 400):
    ckpt.save(state(step), {'steps': step, 'version': step // 100})
  saved = ckpt.saved()
  assert [p.name for p in saved] == ['000000000300', '000000000400']
  loaded, counters = ckpt.load(state(0))
  assert counters['steps'] == 400 and loaded['params']['w'][0] == 400
  for path, step in zip(saved, (300, 400)):
    old = Checkpoint(path)  # What run.from_checkpoint names.
    assert old.exists
    loaded, counters = old.load(state(0))
    assert counters == {'steps': step, 'version': step // 100}
    np.testing.assert_array_equal(loaded['params']['w'], [step] * 3)
  # The newest kept save is the latest's file, not a copy.
  assert (saved[-1] / 'agent.npz').stat().st_ino == (
      ckpt.directory / 'agent.npz').stat().st_ino


def test_keep_one_keeps_only_the_latest(tmp_path):
  ckpt = Checkpoint(tmp_path)
  ckpt.save(state(1), {'steps': 1})
  ckpt.save(state(2), {'steps': 2})
  assert ckpt.saved() == [] and not (ckpt.directory / 'saved').exists()
  with pytest.raises(ValueError, match='keep must be >= 1'):
    Checkpoint(tmp_path, keep=0)


def saved_three(tmp_path):
  """A checkpoint folder of steps 200, 300, 400 kept, 400 the latest."""
  ckpt = Checkpoint(tmp_path, keep=3)
  for step in (200, 300, 400):
    ckpt.save(state(step), {'steps': step, 'version': step // 100})
  return ckpt


def cut(path):
  """What a full disk or a partial copy leaves: the file's first half."""
  data = path.read_bytes()
  path.write_bytes(data[:len(data) // 2])


def flip(path):
  """A flipped byte in the middle of the file (its arrays' data)."""
  data = bytearray(path.read_bytes())
  data[len(data) // 2] ^= 0xFF
  path.write_bytes(bytes(data))


@pytest.mark.parametrize('damage', [cut, flip])
def test_a_damaged_latest_resumes_from_the_newest_intact_save(
    tmp_path, capsys, damage):
  ckpt = saved_three(tmp_path)
  # In place: the newest kept save is the same file, so it is damaged too.
  damage(ckpt.directory / 'agent.npz')
  loaded, counters = newest_intact(ckpt, state(0))
  assert counters == {'steps': 300, 'version': 3}
  np.testing.assert_array_equal(loaded['params']['w'], [300] * 3)
  lines = capsys.readouterr().out.splitlines()
  assert len(lines) == 2, lines
  assert lines[0].startswith('Skipped the unreadable checkpoint')
  assert str(ckpt.directory / 'agent.npz') in lines[0]
  assert str(ckpt.saved()[-1] / 'agent.npz') in lines[0]
  assert lines[1] == (f'Agent resumed at step 300 (params version 3) from '
                      f'{ckpt.saved()[0]}.')


def test_an_intact_latest_is_loaded_without_a_word_of_damage(
    tmp_path, capsys):
  ckpt = saved_three(tmp_path)
  _, counters = newest_intact(ckpt, state(0))
  assert counters['steps'] == 400
  assert 'Skipped' not in capsys.readouterr().out


def test_no_intact_save_is_one_line_that_names_the_files(tmp_path):
  ckpt = saved_three(tmp_path)
  for path in [ckpt.directory, *ckpt.saved()]:
    cut(path / 'agent.npz')
  (ckpt.saved()[0] / 'counters.json').write_text('{"steps": 3')
  with pytest.raises(CheckpointUnreadable) as error:
    newest_intact(ckpt, state(0))
  message = str(error.value)
  assert '\n' not in message
  for path in [ckpt.directory, *ckpt.saved()]:
    assert str(path / 'agent.npz') in message
  assert (f'move {ckpt.directory / "agent.npz"} and {ckpt.directory / "saved"}'
          ' away to start the agent afresh') in message


def test_a_save_of_another_config_is_not_skipped_as_damaged(tmp_path):
  ckpt = saved_three(tmp_path)
  other = {'params': {'w': np.zeros((4,), np.float32)}, 'step': np.int64(0)}
  with pytest.raises(CheckpointMismatch, match=r"w'\]: expected float32\[4\]"):
    newest_intact(ckpt, other)
