"""Traces and compiles of jitted functions, counted with JAX's own
monitoring events (`jaxpr_trace_duration`, a backend compile)."""

import contextlib

from jax import monitoring

EVENTS = ('/jax/core/compile/jaxpr_trace_duration',
          '/jax/core/compile/backend_compile_duration')


@contextlib.contextmanager
def compiles():
  """Yields the list of (event, function name) traced or compiled inside."""
  seen = []

  def listener(event, seconds, **kwargs):
    del seconds
    if event in EVENTS:
      seen.append((event, kwargs.get('fun_name')))

  monitoring.register_event_duration_secs_listener(listener)
  try:
    yield seen
  finally:
    monitoring.unregister_event_duration_listener(listener)
