"""The DreamerV3 agent: pure, jitted functions over explicit pytrees.

  params = agent.init_params(seed)        # {enc, dyn, dec, rew, con, pol, val}
  state = agent.init_state(params)        # + optimizer, slow critic, ...
  carry = agent.init_carry(batch)         # {deter, stoch, action}
  carry, act, outs = agent.policy(params, carry, obs, key, mode)
  state, carry, outs, metrics = agent.train(state, carry, batch)
  state, carry, outs, metrics = agent.train_many(state, carry, batches)
  metrics = agent.report(state, batch)    # scalars, + videos of image keys
  losses = agent.loss_terms(params, state, carry, batch)  # per term, [B, T]

Batches for train/report are [B, T + C] sequences, C = replay_context: the
first C steps only supply the stored latent (and action) to start from.
`train_many` takes K such batches stacked on a leading axis and makes the
K updates `train` would make one after the other, in one compiled call
(one dispatch instead of K); its outs and metrics gain that leading axis.
"""

import math

import jax
import jax.numpy as jnp

from dreamer_ver.core.transitions import is_log

from . import behavior
from . import dists
from . import heads
from . import nets
from . import optim
from . import rssm

f32 = jnp.float32
sg = jax.lax.stop_gradient

RESERVED = ('reward', 'is_first', 'is_last', 'is_terminal')
MODULES = ('enc', 'dyn', 'dec', 'rew', 'con', 'pol', 'val')
POLICY_MODULES = ('enc', 'dyn', 'pol')
VIDEO_ROWS = 4  # batch rows in a report video: few, it is sent to the logger


def _cfg(node):
  """Config node -> plain kwargs dict (tuples for lists, hashable)."""
  return {k: tuple(v) if isinstance(v, (list, tuple)) else v
          for k, v in dict(node).items()}


class Agent:

  def __init__(self, obs_space, act_space, config):
    self.config = config
    # `log/` keys are for logging only: the replay and the learner's
    # batches never carry them, so the agent does not know of them.
    self.obs_space = {k: v for k, v in obs_space.items()
                      if not is_log(k)}
    self.act_space = {k: v for k, v in act_space.items() if k != 'reset'}
    self.model_space = {k: v for k, v in self.obs_space.items()
                        if k not in RESERVED}
    cfg = config.agent
    self.dtype = jnp.dtype(config.jax.compute_dtype)
    if self.dtype == jnp.float16:
      # float16 gradients underflow without loss scaling, which upstream
      # has and this agent does not.
      raise ValueError(
          'jax.compute_dtype float16 is not supported (it needs loss '
          'scaling); use bfloat16 for low-precision compute, or float32.')
    self.context = int(config.replay_context)
    dt = dict(dtype=self.dtype)
    self.enc = rssm.Encoder(self.model_space, **_cfg(cfg.enc), **dt)
    self.dyn = rssm.RSSM(self.act_space, **_cfg(cfg.rssm), **dt)
    self.dec = rssm.Decoder(self.model_space, **_cfg(cfg.dec), **dt)
    self.rew = heads.ScalarHead('symexp_twohot', **_cfg(cfg.rewhead), **dt)
    self.con = heads.ScalarHead('binary', **_cfg(cfg.conhead), **dt)
    self.pol = heads.PolicyHead(self.act_space, **_cfg(cfg.policy), **dt)
    self.val = heads.ScalarHead('symexp_twohot', **_cfg(cfg.value), **dt)
    self.opt = optim.make_optimizer(**_cfg(cfg.opt))
    scales = dict(cfg.loss_scales)
    rec = scales.pop('rec')
    scales.update({k: rec for k in self.model_space})
    self.scales = scales
    # One compile (which JAX's persistent cache keeps across processes)
    # instead of compiling each of init's few hundred eager ops in every
    # process: the debug agent's init took 6.9 s eagerly, 1.1 s from the
    # cache, on a 2-core AMD EPYC.
    self.init_params = jax.jit(self._init_params)
    self.policy = jax.jit(self.policy_step, static_argnames=('mode',))
    self.unroll = int(cfg.scan_unroll)
    self.scan_grads = cfg.scan_grads
    self.train = jax.jit(self._train, donate_argnums=(0,))
    self.train_many = jax.jit(self._train_many, donate_argnums=(0,))
    self.report = jax.jit(self._report)

  # ---------------------------------------------------------------- init

  @property
  def feat_size(self):
    r = self.config.agent.rssm
    return r.deter + r.stoch * r.classes

  def _init_params(self, seed):
    keys = dict(zip(MODULES, jax.random.split(jax.random.PRNGKey(seed), 7)))
    obs = {k: jnp.zeros((1, *v.shape), v.dtype)
           for k, v in self.model_space.items()}
    carry = self.init_carry(1)
    tokens = self.enc.init(keys['enc'], obs, 1)['params']
    tok = self.enc.apply({'params': tokens}, obs, 1)
    act = rssm.embed_action(self.act_space, carry['action'])
    reset = jnp.zeros((1,), bool)
    dyn = self.dyn.init(keys['dyn'], self._rssm_carry(carry), act, tok, reset,
                        keys['dyn'])['params']
    feat = {'deter': carry['deter'], 'stoch': carry['stoch']}
    vec = jnp.zeros((1, self.feat_size), self.dtype)
    return {
        'enc': tokens, 'dyn': dyn,
        'dec': self.dec.init(keys['dec'], feat, 1)['params'],
        'rew': self.rew.init(keys['rew'], vec)['params'],
        'con': self.con.init(keys['con'], vec)['params'],
        'pol': self.pol.init(keys['pol'], vec)['params'],
        'val': self.val.init(keys['val'], vec)['params'],
    }

  def init_state(self, params, seed=0):
    """Everything `train` updates: params, optimizer, slow critic, return
    normaliser, step counter and the RNG key of the training stream."""
    return {
        'params': params,
        'opt': self.opt.init(params),
        'slowval': jax.tree.map(jnp.copy, params['val']),
        'retnorm': {'lo': jnp.zeros((), f32), 'hi': jnp.zeros((), f32)},
        'step': jnp.zeros((), jnp.int32),
        'rng': jax.random.PRNGKey(seed + 1),
    }

  def init_carry(self, batch):
    r = self.config.agent.rssm
    return {
        'deter': jnp.zeros((batch, r.deter), self.dtype),
        'stoch': jnp.zeros((batch, r.stoch, r.classes), self.dtype),
        'action': {k: jnp.zeros((batch, *v.shape), v.dtype)
                   for k, v in self.act_space.items()},
    }

  @staticmethod
  def param_count(params):
    """Trainable parameters of all modules (the slow critic excluded), as
    upstream's optimizer counts them."""
    return int(sum(math.prod(x.shape) for x in jax.tree.leaves(params)))

  # -------------------------------------------------------------- policy

  def policy_step(self, params, carry, obs, key, mode='sample'):
    """One acting step for a batch of envs; rows with is_first restart.
    Pure and unjitted, for callers that jit it into a step of their own
    (the actor's carry-table step); `self.policy` is it jitted."""
    enc_key, dyn_key, act_key = jax.random.split(key, 3)
    del enc_key
    reset = obs['is_first'].astype(bool)
    tokens = self.enc.apply({'params': params['enc']}, obs, 1)
    prev = rssm.embed_action(self.act_space, carry['action'])
    dyn = lambda method, *args: self.dyn.apply(
        {'params': params['dyn']}, *args, method=method)
    inputs = dyn(self.dyn.obs_inputs, prev, tokens, reset)
    state, feat = dyn(self.dyn.obs_step, self._rssm_carry(carry), inputs,
                      reset, self.dyn.draws(dyn_key, reset.shape[0]))
    policy = self.pol.apply({'params': params['pol']}, self._featvec(feat))
    if mode == 'greedy':
      act = {k: d.mode() for k, d in policy.items()}
    else:
      keys = dict(zip(sorted(policy), jax.random.split(act_key, len(policy))))
      act = {k: d.sample(keys[k]) for k, d in policy.items()}
    act = {k: v.astype(self.act_space[k].dtype) for k, v in act.items()}
    outs = {'dyn/deter': state['deter'].astype(f32),
            'dyn/stoch': state['stoch'].astype(f32)}
    return {**state, 'action': act}, act, outs

  # --------------------------------------------------------------- train

  def _train(self, state, carry, batch):
    key = jax.random.fold_in(state['rng'], state['step'])
    start, obs, prevact, stepid = self._split_context(carry, batch)
    grad_fn = jax.value_and_grad(self._loss, has_aux=True)
    (loss, aux), grads = grad_fn(
        state['params'], state['slowval'], state['retnorm'], start, obs,
        prevact, key)
    updates, opt_state = self.opt.update(grads, state['opt'], state['params'])
    params = jax.tree.map(jnp.add, state['params'], updates)
    slow = self.config.agent.slowvalue
    rate = jnp.where(state['step'] % slow.every == 0, slow.rate, 0.0)
    slowval = jax.tree.map(
        lambda s, v: (1 - rate) * s + rate * v, state['slowval'], params['val'])
    new_state = {
        'params': params, 'opt': opt_state, 'slowval': slowval,
        'retnorm': aux['retnorm'], 'step': state['step'] + 1,
        'rng': state['rng']}
    metrics = dict(aux['metrics'])
    metrics.update(self._opt_metrics(loss, grads, updates, params))
    feat = aux['feat']
    outs = {}
    if self.context:  # Fresh latents for later batches to start from.
      outs['replay'] = {
          'stepid': stepid,
          'dyn/deter': feat['deter'].astype(f32),
          'dyn/stoch': feat['stoch'].astype(f32)}
    last = {k: batch[k][:, -1] for k in self.act_space}
    new_carry = {**aux['carry'], 'action': last}
    return new_state, new_carry, outs, metrics

  def _train_many(self, state, carry, batches):
    def step(state_carry, batch):
      state, carry, outs, metrics = self._train(*state_carry, batch)
      return (state, carry), (outs, metrics)
    (state, carry), (outs, metrics) = jax.lax.scan(
        step, (state, carry), batches)
    return state, carry, outs, metrics

  def loss_terms(self, params, state, carry, batch):
    """The unscaled per-term losses [B, T] of the step `train(state, carry,
    batch)` takes, evaluated at `params`: `jax.grad` of one term shows
    which modules that term trains."""
    key = jax.random.fold_in(state['rng'], state['step'])
    start, obs, prevact, _ = self._split_context(carry, batch)
    _, aux = self._loss(params, state['slowval'], state['retnorm'], start, obs,
                        prevact, key)
    return aux['losses']

  def _opt_metrics(self, loss, grads, updates, params):
    rms = lambda tree: jnp.sqrt(jnp.mean(jnp.concatenate(
        [jnp.square(x).ravel() for x in jax.tree.leaves(tree)])))
    return {
        'opt/loss': loss,
        'opt/grad_norm': jnp.sqrt(sum(
            jnp.square(x).sum() for x in jax.tree.leaves(grads))),
        'opt/grad_rms': rms(grads),
        'opt/update_rms': rms(updates),
        'opt/param_rms': rms(params),
        'opt/param_count': jnp.asarray(self.param_count(params), f32),
    }

  def _loss(self, params, slowval, retnorm, start, obs, prevact, key):
    cfg = self.config.agent
    wm_key, img_key = jax.random.split(key)
    losses, metrics = {}, {}
    B, T = obs['is_first'].shape

    # World model: observe the sequence, reconstruct, predict reward/continue.
    carry, feat = self._observe(params, start, obs, prevact, wm_key)
    prior = self.dyn.apply({'params': params['dyn']}, feat['deter'],
                           method=self.dyn.prior)
    dist = lambda logit: dists.OneHot(logit, cfg.rssm.unimix, event_dims=1)
    post_logit = feat['logit']
    losses['dyn'] = jnp.maximum(
        cfg.rssm.free_nats, dist(sg(post_logit)).kl(dist(prior)))
    losses['rep'] = jnp.maximum(
        cfg.rssm.free_nats, dist(post_logit).kl(dist(sg(prior))))
    metrics['dyn_ent'] = dist(prior).entropy().mean()
    metrics['rep_ent'] = dist(post_logit).entropy().mean()
    recons = self.dec.apply({'params': params['dec']}, feat, 2)
    for k, recon in recons.items():
      target = obs[k].astype(f32) / 255 if nets.is_image(
          self.model_space[k]) else obs[k]
      losses[k] = recon.loss(target)
    vec = self._featvec(feat)
    rew_in = vec if cfg.reward_grad else sg(vec)
    losses['rew'] = self.rew.apply({'params': params['rew']}, rew_in).loss(
        obs['reward'])
    con = 1 - obs['is_terminal'].astype(f32)
    if cfg.contdisc:
      con = con * (1 - 1 / cfg.horizon)
    losses['con'] = self.con.apply({'params': params['con']}, vec).loss(con)

    # Imagination from every posterior state; no gradient into the model.
    starts = jax.tree.map(
        lambda x: sg(x.reshape((B * T, *x.shape[2:]))),
        {'deter': feat['deter'], 'stoch': feat['stoch']})
    imgfeat, imgact = self._imagine(params, starts, img_key)
    img_vec = self._featvec(imgfeat)
    apply = lambda name, p, x: getattr(self, name).apply({'params': p}, x)
    img_losses, imgret, retnorm, img_metrics = behavior.imagination_loss(
        imgact,
        apply('rew', params['rew'], img_vec).pred(),
        apply('con', params['con'], img_vec).prob(),
        apply('pol', params['pol'], img_vec),
        apply('val', params['val'], img_vec),
        apply('val', slowval, img_vec),
        retnorm, _cfg(cfg.retnorm), cfg.horizon, cfg.contdisc,
        **_cfg(cfg.imag_loss))
    losses.update({k: v.mean(1).reshape((B, T)) for k, v in img_losses.items()})
    metrics.update(img_metrics)

    # Critic on replayed states, bootstrapped from the imagination returns.
    if cfg.repval_loss:
      rep_vec = vec if cfg.repval_grad else sg(vec)
      losses['repval'] = behavior.replay_value_loss(
          obs['is_last'], obs['is_terminal'], obs['reward'],
          imgret[:, 0].reshape((B, T)),
          apply('val', params['val'], rep_vec),
          apply('val', slowval, rep_vec),
          cfg.horizon, **_cfg(cfg.repl_loss))

    scales = {k: v for k, v in self.scales.items()
              if k != 'repval' or cfg.repval_loss}
    assert set(losses) == set(scales), (sorted(losses), sorted(scales))
    metrics.update({f'loss/{k}': v.mean() for k, v in losses.items()})
    loss = sum(v.mean() * scales[k] for k, v in losses.items())
    aux = {'carry': carry, 'feat': feat, 'retnorm': retnorm,
           'metrics': metrics, 'losses': losses}
    return loss, aux

  def _observe(self, params, start, obs, prevact, key):
    """Posterior rollout over [B, T] observations from carry `start`."""
    tokens = self.enc.apply({'params': params['enc']}, obs, 2)
    act = rssm.embed_action(self.act_space, prevact)
    reset = obs['is_first'].astype(bool)
    B, T = tokens.shape[:2]
    dyn = lambda method, *args: self.dyn.apply(
        {'params': params['dyn']}, *args, method=method)
    # The products of the actions and tokens, over all B x T rows at once.
    inputs = dyn(self.dyn.obs_inputs, act, tokens, reset)
    draws = jax.vmap(lambda k: self.dyn.draws(k, B))(jax.random.split(key, T))

    def step(params, carry, inputs, fixed):
      return self.dyn.apply({'params': params}, carry, inputs, *fixed,
                            method=self.dyn.obs_step)

    swap = lambda x: jnp.swapaxes(x, 0, 1)
    xs, fixed = jax.tree.map(swap, inputs), (swap(reset), draws)
    if self.scan_grads == 'rows':
      carry, feat = nets.scan_rows(
          step, params['dyn'], start, xs, fixed, unroll=self.unroll)
    else:
      carry, feat = jax.lax.scan(
          lambda c, x: step(params['dyn'], c, *x), start, (xs, fixed),
          unroll=self.unroll)
    return carry, jax.tree.map(swap, feat)

  def _imagine(self, params, start, key):
    """Policy rollout in the prior for imag_length steps. Returns features
    and actions of H+1 states (the start state included)."""
    H = self.config.agent.imag_length
    N = start['deter'].shape[0]
    # Every step's random numbers before the loop, from the keys each step
    # split for itself, so the loop's body is the recurrence alone.
    keys = jax.random.split(key, H + 1)
    pairs = jax.vmap(jax.random.split)(keys[:H])  # each step's act, dyn
    draws = (jax.vmap(lambda k: self.pol.draws(k, N))(pairs[:, 0]),
             jax.vmap(lambda k: self.dyn.draws(k, N))(pairs[:, 1]))

    def act(feat, draws):
      policy = self.pol.apply({'params': params['pol']}, self._featvec(feat))
      return {k: d.sample_from(draws[k]) for k, d in policy.items()}

    def step(carry, draws):
      act_draws, dyn_draws = draws
      action = act(carry, act_draws)
      carry, feat = self.dyn.apply(
          {'params': params['dyn']}, carry,
          rssm.embed_action(self.act_space, action), dyn_draws,
          method=self.dyn.img_step)
      return carry, ({'deter': feat['deter'], 'stoch': feat['stoch']}, action)

    last, (feats, actions) = jax.lax.scan(
        step, start, draws, unroll=self.unroll)
    last_action = act(last, self.pol.draws(keys[H], N))
    swap = lambda x: jnp.swapaxes(x, 0, 1)
    feats = jax.tree.map(
        lambda s, f: jnp.concatenate([s[:, None], swap(f)], 1), start, feats)
    actions = jax.tree.map(
        lambda a, l: jnp.concatenate([swap(a), l[:, None]], 1),
        actions, last_action)
    return jax.tree.map(sg, feats), jax.tree.map(sg, actions)

  def _split_context(self, carry, batch):
    """Splits [B, T+C] into the start carry and the [B, T] training window.

    With C > 0, training starts from the latent stored for step C-1 (written
    by the actor, refreshed by earlier train steps) and its action.
    """
    C = self.context
    obs = {k: batch[k][:, C:] for k in self.obs_space}
    actions = {k: batch[k] for k in self.act_space}
    stepid = batch['stepid'][:, C:]
    if C:
      start = {'deter': batch['dyn/deter'][:, C - 1].astype(self.dtype),
               'stoch': batch['dyn/stoch'][:, C - 1].astype(self.dtype)}
      first = {k: v[:, C - 1] for k, v in actions.items()}
    else:
      start = self._rssm_carry(carry)
      first = carry['action']
    prevact = {k: jnp.concatenate([first[k][:, None], v[:, C:-1]], 1)
               for k, v in actions.items()}
    return start, obs, prevact, stepid

  # -------------------------------------------------------------- report

  def _report(self, state, batch):
    """Loss metrics without an update, plus the open-loop prediction error:
    observe the first half, imagine the second with the replayed actions.

    For each image key, also ``openloop/<key>``: a uint8 video [T, 3H,
    VIDEO_ROWS * W, C] of the first batch rows side by side, each the
    truth above the model (the first half reconstructed from the observed
    states, the second predicted from the imagined ones) above the error
    (grey where the model is right), as upstream's report. Vector-only
    agents compute no video."""
    params = state['params']
    key = jax.random.fold_in(
        jax.random.fold_in(state['rng'], state['step']), 1)
    start, obs, prevact, _ = self._split_context(
        self.init_carry(batch['is_first'].shape[0]), batch)
    _, aux = self._loss(params, state['slowval'], state['retnorm'], start,
                        obs, prevact, key)
    metrics = dict(aux['metrics'])
    T = obs['is_first'].shape[1]
    half = T // 2
    first = jax.tree.map(lambda x: x[:, :half], obs)
    carry, obsfeat = self._observe(
        params, start, first, jax.tree.map(lambda x: x[:, :half], prevact), key)
    acts = rssm.embed_action(
        self.act_space, jax.tree.map(lambda x: x[:, half:], prevact))

    def step(carry, inputs):
      act_t, draws_t = inputs
      carry, feat = self.dyn.apply(
          {'params': params['dyn']}, carry, act_t, draws_t,
          method=self.dyn.img_step)
      return carry, {'deter': feat['deter'], 'stoch': feat['stoch']}

    B = obs['is_first'].shape[0]
    draws = jax.vmap(lambda k: self.dyn.draws(k, B))(
        jax.random.split(key, T - half))
    _, imgfeat = jax.lax.scan(step, carry, (jnp.swapaxes(acts, 0, 1), draws))
    imgfeat = jax.tree.map(lambda x: jnp.swapaxes(x, 0, 1), imgfeat)
    recons = self.dec.apply({'params': params['dec']}, imgfeat, 2)
    for k, recon in recons.items():
      truth = obs[k][:, half:]
      if nets.is_image(self.model_space[k]):
        truth = truth.astype(f32) / 255
      pred = recon.mode() if hasattr(recon, 'mode') else recon.pred()
      error = jnp.square(pred.astype(f32) - truth.astype(f32))
      metrics[f'openloop/{k}_mse'] = error.mean()
    rew = self.rew.apply({'params': params['rew']}, self._featvec(imgfeat))
    metrics['openloop/reward_mse'] = jnp.square(
        rew.pred() - obs['reward'][:, half:]).mean()
    images = [k for k in recons if nets.is_image(self.model_space[k])]
    if images:
      rows = lambda x: x[:VIDEO_ROWS]
      observed = self.dec.apply(
          {'params': params['dec']}, jax.tree.map(rows, obsfeat), 2)
      for k in images:
        model = jnp.concatenate(
            [observed[k].pred(), rows(recons[k].pred())], 1)
        metrics[f'openloop/{k}'] = _video(rows(obs[k]), model)
    return metrics

  # ------------------------------------------------------------- helpers

  def _featvec(self, feat):
    stoch = feat['stoch'].reshape((*feat['stoch'].shape[:-2], -1))
    return jnp.concatenate(
        [feat['deter'].astype(self.dtype), stoch.astype(self.dtype)], -1)

  @staticmethod
  def _rssm_carry(carry):
    return {'deter': carry['deter'], 'stoch': carry['stoch']}


def _video(truth, model):
  """Truth (uint8) and model (float in [0, 1]) frames, both [B, T, H, W, C]
  -> uint8 [T, 3H, B * W, C]: per batch row, truth above model above error,
  the rows side by side."""
  truth_unit = truth.astype(f32) / 255
  error = (model - truth_unit + 1) / 2
  to_uint8 = lambda x: jnp.round(jnp.clip(x, 0, 1) * 255).astype(jnp.uint8)
  panels = jnp.concatenate([truth, to_uint8(model), to_uint8(error)], 2)
  B, T, H3, W, C = panels.shape
  return panels.transpose((1, 2, 0, 3, 4)).reshape((T, H3, B * W, C))


def policy_params(params):
  """The subset of params the actor needs."""
  return {k: params[k] for k in POLICY_MODULES}
