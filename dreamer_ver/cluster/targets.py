"""What a process runs, named as 'module:function', and the one loader.

The supervisor, the Ray host, the eval worker and `main` start functions by
name (a child process imports its target itself); the components' entry
points are named here once, for every launcher.
"""

import importlib

AGENT = 'dreamer_ver.runtime.agent_process:run_agent'
LEARNER = 'dreamer_ver.runtime.agent_process:run_learner'
REPLAY = 'dreamer_ver.runtime.replay_process:serve_replay'
LOGGER = 'dreamer_ver.runtime.logger_process:serve_logger'
ENVS = 'dreamer_ver.runtime.env_worker:run_envs'
EVAL_WORKER = 'dreamer_ver.runtime.eval_worker_process:serve'


def load(spec, what='callable'):
  """The callable `spec` names ('module:function'), or `spec` itself if it
  is callable. ValueError or TypeError say what is wrong with it."""
  if callable(spec):
    return spec
  module, _, attr = str(spec).partition(':')
  if not module or not attr:
    raise ValueError(f'{what} must be "module:function", got {spec!r}')
  try:
    value = getattr(importlib.import_module(module), attr)
  except (ImportError, AttributeError) as e:
    raise ValueError(f'{what} {spec!r} cannot be imported: {e}') from None
  if not callable(value):
    raise TypeError(f'{what} {spec!r} is not callable')
  return value
