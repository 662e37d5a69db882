"""Actor-critic losses: lambda-returns, return normalisation, and the
imagination and replay losses of DreamerV3."""

import jax
import jax.numpy as jnp

f32 = jnp.float32
sg = jax.lax.stop_gradient


def lambda_return(last, term, rew, boot, disc, lam):
  """TD(lambda) targets for steps 0..T-2 of [B, T] sequences.

  R_t = r_{t+1} + disc_{t+1} * ((1 - lam_{t+1}) * boot_{t+1} + lam_{t+1} * R_{t+1})
  where an episode end (`last`) stops lambda-propagation and a terminal
  (`term`) zeroes the bootstrap. R_{T-1} = boot_{T-1}.
  """
  live = (1 - term.astype(f32))[:, 1:] * disc
  cont = (1 - last.astype(f32))[:, 1:] * lam
  interm = rew[:, 1:] + (1 - cont) * live * boot[:, 1:]

  def step(ret, inputs):
    interm_t, live_t, cont_t = inputs
    ret = interm_t + live_t * cont_t * ret
    return ret, ret

  _, rets = jax.lax.scan(
      step, boot[:, -1], (interm.T, live.T, cont.T), reverse=True)
  return rets.T


def percentile_norm(state, values, rate, limit, perclo, perchi):
  """Updates EMAs of the low/high percentiles of `values`.

  Returns the new state and the scale max(limit, hi - lo) used to divide
  advantages, so returns of any magnitude give advantages of order one.
  """
  lo = jnp.percentile(values.astype(f32), perclo)
  hi = jnp.percentile(values.astype(f32), perchi)
  state = dict(
      lo=(1 - rate) * state['lo'] + rate * lo,
      hi=(1 - rate) * state['hi'] + rate * hi)
  scale = jnp.maximum(limit, state['hi'] - state['lo'])
  return sg(state), sg(scale)


def imagination_loss(act, rew, con, policy, value, slowvalue, retnorm_state,
                     retnorm_cfg, horizon, contdisc, lam, actent, slowreg):
  """REINFORCE actor and two-hot critic on imagined [N, H+1] trajectories.

  `con` is the continue probability; with `contdisc` it already includes the
  discount 1 - 1/horizon, so the returns use a discount of 1.
  """
  losses, metrics = {}, {}
  val = value.pred()
  slowval = slowvalue.pred()
  disc = 1.0 if contdisc else 1 - 1 / horizon
  weight = jnp.cumprod(disc * con, 1) / disc
  ret = lambda_return(
      jnp.zeros_like(con), 1 - con, rew, val, disc, lam)
  retnorm_state, scale = percentile_norm(retnorm_state, ret, **retnorm_cfg)
  adv = (ret - val[:, :-1]) / scale
  logpi = sum(policy[k].logp(sg(act[k]))[:, :-1] for k in policy)
  ents = {k: policy[k].entropy()[:, :-1] for k in policy}
  losses['policy'] = sg(weight[:, :-1]) * -(
      logpi * sg(adv) + actent * sum(ents.values()))
  target = jnp.concatenate([ret, jnp.zeros_like(ret[:, -1:])], 1)
  losses['value'] = sg(weight[:, :-1]) * (
      value.loss(sg(target)) + slowreg * value.loss(sg(slowval)))[:, :-1]

  metrics.update({
      'adv': adv.mean(), 'adv_std': adv.std(), 'adv_mag': jnp.abs(adv).mean(),
      'rew': rew.mean(), 'con': con.mean(), 'ret': (ret / scale).mean(),
      'val': val.mean(), 'tar': ret.mean(), 'weight': weight.mean(),
      'slowval': slowval.mean(), 'ret_min': (ret / scale).min(),
      'ret_max': (ret / scale).max(),
      'ret_rate': (jnp.abs(ret / scale) >= 1.0).mean(),
      'retnorm/lo': retnorm_state['lo'], 'retnorm/hi': retnorm_state['hi']})
  for k in policy:
    metrics[f'ent/{k}'] = ents[k].mean()
    lo, hi = policy[k].minent, policy[k].maxent
    metrics[f'rand/{k}'] = (ents[k].mean() - lo) / (hi - lo)
  return losses, ret, retnorm_state, metrics


def replay_value_loss(last, term, rew, boot, value, slowvalue, horizon, lam,
                      slowreg):
  """Critic loss on replayed posterior states, bootstrapping each step from
  the imagination return that started there."""
  ret = lambda_return(last, term, rew, boot, 1 - 1 / horizon, lam)
  target = jnp.concatenate([ret, jnp.zeros_like(ret[:, -1:])], 1)
  weight = (1 - last.astype(f32))[:, :-1]
  loss = weight * (
      value.loss(sg(target)) +
      slowreg * value.loss(sg(slowvalue.pred())))[:, :-1]
  return loss
