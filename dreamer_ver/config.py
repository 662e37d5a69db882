"""Configuration: YAML blocks in ``configs/``, composed in order, then flags.

A run's config is built in three layers:

1. ``configs/defaults.yaml`` defines every key, its default and its type.
2. The blocks named by ``--configs a b c`` (``configs/a.yaml`` ...) are applied
   in that order; a later block wins over an earlier one.
3. ``--key.sub value`` flags are applied last.

Blocks may set nested keys (``run: {envs: 4}``), dotted keys
(``env.dmc.image: False``) or regex keys that set every matching key
(``.*\\.units: 64``; a key is a regex when it holds a character other than
letters, digits, ``_``, ``.`` and ``-``; it must match whole keys).

Overrides are strict: an unknown key, a regex that matches nothing, a group
given a single value, or a value of the wrong type raises :class:`ConfigError`
with a one-line message that names the key and where the value came from.
Ints are accepted for float keys and whole-number floats (``1e4``) for int
keys; nothing else is converted.

This module must stay light: it never imports JAX.
"""

import datetime
import difflib
import math
import os
import re
from pathlib import Path

import elements

CONFIG_DIR = Path(__file__).resolve().parent.parent / 'configs'
DEFAULTS = 'defaults'

_REGEX_CHAR = re.compile(r'[^A-Za-z0-9_.\-]')
_SCALARS = (bool, int, float, str)


class ConfigError(ValueError):
  """A bad config block, key, value or combination. The message is one line."""

  def __init__(self, message):
    super().__init__(' '.join(str(message).split()))


# ---------------------------------------------------------------------------
# Blocks.

def block_names(folder=None):
  """Names of all config blocks (YAML files) in ``folder``, sorted."""
  folder = Path(folder) if folder else CONFIG_DIR
  return sorted(p.stem for p in folder.glob('*.yaml'))


def load_block(name, folder=None):
  """Reads one block as a plain (nested) dict."""
  folder = Path(folder) if folder else CONFIG_DIR
  path = folder / f'{name}.yaml'
  if not re.fullmatch(r'[A-Za-z0-9_\-]+', name) or not path.is_file():
    available = ', '.join(block_names(folder)) or '(none)'
    raise ConfigError(
        f"unknown config block '{name}'; available: {available}")
  from ruamel.yaml import YAML
  from ruamel.yaml.error import YAMLError
  try:
    data = YAML(typ='safe').load(path.read_text())
  except YAMLError as e:
    first = str(e).strip().splitlines()[0] if str(e).strip() else type(e)
    raise ConfigError(f'cannot parse config block {path}: {first}')
  if data is None:
    return {}
  if not isinstance(data, dict):
    raise ConfigError(f"config block '{name}' must be a mapping of keys")
  return data


def _is_regex(key):
  return bool(_REGEX_CHAR.search(key))


def _flatten(mapping, where, prefix=''):
  """Nested dict -> ordered list of (key or regex, value) pairs."""
  pairs = []
  for key, value in mapping.items():
    if not isinstance(key, str) or not key:
      raise ConfigError(f'{where}: key {key!r} under {prefix!r} is not a name')
    if not prefix:
      full = key
    elif _is_regex(prefix) or _is_regex(key):
      left = prefix if _is_regex(prefix) else re.escape(prefix)
      right = key if _is_regex(key) else re.escape(key)
      full = f'{left}\\.{right}'
    else:
      full = f'{prefix}.{key}'
    if isinstance(value, dict):
      if not value:
        raise ConfigError(f"{where}: key '{full}' has an empty mapping")
      pairs += _flatten(value, where, full)
    else:
      pairs.append((full, value))
  return pairs


def _normalize(key, value, where):
  """Checks that a value is a scalar or a non-empty homogeneous list."""
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


def _defaults(folder=None):
  where = f"block '{DEFAULTS}'"
  flat = {}
  for key, value in _flatten(load_block(DEFAULTS, folder), where):
    if _is_regex(key):
      raise ConfigError(f"{where}: key '{key}' must be a plain name")
    flat[key] = _normalize(key, value, where)
  return flat


# ---------------------------------------------------------------------------
# Applying overrides.

def _typename(value):
  if isinstance(value, tuple):
    return f'list of {_typename(value[0])}'
  return type(value).__name__


def _ending_in(flat, key):
  """The keys whose last part is `key`: when there is one, `key` names it
  (`from_checkpoint` is `run.from_checkpoint`)."""
  return [k for k in flat if k.endswith('.' + key)]


def _targets(flat, key, where):
  """The existing keys that an override key (plain or regex) refers to."""
  if _is_regex(key):
    try:
      pattern = re.compile(key)
    except re.error as e:
      raise ConfigError(f"{where}: key '{key}' is not a valid regex: {e}")
    matches = [k for k in flat if pattern.fullmatch(k)]
    if not matches:
      raise ConfigError(f"{where}: config key pattern '{key}' matches no key")
    return matches
  if key in flat:
    return [key]
  suffixed = _ending_in(flat, key)
  if len(suffixed) == 1:
    return suffixed
  if suffixed:
    raise ConfigError(
        f"{where}: config key '{key}' is ambiguous: "
        + ', '.join(sorted(suffixed)))
  children = [k for k in flat if k.startswith(key + '.')]
  if children:
    raise ConfigError(
        f"{where}: config key '{key}' is a group, set one of its keys "
        f"(e.g. '{children[0]}')")
  close = difflib.get_close_matches(key, list(flat), n=1, cutoff=0.6)
  hint = f"; did you mean '{close[0]}'?" if close else ''
  raise ConfigError(f"{where}: unknown config key '{key}'{hint}")


def _coerce(old, new, key, where):
  """Converts a typed value (from YAML or Python) to the type of ``old``."""
  def fail():
    raise ConfigError(
        f"{where}: config key '{key}' expects {_typename(old)}, "
        f"got {new!r} ({type(new).__name__})")
  if isinstance(old, tuple):
    if not isinstance(new, (list, tuple)):
      fail()
    new = _normalize(key, new, where)
    return tuple(_coerce(old[0], x, key, where) for x in new)
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


_BOOLS = {'True': True, 'true': True, 'False': False, 'false': False}


def _parse_text(old, texts, key, where):
  """Converts flag strings to the type of ``old``."""
  if isinstance(old, tuple):
    if len(texts) == 1 and ',' in texts[0]:
      texts = [t for t in texts[0].split(',') if t != '']
    if not texts:
      raise ConfigError(f"{where}: config key '{key}' needs at least one value")
    return tuple(_parse_text(old[0], [t], key, where) for t in texts)
  if len(texts) != 1:
    raise ConfigError(
        f"{where}: config key '{key}' expects a single {_typename(old)}, "
        f"got {len(texts)} values: {' '.join(texts)}")
  text = texts[0]
  def fail():
    raise ConfigError(
        f"{where}: config key '{key}' expects {_typename(old)}, got '{text}'")
  if isinstance(old, bool):
    if text not in _BOOLS:
      fail()
    return _BOOLS[text]
  if isinstance(old, int):
    try:
      return int(text)
    except ValueError:
      pass
    try:
      value = float(text)
    except ValueError:
      fail()
    if not (math.isfinite(value) and value.is_integer()):
      fail()
    return int(value)
  if isinstance(old, float):
    try:
      return float(text)
    except ValueError:
      fail()
  return text


def _apply(flat, pairs, where, text=False):
  """Applies (key, value) pairs in order to the flat dict, in place."""
  for key, value in pairs:
    for target in _targets(flat, key, where):
      old = flat[target]
      if text:
        flat[target] = _parse_text(old, value, target, where)
      else:
        value = _normalize(target, value, where)
        flat[target] = _coerce(old, value, target, where)
  return flat


def _build(flat):
  nested = {}
  for key, value in flat.items():
    node = nested
    *parents, leaf = key.split('.')
    for part in parents:
      node = node.setdefault(part, {})
    node[leaf] = value
  return elements.Config(nested)


def override(config, mapping, where='override'):
  """Returns ``config`` with ``mapping`` applied, with the strict checks.

  ``mapping`` may be nested or use dotted or regex keys, like a block.
  """
  flat = dict(config.flat)
  pairs = _flatten(dict(mapping), where)
  return _build(_apply(flat, pairs, where))


def compose(names=(), overrides=None, folder=None):
  """defaults + the named blocks in order + an optional mapping of overrides."""
  flat = _defaults(folder)
  for name in names:
    where = f"block '{name}'"
    _apply(flat, _flatten(load_block(name, folder), where), where)
  if overrides:
    _apply(flat, _flatten(dict(overrides), 'override'), 'override')
  return _build(flat)


# ---------------------------------------------------------------------------
# Command line.

def split_argv(argv):
  """Splits argv into (block names, [(flag name, [values])], stray tokens).

  Accepts ``--key value``, ``--key=value``, ``--key v1 v2`` (lists) and
  ``--configs a b`` or ``--configs a,b`` (may be repeated).
  """
  names, flags, stray = [], [], []
  current = None
  for token in argv:
    if token.startswith('--') and len(token) > 2:
      name, eq, value = token[2:].partition('=')
      current = (name, [value] if eq else [])
      flags.append(current)
    elif current is None:
      stray.append(token)
    else:
      current[1].append(token)
  rest = []
  for name, values in flags:
    if name == 'configs':
      if not values:
        raise ConfigError('flag --configs: missing block names')
      for value in values:
        names += [v for v in value.split(',') if v]
    else:
      rest.append((name, values))
  return names, rest, stray


def parse_known(argv, folder=None):
  """Builds the config from argv; returns (config, remaining tokens).

  Flags whose key matches no config key, and tokens not preceded by a flag,
  are returned in ``remaining`` instead of raising. Bad blocks, flags without
  a value and values of the wrong type still raise :class:`ConfigError`.
  """
  names, flags, stray = split_argv(list(argv))
  flat = _defaults(folder)
  for name in names:
    where = f"block '{name}'"
    _apply(flat, _flatten(load_block(name, folder), where), where)
  remaining = list(stray)
  for name, values in flags:
    where = f'flag --{name}'
    if not values:
      raise ConfigError(f'{where}: missing value')
    if _is_regex(name):
      try:
        known = any(re.fullmatch(name, k) for k in flat)
      except re.error as e:
        raise ConfigError(f"{where}: not a valid regex: {e}")
    else:
      known = (name in flat or _ending_in(flat, name)
               or any(k.startswith(name + '.') for k in flat))
    if not known:
      remaining += [f'--{name}', *values]
      continue
    _apply(flat, [(name, values)], where, text=True)
  return _build(flat), remaining


def load_config(argv, folder=None, check=True):
  """Builds the config from argv, rejecting anything unknown.

  With ``check`` (the default) the result also passes :func:`validate`.
  """
  config, remaining = parse_known(argv, folder)
  if remaining:
    first = remaining[0]
    if first.startswith('--'):
      name = first[2:]
      flat = config.flat
      close = difflib.get_close_matches(name, list(flat), n=1, cutoff=0.6)
      hint = f"; did you mean '--{close[0]}'?" if close else ''
      raise ConfigError(
          f"flag --{name}: unknown config key '{name}'{hint}")
    raise ConfigError(
        f"unexpected argument '{first}' (values must follow a --key flag)")
  if check:
    validate(config)
  return config


# ---------------------------------------------------------------------------
# Validation.

# Keys that take one of a few names.
CHOICES = {
    'run.eval_mode': ('greedy', 'sample'),
    'run.actor_cutoff': ('preempt', 'ver', 'fixed'),
    'jax.platform': ('', 'cpu', 'cuda', 'gpu', 'tpu'),
    'jax.compute_dtype': ('float32', 'bfloat16', 'float16'),
}


def validate(config):
  """Checks cross-key constraints; returns ``config`` or raises ConfigError.

  All problems found are reported together, separated by '; '.
  """
  c = config.flat
  problems = []

  def need(ok, message):
    if not ok:
      problems.append(message)

  for key in ('batch_size', 'batch_length', 'report_length', 'replicas',
              'run.envs', 'run.report_batches', 'run.actor_threads',
              'replay.chunksize'):
    need(c[key] >= 1, f'{key} must be >= 1 (got {c[key]})')
  for key in ('replay_context', 'replica', 'run.eval_envs', 'run.duration'):
    need(c[key] >= 0, f'{key} must be >= 0 (got {c[key]})')
  for key in ('replay.size', 'run.steps', 'run.train_ratio', 'run.log_every',
              'run.report_every', 'run.episode_timeout',
              'run.actor_max_wait', 'run.env_timeout'):
    need(c[key] > 0, f'{key} must be > 0 (got {c[key]})')
  need(c['run.actor_min_wait'] >= 0,
       f"run.actor_min_wait must be >= 0 (got {c['run.actor_min_wait']})")
  for key, choices in CHOICES.items():
    need(c[key] in choices, f"{key} must be one of "
         f"{', '.join(repr(x) for x in choices)} (got {c[key]!r})")

  task = c['task']
  need(re.fullmatch(r'[A-Za-z0-9]+_.+', task) is not None,
       f"task must look like <suite>_<name> (got '{task}')")

  # Sequences and replay.
  stored = c['batch_length'] + c['replay_context']
  need(c['report_length'] <= stored,
       f"report_length ({c['report_length']}) must be <= batch_length + "
       f"replay_context ({stored})")
  need(c['batch_size'] * stored <= c['replay.size'],
       f"batch_size * (batch_length + replay_context) "
       f"({c['batch_size']} * {stored} = {c['batch_size'] * stored}) must be "
       f"<= replay.size ({c['replay.size']:g})")
  fracs = {k: v for k, v in c.items() if k.startswith('replay.fracs.')}
  need(all(v >= 0 for v in fracs.values()),
       f'replay.fracs.* must be >= 0 (got {_fmt(fracs)})')
  need(abs(sum(fracs.values()) - 1) < 1e-6,
       f'replay.fracs.* must sum to 1 (got {_fmt(fracs)})')
  need(0 <= c['replay.prio.maxfrac'] <= 1,
       f"replay.prio.maxfrac must be in [0, 1] (got {c['replay.prio.maxfrac']})")

  # Actor batching.
  envs, total = c['run.envs'], c['run.envs'] + c['run.eval_envs']
  batch = c['run.actor_batch']
  need(batch <= envs,
       f'run.actor_batch ({batch}) must be <= run.envs ({envs})')
  lo, hi = c['run.actor_min_batch'], c['run.actor_max_batch']
  need(lo <= 0 or hi <= 0 or lo <= hi,
       f'run.actor_min_batch ({lo}) must be <= run.actor_max_batch ({hi})')
  buckets = c['run.actor_buckets']
  if buckets != (0,):
    need(all(b >= 1 for b in buckets) and list(buckets) == sorted(set(buckets)),
         f'run.actor_buckets must be [0] (auto) or increasing positive sizes '
         f'(got {list(buckets)})')
    largest = hi if hi > 0 else total
    need(buckets[-1] >= largest,
         f'the largest of run.actor_buckets ({buckets[-1]}) must be >= the '
         f'largest batch ({largest}, run.actor_max_batch or '
         f'run.envs + run.eval_envs)')

  # Addresses: '{auto}' ports only work when one process starts everything.
  addrs = {k: c[f'run.{k}'] for k in ('actor_addr', 'replay_addr', 'logger_addr')}
  for key, addr in addrs.items():
    need(re.fullmatch(r'.+:(\d+|\{auto\})', addr) is not None,
         f"run.{key} must be host:port or host:{{auto}} (got '{addr}')")
  explicit = set()
  if c['script'].startswith('parallel_'):  # one component of a split run
    explicit = set(addrs)
  if c['run.remote_envs']:
    explicit |= {'actor_addr'}
  if c['run.remote_replay']:
    explicit |= {'replay_addr', 'logger_addr'}
  for key in sorted(explicit):
    need('{auto}' not in addrs[key],
         f"run.{key} needs an explicit port when components run in separate "
         f"processes (script '{c['script']}', remote_envs "
         f"{c['run.remote_envs']}, remote_replay {c['run.remote_replay']})")

  # JAX.
  for key in ('jax.policy_devices', 'jax.train_devices'):
    need(len(c[key]) >= 1 and all(d >= 0 for d in c[key]),
         f'{key} must be device indices >= 0 (got {list(c[key])})')
  need(len(set(c['jax.policy_devices'])) == len(c['jax.policy_devices']),
       f"jax.policy_devices names a device twice "
       f"(got {list(c['jax.policy_devices'])})")

  # Envs.
  for key in ('env.gym.size', 'env.dmc.size', 'env.atari100k.size'):
    need(len(c[key]) == 2 and all(x >= 1 for x in c[key]),
         f'{key} must be two positive ints (got {list(c[key])})')
  if task.startswith('dmc_'):
    need(c['env.dmc.proprio'] or c['env.dmc.image'],
         'env.dmc.proprio and env.dmc.image cannot both be False')

  # Agent.
  a = 'agent.'
  for key in ('rssm.deter', 'rssm.hidden', 'rssm.stoch', 'rssm.classes',
              'rssm.blocks', 'enc.depth', 'enc.units', 'enc.kernel',
              'dec.depth', 'dec.units', 'dec.kernel', 'dec.bspace',
              'rewhead.units', 'conhead.units', 'policy.units', 'value.units',
              'imag_length', 'horizon', 'slowvalue.every'):
    need(c[a + key] >= 1, f'{a}{key} must be >= 1 (got {c[a + key]})')
  for key in ('rssm.imglayers', 'rssm.obslayers', 'rssm.dynlayers',
              'enc.layers', 'dec.layers', 'rewhead.layers', 'conhead.layers',
              'policy.layers', 'value.layers', 'rssm.free_nats', 'opt.agc',
              'opt.warmup', 'imag_loss.actent'):
    need(c[a + key] >= 0, f'{a}{key} must be >= 0 (got {c[a + key]})')
  for key in ('rewhead.bins', 'value.bins'):
    need(c[a + key] >= 2, f'{a}{key} must be >= 2 (got {c[a + key]})')
  for key in ('enc.mults', 'dec.mults'):
    need(all(m >= 1 for m in c[a + key]),
         f'{a}{key} must be positive (got {list(c[a + key])})')
  deter, blocks = c[a + 'rssm.deter'], c[a + 'rssm.blocks']
  need(blocks < 1 or deter % blocks == 0,
       f'{a}rssm.deter ({deter}) must be divisible by {a}rssm.blocks ({blocks})')
  for key in ('rssm.unimix', 'policy.unimix'):
    need(0 <= c[a + key] < 1, f'{a}{key} must be in [0, 1) (got {c[a + key]})')
  for key in ('imag_loss.lam', 'repl_loss.lam', 'slowvalue.rate',
              'retnorm.rate'):
    need(0 <= c[a + key] <= 1, f'{a}{key} must be in [0, 1] (got {c[a + key]})')
  for key in ('opt.beta1', 'opt.beta2'):
    need(0 <= c[a + key] < 1, f'{a}{key} must be in [0, 1) (got {c[a + key]})')
  for key in ('opt.lr', 'opt.eps'):
    need(c[a + key] > 0, f'{a}{key} must be > 0 (got {c[a + key]})')
  scales = {k: v for k, v in c.items() if k.startswith(a + 'loss_scales.')}
  need(all(v >= 0 for v in scales.values()),
       f'{a}loss_scales.* must be >= 0 (got {_fmt(scales)})')
  lo, hi = c[a + 'policy.minstd'], c[a + 'policy.maxstd']
  need(0 < lo <= hi,
       f'need 0 < {a}policy.minstd ({lo}) <= {a}policy.maxstd ({hi})')
  lo, hi = c[a + 'retnorm.perclo'], c[a + 'retnorm.perchi']
  need(0 <= lo < hi <= 100,
       f'need 0 <= {a}retnorm.perclo ({lo}) < {a}retnorm.perchi ({hi}) <= 100')

  if problems:
    raise ConfigError('invalid config: ' + '; '.join(problems))
  return config


def _fmt(mapping):
  return ', '.join(f'{k.split(".")[-1]}={v}' for k, v in mapping.items())


# ---------------------------------------------------------------------------
# Helpers for main and scripts.

def timestamp(now=None):
  now = now or datetime.datetime.now()
  return now.strftime('%Y%m%dT%H%M%S')


def resolve_logdir(config, now=None):
  """Returns the config with ``logdir`` made concrete and absolute.

  An empty logdir becomes ``runs/{timestamp}``; ``{timestamp}`` in the value
  is replaced by the current local time (YYYYmmddTHHMMSS); ``~`` is expanded.
  """
  logdir = config.logdir or os.path.join('runs', '{timestamp}')
  logdir = logdir.replace('{timestamp}', timestamp(now))
  logdir = os.path.abspath(os.path.expanduser(logdir))
  return override(config, {'logdir': logdir}, 'resolve_logdir')


def changes(config, base):
  """{key: value} for the keys of ``config`` that differ from ``base``."""
  theirs = base.flat
  return {k: v for k, v in config.flat.items() if theirs.get(k) != v}


def summary(config, names=(), folder=None):
  """A short human-readable summary: blocks, script, task, and changed keys."""
  base = compose((), folder=folder)
  lines = [f"Config blocks: {', '.join([DEFAULTS, *names])}"]
  lines.append(f'Script: {config.script}  Task: {config.task}  '
               f'Logdir: {config.logdir}')
  diff = changes(config, base)
  diff.pop('logdir', None)
  if diff:
    lines.append('Changed from defaults:')
    width = max(len(k) for k in diff)
    for key, value in diff.items():
      shown = list(value) if isinstance(value, tuple) else value
      lines.append(f'  {key.ljust(width)}  {shown}')
  return '\n'.join(lines)
