"""When the batch server turns its pending requests into a batch.

This is the seam the preemption module plugs into. The batch server asks its
cutoff policy, every time something changes, what to do with the queue:

  decision = policy.decide(pending, now)

`pending` is a read-only sequence of the queued requests, oldest first; each
has `.arrival` (time.monotonic() seconds) and `.envid` (who sent it). The
sequence is only valid during the call: copy what you want to keep. The
decision is one of

  * `Cut(count, reason)`: dispatch the `count` oldest requests now, and record
    `reason` (a short string, reported as the stats key `cut/<reason>`);
  * a number of seconds: wait that long, or until a request arrives;
  * `None`: wait until a request arrives.

A policy may keep state. The server tells it what happened, so an adaptive
policy (VER's rule, a throughput-optimal predictor) can learn arrival and
inference times:

  policy.observe_batch(size, inference_seconds)  # after each handler call
  policy.observe_reply(envid, time)              # after each reply is sent

The server makes every call under one lock, so a policy needs no locking of
its own. All times come from the caller, so policies are pure and testable
with a fake clock.
"""

import collections

Cut = collections.namedtuple('Cut', 'count reason')


class Cutoff:
  """Base class: observes nothing, never dispatches."""

  def decide(self, pending, now):
    raise NotImplementedError

  def observe_batch(self, size, inference_seconds):
    pass

  def observe_reply(self, envid, time):
    pass


class MinMaxTimeout(Cutoff):
  """Dispatch once `min_batch` are queued or the oldest waited `timeout`.

  Never more than `max_batch` at once. The timeout is the latency cap that
  keeps stragglers from holding back the requests already queued, and lets a
  run with fewer live envs than `min_batch` make progress.
  """

  def __init__(self, min_batch, max_batch, timeout):
    if not 1 <= min_batch <= max_batch:
      raise ValueError(
          f'need 1 <= min_batch <= max_batch, got {min_batch}, {max_batch}')
    if timeout < 0:
      raise ValueError(f'timeout must be >= 0, got {timeout}')
    self.min_batch = min_batch
    self.max_batch = max_batch
    self.timeout = timeout

  def decide(self, pending, now):
    count = len(pending)
    if not count:
      return None
    if count >= self.max_batch:
      return Cut(self.max_batch, 'max')
    if count >= self.min_batch:
      return Cut(count, 'min')
    remaining = pending[0].arrival + self.timeout - now
    if remaining <= 0:
      return Cut(count, 'timeout')
    return remaining


class Fixed(Cutoff):
  """DreamerV3's rule (portal.BatchServer): exactly `batch`, never fewer.

  Kept as the baseline for A/B benchmarks. With fewer live envs than
  `batch` it waits forever, as the original does.
  """

  def __init__(self, batch):
    if batch < 1:
      raise ValueError(f'batch must be >= 1, got {batch}')
    self.batch = batch

  def decide(self, pending, now):
    if len(pending) >= self.batch:
      return Cut(self.batch, 'fixed')
    return None
