"""Layers with DreamerV3's initialisation and dtype rules.

Parameters are always stored in float32. Matrix products run in the module's
compute `dtype` (bfloat16 on GPU, float32 on CPU); normalisation runs in
float32 and returns the compute dtype again.
"""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

f32 = jnp.float32


def symlog(x):
  return jnp.sign(x) * jnp.log1p(jnp.abs(x))


def symexp(x):
  return jnp.sign(x) * jnp.expm1(jnp.abs(x))


def trunc_normal_in(scale=1.0, fan_axes=(0,)):
  """Truncated normal in [-2, 2] scaled to unit variance per input unit.

  1.1368 undoes the variance lost by truncation. `fan_axes` names the kernel
  axes that count as fan-in: all but the last for dense, conv and block
  kernels alike, as upstream counts them.
  """
  def init(key, shape, dtype=f32):
    fan_in = math.prod(shape[a] for a in fan_axes)
    x = jax.random.truncated_normal(key, -2, 2, shape, f32)
    return (x * (1.1368 / np.sqrt(fan_in)) * scale).astype(dtype)
  return init


def is_image(space):
  return space.dtype == np.uint8 and len(space.shape) == 3


def num_classes(space):
  """Classes of a discrete space (the largest, if they differ per element)."""
  return int(np.max(space.classes))


def class_low(space):
  """The value of class 0 per element of a discrete space: one-hot inputs,
  decoder targets and sampled actions all count classes from it."""
  return np.asarray(space.low, np.int32)


ACTIVATIONS = {
    'silu': jax.nn.silu, 'gelu': jax.nn.gelu, 'relu': jax.nn.relu,
    'elu': jax.nn.elu, 'tanh': jnp.tanh, 'none': lambda x: x}


class Linear(nn.Module):
  """Dense layer; `units` may be a shape, the output is reshaped to it."""
  units: int | tuple
  outscale: float = 1.0
  dtype: jnp.dtype = f32

  @nn.compact
  def __call__(self, x):
    shape = (self.units,) if isinstance(self.units, int) else tuple(self.units)
    size = math.prod(shape)
    kernel = self.param(
        'kernel', trunc_normal_in(self.outscale), (x.shape[-1], size))
    bias = self.param('bias', nn.initializers.zeros, (size,))
    x = x.astype(self.dtype) @ kernel.astype(self.dtype)
    x = x + bias.astype(self.dtype)
    return x.reshape((*x.shape[:-1], *shape))


def block_product(x, kernel):
  """[..., g, i] x [g, i, o] -> [..., g * o]: one product per block.

  XLA:CPU runs a batched `dot_general` (what an einsum over the blocks
  becomes) at about half the speed of the same g products done one by one
  (bench/README.md, `learner_bench.py`), so CPU gets the loop and
  other backends the einsum. Both compute the same values.
  """
  if jax.default_backend() == 'cpu':
    # Split, not slice: the gradient of a split is one concatenate, that of
    # g slices is g zero-padded copies of the kernel summed.
    g = kernel.shape[0]
    xs = jax.lax.split(x, [1] * g, axis=x.ndim - 2)
    ks = jax.lax.split(kernel, [1] * g, axis=0)
    return jnp.concatenate([a[..., 0, :] @ k[0] for a, k in zip(xs, ks)], -1)
  x = jnp.einsum('...gi,gio->...go', x, kernel)
  return x.reshape((*x.shape[:-2], -1))


class BlockLinear(nn.Module):
  """Block-diagonal dense layer: `blocks` independent groups.

  `x` [..., blocks * i] is cut into blocks; each block's output sees only
  its own slice, plus `shared` [..., s] when given: every block sees all of
  it, as if it were concatenated to each slice (the RSSM core's input). The
  kernel [blocks, i + s, out / blocks] has the shared rows last; they are
  applied as one dense product, so the blocks' copies of `shared` are never
  made. The kernel is initialised with the whole input size as fan-in
  (upstream's rule for rank-3 kernels), so each block starts sqrt(blocks)
  smaller than a dense layer of its own size.
  """
  units: int
  blocks: int
  outscale: float = 1.0
  dtype: jnp.dtype = f32

  @nn.compact
  def __call__(self, x, shared=None):
    g = self.blocks
    assert x.shape[-1] % g == 0 and self.units % g == 0, (x.shape, self)
    own = x.shape[-1] // g
    width = 0 if shared is None else shared.shape[-1]
    kernel = self.param(
        'kernel', trunc_normal_in(self.outscale, fan_axes=(0, 1)),
        (g, own + width, self.units // g))
    bias = self.param('bias', nn.initializers.zeros, (self.units,))
    kernel = kernel.astype(self.dtype)
    x = x.astype(self.dtype).reshape((*x.shape[:-1], g, own))
    out = block_product(x, kernel[:, :own])
    if shared is not None:
      wide = kernel[:, own:].transpose((1, 0, 2)).reshape((width, self.units))
      out = out + shared.astype(self.dtype) @ wide
    return out + bias.astype(self.dtype)


class Conv2D(nn.Module):
  """Stride-1 'same' convolution over [B, H, W, C] inputs."""
  depth: int
  kernel: int
  outscale: float = 1.0
  dtype: jnp.dtype = f32

  @nn.compact
  def __call__(self, x):
    k = self.kernel
    shape = (k, k, x.shape[-1], self.depth)
    kernel = self.param(
        'kernel', trunc_normal_in(self.outscale, fan_axes=(0, 1, 2)), shape)
    bias = self.param('bias', nn.initializers.zeros, (self.depth,))
    x = jax.lax.conv_general_dilated(
        x.astype(self.dtype), kernel.astype(self.dtype), (1, 1), 'SAME',
        dimension_numbers=('NHWC', 'HWIO', 'NHWC'))
    return x + bias.astype(self.dtype)


class Norm(nn.Module):
  """RMS norm (eps 1e-4, learned scale, no shift) computed in float32."""
  impl: str = 'rms'
  eps: float = 1e-4

  @nn.compact
  def __call__(self, x):
    if self.impl == 'none':
      return x
    assert self.impl == 'rms', self.impl
    dtype = x.dtype
    x = x.astype(f32)
    scale = self.param('scale', nn.initializers.ones, (x.shape[-1],))
    mean2 = jnp.square(x).mean(-1, keepdims=True)
    return (x * jax.lax.rsqrt(mean2 + self.eps) * scale).astype(dtype)


class Dense(nn.Module):
  """Linear -> Norm -> activation, DreamerV3's hidden layer."""
  units: int
  act: str = 'silu'
  norm: str = 'rms'
  dtype: jnp.dtype = f32

  @nn.compact
  def __call__(self, x):
    x = Linear(self.units, dtype=self.dtype, name='linear')(x)
    return ACTIVATIONS[self.act](Norm(self.norm, name='norm')(x))


class MLP(nn.Module):
  layers: int
  units: int
  act: str = 'silu'
  norm: str = 'rms'
  dtype: jnp.dtype = f32

  @nn.compact
  def __call__(self, x):
    for i in range(self.layers):
      x = Dense(self.units, self.act, self.norm, self.dtype, name=f'layer{i}')(x)
    return x
