"""The `jax` config block applied to this process, and the devices the actor
and the learner run on.

Call `setup(config)` before JAX touches a device: the platform and GPU
memory preallocation are fixed once JAX has started its backend (later
changes are ignored by JAX).
"""

import os


def setup(config):
  """Applies `jax.platform`, `jax.prealloc` and `jax.jit`; returns the
  (policy device, train device) named by `jax.policy_devices[0]` and
  `jax.train_devices[0]`."""
  import jax
  cfg = config.jax
  os.environ['XLA_PYTHON_CLIENT_PREALLOCATE'] = str(bool(cfg.prealloc)).lower()
  if cfg.platform:
    jax.config.update(
        'jax_platforms', 'cuda' if cfg.platform == 'gpu' else cfg.platform)
  jax.config.update('jax_disable_jit', not cfg.jit)
  devices = jax.devices()

  def pick(key):
    index = cfg[key][0]
    if index >= len(devices):
      raise ValueError(
          f'jax.{key} names device {index}, but this process has '
          f'{len(devices)} {devices[0].platform} device(s)')
    return devices[index]

  return pick('policy_devices'), pick('train_devices')
