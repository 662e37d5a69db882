"""Kept checkpoints (`agent/checkpoint.py`, `run.keep_checkpoints`): the
latest and the saves before it, each loadable with its own values."""

import numpy as np
import pytest

from dreamer_ver.agent.checkpoint import Checkpoint


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
