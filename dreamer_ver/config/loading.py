"""Configuration: YAML blocks in ``configs/``, composed in order, then flags.

The blocks are the repository's ``configs/*.yaml``, shipped as package data
(``dreamer_ver/configs`` links to them) and read with
``importlib.resources`` so that an installed wheel finds them as a clone does.

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
keys; nothing else is converted. Flag values are parsed by
``elements.Flags``; which keys a flag names is decided here (elements
returns an unknown flag without a hint and knows no short names such as
``--from_checkpoint``), and blocks are applied here (``Config.update``
matches a regex key by its prefix and converts any value with its old
type's constructor: ``bool('False')`` is True).
The checks of single values, and the ranges and cross-key constraints of a
composed config (``validate``, which ``load_config`` runs), live in
``validation``.

Every key of ``defaults.yaml`` has a trailing ``# comment`` on its line, its
one-line meaning; :func:`meanings` reads them for ``--help``.

This module must stay light: it never imports JAX.
"""

import datetime
import difflib
import importlib.resources
import os
import re
from pathlib import Path

import elements

from dreamer_ver.config.validation import (
    ConfigError, coerce, normalize, typename, validate)

CONFIG_DIR = importlib.resources.files('dreamer_ver') / 'configs'
DEFAULTS = 'defaults'

_REGEX_CHAR = re.compile(r'[^A-Za-z0-9_.\-]')


# ---------------------------------------------------------------------------
# Blocks.

def block_names(folder=None):
  """Names of all config blocks (YAML files) in ``folder``, sorted."""
  folder = Path(folder) if folder else CONFIG_DIR
  return sorted(p.name[:-len('.yaml')] for p in folder.iterdir()
                if p.name.endswith('.yaml'))


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


def _defaults(folder=None):
  where = f"block '{DEFAULTS}'"
  flat = {}
  for key, value in _flatten(load_block(DEFAULTS, folder), where):
    if _is_regex(key):
      raise ConfigError(f"{where}: key '{key}' must be a plain name")
    flat[key] = normalize(key, value, where)
  return flat


_KEY_LINE = re.compile(r'( *)([A-Za-z0-9_]+):(.*)')


def meanings(folder=None):
  """{key: its trailing comment} for the keys of the block-style defaults.

  A line parser, because YAML loaders drop comments; groups (lines with no
  value) are left out, and a key without a comment maps to ''.
  """
  path = (Path(folder) if folder else CONFIG_DIR) / f'{DEFAULTS}.yaml'
  found, parents = {}, []  # parents: (indent, name) of the enclosing groups
  for line in path.read_text().splitlines():
    match = _KEY_LINE.fullmatch(line)
    if not match:
      continue
    indent, name, rest = len(match[1]), match[2], match[3]
    while parents and parents[-1][0] >= indent:
      parents.pop()
    value, comment = _split_comment(rest)
    if value:
      found['.'.join([p for _, p in parents] + [name])] = comment
    else:
      parents.append((indent, name))
  return found


def _split_comment(text):
  """'value  # comment' -> ('value', 'comment'); a '#' in quotes is text."""
  quote = None
  for i, char in enumerate(text):
    if quote:
      quote = None if char == quote else quote
    elif char in '\'"':
      quote = char
    elif char == '#' and (i == 0 or text[i - 1].isspace()):
      return text[:i].strip(), text[i + 1:].strip()
  return text.strip(), ''


# ---------------------------------------------------------------------------
# Applying overrides.

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


def _parse_text(old, texts, key, where):
  """Converts flag strings to the type of ``old`` with ``elements.Flags``
  (a list from several values or one comma-separated value, ``1e4`` as an
  int, booleans as True or False); a value it refuses is our one-line
  error."""
  if not isinstance(old, tuple) and len(texts) != 1:
    raise ConfigError(
        f"{where}: config key '{key}' expects a single {typename(old)}, "
        f"got {len(texts)} values: {' '.join(texts)}")
  try:
    parsed, _ = elements.Flags({key: old}).parse_known([f'--{key}', *texts])
    value = parsed[key]
  except (TypeError, ValueError, KeyError, OverflowError):
    value = None
  if value is None or value == () or (
      isinstance(old, tuple) and '' in value):
    shown = ' '.join(texts)
    expected = typename(old) + (' (True or False)' if isinstance(
        old, bool) else '')
    raise ConfigError(
        f"{where}: config key '{key}' expects {expected}, got '{shown}'")
  return value


def _apply(flat, pairs, where, text=False):
  """Applies (key, value) pairs in order to the flat dict, in place."""
  for key, value in pairs:
    for target in _targets(flat, key, where):
      old = flat[target]
      if text:
        flat[target] = _parse_text(old, value, target, where)
      else:
        value = normalize(target, value, where)
        flat[target] = coerce(old, value, target, where)
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


def _composed(names, folder):
  """Flat defaults with the named blocks applied in order."""
  flat = _defaults(folder)
  for name in names:
    where = f"block '{name}'"
    _apply(flat, _flatten(load_block(name, folder), where), where)
  return flat


def compose(names=(), overrides=None, folder=None):
  """defaults + the named blocks in order + an optional mapping of overrides."""
  flat = _composed(names, folder)
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
  flat = _composed(names, folder)
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


SECRET_KEYS = ('run.token',)


def redacted(config, mark=''):
  """The config with its secrets (the run token) replaced by `mark`: what
  may be printed, written to config.yaml or uploaded."""
  return config.update({key: mark for key in SECRET_KEYS if config[key]})


def summary(config, names=(), folder=None):
  """A short human-readable summary: blocks, script, task, and changed keys
  (secrets shown as '(hidden)')."""
  config = redacted(config, '(hidden)')
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
