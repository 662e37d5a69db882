"""PinPad, DreamerV3's small memory and exploration task: tasks
`pinpad_three` ... `pinpad_eight`.

A 16 x 14 room (walls around it) with n colored pads; the player (a black
cell) moves with 5 actions (stay, up, down, right, left). Stepping onto a
pad presses it (pressing the same pad again in a row counts once); reward
10 once the last n presses were pads 1, 2, ..., n in that order. After a
reward the room glows green for 10 steps, then the player respawns
anywhere with the presses forgotten. The presses so far show in a strip at
the bottom of the image, so the task needs memory only beyond what is
drawn there: which pad is next. Episodes end after `length` steps (a time
limit, not terminal).

Ours: the pads are 4 x 4 squares placed around the room by `layout`, not
upstream's hand-drawn maps; the rules and the observation are the same.
"""

import elements
import numpy as np

from . import base

NAMES = {'three': 3, 'four': 4, 'five': 5, 'six': 6, 'seven': 7, 'eight': 8}
COLORS = np.array([(255, 0, 0), (0, 255, 0), (0, 0, 255), (255, 255, 0),
                   (255, 0, 255), (0, 255, 255), (128, 0, 128),
                   (0, 128, 128)], np.uint8)
WIDTH, HEIGHT = 16, 14
MOVES = ((0, 0), (0, -1), (0, 1), (1, 0), (-1, 0))  # (dx, dy)
GLOW = 10  # steps the room glows after a reward before the respawn
# Top-left corners of the pad squares, in the order pads are placed: the
# four corners of the room, then the middles of its walls.
CORNERS = ((1, 1), (11, 1), (1, 9), (11, 9), (6, 1), (6, 9), (1, 5), (11, 5))


def layout(pads):
  """[WIDTH, HEIGHT] int array: -1 wall, 0 floor, k the k-th pad (1..n)."""
  grid = np.zeros((WIDTH, HEIGHT), np.int64)
  grid[0, :] = grid[-1, :] = grid[:, 0] = grid[:, -1] = -1
  # Pads go round the room, so the shortest tour from one to the next is
  # never a straight line through another.
  order = (0, 1, 3, 2, 4, 5, 6, 7)[:pads]
  for number, index in enumerate(order, 1):
    x, y = CORNERS[index]
    grid[x:x + 4, y:y + 4] = number
  return grid


class PinPad(base.Env):

  def __init__(self, task, seed=0, length=10000):
    if task not in NAMES:
      raise ValueError(f'unknown pinpad task {task!r}; tasks: '
                       f"{', '.join('pinpad_' + n for n in NAMES)}")
    self.pads = NAMES[task]
    self.grid = layout(self.pads)
    self.spawns = np.argwhere(self.grid >= 0)
    self.length = int(length)
    self.rng = np.random.default_rng(seed)
    self.player = None
    self.presses = []
    self.steps = 0
    self.glow = 0
    self.done = True

  @property
  def obs_space(self):
    return {**base.basic_obs_space(),
            'image': elements.Space(np.uint8, (64, 64, 3))}

  @property
  def act_space(self):
    return {'action': elements.Space(np.int32, (), 0, len(MOVES)),
            'reset': elements.Space(bool)}

  def step(self, action):
    if self.done or action['reset']:
      self._respawn()
      self.steps, self.glow, self.done = 0, 0, False
      return self._obs(0.0, is_first=True)
    if self.glow:
      self.glow -= 1
      if not self.glow:
        self._respawn()
    dx, dy = MOVES[int(action['action'])]
    x, y = self.player[0] + dx, self.player[1] + dy
    if self.grid[x, y] >= 0:
      self.player = (x, y)
    pad = int(self.grid[self.player])
    if pad and (not self.presses or self.presses[-1] != pad):
      self.presses = (self.presses + [pad])[-self.pads:]
    reward = 0.0
    if not self.glow and self.presses == list(range(1, self.pads + 1)):
      reward, self.glow = 10.0, GLOW
    self.steps += 1
    self.done = self.steps >= self.length
    return self._obs(reward, is_last=self.done)

  def _respawn(self):
    self.player = tuple(self.spawns[self.rng.integers(len(self.spawns))])
    self.presses = []

  def _obs(self, reward, is_first=False, is_last=False):
    return {'image': self.render(), 'reward': np.float32(reward),
            'is_first': is_first, 'is_last': is_last, 'is_terminal': False}

  def render(self):
    """64 x 64 x 3: 4 x 4 pixels per cell; the pad under the player in
    full colour, the others faded; the presses in the bottom strip."""
    cells = np.full((WIDTH, 16, 3), 255, np.uint8)
    if self.glow:
      cells[:] = (223, 255, 223)
    cells[:, :HEIGHT][self.grid < 0] = 192
    under = self.grid[self.player]
    for pad in range(1, self.pads + 1):
      color = COLORS[pad - 1].astype(np.float32)
      if pad != under:
        color = 0.1 * color + 0.9 * 255
      cells[:, :HEIGHT][self.grid == pad] = color.astype(np.uint8)
    cells[self.player] = 0
    cells[:, HEIGHT:] = 192
    for i, pad in enumerate(self.presses):
      cells[2 * i + 1, HEIGHT] = COLORS[pad - 1]
    image = np.repeat(np.repeat(cells, 4, 0), 4, 1)  # [x, y] -> pixels
    return image.transpose(1, 0, 2)  # rows are y
