"""The replays and the limiter of a run, built from its config, so every
script stores, samples and rate-limits alike.

  train_replay(config, logdir)  sequences of batch_length + replay_context
                                steps, selectors from `replay.fracs`
  eval_replay(config, logdir)   report_length + replay_context, uniform
  make_limiter(config)          `run.train_ratio` as samples per insert
"""

from pathlib import Path

from .limiter import SamplesPerInsert, Unlimited
from .replay import Replay
from .selectors import Mixture, Prioritized, Recency, Uniform


def train_replay(config, logdir):
  return Replay(
      config.batch_length + config.replay_context, int(config.replay.size),
      Path(logdir) / 'replay', chunksize=int(config.replay.chunksize),
      online=bool(config.replay.online),
      selector=make_selector(config, config.seed), seed=config.seed)


def eval_replay(config, logdir):
  """Eval data only feeds eval reports: a tenth of the train capacity (as
  upstream), but never less than one batch of sequences."""
  length = config.report_length + config.replay_context
  size = max(int(config.replay.size) // 10, config.batch_size * length)
  return Replay(
      length, size, Path(logdir) / 'replay_eval',
      chunksize=int(config.replay.chunksize), online=False,
      selector=Uniform(config.seed + 1), seed=config.seed + 1)


def make_selector(config, seed=0):
  """The train selector from `replay.fracs`; a Mixture only when needed."""
  fracs = {name: float(value) for name, value in dict(
      config.replay.fracs).items() if float(value) > 0}
  prio = config.replay.prio

  def build(name, seed):
    if name == 'uniform':
      return Uniform(seed)
    if name == 'priority':
      return Prioritized(
          prio.exponent, prio.initial, prio.zero_on_sample, prio.maxfrac,
          seed)
    if name == 'recency':
      return Recency(config.replay.recexp, seed)
    raise ValueError(f'Unknown replay selector {name!r} in replay.fracs.')

  if not fracs:
    raise ValueError('replay.fracs: at least one fraction must be positive.')
  if len(fracs) == 1:
    return build(next(iter(fracs)), seed)
  selectors = {
      name: build(name, seed + 1 + index)
      for index, name in enumerate(sorted(fracs))}
  return Mixture(selectors, fracs, seed)


def make_limiter(config):
  """train_ratio counts replayed steps per env step; the limiter counts
  sequences per inserted step, hence the division by batch_length."""
  if config.run.train_ratio <= 0:
    return Unlimited()
  return SamplesPerInsert(
      config.run.train_ratio / config.batch_length,
      tolerance=4 * config.batch_size,
      minsize=config.batch_size * config.batch_length)
