"""PinPad (`envs/pinpad.py`) by value: the pads pressed in order pay 10
once, the room glows, the player respawns with the presses forgotten; a
wrong order or a repeated press pays nothing; the image shows the player,
the pads and the presses."""

import numpy as np
import pytest

from dreamer_ver import envs
from dreamer_ver.envs import pinpad
from test_envs import assert_space

STAY = {'action': 0, 'reset': False}


def walk(env, cell, y_first=False):
  """Steps towards `cell` (x first, then y); returns the rewards."""
  rewards = []
  while env.player != cell:
    dx = int(np.sign(cell[0] - env.player[0]))
    dy = int(np.sign(cell[1] - env.player[1]))
    move = (0, dy) if (y_first and dy) or not dx else (dx, 0)
    index = pinpad.MOVES.index(move)
    rewards.append(env.step({'action': index, 'reset': False})['reward'])
  return rewards


def pad_cell(env, number):
  x, y = np.argwhere(env.grid == number)[0]
  return int(x), int(y)


def test_every_task_has_its_pads_and_the_spaces_of_upstream():
  for name, count in pinpad.NAMES.items():
    env = envs.make_env(f'pinpad_{name}', seed=1)
    assert_space(env.obs_space['image'], np.uint8, (64, 64, 3))
    space = env.act_space['action']
    assert (space.dtype, space.shape, space.low, space.high) == (
        np.int32, (), 0, 5)
    raw = pinpad.PinPad(name)
    assert sorted(set(raw.grid.ravel()) - {-1, 0}) == list(range(1, count + 1))
    assert all((raw.grid == k).sum() == 16 for k in range(1, count + 1))
    env.close()
  with pytest.raises(ValueError, match='pinpad_three'):
    pinpad.PinPad('nine')


def test_pads_in_order_pay_once_then_the_player_respawns():
  env = pinpad.PinPad('three', seed=0)
  obs = env.step({'action': 0, 'reset': True})
  assert obs['is_first'] and obs['reward'] == 0
  rewards = []
  for number in (1, 2, 3):
    rewards += walk(env, pad_cell(env, number))
  assert env.presses == [1, 2, 3]
  assert rewards[-1] == 10 and sum(rewards) == 10  # the last press pays
  assert tuple(env.render()[4 * 7, 4 * 7]) == (223, 255, 223)  # floor glows
  # Standing on pad 3 while the room glows pays nothing more.
  assert [env.step(STAY)['reward'] for _ in range(pinpad.GLOW - 1)] == [0] * 9
  env.step(STAY)  # the glow ends: a respawn, presses forgotten
  assert env.presses == [] and env.glow == 0


def test_a_wrong_order_or_a_repeated_press_pays_nothing():
  env = pinpad.PinPad('three', seed=0)
  env.step({'action': 0, 'reset': True})
  rewards = []
  for number in (1, 3, 2):  # round pad 2 on the way from 1 to 3
    rewards += walk(env, pad_cell(env, number), y_first=True)
  assert env.presses == [1, 3, 2] and sum(rewards) == 0
  # Pressing 2 again, pad by pad within it, counts once.
  x, y = env.player
  rewards += walk(env, (x, y + 1 if env.grid[x, y + 1] == 2 else y - 1))
  assert env.presses == [1, 3, 2]
  # 1 -> 2 -> 3 from here: the last three presses are then in order.
  for number in (1, 2, 3):
    rewards += walk(env, pad_cell(env, number))
  assert sum(rewards) == 10


def test_the_image_shows_the_player_the_pad_under_it_and_the_presses():
  env = pinpad.PinPad('four', seed=3)
  env.step({'action': 0, 'reset': True})
  walk(env, pad_cell(env, 2))
  image = env.render()
  x, y = env.player
  assert (image[4 * y:4 * y + 4, 4 * x:4 * x + 4] == 0).all()  # the player
  # Pad 2 in full colour under the player, pad 1 faded.
  x2, y2 = [c for c in np.argwhere(env.grid == 2) if tuple(c) != env.player][0]
  assert tuple(image[4 * y2, 4 * x2]) == tuple(pinpad.COLORS[1])
  x1, y1 = pad_cell(env, 1)
  assert tuple(image[4 * y1, 4 * x1]) != tuple(pinpad.COLORS[0])
  # The strip below the room: the latest press, pad 2, in its colour.
  last = 2 * (len(env.presses) - 1) + 1
  assert env.presses[-1] == 2
  assert tuple(image[4 * pinpad.HEIGHT, 4 * last]) == tuple(pinpad.COLORS[1])


def test_the_time_limit_is_last_but_not_terminal():
  env = pinpad.PinPad('five', seed=0, length=7)
  env.step({'action': 0, 'reset': True})
  steps = [env.step(STAY) for _ in range(7)]
  assert [s['is_last'] for s in steps] == [False] * 6 + [True]
  assert not any(s['is_terminal'] for s in steps)
  assert env.step(STAY)['is_first']  # the next step starts a new episode
