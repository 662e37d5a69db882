"""Kept checkpoints (`agent/checkpoint.py`, `run.keep_checkpoints`): the
latest and the saves before it, each loadable with its own values; a
damaged latest (cut, flipped) resumes from the newest save that reads; a
save killed at any point leaves only whole saves behind."""

import builtins
import itertools
import os
import signal
import time

import jax
import numpy as np
import pytest

from dreamer_ver.agent.checkpoint import (
    Checkpoint, CheckpointMismatch, CheckpointUnreadable, newest_intact, save)
from dreamer_ver.core.atomic import write_json


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
  """A flipped byte in the data of the latest save's array `w`."""
  data = bytearray(path.read_bytes())
  data[data.index(state(400)['params']['w'].tobytes()) + 5] ^= 0xFF
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


def killed_at(point, do):
  """Runs `do()` in a forked child that SIGKILLs itself just before its
  `point`-th file operation (a write into a file, a rename, a link, a
  removal, an fsync), as a crash or the OOM killer would: no cleanup runs.
  Returns whether the child was killed (False: `do` made fewer
  operations and finished)."""
  pid = os.fork()
  if pid == 0:  # The child: plain file operations, no JAX computation.
    count = [0]

    def tick():
      count[0] += 1
      if count[0] == point:
        os.kill(os.getpid(), signal.SIGKILL)

    def counted(function):
      return lambda *args, **kwargs: (tick(), function(*args, **kwargs))[1]

    class Writes:
      def __init__(self, file):
        self.file = file

      def write(self, data):
        tick()
        return self.file.write(data)

      def __getattr__(self, name):
        return getattr(self.file, name)

      def __enter__(self):
        return self

      def __exit__(self, *error):
        return self.file.__exit__(*error)

    opened = builtins.open
    builtins.open = lambda *args, **kwargs: Writes(opened(*args, **kwargs))
    for name in ('replace', 'link', 'unlink', 'rmdir', 'fsync'):
      setattr(os, name, counted(getattr(os, name)))
    try:
      do()
    finally:
      os._exit(0)
  deadline = time.monotonic() + 30
  while time.monotonic() < deadline:
    done, status = os.waitpid(pid, os.WNOHANG)
    if done:
      return os.WIFSIGNALED(status)
    time.sleep(0.01)
  os.kill(pid, signal.SIGKILL)
  os.waitpid(pid, 0)
  raise AssertionError(f'the save at point {point} did not end in 30 s')


def big_state(value):
  """A state whose file takes many writes (three arrays of 4 KB)."""
  return {'params': {name: np.full((1000,), value, np.float32)
                     for name in ('a', 'b', 'c')}, 'step': np.int64(value)}


def test_a_save_killed_at_any_point_leaves_whole_saves_that_agree(tmp_path):
  # Before each point of the save of step 300 (its file's writes, the
  # renames, the kept save's link and the old save's removal) a kill:
  # what reads afterwards is a save whose arrays and counters are one
  # save's, 200 or 300; every kept save is whole; and the next save
  # leaves the latest and keep - 1 whole saves, nothing half made.
  points = 0
  for point in itertools.count(1):
    folder = tmp_path / str(point)
    ckpt = Checkpoint(folder, keep=3)
    for step in (100, 200):
      ckpt.save(big_state(step), {'steps': step, 'version': step // 100})
    if not killed_at(point, lambda: ckpt.save(
        big_state(300), {'steps': 300, 'version': 3})):
      break
    points += 1
    loaded, counters = newest_intact(ckpt, big_state(0))
    assert counters['steps'] in (200, 300), (point, counters)
    assert counters == {'steps': counters['steps'],
                        'version': counters['steps'] // 100}, point
    for leaf in jax.tree.leaves(loaded):
      np.testing.assert_array_equal(leaf, counters['steps'], err_msg=point)
    for kept in ckpt.saved():
      state, kept_counters = Checkpoint(kept).load(big_state(0))
      assert kept.name == f"{kept_counters['steps']:012d}", (point, kept)
      assert int(state['step']) == kept_counters['steps'], (point, kept)
    # Killed before its kept copy was made, save 300 has none after 400.
    kept = [p.name for p in ckpt.saved()] + ['000000000400']
    ckpt.save(big_state(400), {'steps': 400, 'version': 4})
    assert [p.name for p in ckpt.saved()] == kept[-2:], point
    assert sorted(p.name for p in (folder / 'ckpt' / 'saved').iterdir()) == (
        kept[-2:]), point
    assert not list((folder / 'ckpt').glob('*.tmp')), point
  assert points > 20, points  # the writes, renames and removals were hit


def test_a_save_without_counters_inside_reads_them_from_counters_json(
    tmp_path):
  # Saves written before the counters went into agent.npz still resume.
  ckpt = Checkpoint(tmp_path)
  save(state(5), ckpt.directory / 'agent.npz')
  write_json(ckpt.directory / 'counters.json', {'steps': 5, 'version': 1})
  loaded, counters = ckpt.load(state(0))
  assert counters == {'steps': 5, 'version': 1}
  np.testing.assert_array_equal(loaded['params']['w'], [5] * 3)
