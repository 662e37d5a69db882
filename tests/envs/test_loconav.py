"""LocoNav (`envs/loconav.py`): the Ant's spaces and camera, seeded mazes,
the goal's reward and the episode's end by value (the Ant put on the goal),
the floor cells it covers, and the time limit as `is_last` only."""

import numpy as np
import pytest

from dreamer_ver import envs
from dreamer_ver.envs.loconav import MAZES
from test_envs import assert_space

pytest.importorskip('dm_control')

STILL = {'action': np.zeros(8, np.float32), 'reset': False}


def reset(env):
  return env.step({**STILL, 'reset': True})


def put_on_goal(env):
  """Moves the Ant onto the goal sphere (the maze's one 'G')."""
  goal = env._env.task.root_entity.target_positions[0]
  env._walker.set_pose(env._env.physics, position=goal)
  return goal


def test_spaces_camera_and_seeded_spawns():
  env = envs.make_env('loconav_ant_maze_s', seed=3)
  space = env.obs_space
  assert_space(space['image'], np.uint8, (64, 64, 3))
  assert_space(space['walker_joints_pos'], np.float32, (8,))
  assert_space(space['log/coverage'], np.int32, ())
  action = env.act_space['action']
  assert (action.dtype, action.shape) == (np.float32, (8,))
  assert (action.low == -1).all() and (action.high == 1).all()
  first = reset(env)
  assert first['is_first'] and first['log/coverage'] == 1
  assert set(first) == set(space)
  for key, value in first.items():
    assert np.asarray(value).dtype == space[key].dtype, key
  # The camera sees the maze, and the view changes as the Ant moves.
  steps = [env.step({'action': np.full(8, sign, np.float32), 'reset': False})
           for sign in (1, -1) * 10]
  assert any((s['image'] != first['image']).any() for s in steps)
  assert not any(s['is_last'] or s['reward'] for s in steps)
  # The same seed spawns the Ant the same way.
  again = envs.make_env('loconav_ant_maze_s', seed=3)
  np.testing.assert_array_equal(reset(again)['image'], first['image'])
  for each in (env, again):
    each.close()
  with pytest.raises(ValueError, match='loconav_ant_maze_m'):
    envs.make_env('loconav_dog_maze_s')


def test_the_goal_pays_one_and_ends_the_episode_after_the_last_goal():
  env = envs.make_env('loconav_ant_maze_m', env_config={
      'loconav': {'goals': 2}})
  reset(env)
  goal = put_on_goal(env)
  first = env.step(STILL)
  # One goal of two: paid, and the Ant is back at its spawn, far away.
  assert first['reward'] == 1 and not first['is_last']
  pose = env._walker.get_pose(env._env.physics)[0]
  assert np.linalg.norm(pose[:2] - goal[:2]) > 3
  assert env.step(STILL)['reward'] == 0
  put_on_goal(env)
  last = env.step(STILL)
  assert last['reward'] == 1 and last['is_last'] and last['is_terminal']
  # Its visits: at least the spawn's cell and the goal's.
  assert last['log/coverage'] >= 2
  assert reset(env)['log/coverage'] == 1  # a new episode counts afresh
  env.close()


def test_the_time_limit_is_last_but_not_terminal():
  env = envs.make_env('loconav_ant_maze_l', env_config={
      'loconav': {'length': 5}})
  reset(env)
  steps = [env.step(STILL) for _ in range(5)]
  assert [s['is_last'] for s in steps] == [False] * 4 + [True]
  assert not steps[-1]['is_terminal']
  assert reset(env)['is_first']
  env.close()


def test_every_maze_is_a_closed_rectangle_with_one_spawn_and_one_goal():
  for name, rows in MAZES.items():
    assert len({len(row) for row in rows}) == 1, name
    text = ''.join(rows)
    assert text.count('P') == 1 and text.count('G') == 1, name
    border = rows[0] + rows[-1] + ''.join(r[0] + r[-1] for r in rows)
    assert all(char.isdigit() for char in border), name
