"""The replays and the limiter of a run, built from its `Options` (the
part of the run config they use), so every script stores, samples and
rate-limits alike.

  Options.of(config)             the replay keys of a run config, typed
  train_replay(options, logdir)  sequences of batch_length + context steps,
                                 selectors from `replay.fracs`
  eval_replay(options, logdir)   report_length + context, uniform
  make_limiter(options)          `run.train_ratio` as samples per insert
"""

import dataclasses
from pathlib import Path

from .limiter import SamplesPerInsert, Unlimited
from .replay import Replay
from .selectors import Mixture, Prioritized, Recency, Uniform


@dataclasses.dataclass(frozen=True)
class Options:
  """What the replays, the limiter and the replay service use of a run
  config: the batch shape, the `replay.*` block and `run.train_ratio`."""

  batch_size: int
  batch_length: int
  report_length: int
  context: int  # replay_context: steps before each sequence, not trained on
  size: int
  chunksize: int
  online: bool
  fracs: tuple  # ((selector name, fraction), ...), fractions > 0
  prio: tuple  # (exponent, initial, zero_on_sample, maxfrac)
  recexp: float
  wal: str
  train_ratio: float
  seed: int

  @classmethod
  def of(cls, config):
    replay, prio = config.replay, config.replay.prio
    return cls(
        batch_size=int(config.batch_size),
        batch_length=int(config.batch_length),
        report_length=int(config.report_length),
        context=int(config.replay_context), size=int(replay.size),
        chunksize=int(replay.chunksize), online=bool(replay.online),
        fracs=tuple((name, float(value)) for name, value in sorted(
            dict(replay.fracs).items()) if float(value) > 0),
        prio=(float(prio.exponent), float(prio.initial),
              bool(prio.zero_on_sample), float(prio.maxfrac)),
        recexp=float(replay.recexp), wal=str(replay.wal),
        train_ratio=float(config.run.train_ratio), seed=int(config.seed))


def train_replay(options, logdir):
  return Replay(
      options.batch_length + options.context, options.size,
      Path(logdir) / 'replay', chunksize=options.chunksize,
      online=options.online, selector=make_selector(options, options.seed),
      seed=options.seed)


def eval_replay(options, logdir):
  """Eval data only feeds eval reports: a tenth of the train capacity (as
  upstream), but never less than one batch of sequences."""
  length = options.report_length + options.context
  size = max(options.size // 10, options.batch_size * length)
  return Replay(
      length, size, Path(logdir) / 'replay_eval',
      chunksize=options.chunksize, online=False,
      selector=Uniform(options.seed + 1), seed=options.seed + 1)


def make_selector(options, seed=0):
  """The train selector from `replay.fracs`; a Mixture only when needed."""
  fracs = dict(options.fracs)

  def build(name, seed):
    if name == 'uniform':
      return Uniform(seed)
    if name == 'priority':
      return Prioritized(*options.prio, seed)
    if name == 'recency':
      return Recency(options.recexp, seed)
    raise ValueError(f'Unknown replay selector {name!r} in replay.fracs.')

  if not fracs:
    raise ValueError('replay.fracs: at least one fraction must be positive.')
  if len(fracs) == 1:
    return build(next(iter(fracs)), seed)
  selectors = {
      name: build(name, seed + 1 + index)
      for index, name in enumerate(sorted(fracs))}
  return Mixture(selectors, fracs, seed)


def make_limiter(options):
  """train_ratio counts replayed steps per env step; the limiter counts
  sequences per inserted step, hence the division by batch_length."""
  if options.train_ratio <= 0:
    return Unlimited()
  return SamplesPerInsert(
      options.train_ratio / options.batch_length,
      tolerance=4 * options.batch_size,
      minsize=options.batch_size * options.batch_length)
