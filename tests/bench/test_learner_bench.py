"""bench/learner/learner_bench.py's inputs: walker's spaces without
dm_control, and random batches that stay inside any task's spaces."""

import types

import numpy as np

from bench.learner import learner_bench
from dreamer_ver.envs import make_env


def test_walkers_spaces_need_no_dm_control():
  obs, act = learner_bench.spaces()
  assert obs['orientations'].shape == (14,) and act['action'].shape == (6,)
  assert (act['action'].low == -1).all() and (act['action'].high == 1).all()


def test_random_batches_fill_every_space_within_its_range():
  env = make_env('dummy_disc')  # images, discrete and bounded spaces
  obs, act = env.obs_space, env.act_space
  env.close()
  rssm = types.SimpleNamespace(deter=8, stoch=2, classes=3)
  agent = types.SimpleNamespace(
      obs_space=obs, act_space=act, config=types.SimpleNamespace(
          agent=types.SimpleNamespace(rssm=rssm)))
  batch = learner_bench.random_batch(agent, 2, 5, seed=0)
  for key, space in {**obs, **act}.items():
    if space.dtype == bool and key != 'reset':
      assert batch[key].shape == (2, 5) and batch[key].dtype == bool
    elif key != 'reset':
      value = batch[key]
      assert value.shape == (2, 5, *space.shape), key
      assert value.dtype == space.dtype, key
      assert (value >= space.low).all() and (value <= space.high).all(), key
  assert batch['is_first'][:, 0].all() and not batch['is_first'][:, 1:].any()
  # Discrete actions are drawn over their classes, not left at zero.
  assert len(np.unique(batch['act_disc'])) > 1
  assert batch['dyn/deter'].shape == (2, 5, 8)
