"""Layers with DreamerV3's initialisation and dtype rules.

Parameters are always stored in float32. Matrix products run in the module's
compute `dtype` (bfloat16 on GPU, float32 on CPU); normalisation runs in
float32 and returns the compute dtype again.
"""

import functools
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
    x = product(x.astype(self.dtype), kernel.astype(self.dtype))
    x = x + bias.astype(self.dtype)
    return x.reshape((*x.shape[:-1], *shape))

  def rows(self, x, start, bias=False):
    """x [..., w] times the kernel's rows start..start+w (+ the bias): what
    a slice of a concatenated input adds to the layer's product, so that
    the slices can be multiplied apart (at other times, over more rows).
    Reads the parameters `__call__` made; for a flat `units` only."""
    kernel = self.get_variable('params', 'kernel')
    x = product(x.astype(self.dtype), hoistable(
        kernel[start:start + x.shape[-1]].astype(self.dtype)))
    if bias:
      x = x + self.get_variable('params', 'bias').astype(self.dtype)
    return x


def hoistable(weights):
  """`weights` (a slice or rearrangement of parameters) behind an
  optimization barrier, so that inside a scan's step XLA computes them once
  before the loop: its loop-invariant code motion does not move a slice or
  transpose on its own, and layout assignment then makes the transpose a
  copy in every step; it does move the barrier, and what feeds it."""
  return jax.lax.optimization_barrier(weights)


def product(x, kernel):
  """x [..., i] @ kernel [i, o], every dense layer's product. On the CPU,
  for i >= 128 or 8192 rows and more, the kernel's gradient multiplies a
  transposed copy of `x` (made first, rows last) instead of `x` as it
  lies: XLA:CPU runs a product that contracts the long rows axis of an
  operand in place 1.6-2.9x slower than the forward one for wide layers,
  and for narrow ones (64 inputs) it chose layouts in the update that ran
  at about 40 GFLOP/s (docs/benchmarks.md, learner section). The same
  values."""
  rows = math.prod(x.shape[:-1])
  if jax.default_backend() == 'cpu' and (x.shape[-1] >= 128 or rows >= 8192):
    return _product_copied(x, kernel)
  return x @ kernel


@jax.custom_vjp
def _product_copied(x, kernel):
  return x @ kernel


def _product_copied_fwd(x, kernel):
  return x @ kernel, (x, kernel)


def _product_copied_bwd(saved, grad):
  x, kernel = saved
  rows = x.reshape((-1, x.shape[-1]))
  grads = grad.reshape((-1, grad.shape[-1]))
  # No transpose of the kernel (it would be one more op in a scan's step).
  dx = jax.lax.dot_general(grad, kernel, (((grad.ndim - 1,), (1,)), ((), ())))
  # The barrier keeps the transpose a copy of its own, not folded into
  # the product's operand layout again.
  dk = jax.lax.optimization_barrier(rows.T) @ grads
  return dx.astype(x.dtype), dk.astype(kernel.dtype)


_product_copied.defvjp(_product_copied_fwd, _product_copied_bwd)


def block_product(x, kernel):
  """[..., g, i] x [g, i, o] -> [..., g * o]: one product per block.

  On CPU the blocks axis is moved first and `x` is the left operand, so
  XLA:CPU hands the batched product (and its input's gradient) to its
  YNNPACK kernels; an einsum puts the kernel first, and XLA:CPU runs the
  [g, o, ...] product that makes as a generic, slower dot
  (docs/benchmarks.md, `learner_bench.py`). Other backends get the
  einsum. Both compute the same values.
  """
  if jax.default_backend() == 'cpu':
    x = jnp.moveaxis(x, -2, 0)
    x = jax.lax.dot_general(x, kernel, (((x.ndim - 1,), (1,)), ((0,), (0,))))
    x = jnp.moveaxis(x, 0, -2)
  else:
    x = jnp.einsum('...gi,gio->...go', x, kernel)
  return x.reshape((*x.shape[:-2], -1))


class BlockLinear(nn.Module):
  """Block-diagonal dense layer: `blocks` independent groups.

  `x` [..., inputs] is cut into blocks; each block's output sees only its
  own slice, plus a `shared` input [..., shared] when the layer has one:
  every block sees all of it, as if it were concatenated to each slice
  (the RSSM core's input). The kernel [blocks, inputs / blocks + shared,
  units / blocks] has the shared rows last; `share` applies them as one
  dense product (of all of the shared input or of a slice of its
  columns), so the blocks' copies of it are never made. The kernel is
  initialised with the whole input size as fan-in (upstream's rule for
  rank-3 kernels), so each block starts sqrt(blocks) smaller than a dense
  layer of its own size.
  """
  units: int
  blocks: int
  inputs: int
  shared: int = 0
  outscale: float = 1.0
  dtype: jnp.dtype = f32

  def setup(self):
    g = self.blocks
    assert self.inputs % g == 0 and self.units % g == 0, self
    self.kernel = self.param(
        'kernel', trunc_normal_in(self.outscale, fan_axes=(0, 1)),
        (g, self.inputs // g + self.shared, self.units // g))
    self.bias = self.param('bias', nn.initializers.zeros, (self.units,))

  def __call__(self, x, shared=None):
    """x [..., inputs] -> [..., units]; `shared`: the shared input's
    product (`share`, summed over its slices), None for none."""
    g = self.blocks
    own = self.inputs // g
    kernel = self.kernel.astype(self.dtype)
    x = x.astype(self.dtype).reshape((*x.shape[:-1], g, own))
    out = block_product(x, hoistable(kernel[:, :own]))
    if shared is not None:
      out = out + shared
    return out + self.bias.astype(self.dtype)

  def share(self, part, start=0):
    """The shared input's columns start..start+w (`part` [..., w]) times
    their rows of the kernel: what they add to every block's output."""
    own, width = self.inputs // self.blocks, part.shape[-1]
    assert start + width <= self.shared, (start, width, self)
    rows = self.kernel[:, own + start:own + start + width]
    wide = rows.transpose((1, 0, 2)).reshape((width, self.units))
    return product(part.astype(self.dtype), hoistable(wide.astype(self.dtype)))


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
  """Linear -> Norm -> activation, DreamerV3's hidden layer. `linear` and
  `finish` apart let a caller sum the products of a split input first
  (`Linear.rows`)."""
  units: int
  act: str = 'silu'
  norm: str = 'rms'
  dtype: jnp.dtype = f32

  def setup(self):
    self.linear = Linear(self.units, dtype=self.dtype)
    self.normalize = Norm(self.norm, name='norm')

  def __call__(self, x):
    return self.finish(self.linear(x))

  def finish(self, x):
    """The norm and activation of the layer's product `x`."""
    return ACTIVATIONS[self.act](self.normalize(x))


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


def scan_rows(step, params, carry, xs, fixed, unroll=1):
  """`jax.lax.scan` of `step(params, carry, x, f) -> (carry, y)` over the
  leading axis of `xs` and `fixed` (per-step inputs without a gradient),
  whose gradient for `params` is taken once over every step's rows.

  A scan's own gradient runs each step's parameter products in its
  reverse loop, a few rows at a time, and adds them up step by step. Here
  the reverse loop carries only the activations' gradients, recomputing
  each step from its input carry (nothing per step is stored but the
  carries), and the parameters' gradient is one vector-Jacobian product
  of `step` applied to all steps' rows at once: the same sum, as large
  products outside the loop. `step` must treat batch rows (axis 0 of
  every carry, x and f leaf) independently and be deterministic given its
  inputs (random draws come in `fixed`).
  """
  return _scan_rows(step, unroll, params, carry, xs, fixed)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _scan_rows(step, unroll, params, carry, xs, fixed):
  body = lambda c, inputs: step(params, c, *inputs)
  return jax.lax.scan(body, carry, (xs, fixed), unroll=unroll)


def _scan_rows_fwd(step, unroll, params, carry, xs, fixed):
  def body(c, inputs):
    out, y = step(params, c, *inputs)
    return out, (y, c)
  last, (ys, carries) = jax.lax.scan(body, carry, (xs, fixed), unroll=unroll)
  return (last, ys), (params, carries, xs, fixed)


def _scan_rows_bwd(step, unroll, saved, cts):
  params, carries, xs, fixed = saved
  ct_last, ct_ys = cts

  def body(ct_out, inputs):
    c, x, f, ct_y = inputs
    _, pull = jax.vjp(lambda c, x: step(params, c, x, f), c, x)
    ct_in, ct_x = pull((ct_out, ct_y))
    return ct_in, (ct_out, ct_x)

  ct_start, (ct_outs, ct_xs) = jax.lax.scan(
      body, ct_last, (carries, xs, fixed, ct_ys), reverse=True, unroll=unroll)
  rows = lambda tree: jax.tree.map(
      lambda v: v.reshape((-1, *v.shape[2:])), tree)
  _, pull = jax.vjp(
      lambda p: step(p, rows(carries), rows(xs), rows(fixed)), params)
  ct_params, = pull((rows(ct_outs), rows(ct_ys)))
  return ct_params, ct_start, ct_xs, None


_scan_rows.defvjp(_scan_rows_fwd, _scan_rows_bwd)
