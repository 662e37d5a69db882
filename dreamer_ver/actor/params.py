"""Versioned parameters: the learner publishes, the actor reads the newest.

Publishing swaps one reference under a lock, so the actor never sees a half
updated tree and never waits for the learner. With several policy devices
the store keeps one copy per device, all of one version.
"""

import threading

import jax
import jax.numpy as jnp


class ParamsStore:
  """`devices`: where the copies live (None: JAX's default device). Every
  copy is committed to its device, whatever placement the published params
  had, so a step compiled for the first copies fits every later one."""

  def __init__(self, params, version=0, devices=(None,)):
    self._lock = threading.Lock()
    self._devices = tuple(jax.devices()[0] if d is None else d
                          for d in devices)
    self._treedef = jax.tree.structure(params)
    self._copies = self._own(params)
    self._version = int(version)

  def publish(self, params, version):
    """Stores private copies: the learner's buffers are donated to the next
    train step, so the actor must not hold on to them. Raises ValueError
    for params of another tree structure than the first (the policies that
    read them are compiled for it)."""
    if jax.tree.structure(params) != self._treedef:
      raise ValueError(
          f'published params are a {jax.tree.structure(params)}, the '
          f'store holds a {self._treedef}')
    copies = self._own(params)
    with self._lock:
      self._copies, self._version = copies, int(version)

  def latest(self, index=0):
    """(params on the `index`-th of the store's devices, version)."""
    with self._lock:
      return self._copies[index], self._version

  @property
  def devices(self):
    return self._devices

  @property
  def version(self):
    with self._lock:
      return self._version

  def _own(self, params):
    return tuple(jax.tree.map(lambda x: _copy_to(x, device), params)
                 for device in self._devices)


def _copy_to(array, device):
  """A copy of `array` on `device` that shares no buffer with it. JAX's
  device_put hands back the array's own shard when the array already has
  one on `device` (a learner's params replicated over several devices),
  even with may_alias=False; copy on the device then."""
  if isinstance(array, jax.Array) and device in array.devices():
    return jnp.copy(jax.device_put(array, device))
  return jax.device_put(array, device, may_alias=False)
