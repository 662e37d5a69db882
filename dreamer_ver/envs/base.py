"""The environment interface shared by every suite and wrapper.

An env is driven only through ``step(action)``. There is no separate
``reset()``: the action dict carries a boolean ``reset`` entry, so an actor
process can treat every env the same way and batch resets together with
ordinary steps. Each env also resets by itself on its first call and on the
call that follows an ``is_last`` observation.

Every observation dict holds the four bookkeeping entries returned by
``basic_obs_space()``. A reset step returns ``is_first=True`` and reward 0.
Keys starting with ``log/`` are for logging only and are not fed to the agent.

Frames rendered only for videos (e.g. dmc's ``log/image``) cost far more
than a physics step, so an env renders them only between
``render_frames(True)`` and ``render_frames(False)`` (off at first): a
``log/`` key listed in ``obs_space`` may be absent from an observation.
"""

import elements
import numpy as np


def basic_obs_space():
  """Spaces of the entries that every observation must contain."""
  return {
      'reward': elements.Space(np.float32),
      'is_first': elements.Space(bool),
      'is_last': elements.Space(bool),
      'is_terminal': elements.Space(bool),
  }


def basic_obs(reward=0.0, is_first=False, is_last=False, is_terminal=False):
  """The bookkeeping entries of one observation, with their final dtypes."""
  return {
      'reward': np.float32(reward),
      'is_first': bool(is_first),
      'is_last': bool(is_last),
      'is_terminal': bool(is_terminal),
  }


class Env:
  """Base class; subclasses define both spaces and ``step``."""

  @property
  def obs_space(self) -> dict:
    """Dict of ``elements.Space``, including ``basic_obs_space()``."""
    raise NotImplementedError

  @property
  def act_space(self) -> dict:
    """Dict of ``elements.Space``, including ``reset`` (bool)."""
    raise NotImplementedError

  def step(self, action: dict) -> dict:
    """Apply ``action`` (or reset when ``action['reset']``); return obs."""
    raise NotImplementedError

  def render_frames(self, on: bool):
    """Turns rendering of the ``log/`` frames on or off from the next step.

    Off until called; a no-op here, for envs that render no such frames."""

  def close(self):
    pass

  def __repr__(self):
    return (
        f'{type(self).__name__}(obs_space={self.obs_space}, '
        f'act_space={self.act_space})')
