"""bench/learner/learner_bench.py's inputs: walker's spaces without
dm_control, and random batches that stay inside any task's spaces."""

import shutil
import subprocess
import types
from pathlib import Path

import numpy as np

from bench.learner import learner_bench, learner_pairs
from dreamer_ver.envs import make_env
from helpers import ROOT


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


def test_against_checks_out_the_commits_own_files():
  # `--against REV` builds the learner from REV's files: its folder holds
  # what git has at that commit, not the working tree's.
  git = lambda *a: subprocess.run(['git', '-C', str(ROOT), *a], check=True,
                                  capture_output=True).stdout
  first = git('rev-list', '--max-parents=0', 'HEAD').split()[0].decode()
  commit, folder = learner_bench.checkout(first)
  try:
    assert first.startswith(commit)
    names = sorted(str(p.relative_to(folder)) for p in Path(folder).rglob('*')
                   if p.is_file())
    assert names == sorted(git('ls-tree', '-r', '--name-only', first)
                           .decode().split())
    for name in names[:20]:
      assert (Path(folder) / name).read_bytes() == git(
          'show', f'{first}:{name}')
  finally:
    shutil.rmtree(folder)


def test_a_pairs_ratio_is_each_sides_median_over_ours():
  # Medians, not means: one slow round does not move a pair's ratio.
  times = {'ours': [0.2, 0.4, 0.3], 'against': [0.6, 0.1, 0.33],
           'upstream': [0.5, 0.5, 9.0, 0.4]}
  assert learner_pairs.pair_ratios(times) == {
      'against': round(0.33 / 0.3, 3), 'upstream': round(0.5 / 0.3, 3)}
