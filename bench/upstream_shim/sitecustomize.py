"""Lets upstream DreamerV3 (danijar/dreamerv3, written for jax 0.4.33) run
on this project's JAX, untouched: since jax 0.5 `jax.jit` takes shardings,
static and donated arguments by keyword only, and upstream passes them by
position (`embodied/jax/transform.py`, `internal.py`). With this folder on
PYTHONPATH, Python imports this file at start-up in every upstream process
(`bench/upstream.py` sets that up); nothing of dreamer_ver runs with it."""

import jax

_jit = jax.jit
_POSITIONAL = ('in_shardings', 'out_shardings', 'static_argnums',
               'static_argnames', 'donate_argnums')


def _jit_with_positional_options(fun, *options, **kwargs):
  kwargs.update(zip(_POSITIONAL, options))
  return _jit(fun, **kwargs)


jax.jit = _jit_with_positional_options
