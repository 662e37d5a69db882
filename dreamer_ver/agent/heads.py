"""Prediction heads on model features: reward, continue, value and policy."""

import flax.linen as nn
import jax
import jax.numpy as jnp

from . import dists
from . import nets

f32 = jnp.float32


class ScalarHead(nn.Module):
  """MLP then a scalar output: `symexp_twohot` (reward, value) or `binary`."""
  output: str
  layers: int = 1
  units: int = 1024
  act: str = 'silu'
  norm: str = 'rms'
  outscale: float = 1.0
  bins: int = 255
  dtype: jnp.dtype = f32

  @nn.compact
  def __call__(self, x):
    x = nets.MLP(self.layers, self.units, self.act, self.norm, self.dtype,
                 name='mlp')(x)
    if self.output == 'symexp_twohot':
      logits = nets.Linear(self.bins, self.outscale, self.dtype,
                           name='logits')(x)
      return dists.TwoHot(logits, dists.symexp_bins(self.bins))
    if self.output == 'binary':
      logit = nets.Linear((), self.outscale, self.dtype, name='logit')(x)
      return dists.Binary(logit)
    raise ValueError(f'unknown scalar head output: {self.output}')


class PolicyHead(nn.Module):
  """MLP then one action distribution per action key: a categorical (with
  unimix) for discrete keys, a bounded normal for continuous keys."""
  act_space: dict
  layers: int = 3
  units: int = 1024
  act: str = 'silu'
  norm: str = 'rms'
  outscale: float = 0.01
  minstd: float = 0.1
  maxstd: float = 1.0
  unimix: float = 0.01
  dtype: jnp.dtype = f32

  def draws(self, key, batch):
    """The random numbers {action key: [batch, ...]} that sampling every
    action of `batch` rows with `key` reads (each distribution's
    `sample(k)` is its `sample_from` of these)."""
    keys = jax.random.split(key, len(self.act_space))
    out = {}
    for name, k in zip(sorted(self.act_space), keys):
      space = self.act_space[name]
      if space.discrete:
        shape = (batch, *space.shape, nets.num_classes(space))
        out[name] = dists.draws(k, shape)
      else:
        out[name] = jax.random.normal(k, (batch, *space.shape), f32)
    return out

  @nn.compact
  def __call__(self, x):
    x = nets.MLP(self.layers, self.units, self.act, self.norm, self.dtype,
                 name='mlp')(x)
    outs = {}
    for key in sorted(self.act_space):
      space = self.act_space[key]
      dims = len(space.shape)
      if space.discrete:
        shape = (*space.shape, nets.num_classes(space))
        logits = nets.Linear(shape, self.outscale, self.dtype,
                             name=f'{key}_logits')(x)
        outs[key] = dists.Categorical(
            logits, self.unimix, event_dims=dims, low=nets.class_low(space))
      else:
        mean = nets.Linear(space.shape, self.outscale, self.dtype,
                           name=f'{key}_mean')(x)
        std = nets.Linear(space.shape, self.outscale, self.dtype,
                          name=f'{key}_std')(x)
        outs[key] = dists.BoundedNormal(
            mean, std, self.minstd, self.maxstd, event_dims=dims)
    return outs
