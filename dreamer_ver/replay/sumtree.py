"""A sum tree: sample keys with probability proportional to their weight.

Leaves live in the second half of flat arrays (a complete binary tree stored
heap-style: node ``i`` has children ``2i`` and ``2i + 1``, the root is node
1). Every node keeps three aggregates of the leaves below it:

* ``sums``: the sum of the finite weights,
* ``infs``: how many weights are infinite,
* ``counts``: how many leaves are occupied.

Keeping the infinite weights out of the sums means the sums stay finite and
exact, and it gives the three sampling rules directly:

* if any weight is infinite, pick uniformly among the infinite ones;
* otherwise, if all weights are zero, pick uniformly among all keys;
* otherwise, pick proportionally to the weights.

Insert, remove, update and sample are O(log n). Parents are recomputed from
their children (not adjusted by differences), so rounding errors do not
accumulate. The arrays double when full; freed leaves are reused.

Not thread-safe on its own.
"""

import numpy as np


class SumTree:

  def __init__(self, seed=0, initial_capacity=64):
    self.rng = np.random.default_rng(seed)
    self.capacity = 1
    while self.capacity < initial_capacity:
      self.capacity *= 2
    self._allocate(self.capacity)
    self.slots = {}  # key -> leaf slot
    self.keys = [None] * self.capacity  # leaf slot -> key
    self.free = list(reversed(range(self.capacity)))

  def __len__(self):
    return len(self.slots)

  def __contains__(self, key):
    return key in self.slots

  @property
  def total(self):
    """Sum of the finite weights."""
    return float(self.sums[1])

  @property
  def infinite(self):
    """Number of keys with infinite weight."""
    return int(self.infs[1])

  def weight(self, key):
    node = self.capacity + self.slots[key]
    return np.inf if self.infs[node] else float(self.sums[node])

  def insert(self, key, weight):
    if key in self.slots:
      raise KeyError(f'Key {key!r} is already in the tree.')
    weight = _check(weight)
    if not self.free:
      self._grow()
    slot = self.free.pop()
    self.slots[key] = slot
    self.keys[slot] = key
    self._set_leaf(slot, weight, occupied=True)

  def update(self, key, weight):
    weight = _check(weight)
    self._set_leaf(self.slots[key], weight, occupied=True)

  def remove(self, key):
    slot = self.slots.pop(key)
    self.keys[slot] = None
    self.free.append(slot)
    self._set_leaf(slot, 0.0, occupied=False)

  def sample(self):
    if not self.slots:
      raise ValueError('Cannot sample from an empty sum tree.')
    if self.infs[1] > 0:
      weights = self.infs
    elif self.sums[1] > 0:
      weights = self.sums
    else:
      weights = self.counts
    node = 1
    target = self.rng.uniform(0, weights[1])
    while node < self.capacity:
      left, right = 2 * node, 2 * node + 1
      # The comparison guards against rounding: never step into a subtree
      # whose weight is zero.
      if (target < weights[left] and weights[left] > 0) or weights[right] <= 0:
        node = left
      else:
        target -= weights[left]
        node = right
    return self.keys[node - self.capacity]

  def _set_leaf(self, slot, weight, occupied):
    node = self.capacity + slot
    if np.isinf(weight):
      self.sums[node], self.infs[node] = 0.0, 1
    else:
      self.sums[node], self.infs[node] = weight, 0
    self.counts[node] = int(occupied)
    node //= 2
    while node >= 1:
      left, right = 2 * node, 2 * node + 1
      self.sums[node] = self.sums[left] + self.sums[right]
      self.infs[node] = self.infs[left] + self.infs[right]
      self.counts[node] = self.counts[left] + self.counts[right]
      node //= 2

  def _allocate(self, capacity):
    self.sums = np.zeros(2 * capacity, np.float64)
    self.infs = np.zeros(2 * capacity, np.int64)
    self.counts = np.zeros(2 * capacity, np.int64)

  def _grow(self):
    old_capacity = self.capacity
    old = (self.sums, self.infs, self.counts)
    self.capacity *= 2
    self._allocate(self.capacity)
    new = (self.sums, self.infs, self.counts)
    for src, dst in zip(old, new):
      dst[self.capacity: self.capacity + old_capacity] = src[old_capacity:]
    # Rebuild the inner nodes bottom-up, one level at a time.
    start = self.capacity
    while start > 1:
      parents = np.arange(start // 2, start)
      for dst in new:
        dst[parents] = dst[2 * parents] + dst[2 * parents + 1]
      start //= 2
    self.keys += [None] * old_capacity
    self.free = list(reversed(range(old_capacity, self.capacity))) + self.free


def _check(weight):
  weight = float(weight)
  if np.isnan(weight) or weight < 0:
    raise ValueError(f'Weights must be non-negative, got {weight}.')
  return weight
