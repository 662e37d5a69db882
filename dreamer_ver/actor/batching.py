"""The actor's batching from a run's settings: how many requests one lane
batches, the padded sizes compiled at start-up, and the cutoff policy
(`preemption.py`) that `run.actor_cutoff` names."""

from dreamer_ver.actor.preemption import VER, Fixed, Preempt


def max_batch(run, envs, lanes=1):
  """The most requests one lane batches: `run.actor_max_batch`, or by
  default the lane's share of the `envs` envs."""
  return run.actor_max_batch if run.actor_max_batch > 0 else -(-envs // lanes)


def bucket_sizes(run, largest):
  """The padded batch sizes compiled at start-up: `run.actor_buckets`, or
  powers of two; always up to `largest`."""
  if list(run.actor_buckets) != [0]:
    return sorted(set(list(run.actor_buckets) + [largest]))
  return powers_of_two(largest)


def powers_of_two(largest):
  """1, 2, 4, ... below `largest`, then `largest`: the default buckets."""
  sizes, size = [], 1
  while size < largest:
    sizes.append(size)
    size *= 2
  return sizes + [largest]


def make_cutoff(run, envs, buckets, inference=None, lanes=1, shared=None):
  """The cutoff policy named by `run.actor_cutoff` with its guard rails,
  for one of `lanes` lanes that share `envs` envs (and, for preempt, the
  `shared` decider of all lanes).

  Defaults as VER's: min = N / (1.5 W), following the live envs, max = the
  lane's share of the N envs, with W the inference threads of all lanes.
  """
  threads = max(1, run.actor_threads) * lanes
  largest = max_batch(run, envs, lanes)
  min_batch = run.actor_min_batch
  if min_batch <= 0:
    min_batch = max(1, int(envs / threads / 1.5))
  min_batch = min(min_batch, largest)
  if run.actor_cutoff == 'fixed':
    batch = run.actor_batch if run.actor_batch > 0 else max(
        1, run.envs // (2 * lanes))
    return Fixed(batch)
  if run.actor_cutoff == 'ver':
    return VER(min_batch, largest, run.actor_min_wait, run.actor_max_wait)
  if run.actor_cutoff == 'preempt':
    return Preempt(min_batch, largest, buckets, inference,
                   max_wait=run.actor_max_wait, forget=run.env_timeout,
                   shared=shared,
                   threads=threads if run.actor_min_batch <= 0 else None)
  raise ValueError(f'unknown run.actor_cutoff {run.actor_cutoff!r}')
