"""Versioned parameters: the learner publishes, the actor reads the newest.

Publishing swaps one reference under a lock, so the actor never sees a half
updated tree and never waits for the learner.
"""

import threading

import jax
import jax.numpy as jnp


class ParamsStore:

  def __init__(self, params, version=0, device=None):
    self._lock = threading.Lock()
    self._device = device
    self._params = self._own(params)
    self._version = int(version)

  def publish(self, params, version):
    """Stores a private copy: the learner's buffers are donated to the next
    train step, so the actor must not hold on to them."""
    params = self._own(params)
    with self._lock:
      self._params, self._version = params, int(version)

  def latest(self):
    with self._lock:
      return self._params, self._version

  @property
  def version(self):
    with self._lock:
      return self._version

  def _own(self, params):
    params = jax.tree.map(jnp.copy, params)
    if self._device is not None:
      params = jax.device_put(params, self._device)
    return params
