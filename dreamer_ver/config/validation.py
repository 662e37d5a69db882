"""Checks of config values, so that a bad value or combination of keys
fails at start-up in one line instead of deep inside some process.

* ``normalize`` and ``coerce``: the form and type of one value, as
  ``loading`` applies a block or an override (a key keeps its type);
* ``validate(config)``: value ranges and cross-key constraints of a composed
  config, every problem found named in one :class:`ConfigError`.

This module must stay light: it never imports JAX.
"""

import math
import re

_SCALARS = (bool, int, float, str)


class ConfigError(ValueError):
  """A bad config block, key, value or combination. The message is one line."""

  def __init__(self, message):
    super().__init__(' '.join(str(message).split()))


# ---------------------------------------------------------------------------
# One value.

def typename(value):
  """A value's type as messages name it: 'int', 'list of float', ..."""
  if isinstance(value, tuple):
    return f'list of {typename(value[0])}'
  return type(value).__name__


def normalize(key, value, where):
  """Checks that a value is a scalar or a non-empty homogeneous list; lists
  become tuples, so configs stay hashable and compare equal however built."""
  if value is None:
    raise ConfigError(f"{where}: key '{key}' has no value")
  if isinstance(value, (list, tuple)):
    if not value:
      raise ConfigError(f"{where}: key '{key}' is an empty list")
    if not all(isinstance(x, _SCALARS) for x in value):
      raise ConfigError(
          f"{where}: key '{key}' is a list of non-scalars: {list(value)}")
    kinds = {type(x) for x in value}
    if kinds == {int, float}:
      value = [float(x) for x in value]
    elif len(kinds) > 1:
      raise ConfigError(
          f"{where}: key '{key}' mixes types in a list: {list(value)}")
    return tuple(value)
  if not isinstance(value, _SCALARS):
    raise ConfigError(
        f"{where}: key '{key}' has a value of unsupported type "
        f"{type(value).__name__}: {value!r}")
  return value


def coerce(old, new, key, where):
  """Converts a typed value (from YAML or Python) to the type of ``old``."""
  def fail():
    raise ConfigError(
        f"{where}: config key '{key}' expects {typename(old)}, "
        f"got {new!r} ({type(new).__name__})")
  if isinstance(old, tuple):
    if not isinstance(new, (list, tuple)):
      fail()
    new = normalize(key, new, where)
    return tuple(coerce(old[0], x, key, where) for x in new)
  if isinstance(old, bool):
    if isinstance(new, bool):
      return new
    fail()
  if isinstance(old, int):
    if isinstance(new, bool):
      fail()
    if isinstance(new, int):
      return new
    if isinstance(new, float) and math.isfinite(new) and new.is_integer():
      return int(new)
    fail()
  if isinstance(old, float):
    if isinstance(new, (int, float)) and not isinstance(new, bool):
      return float(new)
    fail()
  if isinstance(old, str):
    if isinstance(new, str):
      return new
    fail()
  raise AssertionError((key, old))


# ---------------------------------------------------------------------------
# A composed config.

def _agent(*keys):
  return tuple(f'agent.{key}' for key in keys)


# The names logger.outputs may list (logger/outputs.py). metrics.jsonl,
# scores.jsonl and the videos' GIFs are always written: jsonl adds nothing.
OUTPUTS = ('jsonl', 'tensorboard', 'wandb')

# Keys that take one of a few names.
CHOICES = {
    'run.eval_mode': ('greedy', 'sample'),
    'run.actor_cutoff': ('preempt', 'ver', 'fixed'),
    'run.actor_transport': ('auto', 'shm', 'tcp'),
    'replay.wal': ('flush', 'fsync', 'off'),
    'jax.platform': ('', 'cpu', 'cuda', 'gpu', 'tpu'),
    'jax.compute_dtype': ('float32', 'bfloat16'),
    'jax.malloc': ('mimalloc', 'one_arena', 'glibc'),
    'agent.scan_grads': ('rows', 'steps'),
    'env.atari100k.actions': ('needed', 'all'),
    'env.atari100k.lives': ('unused', 'discount', 'reset'),
    'env.atari100k.resize': ('pillow', 'numpy'),
    'env.atari.actions': ('needed', 'all'),
    'env.atari.lives': ('unused', 'discount', 'reset'),
    'env.atari.resize': ('pillow', 'numpy'),
    'env.atari.aggregate': ('max', 'mean'),
    'logger.wandb_mode': ('online', 'offline'),
    'ray.env_strategy': ('SPREAD', 'DEFAULT'),
}

# Value ranges: (keys, test, the rule as the message states it).
RANGES = (
    (('batch_size', 'batch_length', 'report_length', 'run.envs',
      'run.eval_worker_envs', 'run.envs_per_worker', 'run.keep_checkpoints', 'run.actor_threads', 'replay.chunksize',
      'run.train_fuse', 'logger.fps', 'logger.video_length') + _agent(
          'rssm.deter', 'rssm.hidden', 'rssm.stoch', 'rssm.classes',
          'rssm.blocks', 'enc.depth', 'enc.units', 'enc.kernel', 'dec.depth',
          'dec.units', 'dec.kernel', 'dec.bspace', 'rewhead.units',
          'conhead.units', 'policy.units', 'value.units', 'imag_length',
          'horizon', 'slowvalue.every', 'scan_unroll'),
     lambda v: v >= 1, 'must be >= 1'),
    (('replay_context', 'replica', 'run.eval_envs', 'run.envid_offset',
      'run.crash_limit', 'run.peer_timeout',
      'run.eval_every', 'run.eval_timeout', 'run.eval_max_steps',
      'run.duration',
      'run.actor_min_wait',
      'env.gym.max_episode_steps', 'env.crafter.length') + _agent(
          'rssm.imglayers', 'rssm.obslayers', 'rssm.dynlayers', 'enc.layers',
          'dec.layers', 'rewhead.layers', 'conhead.layers', 'policy.layers',
          'value.layers', 'rssm.free_nats', 'opt.agc', 'opt.warmup',
          'imag_loss.actent', 'opt.lr') + tuple(
          f'ray.{name}' for name in ('env_cpus', 'agent_cpus', 'agent_gpus',
                                     'replay_cpus', 'logger_cpus',
                                     'eval_cpus', 'eval_gpus')),
     lambda v: v >= 0, 'must be >= 0'),
    (('replay.size', 'run.steps', 'run.train_ratio', 'run.log_every',
      'run.report_every', 'run.episode_timeout', 'run.actor_max_wait',
      'run.env_timeout', 'run.crash_window') + _agent('opt.eps'),
     lambda v: v > 0, 'must be > 0'),
    (_agent('rewhead.bins', 'value.bins'), lambda v: v >= 2, 'must be >= 2'),
    (_agent('rssm.unimix', 'policy.unimix', 'opt.beta1', 'opt.beta2'),
     lambda v: 0 <= v < 1, 'must be in [0, 1)'),
    (('replay.prio.maxfrac',) + _agent(
        'imag_loss.lam', 'repl_loss.lam', 'slowvalue.rate', 'retnorm.rate'),
     lambda v: 0 <= v <= 1, 'must be in [0, 1]'),
    (_agent('enc.mults', 'dec.mults'),
     lambda v: all(m >= 1 for m in v), 'must be positive'),
    (('env.gym.size', 'env.dmc.size', 'env.atari.size', 'env.atari100k.size',
      'env.crafter.size'),
     lambda v: len(v) == 2 and all(x >= 1 for x in v),
     'must be two positive ints'),
)


def validate(config):
  """Returns ``config`` or raises ConfigError listing all problems found,
  separated by '; ', so one run of a bad command line shows all of them."""
  c = config.flat
  problems = [f'{key} {rule} (got {_show(c[key])})'
              for keys, test, rule in RANGES for key in keys
              if not test(c[key])]
  problems += [f"{key} must be one of {', '.join(map(repr, names))} "
               f'(got {c[key]!r})'
               for key, names in CHOICES.items() if c[key] not in names]
  for check in (_task, _script, _sequences, _addresses, _devices, _model,
                _outputs):
    problems += check(c)
  problems += _actor(c, config.run)
  if problems:
    raise ConfigError('invalid config: ' + '; '.join(problems))
  return config


def _task(c):
  """The task's form and its suite's options."""
  task = c['task']
  if not re.fullmatch(r'[A-Za-z0-9]+_.+', task):
    yield f"task must look like <suite>_<name> (got '{task}')"
  if task.startswith('dmc_') and not (c['env.dmc.proprio']
                                      or c['env.dmc.image']):
    yield 'env.dmc.proprio and env.dmc.image cannot both be False'


def _script(c):
  """Keys that only one script reads would be silently ignored by others."""
  if c['random_agent'] and c['script'] != 'eval_only':
    yield ("random_agent is only supported by --script eval_only "
           f"(got script '{c['script']}')")
  if c['script'] == 'ray' and (c['run.remote_envs'] or c['run.remote_replay']):
    yield ('run.remote_envs and run.remote_replay do not apply to --script '
           'ray: Ray starts every component')
  if not c['ray.address']:
    yield "ray.address must be local, auto, host:port or ray://host:port"


def _sequences(c):
  """Sequence lengths against the replay, and the replay's selectors."""
  stored = c['batch_length'] + c['replay_context']
  if c['report_length'] > stored:
    yield (f"report_length ({c['report_length']}) must be <= batch_length + "
           f"replay_context ({stored})")
  if c['batch_size'] * stored > c['replay.size']:
    yield ("batch_size * (batch_length + replay_context) "
           f"({c['batch_size']} * {stored} = {c['batch_size'] * stored}) "
           f"must be <= replay.size ({c['replay.size']:g})")
  fracs = _group(c, 'replay.fracs.')
  if any(v < 0 for v in fracs.values()):
    yield f'replay.fracs.* must be >= 0 (got {_fmt(fracs)})'
  if abs(sum(fracs.values()) - 1) >= 1e-6:
    yield f'replay.fracs.* must sum to 1 (got {_fmt(fracs)})'


def _actor(c, run):
  """Batch sizes of the actor; compiled buckets must hold the largest."""
  from dreamer_ver.actor.batching import max_batch
  batch, envs = c['run.actor_batch'], c['run.envs']
  if batch > envs:
    yield f'run.actor_batch ({batch}) must be <= run.envs ({envs})'
  lo, hi = c['run.actor_min_batch'], c['run.actor_max_batch']
  if lo > 0 and hi > 0 and lo > hi:
    yield f'run.actor_min_batch ({lo}) must be <= run.actor_max_batch ({hi})'
  buckets = list(c['run.actor_buckets'])
  if buckets == [0]:
    return
  if not (all(b >= 1 for b in buckets) and buckets == sorted(set(buckets))):
    yield (f'run.actor_buckets must be [0] (auto) or increasing positive '
           f'sizes (got {buckets})')
  largest = max_batch(run, run.envs + run.eval_envs)
  if buckets[-1] < largest:
    yield (f'the largest of run.actor_buckets ({buckets[-1]}) must be >= the '
           f'largest batch ({largest}, run.actor_max_batch or '
           f'run.envs + run.eval_envs)')


def _addresses(c):
  """'{auto}' ports only work when one process starts every component
  (under --script ray, Ray says where each one serves)."""
  addrs = {k: c[f'run.{k}'] for k in ('actor_addr', 'replay_addr',
                                      'logger_addr')}
  for key, addr in addrs.items():
    if not re.fullmatch(r'.+:(\d+|\{auto\})', addr):
      yield f"run.{key} must be host:port or host:{{auto}} (got '{addr}')"
  if c['script'] == 'ray':
    return
  explicit = set()
  if c['script'] == 'parallel_learner':  # It talks to replay alone.
    explicit = {'replay_addr'}
  elif c['script'].startswith('parallel_'):  # One component of a split run.
    explicit = set(addrs)
  if c['jax.processes'] > 1:  # Every learner process samples from replay.
    explicit |= {'replay_addr'}
  if c['run.remote_envs']:
    explicit |= {'actor_addr'}
  if c['run.remote_replay']:
    explicit |= {'replay_addr', 'logger_addr'}
  for key in sorted(k for k in explicit if '{auto}' in addrs[k]):
    yield (f"run.{key} needs an explicit port when components run in "
           f"separate processes (script '{c['script']}', remote_envs "
           f"{c['run.remote_envs']}, remote_replay {c['run.remote_replay']}, "
           f"jax.processes {c['jax.processes']})")


def _devices(c):
  """Device indices and learner processes, checked here; whether the
  devices exist, in cluster/devices."""
  for key in ('jax.policy_devices', 'jax.train_devices'):
    names = list(c[key])
    if not all(d >= 0 for d in names):
      yield f'{key} must be device indices >= 0 (got {names})'
    if len(set(names)) != len(names):
      yield f'{key} names a device twice (got {names})'
  processes, process_id = c['jax.processes'], c['jax.process_id']
  train = len(c['jax.train_devices']) * processes
  if c['script'] == 'train' and train > 1:
    yield (f"script 'train' trains on one device (got jax.train_devices "
           f"{list(c['jax.train_devices'])}, jax.processes {processes}); the "
           f"data-parallel learner runs in the agent process (scripts "
           f"parallel, parallel_agent and ray)")
  if c['script'] == 'eval_only' and processes > 1:
    yield (f"script 'eval_only' runs in one process (got jax.processes "
           f"{processes}); a multi-host learner runs under the scripts "
           f"parallel_agent and parallel_learner, or ray")
  if processes < 1 or not 0 <= process_id < processes:
    yield (f'jax.process_id must be in [0, jax.processes) and jax.processes '
           f'>= 1 (got {process_id} and {processes})')
  if c['script'] == 'ray' and process_id:
    yield (f"script 'ray' starts every learner process itself: leave "
           f"jax.process_id at 0 (got {process_id})")
  if processes > 1 and not c['jax.coordinator'] and c['script'] != 'ray':
    yield ('jax.coordinator (host:port of process 0) is required when '
           'jax.processes > 1')
  learner = c['script'] == 'parallel_learner'
  if learner != (process_id > 0) and c['script'] in (
      'parallel', 'parallel_agent', 'parallel_learner'):
    yield (f"jax.process_id {process_id}: process 0 is the agent (scripts "
           f"parallel, parallel_agent), the others run parallel_learner "
           f"(got script {c['script']!r})")
  if c['batch_size'] % train:
    yield (f"batch_size ({c['batch_size']}) must be a multiple of the "
           f"number of train devices ({train}: jax.train_devices times "
           f"jax.processes): each trains on an equal share of the rows")


def _model(c):
  """Agent constraints that involve more than one key."""
  deter, blocks = c['agent.rssm.deter'], c['agent.rssm.blocks']
  if blocks >= 1 and deter % blocks:
    yield (f'agent.rssm.deter ({deter}) must be divisible by '
           f'agent.rssm.blocks ({blocks})')
  scales = _group(c, 'agent.loss_scales.')
  if any(v < 0 for v in scales.values()):
    yield f'agent.loss_scales.* must be >= 0 (got {_fmt(scales)})'
  lo, hi = c['agent.policy.minstd'], c['agent.policy.maxstd']
  if not 0 < lo <= hi:
    yield (f'need 0 < agent.policy.minstd ({lo}) <= agent.policy.maxstd '
           f'({hi})')
  lo, hi = c['agent.retnorm.perclo'], c['agent.retnorm.perchi']
  if not 0 <= lo < hi <= 100:
    yield (f'need 0 <= agent.retnorm.perclo ({lo}) < agent.retnorm.perchi '
           f'({hi}) <= 100')


def _outputs(c):
  """A typo in logger.outputs would silently drop an output."""
  unknown = [name for name in c['logger.outputs'] if name not in OUTPUTS]
  if unknown:
    yield (f'logger.outputs has unknown names {unknown} (known: '
           f"{', '.join(OUTPUTS)})")


def _group(c, prefix):
  return {k: v for k, v in c.items() if k.startswith(prefix)}


def _fmt(mapping):
  return ', '.join(f'{k.split(".")[-1]}={v}' for k, v in mapping.items())


def _show(value):
  return list(value) if isinstance(value, tuple) else value
