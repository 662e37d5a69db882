"""World-model networks: encoder, RSSM and decoder (Flax linen modules).

Each module is applied with explicit parameters by the agent; the RSSM has
one method per step kind (`obs_step`, `img_step`) so the agent can scan them.
"""

import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from . import dists
from . import nets

f32 = jnp.float32
sg = jax.lax.stop_gradient


def concat_vectors(spaces, values, squash):
  """Flattens a dict of [*B, ...] arrays into [*B, N] in sorted key order.

  Discrete values become one-hot vectors, continuous ones go through
  `squash` (symlog for observations, identity for actions).
  """
  parts = []
  for key in sorted(spaces):
    space, x = spaces[key], values[key]
    bdims = x.ndim - len(space.shape)
    if space.discrete:
      x = jax.nn.one_hot(
          x - nets.class_low(space), nets.num_classes(space), dtype=f32)
    else:
      x = squash(x.astype(f32))
    parts.append(x.reshape((*x.shape[:bdims], -1)))
  return jnp.concatenate(parts, -1)


def embed_action(act_space, action):
  """Action vector fed to the RSSM core; large magnitudes are scaled to 1."""
  x = concat_vectors(act_space, action, squash=lambda v: v)
  return x / sg(jnp.maximum(1.0, jnp.abs(x)))


class ObsNet(nn.Module):
  """What the encoder and decoder share: the observation space, split into
  vector and image keys, and the sizes of their MLP and CNN."""
  obs_space: dict
  units: int = 1024
  layers: int = 3
  depth: int = 64
  mults: tuple = (2, 3, 4, 4)
  kernel: int = 5
  act: str = 'silu'
  norm: str = 'rms'
  dtype: jnp.dtype = f32

  def keys(self):
    """(vector keys, image keys), each sorted."""
    images = {k for k, s in self.obs_space.items() if nets.is_image(s)}
    return sorted(set(self.obs_space) - images), sorted(images)


class Encoder(ObsNet):
  """Observations [*B, ...] -> tokens [*B, N]: MLP on vectors, CNN on images."""
  symlog: bool = True

  @nn.compact
  def __call__(self, obs, bdims):
    vec_keys, img_keys = self.keys()
    bshape = next(iter(obs.values())).shape[:bdims]
    outs = []
    if vec_keys:
      squash = nets.symlog if self.symlog else (lambda v: v)
      x = concat_vectors(
          {k: self.obs_space[k] for k in vec_keys}, obs, squash)
      x = x.reshape((-1, x.shape[-1]))
      x = nets.MLP(self.layers, self.units, self.act, self.norm, self.dtype,
                   name='mlp')(x)
      outs.append(x)
    if img_keys:
      x = jnp.concatenate([obs[k] for k in img_keys], -1)
      x = x.astype(self.dtype) / 255 - 0.5
      x = x.reshape((-1, *x.shape[bdims:]))
      for i, mult in enumerate(self.mults):
        x = nets.Conv2D(self.depth * mult, self.kernel, dtype=self.dtype,
                        name=f'cnn{i}')(x)
        b, h, w, c = x.shape
        x = x.reshape((b, h // 2, 2, w // 2, 2, c)).max((2, 4))
        x = nets.ACTIVATIONS[self.act](nets.Norm(self.norm, name=f'cnn{i}norm')(x))
      assert 3 <= x.shape[1] <= 16 and 3 <= x.shape[2] <= 16, x.shape
      outs.append(x.reshape((x.shape[0], -1)))
    x = jnp.concatenate([o.astype(self.dtype) for o in outs], -1)
    return x.reshape((*bshape, x.shape[-1]))


def block_gates(x, old):
  """The block GRU's new state from its gate inputs `x` [*B, g, 3, d / g]
  and the old state `old` [*B, g, d / g]: [*B, d].

  All blocks at once: block by block, the observe scan's compiled step had
  8 times the gates' ops and saved each block's for the gradient (405 ops
  per step, forward and backward, against 291 so), and the update was no
  faster on a CPU (docs/benchmarks.md, learner section).
  """
  reset, cand, update = x[..., 0, :], x[..., 1, :], x[..., 2, :]
  reset = jax.nn.sigmoid(reset)
  cand = jnp.tanh(reset * cand)
  update = jax.nn.sigmoid(update - 1)
  new = update * cand + (1 - update) * old
  return new.reshape((*new.shape[:-2], -1))


class RSSM(nn.Module):
  """Recurrent state-space model with a block-GRU deter state and
  categorical stoch latents. Carries are dicts {deter [B, D], stoch [B, S, C]}.
  """
  act_space: dict
  deter: int = 8192
  hidden: int = 1024
  stoch: int = 32
  classes: int = 64
  act: str = 'silu'
  norm: str = 'rms'
  unimix: float = 0.01
  outscale: float = 1.0
  imglayers: int = 2
  obslayers: int = 1
  dynlayers: int = 1
  absolute: bool = False
  blocks: int = 8
  free_nats: float = 1.0
  dtype: jnp.dtype = f32

  def setup(self):
    dense = lambda name: nets.Dense(
        self.hidden, self.act, self.norm, self.dtype, name=name)
    self.dynin = [dense(f'dynin{i}') for i in range(3)]
    # The first hidden layer's shared input: [dynin0, dynin1, dynin2].
    self.dynhid = [
        nets.BlockLinear(self.deter, self.blocks, self.deter,
                         3 * self.hidden if i == 0 else 0, dtype=self.dtype,
                         name=f'dynhid{i}') for i in range(self.dynlayers)]
    self.dynhid_norm = [
        nets.Norm(self.norm, name=f'dynhid{i}norm')
        for i in range(self.dynlayers)]
    self.dyngru = nets.BlockLinear(
        3 * self.deter, self.blocks, self.deter, dtype=self.dtype,
        name='dyngru')
    self.prior_layers = [dense(f'prior{i}') for i in range(self.imglayers)]
    self.obs_layers = [dense(f'obs{i}') for i in range(self.obslayers)]
    logit = lambda name: nets.Linear(
        (self.stoch, self.classes), self.outscale, self.dtype, name=name)
    self.prior_logit = logit('priorlogit')
    self.obs_logit = logit('obslogit')

  def initial(self, batch):
    return dict(
        deter=jnp.zeros((batch, self.deter), self.dtype),
        stoch=jnp.zeros((batch, self.stoch, self.classes), self.dtype))

  def dist(self, logits):
    return dists.OneHot(logits, self.unimix, event_dims=1)

  def action_share(self, action):
    """The embedded action's part of the core's first hidden layer:
    dynin2 and its rows of the shared product ([*B, deter])."""
    return self.dynhid[0].share(self.dynin[2](action), 2 * self.hidden)

  def core(self, deter, stoch, action):
    """One block-GRU step; `action` is the embedded action vector."""
    return self._core(deter, stoch, self.action_share(action))

  def _core(self, deter, stoch, action_share):
    """`core` from the action's part of it (`action_share`)."""
    g = self.blocks
    stoch = stoch.reshape((*stoch.shape[:-2], -1))
    inputs = jnp.concatenate(
        [self.dynin[0](deter), self.dynin[1](stoch)], -1)
    # Every deter block sees its own slice of deter plus all of the inputs.
    x = deter
    for i, (layer, norm) in enumerate(zip(self.dynhid, self.dynhid_norm)):
      shared = layer.share(inputs) + action_share if i == 0 else None
      x = nets.ACTIVATIONS[self.act](norm(layer(x, shared)))
    x = self.dyngru(x).reshape((*deter.shape[:-1], g, 3, -1))
    old = deter.reshape((*deter.shape[:-1], g, -1)).astype(x.dtype)
    return block_gates(x, old).astype(self.dtype)

  def prior(self, deter):
    x = deter
    for layer in self.prior_layers:
      x = layer(x)
    return self.prior_logit(x)

  def obs_inputs(self, action, tokens, reset):
    """What posterior steps read that does not depend on the recurrence,
    for any number of steps at once ([*B, ...]): the action's part of the
    core (zero actions where `reset`) and the tokens' part of the
    posterior (its first layer's product of the tokens' rows, or with
    `absolute` the whole posterior). A layer on a concatenation is the sum
    of its slices' products, so `obs_step` from these is the posterior step
    from [deter, tokens] with the same parameters, while the products run
    once over all steps' rows instead of inside the scan."""
    action = jnp.where(reset[..., None], 0, action)
    if self.absolute:
      posterior = self._posterior_layers(tokens)
    else:
      first = self.obs_layers[0]
      posterior = first.linear.rows(tokens, self.deter, bias=True)
    return {'action': self.action_share(action), 'posterior': posterior}

  def _posterior_layers(self, x, first=None):
    """The posterior's layers and logits on `x`; `first`: the first layer's
    product from its other rows, added before its norm."""
    for i, layer in enumerate(self.obs_layers):
      x = layer(x) if i or first is None else layer.finish(
          layer.linear.rows(x, 0) + first)
    return self.obs_logit(x)

  def draws(self, key, batch):
    """The uniform numbers [batch, stoch, 1] a step's latent sample reads."""
    return dists.draws(key, (batch, self.stoch, self.classes))

  def obs_step(self, carry, inputs, reset, draws):
    """Posterior step from `obs_inputs`, its latent sampled with `draws`.
    Rows with `reset` start from zeros (new episode)."""
    keep = (~reset)[:, None]
    deter = jnp.where(keep, carry['deter'], 0)
    stoch = jnp.where(keep[..., None], carry['stoch'], 0)
    deter = self._core(deter, stoch, inputs['action'])
    logit = inputs['posterior'] if self.absolute else self._posterior_layers(
        deter, first=inputs['posterior'])
    stoch = self.dist(logit).sample_from(draws).astype(self.dtype)
    carry = dict(deter=deter, stoch=stoch)
    return carry, dict(deter=deter, stoch=stoch, logit=logit)

  def img_step(self, carry, action, draws):
    """Prior step: imagine the next state after `action` (embedded), its
    latent sampled with `draws`."""
    deter = self.core(carry['deter'], carry['stoch'], action)
    logit = self.prior(deter)
    stoch = self.dist(logit).sample_from(draws).astype(self.dtype)
    carry = dict(deter=deter, stoch=stoch)
    return carry, dict(deter=deter, stoch=stoch, logit=logit)

  def __call__(self, carry, action, tokens, reset, key):
    """Touches every submodule; used only to initialise parameters."""
    if not self.absolute:  # the posterior's first layer at its full width
      self.obs_layers[0](jnp.concatenate(
          [carry['deter'], tokens.astype(carry['deter'].dtype)], -1))
    inputs = self.obs_inputs(action, tokens, reset)
    carry, _ = self.obs_step(
        carry, inputs, reset, self.draws(key, reset.shape[0]))
    carry, feat = self.img_step(
        carry, action, self.draws(key, reset.shape[0]))
    return self.prior(feat['deter'])


class Decoder(ObsNet):
  """Features {deter, stoch} [*B, ...] -> dict of reconstruction dists."""
  outscale: float = 1.0
  bspace: int = 8

  @nn.compact
  def __call__(self, feat, bdims):
    vec_keys, img_keys = self.keys()
    bshape = feat['deter'].shape[:bdims]
    deter = feat['deter'].reshape((-1, feat['deter'].shape[-1]))
    stoch = feat['stoch'].reshape((deter.shape[0], -1))
    act = nets.ACTIVATIONS[self.act]
    recons = {}
    if vec_keys:
      x = jnp.concatenate([stoch, deter], -1)
      x = nets.MLP(self.layers, self.units, self.act, self.norm, self.dtype,
                   name='mlp')(x)
      for key in vec_keys:
        space = self.obs_space[key]
        if space.discrete:
          shape = (*space.shape, nets.num_classes(space))
          out = nets.Linear(shape, self.outscale, self.dtype, name=key)(x)
          out = out.reshape((*bshape, *shape))
          recons[key] = dists.Categorical(
              out, event_dims=len(space.shape), low=nets.class_low(space))
        else:
          out = nets.Linear(space.shape, self.outscale, self.dtype,
                            name=key)(x)
          out = out.reshape((*bshape, *space.shape))
          recons[key] = dists.MSE(out, len(space.shape))
    if img_keys:
      res = self.obs_space[img_keys[0]].shape[:2]
      factor = 2 ** len(self.mults)
      minres = (res[0] // factor, res[1] // factor)
      depths = [self.depth * m for m in self.mults]
      shape = (*minres, depths[-1])
      g = self.bspace
      x0 = nets.BlockLinear(math.prod(shape), g, deter.shape[-1],
                            dtype=self.dtype, name='sp0')(deter)
      # Each block of deter paints its own slice of channels.
      x0 = x0.reshape((-1, g, *minres, depths[-1] // g))
      x0 = x0.transpose((0, 2, 3, 1, 4)).reshape((-1, *shape))
      x1 = nets.Dense(2 * self.units, self.act, self.norm, self.dtype,
                      name='sp1')(stoch)
      x1 = nets.Linear(shape, dtype=self.dtype, name='sp2')(x1)
      x = act(nets.Norm(self.norm, name='spnorm')(x0 + x1))
      for i in reversed(range(len(depths) - 1)):
        x = x.repeat(2, 1).repeat(2, 2)
        x = nets.Conv2D(depths[i], self.kernel, dtype=self.dtype,
                        name=f'conv{i}')(x)
        x = act(nets.Norm(self.norm, name=f'conv{i}norm')(x))
      x = x.repeat(2, 1).repeat(2, 2)
      channels = [self.obs_space[k].shape[-1] for k in img_keys]
      x = nets.Conv2D(sum(channels), self.kernel, self.outscale,
                      self.dtype, name='imgout')(x)
      x = jax.nn.sigmoid(x.astype(f32)).reshape((*bshape, *x.shape[1:]))
      splits = np.cumsum(channels)[:-1]
      for key, out in zip(img_keys, jnp.split(x, splits, -1)):
        recons[key] = dists.MSE(out, 3, symlog=False)
    return recons
