"""Environments: one interface (see ``base``) over several suites.

``make_env(task, env_config=None, seed=0)`` builds the task named
``<suite>_<name>``, passing the suite's kwargs from ``env_config[suite]``
(``env_config`` may be None, a dict, or an ``elements.Config``; missing keys
take their defaults from ``env:`` in ``configs/defaults.yaml``, the one place
that lists and explains every suite option), and applies the standard
wrappers (``wrap_env``): continuous actions are normalised to [-1, 1] and
clipped, dtypes unified to float32 / int32 / bool / uint8, and spaces checked.

The suites, their tasks, extras and spaces: ``docs/suites.md``.

More suites plug in without editing this package: ``register(prefix,
constructor)``, or an entry point of the group ``dreamer_ver.envs`` (name:
the prefix, value: 'module:attr'), which the first task with an unknown
prefix loads. A constructor is called as ``constructor(name, seed=seed,
**kwargs)`` and returns an ``Env``; its kwargs come from ``env_config`` and
from ``env.<prefix>`` in defaults.yaml only where such a section exists.
Env processes are spawned, not forked, so a ``register`` call only counts in
the process that made it: for runs, install the suite as an entry point (or
register it in a module every process imports).

This package must stay light: it imports neither JAX nor the agent or
runtime, and suite backends (gymnasium, dm_control, ale-py, crafter,
memory-maze) load only when their suite is used.
"""

import functools
import importlib
import importlib.metadata
import re

from .base import Env  # noqa: F401
from . import wrappers
from dreamer_ver.config import loading as configlib

ENTRY_POINT_GROUP = 'dreamer_ver.envs'

# prefix -> constructor or its 'module:attr', imported on first use.
_SUITES = {
    'dummy': 'dreamer_ver.envs.dummy:Dummy',
    'gym': 'dreamer_ver.envs.gym:FromGym',
    'dmc': 'dreamer_ver.envs.dmc:DMC',
    'atari': 'dreamer_ver.envs.atari:Atari',
    'atari100k': 'dreamer_ver.envs.atari:Atari',
    'crafter': 'dreamer_ver.envs.crafter:Crafter',
    'pinpad': 'dreamer_ver.envs.pinpad:PinPad',
    'memmaze': 'dreamer_ver.envs.memmaze:MemoryMaze',
    'loconav': 'dreamer_ver.envs.loconav:LocoNav',
    'synthetic': 'dreamer_ver.envs.synthetic:Synthetic',
}
_entry_points_loaded = False


def register(prefix: str, constructor, override: bool = False):
  """Adds the suite of tasks ``<prefix>_<name>`` to this process.

  ``constructor`` is a callable ``(name, seed, **kwargs) -> Env`` or its
  'module:attr' path, imported when a task of the suite is first built.
  Registering a known prefix again raises unless ``override``.
  """
  if not isinstance(prefix, str) or not re.fullmatch(r'[A-Za-z0-9]+', prefix):
    # Tasks split at the first '_', and the config's task check expects
    # letters and digits before it.
    raise ValueError(
        f'Suite prefix must be letters and digits only, got {prefix!r}.')
  if isinstance(constructor, str):
    if not re.fullmatch(r'[\w.]+:[\w.]+', constructor):
      raise ValueError(
          f"Suite '{prefix}': constructor path must look like 'module:attr', "
          f'got {constructor!r}.')
  elif not callable(constructor):
    raise TypeError(
        f"Suite '{prefix}': constructor must be callable or a 'module:attr' "
        f'string, got {type(constructor).__name__}.')
  if prefix in _SUITES and not override:
    raise ValueError(
        f"Suite '{prefix}' is already registered ({_SUITES[prefix]!r}); "
        f'pass override=True to replace it. Known suites: {_known()}.')
  _SUITES[prefix] = constructor


def _load_entry_points():
  """Registers the installed ``dreamer_ver.envs`` entry points, once per
  process; suites registered already (built-in or by ``register``) win."""
  global _entry_points_loaded
  if _entry_points_loaded:
    return
  for entry in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
    if entry.name in _SUITES:
      continue
    try:
      register(entry.name, f'{entry.module}:{entry.attr}')
    except ValueError as e:
      raise ValueError(
          f"Entry point '{entry.name} = {entry.value}' of group "
          f"'{ENTRY_POINT_GROUP}': {e}") from None
  _entry_points_loaded = True


def _known():
  return ', '.join(sorted(_SUITES))


def _constructor(suite):
  ctor = _SUITES[suite]
  if isinstance(ctor, str):
    module, attr = ctor.split(':')
    ctor = importlib.import_module(module)
    for part in attr.split('.'):
      ctor = getattr(ctor, part)
  return ctor


@functools.cache
def _defaults():
  """{suite: kwargs} from ``env:`` in configs/defaults.yaml, the one place
  they are set; parsed once per process, not at every env start."""
  env = configlib.compose().env
  return {suite: dict(kwargs) for suite, kwargs in env.items()}


def make_env(task: str, env_config=None, seed: int = 0) -> Env:
  """Builds and wraps the env for ``task``, e.g. 'dmc_walker_walk'."""
  suite, _, name = task.partition('_')
  if suite not in _SUITES:
    _load_entry_points()
  if suite not in _SUITES or not name:
    raise ValueError(
        f"Unknown task '{task}': expected '<suite>_<name>' with suite one of "
        f'{_known()}.')
  overrides = (env_config or {}).get(suite) or {}
  kwargs = {**_defaults().get(suite, {}), **dict(overrides)}
  if 'size' in kwargs:
    kwargs['size'] = tuple(int(x) for x in kwargs['size'])
  return wrap_env(_constructor(suite)(name, seed=seed, **kwargs))


def make_run_env(config, envid: int) -> Env:
  """Env `envid` of a run (train env i is id i, eval env i is id
  `run.envs + i`), seeded from the run's seed and the id alone, so one seed
  gives the same envs in every script."""
  return make_env(config.task, config.env, seed=config.seed * 100_000 + envid)


def wrap_env(env: Env) -> Env:
  """Applies the wrappers every env needs before the agent sees it."""
  continuous = [k for k, v in env.act_space.items() if not v.discrete]
  for key in continuous:
    env = wrappers.NormalizeAction(env, key)
  env = wrappers.UnifyDtypes(env)
  env = wrappers.CheckSpaces(env)
  for key in continuous:
    env = wrappers.ClipAction(env, key)
  return env
