"""Lets upstream DreamerV3 (danijar/dreamerv3, written for jax 0.4.33) run
on this project's JAX, untouched: since jax 0.5 `jax.jit` takes shardings,
static and donated arguments by keyword only, and upstream passes them by
position (`embodied/jax/transform.py`, `internal.py`). With this folder on
PYTHONPATH, Python imports this file at start-up in every upstream process
(`bench/upstream/upstream.py` sets that up); nothing of dreamer_ver runs with it.

With UPSTREAM_BLANK_RENDER=1, dm_control's `Physics.render` returns a black
frame instead: upstream's dmc wrapper renders every step even where the
frame is only logged (`log/image` on proprio tasks), and a machine with no
OpenGL (MUJOCO_GL=disable) would stop it at the first step. The bench sets
it only for proprio tasks there; it makes upstream's env steps cheaper, not
dearer.

With UPSTREAM_NO_PROFILER=1, `jax.profiler` defaults to off: upstream's
default traces updates 100 to 120, and on the CPU its stop_trace never
returned (docs/benchmarks.md, e2e section); its flags cannot turn it off,
since configs.yaml has no such key."""

import dataclasses
import importlib.abc
import importlib.util
import os
import sys

import jax

_jit = jax.jit
_POSITIONAL = ('in_shardings', 'out_shardings', 'static_argnums',
               'static_argnames', 'donate_argnums')


def _jit_with_positional_options(fun, *options, **kwargs):
  kwargs.update(zip(_POSITIONAL, options))
  return _jit(fun, **kwargs)


jax.jit = _jit_with_positional_options


def _blank_render(self, height=240, width=320, *args, **kwargs):
  import numpy as np
  return np.zeros((height, width, 3), np.uint8)


class _OnLoad(importlib.abc.MetaPathFinder):
  """Patches a module as it loads (`patch(module)`), so that importing
  this file costs nothing where that module is never imported."""

  def __init__(self, name, patch):
    self.name, self.patch = name, patch

  def find_spec(self, name, path=None, target=None):
    if name != self.name:
      return None
    sys.meta_path.remove(self)
    spec = importlib.util.find_spec(name)
    load = spec.loader.exec_module

    def exec_module(module):
      load(module)
      self.patch(module)

    spec.loader.exec_module = exec_module
    return spec


def _no_profiler(module):
  """Agent options whose `profiler` defaults to False (the agent reads the
  module's `Options` when it is built)."""
  module.Options = dataclasses.make_dataclass(
      'Options', [('profiler', bool, dataclasses.field(default=False))],
      bases=(module.Options,))


if os.environ.get('UPSTREAM_BLANK_RENDER') == '1':
  sys.meta_path.insert(0, _OnLoad(
      'dm_control.mujoco.engine',
      lambda module: setattr(module.Physics, 'render', _blank_render)))
if os.environ.get('UPSTREAM_NO_PROFILER') == '1':
  sys.meta_path.insert(0, _OnLoad('embodied.jax.agent', _no_profiler))
