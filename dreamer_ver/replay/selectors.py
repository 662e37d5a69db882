"""Selectors: decide which stored item the replay buffer samples next.

Every selector keeps a set of item keys and supports:

* ``selector[key] = stepids`` registers an item. ``stepids`` is a uint8 array
  of shape ``[length, 20]`` holding the step ids of the item's steps, or
  ``None`` when the selector's ``uses_stepids`` attribute is false (the replay
  buffer only gathers step ids for selectors that need them).
* ``del selector[key]`` forgets an item.
* ``selector()`` returns the key of one item (the selector must be non-empty).
* ``len(selector)`` is the number of items.
* ``selector.prioritize(stepids, priorities)`` (prioritized selectors and
  mixtures only) sets per-step priorities.

Selectors are not thread-safe on their own; ``Replay`` calls them under its
lock.
"""

import collections

import numpy as np

from .sumtree import SumTree


class Uniform:
  """Every item equally likely. Add, remove and sample are O(1)."""

  uses_stepids = False

  def __init__(self, seed=0):
    self.rng = np.random.default_rng(seed)
    self.keys = []
    self.index = {}

  def __len__(self):
    return len(self.keys)

  def __call__(self):
    if not self.keys:
      raise ValueError('Cannot sample from an empty selector.')
    return self.keys[int(self.rng.integers(len(self.keys)))]

  def __setitem__(self, key, stepids):
    if key in self.index:
      raise KeyError(f'Key {key!r} is already registered.')
    self.index[key] = len(self.keys)
    self.keys.append(key)

  def __delitem__(self, key):
    # Move the last key into the hole so the list stays dense.
    position = self.index.pop(key)
    last = self.keys.pop()
    if position < len(self.keys):
      self.keys[position] = last
      self.index[last] = position


class Prioritized:
  """Items sampled in proportion to an aggregate of their steps' priorities.

  Priorities belong to steps (addressed by step id), because overlapping items
  share steps. A step that has not been given a priority yet has ``initial``
  (``inf`` makes every new item be sampled before any old one). An item's
  weight combines its steps' priorities raised to ``exponent``::

      maxfrac * max(p ** exponent) + (1 - maxfrac) * mean(p ** exponent)

  With ``zero_on_sample`` the steps of a sampled item get priority zero.
  """

  uses_stepids = True

  def __init__(
      self, exponent=1.0, initial=1.0, zero_on_sample=False, maxfrac=0.0,
      seed=0):
    if not 0 <= maxfrac <= 1:
      raise ValueError(f'maxfrac must be in [0, 1], got {maxfrac}.')
    if np.isnan(initial) or initial < 0:
      raise ValueError(f'initial must be non-negative, got {initial}.')
    self.exponent = float(exponent)
    self.initial = float(initial)
    self.zero_on_sample = zero_on_sample
    self.maxfrac = float(maxfrac)
    self.tree = SumTree(seed)
    self.items = {}  # item key -> tuple of step ids (bytes)
    self.powered = {}  # step id -> priority ** exponent
    self.step_items = collections.defaultdict(set)  # step id -> item keys
    self.ignored = 0  # priority updates for steps no item holds anymore

  def __len__(self):
    return len(self.items)

  def __call__(self):
    key = self.tree.sample()
    if self.zero_on_sample:
      steps = self.items[key]
      self._set(steps, np.zeros(len(steps)))
    return key

  def __setitem__(self, key, stepids):
    if key in self.items:
      raise KeyError(f'Key {key!r} is already registered.')
    steps = tuple(_as_bytes(stepids))
    initial = self._power(self.initial)
    for step in steps:
      self.powered.setdefault(step, initial)
      self.step_items[step].add(key)
    self.items[key] = steps
    self.tree.insert(key, self._weight(steps))

  def __delitem__(self, key):
    self.tree.remove(key)
    for step in self.items.pop(key):
      owners = self.step_items[step]
      owners.discard(key)
      if not owners:
        del self.step_items[step]
        del self.powered[step]

  def prioritize(self, stepids, priorities):
    """Sets the priority of each step; unknown step ids are ignored."""
    priorities = np.asarray(priorities, np.float64).reshape(-1)
    steps = _as_bytes(stepids)
    if len(steps) != len(priorities):
      raise ValueError(
          f'Got {len(steps)} step ids but {len(priorities)} priorities.')
    if np.isnan(priorities).any() or (priorities < 0).any():
      raise ValueError('Priorities must be non-negative.')
    self._set(steps, priorities)

  def _set(self, steps, priorities):
    touched = set()
    for step, priority in zip(steps, priorities):
      if step not in self.powered:
        self.ignored += 1
        continue
      self.powered[step] = self._power(priority)
      touched.update(self.step_items[step])
    for key in touched:
      self.tree.update(key, self._weight(self.items[key]))

  def _power(self, priority):
    priority = float(priority)
    return priority if self.exponent == 1.0 else priority ** self.exponent

  def _weight(self, steps):
    values = [self.powered[step] for step in steps]
    weight = 0.0
    # Each term is only added when its factor is non-zero, so an infinite
    # priority never meets a zero factor (which would give nan).
    if self.maxfrac > 0:
      weight += self.maxfrac * max(values)
    if self.maxfrac < 1:
      weight += (1 - self.maxfrac) * (sum(values) / len(values))
    return weight


class Recency:
  """Newer items more likely: an item of age a has weight ``a ** -exponent``.

  The newest item has age 1. Ages count insertions, so with FIFO removal (what
  the replay buffer does) the live items have ages 1 to n. Removing items out
  of order leaves holes, which sampling skips by drawing again.
  """

  uses_stepids = False

  def __init__(self, exponent=1.0, seed=0):
    if exponent < 0:
      raise ValueError(f'exponent must be non-negative, got {exponent}.')
    self.exponent = float(exponent)
    self.rng = np.random.default_rng(seed)
    self.keys = {}  # insertion number -> key
    self.numbers = {}  # key -> insertion number
    self.oldest = 0  # insertion number of the oldest live item
    self.next = 0  # insertion number of the next item
    self.cdf = np.zeros(1)  # cdf[k] = sum of the weights of ages 1..k

  def __len__(self):
    return len(self.keys)

  def __call__(self):
    if not self.keys:
      raise ValueError('Cannot sample from an empty selector.')
    span = self.next - self.oldest
    self._extend(span)
    for _ in range(16):
      target = self.rng.uniform(0, self.cdf[span])
      # How many of the newest ages lie entirely below the target: 0 picks
      # the newest item (age 1).
      offset = int(np.searchsorted(self.cdf[1:span + 1], target, 'right'))
      number = self.next - 1 - min(offset, span - 1)
      if number in self.keys:
        return self.keys[number]
    # Many holes: draw exactly among the live items instead.
    numbers = np.fromiter(self.keys.keys(), np.int64, len(self.keys))
    weights = (self.next - numbers).astype(np.float64) ** -self.exponent
    choice = self.rng.choice(len(numbers), p=weights / weights.sum())
    return self.keys[int(numbers[choice])]

  def __setitem__(self, key, stepids):
    if key in self.numbers:
      raise KeyError(f'Key {key!r} is already registered.')
    self.keys[self.next] = key
    self.numbers[key] = self.next
    self.next += 1

  def __delitem__(self, key):
    del self.keys[self.numbers.pop(key)]
    while self.oldest < self.next and self.oldest not in self.keys:
      self.oldest += 1

  def _extend(self, span):
    if len(self.cdf) > span:
      return
    size = max(span + 1, 2 * len(self.cdf))
    ages = np.arange(1, size, dtype=np.float64)
    self.cdf = np.concatenate([[0.0], np.cumsum(ages ** -self.exponent)])


class Mixture:
  """Each sample comes from one of several selectors, picked by fraction.

  ``selectors`` and ``fractions`` are dicts with the same keys. Selectors with
  fraction zero are dropped; the rest must sum to one. Every item is
  registered with (and removed from) all remaining selectors.
  """

  def __init__(self, selectors, fractions, seed=0):
    if set(selectors) != set(fractions):
      raise ValueError(
          f'Selectors {sorted(selectors)} and fractions {sorted(fractions)} '
          'must have the same keys.')
    if any(value < 0 for value in fractions.values()):
      raise ValueError(f'Fractions must be non-negative: {fractions}')
    if abs(sum(fractions.values()) - 1) > 1e-6:
      raise ValueError(f'Fractions must sum to 1: {fractions}')
    names = sorted(name for name, value in fractions.items() if value > 0)
    self.names = names
    self.selectors = [selectors[name] for name in names]
    self.fractions = np.array([fractions[name] for name in names], np.float64)
    self.fractions /= self.fractions.sum()
    self.uses_stepids = any(
        getattr(selector, 'uses_stepids', True) for selector in self.selectors)
    self.rng = np.random.default_rng(seed)

  def __len__(self):
    return len(self.selectors[0])

  def __call__(self):
    index = self.rng.choice(len(self.selectors), p=self.fractions)
    return self.selectors[index]()

  def __setitem__(self, key, stepids):
    for selector in self.selectors:
      selector[key] = stepids

  def __delitem__(self, key):
    for selector in self.selectors:
      del selector[key]

  def prioritize(self, stepids, priorities):
    for selector in self.selectors:
      if hasattr(selector, 'prioritize'):
        selector.prioritize(stepids, priorities)


def _as_bytes(stepids):
  """Step ids as a list of ``bytes``, from an array ``[n, 20]`` or a list."""
  if isinstance(stepids, np.ndarray):
    stepids = np.ascontiguousarray(stepids, np.uint8)
    return [row.tobytes() for row in stepids.reshape(-1, stepids.shape[-1])]
  return [x if isinstance(x, bytes) else np.asarray(x).tobytes()
          for x in stepids]
