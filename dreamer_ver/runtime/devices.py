"""The `jax` config block applied to this process, and the devices the actor
and the learner run on.

Call `setup(config)` before JAX touches a device: the platform and GPU
memory preallocation are fixed once JAX has started its backend (later
changes are ignored by JAX).
"""

import os


def setup(config):
  """Applies `jax.platform`, `jax.prealloc` and `jax.jit`; returns the
  policy devices (a list: the actor runs one lane per entry of
  `jax.policy_devices`) and the train device (`jax.train_devices[0]`)."""
  import jax
  cfg = config.jax
  os.environ['XLA_PYTHON_CLIENT_PREALLOCATE'] = str(bool(cfg.prealloc)).lower()
  if cfg.platform:
    jax.config.update(
        'jax_platforms', 'cuda' if cfg.platform == 'gpu' else cfg.platform)
  jax.config.update('jax_disable_jit', not cfg.jit)
  devices = jax.devices()

  def pick(key, index):
    if index >= len(devices):
      raise ValueError(
          f'jax.{key} names device {index}, but this process has '
          f'{len(devices)} {devices[0].platform} device(s)')
    return devices[index]

  policy = [pick('policy_devices', i) for i in cfg.policy_devices]
  return policy, pick('train_devices', cfg.train_devices[0])
