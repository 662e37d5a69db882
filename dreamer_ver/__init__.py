"""dreamer_ver: DreamerV3's parallel actor/learner runtime in JAX + Flax + optax.

Run it with ``dreamer-ver`` (or ``python -m dreamer_ver.main``); the package
layout and its import rules are in ``docs/architecture.md``.

The library (``docs/library.md``), by TorchRL's names where it has them:

  InferenceServer, InferenceClient, WeightSender   serve a batched policy
  Transport, MPTransport, RayTransport             bring calls in
  Collector                                        batches of transitions
  EvalWorker                                       scores of params, async

Each name is imported when first used: processes that never touch JAX (the
supervisor, env workers) stay light when they import this package.
"""

__version__ = '0.2.0'
__all__ = ['Collector', 'EvalWorker', 'InferenceClient', 'InferenceServer',
           'MPTransport', 'RayTransport', 'Transport', 'WeightSender']


def __getattr__(name):
  if name == 'InferenceServer':
    from dreamer_ver.inference import server as module
  elif name in ('InferenceClient', 'WeightSender'):
    from dreamer_ver.inference import client as module
  elif name == 'Transport':
    from dreamer_ver.rpc import transport as module
  elif name == 'MPTransport':
    from dreamer_ver.rpc import mp_transport as module
  elif name == 'RayTransport':
    from dreamer_ver.rpc import ray_transport as module
  elif name == 'Collector':
    from dreamer_ver.inference import collector as module
  elif name == 'EvalWorker':
    from dreamer_ver.evaluation import worker as module
  else:
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
  return getattr(module, name)


def __dir__():
  return sorted(list(globals()) + __all__)
