"""LocoNav (``loconav_ant_<maze>``: loconav_ant_maze_s, loconav_ant_maze_m,
loconav_ant_maze_l), DreamerV3's locomotion-and-navigation tasks: dm_control's
Ant walks through a fixed maze whose walls are coloured by section, from its
spawn point to a goal sphere, seeing through its own camera.

Obs: ``image``, the walker's egocentric camera (64, 64, 3) uint8; its
proprioception as float32 vectors (dm_control's keys, ``/`` as ``_``); and
``log/coverage``, the number of 1 x 1 floor cells visited this episode
(logged, not seen by the agent). Act: ``action``, the 8 joint torques in
[-1, 1]. Reaching the goal pays 1 and respawns the Ant; after ``goals``
goals the episode ends (terminal); else it ends after ``length`` steps
(``is_last`` only). The mazes are ours (DreamerV3's loconav has larger
ones and a quadruped too). Rendering uses ``MUJOCO_GL`` from the
environment, defaulting to ``egl`` as for ``dmc``.
"""

import os

import elements
import numpy as np

from . import base
from .dmc import proprio_keys, proprio_obs, proprio_spaces

# Walls are digits (each its colour), '.' floor, 'P' the spawn, 'G' the goal.
MAZES = {
    'maze_s': (
        '1111112222',
        '1P.......2',
        '1........2',
        '4444444..2',
        '3........2',
        '3.G......2',
        '3333333332',
    ),
    'maze_m': (
        '11111111222',
        '1P........2',
        '1.........2',
        '44444444..2',
        '5.........6',
        '5.........6',
        '5..77777776',
        '5.........6',
        '5......G..6',
        '55555555666',
    ),
    'maze_l': (
        '11111111112222',
        '1P...........2',
        '1............2',
        '444444444....2',
        '5............6',
        '5............6',
        '5....777777776',
        '5....7.......6',
        '5....7..G....6',
        '5....7.......6',
        '5.........8888',
        '5............8',
        '55555555588888',
    ),
}
COLOURS = {  # wall character -> RGB
    '1': (0.85, 0.3, 0.3), '2': (0.3, 0.7, 0.3), '3': (0.3, 0.4, 0.85),
    '4': (0.9, 0.75, 0.2), '5': (0.7, 0.35, 0.8), '6': (0.2, 0.75, 0.8),
    '7': (0.95, 0.55, 0.2), '8': (0.55, 0.55, 0.55),
}
CAMERA = 'walker/egocentric_camera'
CONTROL_SECONDS = 0.02  # 50 Hz, as upstream
PHYSICS_SECONDS = 0.005


class LocoNav(base.Env):

  def __init__(self, task, seed=0, length=3000, goals=1):
    walker, _, maze = task.partition('_')
    if walker != 'ant' or maze not in MAZES:
      raise ValueError(
          f'unknown loconav task {task!r}; tasks: '
          f"{', '.join('loconav_ant_' + m for m in MAZES)}")
    if int(goals) < 1 or int(length) < 1:
      raise ValueError(f'loconav needs goals >= 1 and length >= 1, got '
                       f'{goals}, {length}')
    os.environ.setdefault('MUJOCO_GL', 'egl')
    self._goals = int(goals)
    self._env, self._walker = _build(MAZES[maze], int(length), self._goals,
                                     np.random.RandomState(seed))
    specs = self._env.observation_spec()
    self._keys = proprio_keys(specs, skip=(CAMERA,))
    self._spaces = proprio_spaces(specs, self._keys)
    self._image_shape = tuple(specs[CAMERA].shape)
    self._done = True
    self._reached = 0
    self._visited = set()

  @property
  def obs_space(self):
    return {**self._spaces, **base.basic_obs_space(),
            'image': elements.Space(np.uint8, self._image_shape),
            'log/coverage': elements.Space(np.int32)}

  @property
  def act_space(self):
    spec = self._env.action_spec()
    return {'reset': elements.Space(bool),
            'action': elements.Space(np.float32, spec.shape, -1, 1)}

  def step(self, action):
    if action['reset'] or self._done:
      self._done = False
      self._reached = 0
      self._visited = set()
      return self._obs(self._env.reset(), is_first=True)
    step = self._env.step(np.asarray(action['action'], np.float64))
    reward = float(step.reward or 0.0)
    self._reached += reward > 0
    self._done = step.last()
    done = self._reached >= self._goals or step.discount == 0
    return self._obs(step, reward, is_last=step.last(),
                     is_terminal=step.last() and done)

  def close(self):
    self._env.close()

  def _obs(self, step, reward=0.0, is_first=False, is_last=False,
           is_terminal=False):
    x, y, _ = self._walker.get_pose(self._env.physics)[0]
    self._visited.add((int(np.floor(x)), int(np.floor(y))))
    return {**proprio_obs(step.observation, self._keys),
            'image': np.asarray(step.observation[CAMERA], np.uint8),
            'log/coverage': np.int32(len(self._visited)),
            **base.basic_obs(reward, is_first, is_last, is_terminal)}


def _build(rows, length, goals, random_state):
  """(the composer environment, its walker) for a maze given as rows."""
  import labmaze
  from dm_control import composer, mjcf
  from dm_control.locomotion.arenas import labmaze_textures, mazes
  from dm_control.locomotion.props import target_sphere
  from dm_control.locomotion.tasks import random_goal_maze
  from dm_control.locomotion.walkers import ant

  class Walls(labmaze_textures.WallTextures):
    """One flat colour, so the walls tell the maze's sections apart."""

    def _build(self, rgb):
      self._mjcf_root = mjcf.RootElement(model='walls')
      self._textures = [self._mjcf_root.asset.add(
          'texture', type='2d', name='wall', builtin='flat', rgb1=rgb,
          width=32, height=32)]

  walls = {char: Walls(rgb) for char, rgb in COLOURS.items()
           if any(char in row for row in rows)}
  layout = ''.join(row.replace('.', ' ') + '\n' for row in rows)
  maze = labmaze.FixedMazeWithRandomGoals(
      entity_layer=layout, num_spawns=1, num_objects=1,
      random_state=random_state)
  arena = mazes.MazeWithTargets(
      maze, xy_scale=1.2, z_height=2.0, wall_textures=walls, name='maze')
  walker = ant.Ant()
  task = random_goal_maze.RepeatSingleGoalMaze(
      walker=walker, maze_arena=arena,
      target=target_sphere.TargetSphere(radius=1.2, height_above_ground=0.0),
      max_repeats=goals - 1, randomize_spawn_rotation=True,
      target_reward_scale=1.0, contact_termination=False,
      physics_timestep=PHYSICS_SECONDS, control_timestep=CONTROL_SECONDS)
  env = composer.Environment(
      task, time_limit=length * CONTROL_SECONDS, random_state=random_state,
      strip_singleton_obs_buffer_dim=True)
  return env, walker
