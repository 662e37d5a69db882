"""Memory Maze (``memmaze_<size>``: memmaze_9x9, memmaze_11x11,
memmaze_13x13, memmaze_15x15), DreamerV3's long-term memory benchmark:
a 3D maze in MuJoCo where the agent must reach targets of the colour shown
in the image's border, remembering where it saw each one.

The task is memory_maze's image-only one, as DreamerV3 runs it
(``MemoryMaze-<size>-v0``): obs ``image`` (64, 64, 3) uint8 (square,
``resolution`` pixels a side), act
``action`` (6 discrete moves). Episodes end by the maze's time limit
(1000 to 4000 steps by size: ``is_last``, not ``is_terminal``). Rendering
uses ``MUJOCO_GL`` from the environment, defaulting to ``egl`` as for
``dmc``.
"""

import os

import elements
import numpy as np

from . import base

SIZES = ('9x9', '11x11', '13x13', '15x15')


class MemoryMaze(base.Env):

  def __init__(self, task, seed=0, resolution=64):
    if task not in SIZES:
      raise ValueError(f'unknown memmaze task {task!r}; tasks: '
                       f"{', '.join('memmaze_' + s for s in SIZES)}")
    os.environ.setdefault('MUJOCO_GL', 'egl')
    from memory_maze import tasks
    self._env = getattr(tasks, f'memory_maze_{task}')(
        image_only_obs=True, camera_resolution=int(resolution), seed=seed)
    self._actions = int(self._env.action_spec().num_values)
    self._done = True

  @property
  def obs_space(self):
    shape = self._env.observation_spec().shape
    return {**base.basic_obs_space(),
            'image': elements.Space(np.uint8, shape)}

  @property
  def act_space(self):
    return {'action': elements.Space(np.int32, (), 0, self._actions),
            'reset': elements.Space(bool)}

  def step(self, action):
    if self._done or action['reset']:
      self._done = False
      return self._obs(self._env.reset(), is_first=True)
    step = self._env.step(int(action['action']))
    self._done = step.last()
    return self._obs(step, is_last=step.last(),
                     is_terminal=step.last() and step.discount == 0)

  def _obs(self, step, is_first=False, is_last=False, is_terminal=False):
    return {'image': np.asarray(step.observation, np.uint8),
            'reward': np.float32(step.reward or 0.0), 'is_first': is_first,
            'is_last': is_last, 'is_terminal': bool(is_terminal)}

  def close(self):
    self._env.close()
