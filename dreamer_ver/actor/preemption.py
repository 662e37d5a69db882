"""The preemption module: when the actor's batch server cuts a batch.

After Habitat VER's preemption decider, moved from rollouts to inference
batches: slow or dead envs must never hold the fleet back. The batch server
(`rpc/batch_server.py`) asks its cutoff policy, every time something
changes, what to do with the queue:

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

and the learner, where it shares the policy's device, reports each update's
device time (VER's `learner_time`) to a policy that has the method:

  policy.learner_time(seconds)                   # from the learner's thread

The server makes every other call under one lock per lane, so a policy
needs no locking of its own for them. All times come from the caller, so policies are pure and testable
with a fake clock.
"""

import collections
import threading

Cut = collections.namedtuple('Cut', 'count reason')


class Cutoff:
  """Base class: observes nothing, never dispatches."""

  def decide(self, pending, now):
    raise NotImplementedError

  def observe_batch(self, size, inference_seconds):
    pass

  def observe_reply(self, envid, time):
    pass


def _check_sizes(min_batch, max_batch):
  if not 1 <= min_batch <= max_batch:
    raise ValueError(
        f'need 1 <= min_batch <= max_batch, got {min_batch}, {max_batch}')


class Fixed(Cutoff):
  """DreamerV3's rule (portal.BatchServer): exactly `batch`, never fewer.

  Kept as the baseline for A/B benchmarks. With fewer live envs than
  `batch` it waits forever, as the original does.
  """

  def __init__(self, batch):
    if batch < 1:
      raise ValueError(f'batch must be >= 1, got {batch}')
    self.batch = batch

  @property
  def max_batch(self):
    return self.batch

  def decide(self, pending, now):
    if len(pending) >= self.batch:
      return Cut(self.batch, 'fixed')
    return None


class Deadline(Cutoff):
  """TorchRL's inference-server rule: cut `max_batch` requests as soon as
  that many are queued, else all of them once the oldest has waited
  `timeout` seconds (a batch fills for at most that long)."""

  def __init__(self, max_batch, timeout):
    _check_sizes(1, max_batch)
    if timeout < 0:
      raise ValueError(f'timeout must be >= 0 seconds, got {timeout}')
    self.max_batch = max_batch
    self.timeout = timeout

  def decide(self, pending, now):
    if not pending:
      return None
    if len(pending) >= self.max_batch:
      return Cut(self.max_batch, 'max')
    waited = now - pending[0].arrival
    if waited >= self.timeout:
      return Cut(len(pending), 'timeout')
    return self.timeout - waited


class WindowedMean:
  """Mean and sd of the last `size` values (VER's WindowedRunningMean).

  Running sums keep `mean` and `std` O(1): the preemption decider reads
  them for every env on every decision.
  """

  def __init__(self, size):
    self.values = collections.deque(maxlen=size)
    self.total = 0.0
    self.squares = 0.0

  def add(self, value):
    if len(self.values) == self.values.maxlen:
      old = self.values[0]
      self.total -= old
      self.squares -= old * old
    self.values.append(value)
    self.total += value
    self.squares += value * value

  def __len__(self):
    return len(self.values)

  @property
  def mean(self):
    return self.total / len(self.values) if self.values else 0.0

  @property
  def std(self):
    if len(self.values) < 2:
      return 0.0
    mean = self.mean
    return max(0.0, self.squares / len(self.values) - mean * mean) ** 0.5


class LastBatch:
  """When the latest batch's replies went out. VER's adaptive minimum wait
  counts from there: an actor idle that long cuts at once instead of
  holding its first request."""

  def __init__(self):
    self.time = None

  def observe(self, time):
    self.time = time if self.time is None else max(self.time, time)

  def since(self, pending, now):
    """Seconds since then (before any batch: since the oldest request)."""
    return now - (self.time if self.time is not None else pending[0].arrival)


class VER(Cutoff):
  """VER's inference-worker rule: cut once `min_batch` requests are queued,
  or once `min_wait` has passed since the last batch with at least one
  request queued; never more than `max_batch`. `min_wait` adapts to half the
  mean inference time. A latency cap bounds every request's wait.
  """

  def __init__(self, min_batch, max_batch, min_wait=0.01, max_wait=0.05):
    _check_sizes(min_batch, max_batch)
    self.min_batch = min_batch
    self.max_batch = max_batch
    self.min_wait = min_wait
    self.max_wait = max_wait
    self.inference = WindowedMean(128)
    self.last_batch = LastBatch()

  def decide(self, pending, now):
    count = len(pending)
    if not count:
      return None
    if count >= self.max_batch:
      return Cut(self.max_batch, 'max')
    if count >= self.min_batch:
      return Cut(count, 'min')
    if now - pending[0].arrival >= self.max_wait:
      return Cut(count, 'latency_cap')
    since = self.last_batch.since(pending, now)
    if since >= self.min_wait:
      return Cut(count, 'min_wait')
    return min(self.min_wait - since,
               pending[0].arrival + self.max_wait - now)

  def observe_batch(self, size, inference_seconds):
    self.inference.add(inference_seconds)
    self.min_wait = self.inference.mean / 2

  def observe_reply(self, envid, time):
    self.last_batch.observe(time)


class Shared:
  """VER's one decider for all lanes of an actor (thread-safe): the wait
  lag every lane prices in, VER's real-vs-expected report of all lanes, and
  the learner's device time per batch (VER's LT, reported: each cut of any
  lane takes the `learner_time` reported since the previous cut)."""

  def __init__(self, window=16):
    self.lock = threading.Lock()
    self.learning = 0.0  # learner seconds since the latest cut
    self.learner = WindowedMean(window)  # learner seconds per batch
    self.wait_errors = WindowedMean(1024)
    self.expected = WindowedMean(1024)  # batch size predicted at first wait
    self.real = WindowedMean(1024)  # batch size cut

  def learner_time(self, seconds):
    """The learner spent `seconds` of the policy's device on one update."""
    with self.lock:
      self.learning += seconds

  @property
  def lag(self):
    return max(0.0, self.wait_errors.mean)

  def cut(self, count, expected, wait_error):
    """One lane cut `count` requests; it had predicted `expected` and a
    wait that ran `wait_error` seconds past its prediction (None: no
    wait)."""
    with self.lock:
      self.learner.add(self.learning)
      self.learning = 0.0
      self.expected.add(expected)
      self.real.add(count)
      if wait_error is not None:
        self.wait_errors.add(wait_error)

  def stats(self):
    with self.lock:
      return {
          'preempt/wait_error_ms': self.wait_errors.mean * 1000,
          'preempt/learner_ms_per_batch': self.learner.mean * 1000,
          'preempt/expected_batch': self.expected.mean,
          'preempt/real_batch': self.real.mean,
      }


class Preempt(Cutoff):
  """VER's preemption decider, moved from rollouts to inference batches:
  with k requests queued, cut now or after the next j predicted arrivals,
  whichever serves the fleet fastest (`_best_cut`). VER maximises S /
  (Time(S) + LT) for one rollout; here every queued request's wait counts
  too, because a waiting env is an idle env (VER's literal argmax batched
  too eagerly and lost to VER's own inference-worker rule), and the
  learner's time LT is reported (`Shared`) but not added to a batch's
  cost: the learner runs beside the actor, not between rollouts, so its
  share of the device is already in the measured inference times (adding
  it again made larger, slower batches: docs/benchmarks.md).

  It learns, per env, the time from a reply to that env's next request (its
  step time, windowed mean), and the inference time of each padded bucket.
  Guard rails from VER's
  inference worker: at most `max_batch`; fewer than `min_batch` only after
  an adaptive minimum wait (half the mean inference time, counted from the
  last batch); `min_batch` follows the live envs (N / 1.5 W, W = `threads`
  of all lanes) as envs die or join; and no request ever waits longer than
  `max_wait`. Envs that stop sending (dead, hung, or far slower than their
  history) drop out of the prediction.
  """

  def __init__(self, min_batch, max_batch, buckets, inference=None,
               max_wait=0.05, window=16, late=3.0, forget=5.0, shared=None,
               threads=None):
    _check_sizes(min_batch, max_batch)
    self.min_batch = min_batch
    self.max_batch = max_batch
    self.buckets = sorted(buckets)
    self.max_wait = max_wait
    self.window = window
    self.late = late  # an env this many stds (plus 5 ms) past due is late
    self.forget = forget  # seconds of silence after which an env is dead
    self.threads = threads  # set: min_batch follows the live envs
    self.shared = shared or Shared()
    self.inference = {b: WindowedMean(window) for b in self.buckets}
    for size, seconds in (inference or {}).items():
      self._bucket_mean(size).add(seconds)
    self.step = {}  # envid -> WindowedMean of reply -> next arrival
    self.replied = {}  # envid -> time of the last reply, while not queued
    self.recent = WindowedMean(128)  # inference seconds, any bucket
    self.last_batch = LastBatch()
    self._table = None  # cached _infer_table(), reset by observe_batch
    self.decided = None  # (predicted wait, expected size, when) for stats

  def learner_time(self, seconds):
    """VER's report: the learner spent `seconds` of the device on one
    update."""
    self.shared.learner_time(seconds)

  # ------------------------------------------------------------- decide

  def decide(self, pending, now):
    count = len(pending)
    if not count:
      return None
    self._note_arrivals(pending)
    if count >= self.max_batch:
      return self._cut(self.max_batch, 'max', now)
    deadline = pending[0].arrival + self.max_wait
    if now >= deadline:
      return self._cut(count, 'latency_cap', now)
    # Waits have overrun their predictions by `lag` on average (wake-up
    # delay, arrivals a little late); the options price that in.
    lag = self.shared.lag
    arrivals = [a + lag for a in self._predicted_arrivals(now, deadline)]
    best, best_wait = self._best_cut(
        count, arrivals[:self.max_batch - count], now, self._infer_table())
    if best == 0:
      min_wait = self.recent.mean / 2
      since = self.last_batch.since(pending, now)
      if count >= self._min_batch() or since >= min_wait:
        return self._cut(count, 'optimum', now)
      best_wait = min_wait - since
    if self.decided is None:
      self.decided = (best_wait, count + best, now)
    return max(1e-4, min(best_wait, deadline - now))

  @staticmethod
  def _best_cut(count, arrivals, now, infer):
    """How many of the predicted arrivals to wait for, and how long.

    Every option serves the same requests (the queued ones and the predicted
    arrivals): waiting for the first j arrivals serves k + j in one batch
    when the j-th arrives; the later arrivals are then served the way the
    actor serves them online once it is free (`_greedy_cost`). The option
    with the least total time from arrival (or now, for queued requests) to
    reply serves the fleet fastest: cutting at once wins when a batch is
    cheap against the gaps between arrivals, waiting wins when an arrival is
    due before a second batch could be paid for. Arrivals due later than a
    batch of the queued requests would take are never waited for: by then
    that batch would be done and the actor free again. `infer[n]` is the
    predicted inference time of a batch of n.
    """
    best, best_wait, best_cost = 0, 0.0, None
    waited = 0.0  # sum of the arrival times waited for so far
    for j in range(len(arrivals) + 1):
      if j:
        waited += arrivals[j - 1]
      start = arrivals[j - 1] if j else now
      if start - now > infer[count]:
        break
      done = start + infer[count + j]
      cost = count * (done - now) + j * done - waited
      cost += _greedy_cost(done, arrivals, j, infer)
      if best_cost is None or cost < best_cost - 1e-12:
        best, best_wait, best_cost = j, start - now, cost
    return best, best_wait

  def _min_batch(self):
    """`min_batch`, or with `threads` set VER's N / 1.5 W over the envs
    alive now (never above `min_batch`)."""
    if self.threads is None or not self.step:
      return self.min_batch
    live = len(self.step)
    return max(1, min(self.min_batch, int(live / self.threads / 1.5)))

  def _cut(self, count, reason, now):
    expected, error = count, None
    if self.decided is not None:
      predicted, expected, since = self.decided
      error = (now - since) - predicted
      self.decided = None
    self.shared.cut(count, expected, error)
    return Cut(count, reason)

  # ------------------------------------------------------------ observe

  def observe_batch(self, size, inference_seconds):
    self._bucket_mean(size).add(inference_seconds)
    self.recent.add(inference_seconds)
    self._table = None

  def observe_reply(self, envid, time):
    self.replied[envid] = time
    self.last_batch.observe(time)

  def stats(self):
    return {
        **self.shared.stats(),
        'preempt/envs_tracked': len(self.step),
        'preempt/envs_stepping': len(self.replied),
    }

  # ------------------------------------------------------------ helpers

  def _note_arrivals(self, pending):
    """A queued env is no longer stepping: record its step time once."""
    for request in pending:
      sent = self.replied.pop(request.envid, None)
      if sent is not None and request.arrival >= sent:
        self.step.setdefault(
            request.envid, WindowedMean(self.window)).add(
                request.arrival - sent)

  def _predicted_arrivals(self, now, deadline):
    """Predicted arrival times (sorted) of envs not queued, before the
    deadline. Late envs count as arriving now at best; dead ones are
    forgotten."""
    arrivals = []
    for envid, sent in list(self.replied.items()):
      stats = self.step.get(envid)
      if now - sent > self.forget and (
          stats is None or now - sent > self.forget + stats.mean):
        del self.replied[envid]  # Silent for too long: dead or hung.
        self.step.pop(envid, None)
        continue
      if stats is None or not len(stats):
        continue  # No estimate yet (a new env).
      due = sent + stats.mean
      if now > due + self.late * stats.std + 0.005:
        continue  # Late: do not hold the batch for it.
      # An overdue env is expected later the longer it is overdue (a late
      # env tends to stay late), so waiting for it gets dearer by the moment.
      arrival = due if due >= now else now + 2 * (now - due) + 0.001
      if arrival < deadline:
        arrivals.append(arrival)
    arrivals.sort()
    return arrivals

  def _infer_table(self):
    """Predicted inference seconds of a batch of n, for n in 0..max."""
    if self._table is None:
      self._table = [0.0] + [
          max(1e-5, self._bucket_mean(n).mean or self._nearest(n))
          for n in range(1, self.max_batch + 1)]
    return self._table

  def _bucket_mean(self, size):
    for bucket in self.buckets:
      if bucket >= size:
        return self.inference[bucket]
    return self.inference[self.buckets[-1]]

  def _nearest(self, size):
    """Inference estimate for a bucket never measured: the closest measured
    bucket, scaled linearly in size as a conservative guess."""
    known = [(b, m.mean) for b, m in self.inference.items() if len(m)]
    if not known:
      return 1e-3
    bucket, seconds = min(known, key=lambda x: abs(x[0] - size))
    return seconds * max(1.0, size / bucket)


def _greedy_cost(free, arrivals, first, infer):
  """Total time to reply of the sorted `arrivals[first:]`, served by an
  actor that is free at `free` and cuts whatever has arrived whenever it is
  free."""
  cost, i, n = 0.0, first, len(arrivals)
  while i < n:
    start = max(free, arrivals[i])
    k, waited = i, 0.0
    while k < n and arrivals[k] <= start:
      waited += arrivals[k]
      k += 1
    free = start + infer[k - i]
    cost += (k - i) * free - waited
    i = k
  return cost
