"""Environments: one interface (see ``base``) over several suites.

``make_env(task, env_config=None, seed=0)`` builds the task named
``<suite>_<name>``, passing the suite's kwargs from ``env_config[suite]``
(``env_config`` may be None, a dict, or an ``elements.Config``; missing keys
take their defaults from ``env:`` in ``configs/defaults.yaml``, the one place
that lists and explains every suite option), and applies the standard
wrappers (``wrap_env``): continuous actions are normalised to [-1, 1] and
clipped, dtypes unified to float32 / int32 / bool / uint8, and spaces checked.

Suites and their keys (besides reward, is_first, is_last, is_terminal in
every obs and reset in every action):

  dummy_disc, dummy_cont (``dummy.Dummy``)
    obs image (64,64,3) uint8, vector (7,), token, count, float2d (4,5),
    int2d (2,3); act act_disc (5 classes), act_cont (6,).

  gym_<gymnasium id>, e.g. gym_CartPole-v1 (``gym.FromGym``); kwargs beyond
  the defaults, e.g. max_episode_steps, go to gymnasium.make
    obs vector or image (or the flattened keys of a Dict space);
    act action (or the flattened keys of a Dict space).

  dmc_<domain>_<task>, e.g. dmc_walker_walk (``dmc.DMC``)
    obs one float32 vector per dm_control key, image; act action.

  atari100k_<game>, e.g. atari100k_pong (``atari.Atari``)
    obs image (64,64,3) uint8; act action (minimal action set).

  synthetic_<any name> (``synthetic.Synthetic``), for tests and benchmarks
    obs vector (cue in vector[0]), count; act action (2 classes).

This package must stay light: it imports neither JAX nor the agent or
runtime, and suite backends (gymnasium, dm_control, ale-py) load only when
their suite is used.
"""

import functools
import importlib

from .base import Env  # noqa: F401
from . import wrappers
from .. import config as configlib

_CONSTRUCTORS = {
    'dummy': 'dummy:Dummy',
    'gym': 'gym:FromGym',
    'dmc': 'dmc:DMC',
    'atari100k': 'atari:Atari',
    'synthetic': 'synthetic:Synthetic',
}


@functools.cache
def _defaults():
  """{suite: kwargs} from ``env:`` in configs/defaults.yaml, the one place
  they are set; parsed once per process, not at every env start."""
  env = configlib.compose().env
  return {suite: dict(kwargs) for suite, kwargs in env.items()}


def make_env(task: str, env_config=None, seed: int = 0) -> Env:
  """Builds and wraps the env for ``task``, e.g. 'dmc_walker_walk'."""
  suite, _, name = task.partition('_')
  if suite not in _CONSTRUCTORS or not name:
    raise ValueError(
        f"Unknown task '{task}': expected '<suite>_<name>' with suite one of "
        f'{sorted(_CONSTRUCTORS)}.')
  module, cls = _CONSTRUCTORS[suite].split(':')
  ctor = getattr(importlib.import_module(f'.{module}', __name__), cls)
  overrides = (env_config or {}).get(suite) or {}
  kwargs = {**_defaults()[suite], **dict(overrides)}
  if 'size' in kwargs:
    kwargs['size'] = tuple(int(x) for x in kwargs['size'])
  return wrap_env(ctor(name, seed=seed, **kwargs))


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
