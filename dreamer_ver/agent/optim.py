"""DreamerV3's optimizer as an optax chain: AGC, then LaProp, then a
warmed-up learning rate.

LaProp normalises the gradient by its RMS first and applies momentum to the
normalised update afterwards (Adam does it the other way round), which keeps
steps bounded when the second moment is tiny; hence eps can be 1e-20.
"""

import jax
import jax.numpy as jnp
import optax

f32 = jnp.float32


def clip_by_agc(clip=0.3, pmin=1e-3):
  """Adaptive gradient clipping per tensor: ||g|| <= clip * max(pmin, ||p||).

  `clip` 0 turns clipping off, as upstream (a bound of 0 would instead
  zero every update).
  """

  def init_fn(params):
    del params
    return optax.EmptyState()

  def update_fn(updates, state, params):
    if not clip:
      return updates, state

    def clip_one(param, update):
      upper = clip * jnp.maximum(pmin, jnp.linalg.norm(param.ravel()))
      return update / jnp.maximum(1.0, jnp.linalg.norm(update.ravel()) / upper)
    return jax.tree.map(clip_one, params, updates), state

  return optax.GradientTransformation(init_fn, update_fn)


def scale_by_rms(beta=0.999, eps=1e-20):
  """g / (sqrt(bias-corrected EMA of g^2) + eps)."""

  def init_fn(params):
    nu = jax.tree.map(lambda p: jnp.zeros_like(p, f32), params)
    return optax.ScaleByRmsState(nu=nu), jnp.zeros((), jnp.int32)

  def update_fn(updates, state, params=None):
    del params
    (rms, count) = state
    count = optax.safe_int32_increment(count)
    nu = optax.tree.update_moment_per_elem_norm(updates, rms.nu, beta, 2)
    nu_hat = optax.tree.bias_correction(nu, beta, count)
    updates = jax.tree.map(lambda u, v: u / (jnp.sqrt(v) + eps), updates, nu_hat)
    return updates, (optax.ScaleByRmsState(nu=nu), count)

  return optax.GradientTransformation(init_fn, update_fn)


def scale_by_momentum(beta=0.9):
  """Bias-corrected EMA of the (already normalised) updates."""

  def init_fn(params):
    mu = jax.tree.map(lambda p: jnp.zeros_like(p, f32), params)
    return optax.TraceState(trace=mu), jnp.zeros((), jnp.int32)

  def update_fn(updates, state, params=None):
    del params
    (trace, count) = state
    count = optax.safe_int32_increment(count)
    mu = optax.tree.update_moment(updates, trace.trace, beta, 1)
    return (optax.tree.bias_correction(mu, beta, count),
            (optax.TraceState(trace=mu), count))

  return optax.GradientTransformation(init_fn, update_fn)


def make_optimizer(lr=4e-5, agc=0.3, eps=1e-20, beta1=0.9, beta2=0.999,
                   warmup=1000):
  schedule = optax.constant_schedule(lr)
  if warmup:
    schedule = optax.join_schedules(
        [optax.linear_schedule(0.0, lr, warmup), schedule], [warmup])
  return optax.chain(
      clip_by_agc(agc),
      scale_by_rms(beta2, eps),
      scale_by_momentum(beta1),
      optax.scale_by_learning_rate(schedule))
