"""What the batch server counts between two `stats()` calls: requests,
batches and their sizes, cut reasons, queue waits and latencies (the last
samples, for percentiles), inference time, drops and errors."""

import collections

import numpy as np

# Recent samples kept for the percentiles between two stats() calls.
_SAMPLES = 65536


class Stats:
  """Counters and samples of a batch server between two stats() calls."""

  def __init__(self):
    self.requests = 0
    self.batches = 0
    self.sizes = collections.Counter()
    self.cuts = collections.Counter()
    self.waits = collections.deque(maxlen=_SAMPLES)
    self.latencies = collections.deque(maxlen=_SAMPLES)
    self.inference = 0.0
    self.dropped = 0
    self.errors = 0
    self.postfn_errors = 0

  def cut(self, reason, waits):
    self.cuts[reason] += 1
    self.waits.extend(waits)

  def served(self, batch, sent, inference, errors):
    self.batches += 1
    self.sizes[len(batch)] += 1
    self.latencies.extend(t - r.arrival for r, t in zip(batch, sent))
    self.inference += inference
    self.errors += errors

  def result(self, pending):
    total = sum(size * count for size, count in self.sizes.items())
    stats = {
        'requests': self.requests,
        'batches': self.batches,
        'batch_size_mean': total / self.batches if self.batches else 0.0,
        'batch_size_max': max(self.sizes, default=0),
        'batch_sizes': dict(sorted(self.sizes.items())),
        'inference_ms_mean': (
            1000 * self.inference / self.batches if self.batches else 0.0),
        'dropped': self.dropped,
        'errors': self.errors,
        'postfn_errors': self.postfn_errors,
        'pending': pending,
    }
    stats.update({f'cut/{k}': v for k, v in sorted(self.cuts.items())})
    for name, values in (('queue_wait_ms', self.waits),
                         ('latency_ms', self.latencies)):
      for q in (50, 95, 99):
        value = np.percentile(values, q) * 1000 if values else 0.0
        stats[f'{name}/p{q}'] = float(value)
    return stats

