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
dearer."""

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


class _BlankRender(importlib.abc.MetaPathFinder):
  """Patches dm_control's Physics as its module loads, so that importing
  this file costs nothing where dm_control is never imported."""

  MODULE = 'dm_control.mujoco.engine'

  def find_spec(self, name, path=None, target=None):
    if name != self.MODULE:
      return None
    sys.meta_path.remove(self)
    spec = importlib.util.find_spec(name)
    load = spec.loader.exec_module

    def exec_module(module):
      load(module)
      module.Physics.render = _blank_render

    spec.loader.exec_module = exec_module
    return spec


if os.environ.get('UPSTREAM_BLANK_RENDER') == '1':
  sys.meta_path.insert(0, _BlankRender())
