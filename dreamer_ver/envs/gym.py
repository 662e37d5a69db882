"""Adapter from any gymnasium env to our interface (tasks ``gym_<id>``).

Observation keys: a single Box observation becomes ``image`` when it looks
like a picture (uint8, rank 3) and ``vector`` otherwise; a Dict observation
keeps its keys, nested dicts joined with '/' (a key that clashes with
``reward``, ``is_first``, ``is_last``, ``is_terminal`` or ``reset`` gets a
``gym_`` prefix). With ``pixels=True`` the observation is replaced by
``image``, rendered as rgb_array and resized to ``size``. Actions live under
``action`` (or the flattened Dict keys): Discrete -> int32 scalar with ``n``
classes, Box -> its float array.

``is_terminal`` comes from gymnasium's ``terminated`` and ``is_last`` from
``terminated or truncated``, so time limits are not mistaken for deaths.

``gymnasium.make`` gets ``max_episode_steps`` when it is positive (0 keeps
the env's registered limit) and the entries of ``make_kwargs``: a mapping,
or as the config holds it a YAML flow mapping such as
``'{continuous: true, gravity: -9.0}'`` (JSON works too). The time limit and
``render_mode`` have their own options and are refused there.
"""

import collections.abc

import elements
import gymnasium
import numpy as np
from ruamel.yaml import YAML
from ruamel.yaml.error import YAMLError

from . import base
from . import resize as resize_lib


class FromGym(base.Env):

  def __init__(
      self, env_id, pixels=False, size=(64, 64), max_episode_steps=0,
      make_kwargs='{}', seed=0):
    kwargs = _parse_make_kwargs(make_kwargs)
    if max_episode_steps < 0:
      raise ValueError(
          f'max_episode_steps must be >= 0 (0: the env\'s own limit), got '
          f'{max_episode_steps}')
    if max_episode_steps:
      kwargs['max_episode_steps'] = int(max_episode_steps)
    if pixels:
      kwargs['render_mode'] = 'rgb_array'
    self._env = gymnasium.make(env_id, **kwargs)
    self._pixels = pixels
    self._size = tuple(size)
    self._seed = seed
    self._seeded = False
    self._done = True
    self._env.action_space.seed(seed)
    obs_space = self._env.observation_space
    self._obs_leaves = _leaves(obs_space, _default_obs_key(obs_space))
    self._act_leaves = _leaves(self._env.action_space, 'action')

  @property
  def obs_space(self):
    if self._pixels:
      spaces = {'image': elements.Space(np.uint8, self._size + (3,))}
    else:
      spaces = {k: _convert(v) for k, (_, v) in self._obs_leaves.items()}
    return {**spaces, **base.basic_obs_space()}

  @property
  def act_space(self):
    spaces = {k: _convert(v) for k, (_, v) in self._act_leaves.items()}
    return {'reset': elements.Space(bool), **spaces}

  def step(self, action):
    if action['reset'] or self._done:
      seed = None if self._seeded else self._seed
      self._seeded = True
      obs, _ = self._env.reset(seed=seed)
      self._done = False
      return self._obs(obs, 0.0, is_first=True)
    act = {}
    for key, (path, space) in self._act_leaves.items():
      act = _insert(act, path, _to_gym(action[key], space))
    obs, reward, terminated, truncated, _ = self._env.step(act)
    self._done = bool(terminated or truncated)
    return self._obs(obs, reward, is_last=self._done, is_terminal=terminated)

  def close(self):
    self._env.close()

  def _obs(self, obs, reward, is_first=False, is_last=False, is_terminal=False):
    if self._pixels:
      frame = np.asarray(self._env.render(), np.uint8)
      values = {'image': resize_lib.resize(frame, self._size)}
    else:
      values = {
          key: _from_gym(_lookup(obs, path), space)
          for key, (path, space) in self._obs_leaves.items()}
    return {**values, **base.basic_obs(reward, is_first, is_last, is_terminal)}


_RESERVED = ('reward', 'is_first', 'is_last', 'is_terminal', 'reset')
# make kwargs that other options set: {key: the option to use instead}.
_OWN_OPTIONS = {
    'max_episode_steps': 'env.gym.max_episode_steps',
    'render_mode': 'env.gym.pixels',
}


def _parse_make_kwargs(make_kwargs):
  """The dict of extra ``gymnasium.make`` kwargs, from a mapping or a YAML
  flow-mapping string; raises ValueError with the offending text."""
  if isinstance(make_kwargs, str):
    try:
      parsed = YAML(typ='safe').load(make_kwargs)
    except YAMLError as e:
      problem = getattr(e, 'problem', None) or str(e).strip().splitlines()[0]
      raise ValueError(
          f'env.gym.make_kwargs {make_kwargs!r} is not a YAML flow mapping: '
          f'{problem}')
    make_kwargs = {} if parsed is None else parsed
  if not isinstance(make_kwargs, collections.abc.Mapping) or not all(
      isinstance(k, str) for k in make_kwargs):
    raise ValueError(
        'env.gym.make_kwargs must be a mapping of names to values such as '
        f"'{{continuous: true}}', got {make_kwargs!r}")
  for key, option in _OWN_OPTIONS.items():
    if key in make_kwargs:
      raise ValueError(
          f'env.gym.make_kwargs may not set {key}; use {option} instead')
  return dict(make_kwargs)


def _default_obs_key(space):
  image = (
      isinstance(space, gymnasium.spaces.Box) and space.dtype == np.uint8 and
      len(space.shape) == 3)
  return 'image' if image else 'vector'


def _leaves(space, key, path=()):
  """Maps our flat key to (path into the gym nest, leaf space).

  Non-Dict spaces are a single leaf named ``key`` with the empty path. Keys
  that would clash with our bookkeeping keys get a ``gym_`` prefix.
  """
  if not isinstance(space, gymnasium.spaces.Dict):
    return {key: (path, space)}
  result = {}
  for name, sub in space.spaces.items():
    sub_path = path + (name,)
    flat = '/'.join(sub_path)
    flat = f'gym_{flat}' if flat in _RESERVED else flat
    result.update(_leaves(sub, flat, sub_path))
  return result


def _lookup(nest, path):
  for part in path:
    nest = nest[part]
  return nest


def _insert(nest, path, value):
  """Sets ``value`` at ``path``; the empty path replaces the whole nest."""
  if not path:
    return value
  node = nest
  for part in path[:-1]:
    node = node.setdefault(part, {})
  node[path[-1]] = value
  return nest


def _convert(space):
  """The ``elements.Space`` for one gymnasium leaf space."""
  spaces = gymnasium.spaces
  if isinstance(space, spaces.Discrete):
    return elements.Space(np.int32, (), 0, int(space.n))
  if isinstance(space, spaces.MultiDiscrete):
    return elements.Space(np.int32, space.shape, 0, space.nvec)
  if isinstance(space, spaces.MultiBinary):
    return elements.Space(np.int32, space.shape, 0, 2)
  if isinstance(space, spaces.Box):
    return elements.Space(space.dtype, space.shape, space.low, space.high)
  raise TypeError(f'Unsupported gymnasium space: {space}')


def _from_gym(value, space):
  if isinstance(space, gymnasium.spaces.Discrete):
    return np.int32(int(value) - int(space.start))
  return np.asarray(value)


def _to_gym(value, space):
  if isinstance(space, gymnasium.spaces.Discrete):
    return int(value) + int(space.start)
  if isinstance(space, gymnasium.spaces.MultiDiscrete):
    return np.asarray(value, space.dtype) + space.start
  return np.asarray(value, space.dtype)
