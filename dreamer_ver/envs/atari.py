"""Atari games through ale-py (tasks ``atari_<game>`` and ``atari100k_<game>``,
e.g. atari_pong; the two suites differ only in their options, ``env.atari``
and ``env.atari100k`` in defaults.yaml).

Follows the protocol used by DreamerV3: each policy step repeats the action
for ``repeat`` frames and the image aggregates the last ``pooling`` frames
(``aggregate`` max or mean; the max removes sprite flicker), resized to
``size``. With ``sticky`` the emulator repeats the previous action with
probability 0.25 (the Atari 57 protocol; off for Atari 100k). Episodes
start with a random number of no-ops in [0, ``noops``] and are cut after
``length`` frames. The observation is ``image`` (uint8, 3 or 1 channels);
the action is ``action``, an int32 index into the minimal (``needed``) or
full (``all``) action set. ``autostart`` presses FIRE after each reset.
``is_terminal`` is set only on game over (or a
life loss with lives='discount'/'reset'), not when the time limit cuts the
episode; upstream marks both as terminal.

ale-py is imported lazily so that other suites work without it.
"""

import threading

import elements
import numpy as np

from . import base
from . import resize as resize_lib

# ROM loading in ALE is not thread-safe.
_LOCK = threading.Lock()
# Indices in ALE's full action enumeration.
_NOOP, _FIRE, _UP = 0, 1, 2
_GRAY_WEIGHTS = np.array([0.299, 0.587, 0.114])
_ROM_ALIASES = {'james_bond': 'jamesbond'}


class Atari(base.Env):

  def __init__(
      self, game, size=(64, 64), repeat=4, sticky=False, gray=False,
      actions='needed', lives='unused', noops=30, length=108000, pooling=2,
      aggregate='max', resize='pillow', autostart=False, clip_reward=False,
      seed=0):
    import ale_py
    from ale_py import roms
    if actions not in ('needed', 'all'):
      raise ValueError(f"actions must be 'needed' or 'all', not {actions!r}")
    if lives not in ('unused', 'discount', 'reset'):
      raise ValueError(f'Unknown lives mode {lives!r}')
    if aggregate not in ('max', 'mean'):
      raise ValueError(f"aggregate must be 'max' or 'mean', not {aggregate!r}")
    if resize not in ('pillow', 'numpy'):
      raise ValueError(f"resize must be 'pillow' or 'numpy', not {resize!r}")
    if repeat < 1 or pooling < 1:
      raise ValueError('repeat and pooling must be at least 1')
    self._size = tuple(size)
    self._repeat = int(repeat)
    self._gray = gray
    self._lives_mode = lives
    self._noops = int(noops)
    self._length = length
    self._pooling = int(pooling)
    self._aggregate = aggregate
    # 'pillow' means Pillow's bilinear filter, via numpy if Pillow is absent.
    self._resize = 'auto' if resize == 'pillow' else 'numpy'
    self._autostart = autostart
    self._clip_reward = clip_reward
    self._rng = np.random.default_rng(seed)
    with _LOCK:
      self._ale = ale_py.ALEInterface()
      self._ale.setLoggerMode(ale_py.LoggerMode.Error)
      self._ale.setInt('random_seed', int(self._rng.integers(0, 2 ** 31)))
      self._ale.setFloat('repeat_action_probability', 0.25 if sticky else 0.0)
      self._ale.loadROM(roms.get_rom_path(_ROM_ALIASES.get(game, game)))
    self._actions = list(
        self._ale.getMinimalActionSet() if actions == 'needed'
        else self._ale.getLegalActionSet())
    self._can_fire = any(int(a.value) == _FIRE for a in self._actions)
    height, width = self._ale.getScreenDims()
    self._frames = np.zeros((self._pooling, height, width, 3), np.uint8)
    self._done = True
    self._frame_count = 0
    self._prev_lives = 0

  @property
  def obs_space(self):
    channels = 1 if self._gray else 3
    return {
        'image': elements.Space(np.uint8, self._size + (channels,)),
        **base.basic_obs_space(),
    }

  @property
  def act_space(self):
    return {
        'reset': elements.Space(bool),
        'action': elements.Space(np.int32, (), 0, len(self._actions)),
    }

  def step(self, action):
    if action['reset'] or self._done:
      self._reset()
      self._done = False
      return self._obs(0.0, is_first=True)
    index = int(action['action'])
    if not 0 <= index < len(self._actions):
      raise ValueError(f'Atari action {index} outside [0, {len(self._actions)})')
    reward, last, terminal = 0.0, False, False
    for i in range(self._repeat):
      reward += self._ale.act(self._actions[index])
      self._frame_count += 1
      lives = self._ale.lives()
      lost_life = 0 < lives < self._prev_lives
      self._prev_lives = lives
      if self._ale.game_over():
        last = terminal = True
      elif lost_life and self._lives_mode == 'discount':
        terminal = True
      elif lost_life and self._lives_mode == 'reset':
        last = terminal = True
      if self._length and self._frame_count >= self._length:
        last = True
      if i >= self._repeat - self._pooling or last or terminal:
        self._grab()
      if last or terminal:
        break
    self._done = last
    return self._obs(reward, is_last=last, is_terminal=terminal)

  def close(self):
    pass

  def _reset(self):
    with _LOCK:
      self._ale.reset_game()
    for _ in range(int(self._rng.integers(self._noops + 1))):
      self._ale.act(_NOOP)
      if self._ale.game_over():
        with _LOCK:
          self._ale.reset_game()
    if self._autostart and self._can_fire:
      # Games that wait for FIRE would otherwise stall a random policy.
      for act in (_FIRE, _UP):
        self._ale.act(act)
        if self._ale.game_over():
          with _LOCK:
            self._ale.reset_game()
    self._frame_count = 0
    self._prev_lives = self._ale.lives()
    self._grab()
    self._frames[1:] = self._frames[0]

  def _grab(self):
    """Shifts the frame history and stores the current screen first."""
    self._frames[1:] = self._frames[:-1].copy()
    self._ale.getScreenRGB(self._frames[0])

  def _obs(self, reward, is_first=False, is_last=False, is_terminal=False):
    if self._clip_reward:
      reward = np.sign(reward)
    if self._aggregate == 'max':
      image = self._frames.max(0)
    else:
      image = self._frames.mean(0).astype(np.uint8)
    image = resize_lib.resize(image, self._size, self._resize)
    if self._gray:
      image = (image @ _GRAY_WEIGHTS).astype(np.uint8)[..., None]
    return {
        'image': image,
        **base.basic_obs(reward, is_first, is_last, is_terminal),
    }
