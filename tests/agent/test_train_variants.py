"""The learner's speed variants change no number the agent learns: K updates
fused into one compiled call (`train_many`), unrolled scans
(`agent.scan_unroll`), the observe scan's parameter gradient step by step
or once over all rows (`agent.scan_grads`: lax.scan's own or
`nets.scan_rows`), and the observe scan with the products of its actions and
tokens made beforehand, each against plain `train` calls of the
straightforward version from the same state, carry and batches, in
float32 on the CPU."""

import functools
import re

import elements
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench.learner import learner_counts
from dreamer_ver.agent import agent as agentlib
from dreamer_ver.agent import nets, rssm
from helpers.agent import make_batch, small_config, vector_spaces

K = 3
# Each variant compiles its own program, in which XLA may order float32
# sums differently: on this CPU the fused updates came out bit for bit the
# same and the unrolled ones within 1e-7 of the params' scale.
TOLERANCE = dict(rtol=1e-5, atol=1e-6)


def plain_updates(agent, batches):
  state = agent.init_state(agent.init_params(0), 0)
  carry = agent.init_carry(batches[0]['is_first'].shape[0])
  outs, metrics = [], []
  for batch in batches:
    state, carry, out, met = agent.train(state, carry, batch)
    outs.append(out)
    metrics.append(met)
  return jax.device_get((state, carry, outs, metrics))


@pytest.fixture(scope='module')
def reference():
  agent = agentlib.Agent(*vector_spaces(), small_config())
  T = agent.config.batch_length + agent.context
  batches = [make_batch(agent, 4, T, seed) for seed in range(K)]
  for i, batch in enumerate(batches):  # latents differ per batch and row
    batch['dyn/deter'] += np.float32(0.1 * (i + 1))
    batch['stepid'][:, :, 0] = i
  return agent, batches, plain_updates(agent, batches)


def assert_close(got, want):
  np.testing.assert_equal(jax.tree.structure(got), jax.tree.structure(want))
  for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), **TOLERANCE)


def test_k_updates_fused_in_one_call_equal_k_plain_updates(reference):
  agent, batches, (state, carry, outs, metrics) = reference
  stacked = jax.tree.map(lambda *xs: np.stack(xs), *batches)
  got = agent.train_many(
      agent.init_state(agent.init_params(0), 0), agent.init_carry(4), stacked)
  fused_state, fused_carry, fused_outs, fused_metrics = jax.device_get(got)
  assert int(fused_state['step']) == K
  assert_close(fused_state, state)
  assert_close(fused_carry, carry)
  # Update i's fresh latents and metrics are at index i of the leading axis.
  for i in range(K):
    assert_close(jax.tree.map(lambda x: x[i], fused_outs), outs[i])
    assert_close(jax.tree.map(lambda x: x[i], fused_metrics), metrics[i])
  np.testing.assert_array_equal(fused_outs['replay']['stepid'][:, 0, 0, 0],
                                np.arange(K))


def test_unrolled_scans_give_the_plain_updates(reference):
  _, batches, want = reference
  agent = agentlib.Agent(*vector_spaces(),
                         small_config(**{'agent.scan_unroll': 2}))
  assert_close(plain_updates(agent, batches), want)


def test_the_observe_gradient_step_by_step_gives_the_same_updates(reference):
  agent, batches, want = reference
  assert agent.scan_grads == 'rows'  # the default
  agent = agentlib.Agent(*vector_spaces(),
                         small_config(**{'agent.scan_grads': 'steps'}))
  assert agent.scan_grads == 'steps'
  assert_close(plain_updates(agent, batches), want)


def row_step(params, carry, x, fixed):
  """A recurrent step of the kind `scan_rows` takes: rows independent,
  parameters used in products, a norm-like scale and a bias; rows with
  `reset` restart from zero."""
  reset, noise = fixed
  h = jnp.where(reset[:, None], 0, carry)
  h = jnp.tanh(h @ params['w'] + x['a'] @ params['u'] + params['b'])
  out = h * params['scale'] + noise
  return h, {'out': out, 'sq': jnp.square(x['a']).sum(-1)}


def test_scan_rows_gives_lax_scans_values_and_gradients():
  # Values, and gradients for the parameters, the start carry and the
  # per-step inputs, against jax's own scan, forward and unrolled.
  rng = np.random.default_rng(0)
  T, B, D, A = 7, 3, 4, 2
  f = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  params = {'w': f(D, D), 'u': f(A, D), 'b': f(D), 'scale': f(D)}
  start, xs = f(B, D), {'a': f(T, B, A)}
  fixed = (jnp.asarray(rng.random((T, B)) < 0.2), f(T, B, D))
  weights = f(T, B, D), f(T, B), f(B, D)

  def loss(scan, params, start, xs):
    last, ys = scan(params, start, xs)
    return ((ys['out'] * weights[0]).sum() + (ys['sq'] * weights[1]).sum() +
            jnp.sin(last * weights[2]).sum())

  plain = lambda p, c, x: jax.lax.scan(
      lambda c, i: row_step(p, c, *i), c, (x, fixed))
  want = jax.value_and_grad(loss, (1, 2, 3))(plain, params, start, xs)
  for unroll in (1, 2):
    rows = lambda p, c, x: nets.scan_rows(row_step, p, c, x, fixed, unroll)
    got = jax.jit(jax.value_and_grad(loss, (1, 2, 3)), static_argnums=0)(
        rows, params, start, xs)
    assert_close(got, want)
  assert all(np.abs(g).max() > 0 for g in jax.tree.leaves(want[1]))


def observe_in_scan(agent, params, start, obs, prevact, key):
  """`Agent._observe` as each step computed it for itself before the
  products of the actions and tokens left the scan: the step embeds its
  action (zero where an episode starts), runs the core on it and the
  posterior on [deter, tokens] (the tokens alone with `absolute`)."""
  dyn = agent.dyn
  tokens = agent.enc.apply({'params': params['enc']}, obs, 2)
  act = rssm.embed_action(agent.act_space, prevact)

  def step(module, carry, act, tok, reset, key):
    keep = (~reset)[:, None]
    deter = jnp.where(keep, carry['deter'], 0)
    stoch = jnp.where(keep[..., None], carry['stoch'], 0)
    deter = module.core(deter, stoch, jnp.where(keep, act, 0))
    x = tok if module.absolute else jnp.concatenate([deter, tok], -1)
    for layer in module.obs_layers:
      x = layer(x)
    logit = module.obs_logit(x)
    stoch = module.dist(logit).sample(key).astype(module.dtype)
    carry = dict(deter=deter, stoch=stoch)
    return carry, dict(deter=deter, stoch=stoch, logit=logit)

  apply = functools.partial(nn.apply(step, dyn), {'params': params['dyn']})
  swap = lambda x: jnp.swapaxes(x, 0, 1)
  xs = (swap(act), swap(tokens), swap(obs['is_first'].astype(bool)),
        jax.random.split(key, tokens.shape[1]))
  carry, feat = jax.lax.scan(lambda c, x: apply(c, *x), start, xs)
  return carry, jax.tree.map(swap, feat)


def imagine_in_scan(agent, params, start, key):
  """`Agent._imagine` as each step drew its random numbers for itself:
    (features, actions) of the H steps, and the last state's action."""
  def act(feat, key):
    policy = agent.pol.apply({'params': params['pol']}, agent._featvec(feat))
    keys = jax.random.split(key, len(policy))
    return {k: d.sample(kk) for (k, d), kk in zip(sorted(policy.items()), keys)}

  def img_step(module, carry, action, key):
    deter = module.core(carry['deter'], carry['stoch'], action)
    stoch = module.dist(module.prior(deter)).sample(key)
    return dict(deter=deter, stoch=stoch.astype(module.dtype))

  apply = functools.partial(nn.apply(img_step, agent.dyn),
                            {'params': params['dyn']})

  def step(carry, key):
    act_key, dyn_key = jax.random.split(key)
    action = act(carry, act_key)
    carry = apply(carry, rssm.embed_action(agent.act_space, action), dyn_key)
    return carry, (carry, action)

  keys = jax.random.split(key, agent.config.agent.imag_length + 1)
  last, (feats, actions) = jax.lax.scan(step, start, keys[:-1])
  return feats, actions, act(last, keys[-1])


def test_imagination_draws_made_before_its_loop_are_the_ones_it_drew():
  # The imagination takes every step's random numbers (its latents' and
  # the policy's, discrete and continuous) from the same keys before the
  # loop: the same states and actions as drawing them step by step.
  obs, _ = vector_spaces()
  act = {'act_disc': elements.Space(np.int32, (), 0, 3),
         'act_cont': elements.Space(np.float32, (2,), -1, 1),
         'reset': elements.Space(bool, ())}
  agent = agentlib.Agent(obs, act, small_config())
  params = agent.init_params(0)
  rng = np.random.default_rng(0)
  carry = agent.init_carry(6)
  classes = carry['stoch'].shape[-1]
  start = {'deter': jnp.asarray(rng.normal(size=carry['deter'].shape),
                                jnp.float32),
           'stoch': jnp.asarray(np.eye(classes, dtype=np.float32)[
               rng.integers(0, classes, carry['stoch'].shape[:-1])])}
  key = jax.random.PRNGKey(5)
  feats, actions = jax.jit(agent._imagine)(params, start, key)
  want_feats, want_actions, want_last = jax.jit(
      functools.partial(imagine_in_scan, agent))(params, start, key)
  swap = lambda x: np.swapaxes(x, 0, 1)
  for k in ('deter', 'stoch'):
    np.testing.assert_allclose(feats[k][:, 1:], swap(want_feats[k]),
                               rtol=1e-6, atol=1e-6)
  assert sorted(actions) == ['act_cont', 'act_disc']
  for k in actions:
    np.testing.assert_allclose(actions[k][:, :-1], swap(want_actions[k]),
                               rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(actions[k][:, -1], want_last[k],
                               rtol=1e-6, atol=1e-6)
  assert len(np.unique(np.asarray(actions['act_disc']))) > 1


def assert_close_to_scale(got, want, fraction):
  """Every number within `fraction` of the largest of its array."""
  np.testing.assert_equal(jax.tree.structure(got), jax.tree.structure(want))
  for x, y in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    y = np.asarray(y, np.float64)
    np.testing.assert_allclose(np.asarray(x, np.float64), y, rtol=0,
                               atol=fraction * np.abs(y).max())


@pytest.mark.parametrize('absolute, scan_grads', [
    (False, 'steps'), (True, 'steps'), (False, 'rows')])
def test_products_taken_out_of_the_observe_scan_change_no_number(
    absolute, scan_grads):
  # The scan's step gets the products of the actions and tokens made over
  # all rows beforehand (`RSSM.obs_inputs`), and its latent draws; with
  # `rows` its parameters' gradient is one product over all rows: the
  # same parameters, losses, gradients and update, up to the order of
  # float32 sums (measured: the gradients within 6e-7 of each array's
  # largest). Episodes start mid-batch, so the zeroed actions are
  # compared too.
  config = small_config(**{'agent.rssm.absolute': absolute,
                            'agent.scan_grads': scan_grads,
                            'agent.opt.warmup': 0})  # a first step > 0
  agent, before = (agentlib.Agent(*vector_spaces(), config) for _ in range(2))
  before._observe = functools.partial(observe_in_scan, before)
  T = config.batch_length + agent.context
  batch = make_batch(agent, 4, T, 0)
  batch['is_first'][1, T // 2] = batch['is_first'][2, 3] = True

  def loss_grads_update(agent):
    params = agent.init_params(0)
    state = agent.init_state(params, 0)
    start, obs, prevact, _ = agent._split_context(agent.init_carry(4), batch)
    loss = jax.jit(jax.value_and_grad(agent._loss, has_aux=True))
    (value, aux), grads = loss(
        params, state['slowval'], state['retnorm'], start, obs, prevact,
        jax.random.PRNGKey(1))
    updates, _ = agent.opt.update(grads, state['opt'], params)
    return jax.device_get((value, aux['losses'], grads, updates))

  value, losses, grads, updates = loss_grads_update(agent)
  want_value, want_losses, want_grads, want_updates = loss_grads_update(
      before)
  np.testing.assert_allclose(value, want_value, rtol=1e-6)
  assert_close_to_scale(losses, want_losses, 1e-5)
  assert_close_to_scale(grads, want_grads, 1e-5)
  changed = ('dynin2', 'dynhid0', 'obs0', 'obslogit')  # what the split reads
  assert all(np.abs(g).max() > 0 for g in jax.tree.leaves(
      {k: grads['dyn'][k] for k in changed}))
  # The update: this optimizer's first step moves each param by about its
  # learning rate times the sign of its gradient, so 1 % of it apart
  # means the same step. A gradient within rounding of 0 may take either
  # sign, so those under 1e-4 of their array's largest are left out.
  lr = config.agent.opt.lr
  np.testing.assert_equal(jax.tree.structure(updates),
                          jax.tree.structure(want_updates))
  for x, y, g in zip(*map(jax.tree.leaves, (updates, want_updates, grads))):
    clear = np.abs(g) > 1e-4 * np.abs(g).max()
    np.testing.assert_allclose(x[clear], y[clear], rtol=0, atol=0.01 * lr)
  assert np.abs(updates['dyn']['obs0']['linear']['kernel']).max() > lr / 2


def test_the_weight_slices_and_transposes_in_scan_steps_are_made_before_the_loops(
    reference):
  # XLA:CPU leaves a slice or transpose of a parameter inside a scan's step
  # (a copy every step); `nets.hoistable` puts them before the loop. No
  # loop body of the compiled update may rearrange the core's kernel or
  # slice the posterior's first layer (`Linear.rows`).
  agent, batches, _ = reference
  state = agent.init_state(agent.init_params(0), 0)
  carry = agent.init_carry(batches[0]['is_first'].shape[0])
  hlo = agent.train.lower(state, carry, batches[0]).compile().as_text()
  computations = learner_counts.computations(hlo)
  bodies = [body for _, body in learner_counts.loops(hlo)]
  assert bodies
  rearranged = re.compile(
      r'op_name="[^"]*(dynhid0(\.share/transpose|/slice)|linear\.rows/slice)')
  in_loops = [line for body in bodies for line in computations[body]
              if rearranged.search(line)]
  assert not in_loops, in_loops[:2]
  hoisted = [line for lines in computations.values() for line in lines
             if rearranged.search(line)]
  assert hoisted  # made once, outside the loops


@pytest.mark.skipif(jax.default_backend() != 'cpu', reason='a CPU rule')
@pytest.mark.parametrize('rows,inputs', [(150, 640), (150, 64), (8192, 64)])
def test_a_dense_products_gradients_are_the_plain_ones_its_kernels_from_a_copy(
    rows, inputs):
  # `nets.product`: for 128 inputs or more, or 8192 rows and more, the
  # kernel's gradient multiplies a transposed copy of the input, a product
  # that contracts the operand's last (row-major) axis; the same numbers as
  # `x @ kernel`.
  rng = np.random.default_rng(inputs)
  x = jnp.asarray(rng.standard_normal((2, rows // 2, inputs)), jnp.float32)
  kernel = jnp.asarray(rng.standard_normal((inputs, 24)), jnp.float32)
  weights = jnp.asarray(rng.standard_normal((2, rows // 2, 24)), jnp.float32)
  loss = lambda f: lambda x, k: (jnp.tanh(f(x, k)) * weights).sum()
  got = jax.jit(jax.value_and_grad(loss(nets.product), (0, 1)))(x, kernel)
  want = jax.value_and_grad(loss(lambda x, k: x @ k), (0, 1))(x, kernel)
  # float32 sums of `rows` terms of order one, in another order
  for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6 * rows ** 0.5)
  grad = jax.jit(jax.grad(loss(nets.product), 1))
  hlo = grad.lower(x, kernel).compile().as_text()
  (lines, line), = [
      (lines, l) for lines in learner_counts.computations(hlo).values()
      for l in lines if re.search(rf'= f32\[{inputs},24\]\S* dot\(', l)]
  contracts = re.search(r'lhs_contracting_dims=\{(\d)\}', line)[1]
  if inputs < 128 and rows < 8192:
    assert contracts == '0', line  # x as it lies
    return
  # A copy laid out [inputs, rows] row-major, not a transpose's view.
  assert contracts == '1', line
  lhs = re.search(r' dot\(%?([\w.\-]+),', line)[1]
  (made,) = [l for l in lines if re.match(rf'\s+%?{re.escape(lhs)} = ', l)]
  assert f'f32[{inputs},{rows}]{{1,0}}' in made, made
