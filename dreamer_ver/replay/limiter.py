"""Rate limiter that holds the ratio of sampled sequences to inserted steps.

``SamplesPerInsert(s, tolerance, minsize)`` keeps two numbers:

* ``size``: how many steps were inserted;
* ``avail``: sampling credit. It starts at ``-minsize``; every insert once
  ``size >= minsize`` adds ``s``, every sample takes one.

Decisions:

* inserting is allowed while ``size < minsize`` (filling up), or while the
  learner is not too far behind: ``avail < tolerance * s``;
* sampling is refused while ``size < minsize``; afterwards it is allowed
  while the learner is not too far ahead: ``avail > -tolerance``.

``s <= 0`` disables the rate limit (inserts always allowed, samples allowed
once ``minsize`` steps are in), e.g. for actor-only runs. ``Unlimited()`` is a
limiter that allows everything from the start.

With DreamerV3's defaults (s = train_ratio / batch_length = 32 / 64,
tolerance = 4 * batch_size = 64, minsize = batch_size * length = 16 * 65) the
first sample is allowed after 2992 inserts.
"""

import threading


class _Counts:
  """The two numbers every limiter keeps, saved and restored as a dict."""

  def __init__(self, avail=0.0):
    self.size = 0
    self.avail = avail
    self.lock = threading.Lock()

  def sample(self, amount=1):
    with self.lock:
      self.avail -= amount

  def save(self):
    with self.lock:
      return {'size': self.size, 'avail': self.avail}

  def load(self, state):
    with self.lock:
      self.size = int(state['size'])
      self.avail = float(state['avail'])


class SamplesPerInsert(_Counts):

  def __init__(self, samples_per_insert, tolerance, minsize=1):
    if minsize < 1:
      raise ValueError(f'minsize must be at least 1, got {minsize}.')
    if tolerance < 0:
      raise ValueError(f'tolerance must be non-negative, got {tolerance}.')
    self.samples_per_insert = float(samples_per_insert)
    self.tolerance = float(tolerance)
    self.minsize = int(minsize)
    super().__init__(avail=-float(minsize))

  @property
  def limited(self):
    return self.samples_per_insert > 0

  @property
  def max_avail(self):
    """Inserts wait once the credit reaches this."""
    return self.tolerance * self.samples_per_insert

  @property
  def min_avail(self):
    """Samples wait once the credit drops to this."""
    return -self.tolerance

  def want_insert(self):
    """Returns (allowed, reason)."""
    if self.size < self.minsize:
      return True, 'filling'
    if not self.limited:
      return True, 'unlimited'
    if self.avail < self.max_avail:
      return True, 'ok'
    return False, (
        f'rate limited: credit {self.avail:.3f} >= {self.max_avail:.3f}')

  def want_sample(self):
    """Returns (allowed, reason)."""
    if self.size < self.minsize:
      return False, f'too few steps: {self.size} < {self.minsize}'
    if not self.limited:
      return True, 'unlimited'
    if self.avail > self.min_avail:
      return True, 'ok'
    return False, (
        f'rate limited: credit {self.avail:.3f} <= {self.min_avail:.3f}')

  def insert(self, amount=1):
    with self.lock:
      # Only the inserts that bring the size to minsize or beyond earn credit.
      earning = max(0, self.size + amount - max(self.size, self.minsize - 1))
      self.size += amount
      self.avail += earning * self.samples_per_insert


class Unlimited(_Counts):
  """A limiter that never makes anyone wait (same interface)."""

  limited = False

  def want_insert(self):
    return True, 'unlimited'

  def want_sample(self):
    return True, 'unlimited'

  def insert(self, amount=1):
    with self.lock:
      self.size += amount

