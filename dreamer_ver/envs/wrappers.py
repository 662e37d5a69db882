"""Wrappers that give the agent one uniform view of every env.

``make_env`` stacks them as NormalizeAction -> UnifyDtypes -> CheckSpaces ->
ClipAction (innermost first), so the agent acts in [-1, 1] with float32 /
int32 / bool / uint8 arrays only, and any space violation is caught at the
boundary where it happens instead of deep inside the learner.
"""

import elements
import numpy as np

from dreamer_ver.core.transitions import is_log

from . import base


class Wrapper(base.Env):
  """Forwards everything it does not override to the wrapped env."""

  def __init__(self, env):
    self.env = env

  @property
  def obs_space(self):
    return self.env.obs_space

  @property
  def act_space(self):
    return self.env.act_space

  def step(self, action):
    return self.env.step(action)

  def render_frames(self, on):
    # base.Env defines it, so __getattr__ would never forward it.
    self.env.render_frames(on)

  def close(self):
    self.env.close()

  def __getattr__(self, name):
    # Only reached for attributes this wrapper lacks; dunder lookups must not
    # recurse (e.g. while unpickling, before ``env`` is set).
    if name.startswith('__') or name == 'env':
      raise AttributeError(name)
    return getattr(self.env, name)


class NormalizeAction(Wrapper):
  """Lets the agent emit ``key`` in [-1, 1]; rescales to the env's bounds.

  Dimensions with an infinite bound are passed through unchanged.
  """

  def __init__(self, env, key='action'):
    super().__init__(env)
    self._key = key
    space = env.act_space[key]
    self._inner = space
    self._mask = np.isfinite(space.low) & np.isfinite(space.high)
    self._low = np.where(self._mask, space.low, -1.0)
    self._high = np.where(self._mask, space.high, 1.0)
    low = np.where(self._mask, -1.0, space.low)
    high = np.where(self._mask, 1.0, space.high)
    self._space = elements.Space(np.float32, space.shape, low, high)

  @property
  def act_space(self):
    return {**self.env.act_space, self._key: self._space}

  def step(self, action):
    value = np.asarray(action[self._key])
    scaled = self._low + (value + 1) / 2 * (self._high - self._low)
    scaled = np.where(self._mask, scaled, value).astype(self._inner.dtype)
    return self.env.step({**action, self._key: scaled})


class ClipAction(Wrapper):
  """Clips ``key`` into [low, high]; policy samples may overshoot slightly."""

  def __init__(self, env, key='action', low=-1.0, high=1.0):
    super().__init__(env)
    self._key = key
    self._low = low
    self._high = high

  def step(self, action):
    if self._key not in action:  # Let CheckSpaces report the missing key.
      return self.env.step(action)
    value = np.asarray(action[self._key])
    clipped = np.clip(value, self._low, self._high).astype(value.dtype)
    return self.env.step({**action, self._key: clipped})


def _unified_dtype(dtype):
  dtype = np.dtype(dtype)
  if dtype == bool or dtype == np.uint8:
    return dtype
  if np.issubdtype(dtype, np.floating):
    return np.dtype(np.float32)
  if np.issubdtype(dtype, np.integer):
    return np.dtype(np.int32)
  return dtype


def _unified_space(space):
  dtype = _unified_dtype(space.dtype)
  if dtype == space.dtype:
    return space
  low, high = space.low, space.high
  if dtype == np.int32:  # e.g. int64's default bounds would overflow.
    info = np.iinfo(np.int32)
    low = np.clip(low, info.min, info.max)
    high = np.clip(high, info.min, info.max)
  return elements.Space(dtype, space.shape, low, high)


class UnifyDtypes(Wrapper):
  """Floats become float32 and ints int32; bool and uint8 stay as they are.

  Actions are cast back to the dtypes the wrapped env declared.
  """

  def __init__(self, env):
    super().__init__(env)
    self._obs_space = {k: _unified_space(v) for k, v in env.obs_space.items()}
    self._act_space = {k: _unified_space(v) for k, v in env.act_space.items()}
    self._act_dtypes = {k: v.dtype for k, v in env.act_space.items()}

  @property
  def obs_space(self):
    return self._obs_space

  @property
  def act_space(self):
    return self._act_space

  def step(self, action):
    action = {
        k: np.asarray(v, self._act_dtypes[k]) if k in self._act_dtypes else v
        for k, v in action.items()}
    obs = self.env.step(action)
    return {
        k: np.asarray(v, self._obs_space[k].dtype)
        if k in self._obs_space else v
        for k, v in obs.items()}


_PYTHON_KINDS = {bool: 'b', int: 'i', float: 'f'}


def space_violation(value, space):
  """Why ``value`` is not in ``space``, or None if it is.

  Unlike ``elements.Space.__contains__`` this treats ``high`` of an integer
  space as exclusive, matching how discrete spaces are declared, and
  rejects non-finite floats.
  """
  if not isinstance(value, (np.ndarray, np.generic, bool, int, float)):
    return f'type {type(value).__name__} is not an array or scalar'
  array = np.asarray(value)
  # Python scalars carry no width, so for them only the kind must match.
  kind_only = _PYTHON_KINDS.get(type(value)) == space.dtype.kind
  if array.dtype != space.dtype and not kind_only:
    return f'dtype {array.dtype} != {space.dtype}'
  if array.shape != space.shape:
    return f'shape {array.shape} != {space.shape}'
  if space.dtype == bool or array.size == 0:
    return None
  if np.issubdtype(space.dtype, np.floating) and not np.isfinite(array).all():
    return 'contains non-finite values'
  if (array < space.low).any():
    return f'values below low={space.low.min()}'
  if np.issubdtype(space.dtype, np.integer):
    # An int space's high is exclusive (classes = high - low), except where
    # it is the dtype's maximum, which elements uses as the default bound.
    top = np.iinfo(space.dtype).max
    over = np.where(space.high < top, array >= space.high, array > top)
    if over.any():
      return f'values at or above high={space.high.min()} (exclusive)'
  elif (array > space.high).any():
    return f'values above high={space.high.max()}'
  return None


class CheckSpaces(Wrapper):
  """Asserts that every action and observation lies in its declared space.

  An observation may lack a ``log/`` key (frames are rendered only on
  request, see ``base``); every other key must be there.
  """

  def __init__(self, env):
    overlap = env.obs_space.keys() & env.act_space.keys()
    if overlap:
      raise ValueError(f'Keys in both obs and act space: {sorted(overlap)}')
    super().__init__(env)

  def step(self, action):
    self._check(action, self.env.act_space, 'action')
    obs = self.env.step(action)
    spaces = {k: v for k, v in self.env.obs_space.items()
              if k in obs or not is_log(k)}
    self._check(obs, spaces, 'observation')
    return obs

  def _check(self, values, spaces, kind):
    missing = spaces.keys() - values.keys()
    extra = values.keys() - spaces.keys()
    if missing or extra:
      raise ValueError(
          f'{kind} keys do not match the {kind} space: '
          f'missing {sorted(missing)}, unexpected {sorted(extra)}.')
    for key, space in spaces.items():
      reason = space_violation(values[key], space)
      if reason:
        value = values[key]
        raise ValueError(
            f"Invalid {kind} '{key}': {reason}. Expected dtype "
            f'{space.dtype}, shape {space.shape}, low {_bound(space.low)}, '
            f'high {_bound(space.high)}; received {type(value).__name__} '
            f'with dtype {np.asarray(value).dtype}, shape '
            f'{np.asarray(value).shape}: {_preview(value)}')


def _bound(array):
  lo, hi = np.min(array), np.max(array)
  return lo if lo == hi else f'[{lo}..{hi}]'


def _preview(value):
  text = np.array2string(np.asarray(value), threshold=20, edgeitems=3)
  return text if len(text) < 200 else text[:200] + '...'
