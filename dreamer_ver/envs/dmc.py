"""DeepMind Control Suite tasks (``dmc_<domain>_<task>``, e.g. dmc_walker_walk).

Proprioceptive observations keep dm_control's keys, each flattened to a 1-D
float32 vector (the key ``reward``, used by a few tasks, is renamed
``obs_reward`` to avoid clashing with ours). The camera image is ``image``
when ``image`` is set, rendered every step. Otherwise, with ``log_image``,
the space holds ``log/image`` for videos; as a frame costs over a hundred
physics steps, it is rendered only after ``render_frames(True)`` (an
evaluation recording its video) and absent from the observations otherwise.
``log_image`` False drops the key (useful where no OpenGL backend is
available). The single action key is ``action`` with the task's bounds.
``repeat`` repeats each action, summing rewards. Suite episodes only end
by time limit, so ``is_terminal`` is set only when dm_control reports
discount 0.

dm_control is imported lazily. Rendering uses ``MUJOCO_GL`` from the
environment, defaulting to ``egl``, which also works on CPU-only machines
with Mesa's software EGL.
"""

import os

import elements
import numpy as np

from . import base


class DMC(base.Env):

  DEFAULT_CAMERAS = {'quadruped': 2}
  ALIASES = {'cup': 'ball_in_cup'}

  def __init__(
      self, task, repeat=1, size=(64, 64), proprio=True, image=True,
      camera=-1, log_image=True, seed=0):
    os.environ.setdefault('MUJOCO_GL', 'egl')
    from dm_control import suite
    domain, name = _split(task, suite.ALL_TASKS, self.ALIASES)
    self._env = suite.load(domain, name, task_kwargs={'random': seed})
    self._repeat = int(repeat)
    self._size = tuple(size)
    self._proprio = proprio
    self._camera = self.DEFAULT_CAMERAS.get(domain, 0) if camera == -1 else (
        camera)
    self._image_key = 'image' if image else ('log/image' if log_image else None)
    self._rendering = bool(image)  # The agent's image is always rendered.
    self._done = True
    self._keys = proprio_keys(self._env.observation_spec()) if proprio else {}

  @property
  def obs_space(self):
    specs = self._env.observation_spec()
    spaces = proprio_spaces(specs, self._keys)
    if self._image_key:
      spaces[self._image_key] = elements.Space(np.uint8, self._size + (3,))
    return {**spaces, **base.basic_obs_space()}

  @property
  def act_space(self):
    spec = self._env.action_spec()
    return {
        'reset': elements.Space(bool),
        'action': elements.Space(
            spec.dtype, spec.shape, spec.minimum, spec.maximum),
    }

  def step(self, action):
    if action['reset'] or self._done:
      self._done = False
      return self._obs(self._env.reset(), 0.0, is_first=True)
    reward = 0.0
    for _ in range(self._repeat):
      step = self._env.step(action['action'])
      reward += step.reward or 0.0
      if step.last():
        break
    self._done = step.last()
    return self._obs(
        step, reward, is_last=step.last(), is_terminal=step.discount == 0)

  def render_frames(self, on):
    if self._image_key == 'log/image':
      self._rendering = bool(on)

  def close(self):
    self._env.close()

  def _obs(self, step, reward, is_first=False, is_last=False,
           is_terminal=False):
    obs = proprio_obs(step.observation, self._keys)
    if self._rendering:
      obs[self._image_key] = self._env.physics.render(
          *self._size, camera_id=self._camera)
    return {**obs, **base.basic_obs(reward, is_first, is_last, is_terminal)}


def proprio_keys(specs, skip=()):
  """dm_control key -> our key, for the non-empty entries of an observation
  spec but those in `skip` (``/`` becomes ``_``; ``reward`` becomes
  ``obs_reward``)."""
  keys = {}
  for key, spec in specs.items():
    if key not in skip and int(np.prod(spec.shape)) > 0:
      ours = key.replace('/', '_')
      keys[key] = 'obs_reward' if ours == 'reward' else ours
  return keys


def proprio_spaces(specs, keys):
  """A float32 vector space per key of `proprio_keys`."""
  return {ours: elements.Space(np.float32, (int(np.prod(specs[key].shape)),))
          for key, ours in keys.items()}


def proprio_obs(observation, keys):
  """The observation's entries as flat float32 vectors, under our keys."""
  return {ours: np.asarray(observation[key], np.float32).reshape(-1)
          for key, ours in keys.items()}


def _split(task, all_tasks, aliases):
  """Splits 'point_mass_easy' into ('point_mass', 'easy').

  Domain names may contain underscores, so match against the known tasks.
  """
  for alias, domain in aliases.items():
    if task.startswith(alias + '_'):
      task = domain + task[len(alias):]
  for domain, name in all_tasks:
    if task == f'{domain}_{name}':
      return domain, name
  known = ', '.join(sorted(f'{d}_{n}' for d, n in all_tasks))
  raise ValueError(f"Unknown dmc task '{task}'. Known tasks: {known}")
