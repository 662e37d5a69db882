"""Memory Maze (`envs/memmaze.py`): the image-only task of DreamerV3's
`memmaze_<size>` with our spaces, seeded mazes, and the time limit as
`is_last` only."""

import numpy as np
import pytest

from dreamer_ver import envs
from test_envs import assert_space

pytest.importorskip('memory_maze')


def test_memmaze_spaces_seeds_and_unknown_sizes():
  env = envs.make_env('memmaze_9x9', seed=3)
  assert_space(env.obs_space['image'], np.uint8, (64, 64, 3))
  space = env.act_space['action']
  assert (space.dtype, space.low, space.high) == (np.int32, 0, 6)
  first = env.step({'action': np.int32(0), 'reset': True})
  assert first['is_first'] and first['image'].shape == (64, 64, 3)
  frames = [env.step({'action': np.int32(a), 'reset': False})
            for a in (1, 1, 2, 2, 3)]
  assert not any(f['is_first'] or f['is_terminal'] for f in frames)
  # Moving changes the view; the same seed builds the same maze.
  assert any((f['image'] != first['image']).any() for f in frames)
  again = envs.make_env('memmaze_9x9', seed=3)
  np.testing.assert_array_equal(
      again.step({'action': np.int32(0), 'reset': True})['image'],
      first['image'])
  for each in (env, again):
    each.close()
  with pytest.raises(ValueError, match='memmaze_9x9'):
    envs.make_env('memmaze_10x10')
