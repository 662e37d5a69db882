"""The agent against upstream DreamerV3 (danijar/dreamerv3), by value.

Each test pins one behaviour of upstream's `dreamerv3/agent.py`,
`dreamerv3/rssm.py` or `embodied/jax/{nets,outs,opt}.py` on tiny CPU configs.
"""

import elements
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dreamer_ver.config import loading as configlib
from dreamer_ver.agent import agent as agentlib
from dreamer_ver.agent import behavior, dists, nets, optim, rssm
from helpers.agent import make_batch as helper_batch


def small_config(**overrides):
  return configlib.compose(['debug'], overrides)


def spaces(token_low=0, action_low=0):
  obs = {
      'vector': elements.Space(np.float32, (3,)),
      'token': elements.Space(np.int32, (2,), token_low, token_low + 4),
      'reward': elements.Space(np.float32, ()),
      'is_first': elements.Space(bool, ()),
      'is_last': elements.Space(bool, ()),
      'is_terminal': elements.Space(bool, ()),
  }
  act = {'action': elements.Space(np.int32, (), action_low, action_low + 3),
         'reset': elements.Space(bool, ())}
  return obs, act


def make_batch(agent, B, T, seed=0):
  """The comparisons start from random stored latents, as replay holds."""
  return helper_batch(agent, B, T, seed, random_latents=True)


def perturbed(params, scale=0.3, seed=1):
  """Every leaf moved off its init, so that zero-initialised output layers
  (reward, value) pass gradients on to the layers below them."""
  leaves, tree = jax.tree.flatten(params)
  keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))
  return tree.unflatten([
      x + scale * jax.random.normal(k, x.shape) for x, k in zip(leaves, keys)])


# ------------------------------------------------------------ numerics

def test_block_linear_fan_in_is_the_whole_input():
  # Upstream's Initializer.compute_fans for a kernel [blocks, in / blocks,
  # out / blocks] gives fan_in = blocks * in / blocks = in.
  key = jax.random.PRNGKey(0)
  layer = nets.BlockLinear(1024, 8, 2048)
  kernel = layer.init(key, jnp.zeros((1, 2048)))['params']['kernel']
  assert kernel.shape == (8, 256, 128)
  assert float(kernel.std()) == pytest.approx(1 / np.sqrt(2048), rel=0.05)
  # The same rule where the agent uses block layers, at size1m's RSSM
  # (deter 512, hidden 64, 8 blocks): the RSSM core and the image
  # decoder's first layer, which maps deter to the smallest feature map.
  deter, hidden, blocks = 512, 64, 8
  dyn = rssm.RSSM({'action': elements.Space(np.int32, (), 0, 3)}, deter=deter,
                  hidden=hidden, stoch=32, classes=4, blocks=blocks)
  dyn = jax.jit(lambda key: dyn.init(
      key, dyn.initial(1), jnp.zeros((1, 3)), jnp.zeros((1, 16)),
      jnp.zeros((1,), bool), key))(key)['params']
  dec = rssm.Decoder({'image': elements.Space(np.uint8, (32, 32, 3))},
                     mults=(2, 2), depth=4, units=8, bspace=blocks)
  feat = {'deter': jnp.zeros((1, deter)), 'stoch': jnp.zeros((1, 32, 4))}
  dec = jax.jit(lambda key: dec.init(key, feat, 1))(key)['params']
  fan_in = {
      'dynhid0': (dyn['dynhid0'], deter + 3 * hidden * blocks),
      'dyngru': (dyn['dyngru'], deter),
      'sp0': (dec['sp0'], deter),
      'dynin0': (dyn['dynin0']['linear'], deter),  # dense, for comparison
  }
  for name, (layer, fan) in fan_in.items():
    kernel = layer['kernel']
    assert kernel.size >= 32_000, (name, kernel.shape)
    assert float(kernel.std()) == pytest.approx(
        1 / np.sqrt(fan), rel=0.05), name


def _rssm_core_reference(p, deter, stoch, action, blocks):
  """Upstream's block-GRU step in numpy (float64): every block's input is
  its deter slice concatenated with all of [dynin(deter), dynin(stoch),
  dynin(action)]; the block outputs are [reset, cand, update] per block."""
  silu = lambda x: x / (1 + np.exp(-x))
  sigmoid = lambda x: 1 / (1 + np.exp(-x))
  rms = lambda x, scale: x / np.sqrt((x ** 2).mean(-1, keepdims=True) + 1e-4) * scale
  dense = lambda q, x: silu(rms(
      x @ q['linear']['kernel'] + q['linear']['bias'], q['norm']['scale']))
  def block(q, x):  # [B, g * i] -> [B, units]
    x = x.reshape((len(x), blocks, -1))
    y = np.einsum('bgi,gio->bgo', x, q['kernel'])
    return y.reshape((len(x), -1)) + q['bias']
  p = jax.tree.map(lambda v: np.asarray(v, np.float64), p)
  B = len(deter)
  x = np.concatenate([dense(p['dynin0'], deter),
                      dense(p['dynin1'], stoch.reshape((B, -1))),
                      dense(p['dynin2'], action)], -1)
  x = np.repeat(x[:, None], blocks, 1)
  x = np.concatenate([deter.reshape((B, blocks, -1)), x], -1).reshape((B, -1))
  x = silu(rms(block(p['dynhid0'], x), p['dynhid0norm']['scale']))
  x = block(p['dyngru'], x).reshape((B, blocks, 3, -1))
  reset, cand, update = [x[:, :, i].reshape(deter.shape) for i in range(3)]
  cand = np.tanh(sigmoid(reset) * cand)
  update = sigmoid(update - 1)
  return update * cand + (1 - update) * deter


@pytest.mark.parametrize('backend', ['cpu', 'gpu'])
def test_rssm_core_is_upstreams_block_gru(backend, monkeypatch):
  # The core never builds upstream's per-block copies of the inputs (the
  # shared rows of the first block layer are one dense product) and runs
  # the blocks as one product, blocks first on CPU and one einsum
  # elsewhere: all the same step.
  monkeypatch.setattr(jax, 'default_backend', lambda: backend)
  blocks = 4
  dyn = rssm.RSSM({'action': elements.Space(np.int32, (), 0, 3)}, deter=32,
                  hidden=8, stoch=4, classes=3, blocks=blocks)
  key = jax.random.PRNGKey(0)
  params = dyn.init(key, dyn.initial(1), jnp.zeros((1, 3)), jnp.zeros((1, 16)),
                    jnp.zeros((1,), bool), key)['params']
  params = perturbed(params)
  rng = np.random.default_rng(0)
  deter = rng.normal(size=(5, 32)).astype(np.float32)
  stoch = np.eye(3, dtype=np.float32)[rng.integers(0, 3, (5, 4))]
  action = rng.normal(size=(5, 3)).astype(np.float32)
  # Full float32 products: a GPU's default (TF32) is off by about 1e-3.
  with jax.default_matmul_precision('highest'):
    ours = dyn.apply({'params': params}, deter, stoch, action,
                     method=dyn.core)
  want = _rssm_core_reference(params, deter, stoch, action, blocks)
  np.testing.assert_allclose(ours, want, rtol=1e-4, atol=1e-5)
  assert np.abs(want - deter).max() > 0.1  # The step moved the state.


def test_block_products_and_their_gradients_are_the_same_on_every_backend(
    monkeypatch):
  # CPU's blocks-first product and the einsum other backends run: the same
  # values and the same gradients for the input and the kernel, at the
  # observe scan's rank ([B, g, i]) and the heads' ([B, T, g, i]).
  rng = np.random.default_rng(0)
  kernel = jnp.asarray(rng.normal(size=(4, 3, 5)), jnp.float32)
  for shape in [(6, 4, 3), (2, 6, 4, 3)]:
    x = jnp.asarray(rng.normal(size=shape), jnp.float32)
    weights = jnp.asarray(rng.normal(size=(*shape[:-2], 20)), jnp.float32)
    loss = lambda x, k: (jnp.tanh(nets.block_product(x, k)) * weights).sum()
    results = {}
    for backend in ('cpu', 'gpu'):
      monkeypatch.setattr(jax, 'default_backend', lambda: backend)
      with jax.default_matmul_precision('highest'):
        results[backend] = (nets.block_product(x, kernel),
                            *jax.grad(loss, (0, 1))(x, kernel))
    want = np.einsum('...gi,gio->...go', np.float64(x), np.float64(kernel))
    np.testing.assert_allclose(
        results['cpu'][0], want.reshape((*shape[:-2], 20)), rtol=1e-5,
        atol=1e-5)
    for ours, theirs in zip(results['cpu'], results['gpu']):
      np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)


def test_latent_samples_follow_the_probabilities():
  # 40,000 draws per distribution from one fixed key: the counts of each
  # class are within 4.5 standard deviations of probs * n; classes with
  # probability 0 are never drawn (no unimix here).
  probs = np.array([[0.1, 0.2, 0.3, 0.4], [0.0, 0.0, 1.0, 0.0],
                    [0.5, 0.0, 0.0, 0.5]])
  n = 40_000
  logits = jnp.log(jnp.asarray(np.repeat(probs[None], n, 0)))
  sample = np.asarray(dists.OneHot(logits).sample(jax.random.PRNGKey(3)))
  onehot = np.round(sample)  # + probs - sg(probs) rounds to 1 - 6e-8
  np.testing.assert_allclose(sample, onehot, atol=1e-6)
  np.testing.assert_array_equal(onehot.sum(-1), 1)
  counts = onehot.sum(0)
  np.testing.assert_array_less(
      np.abs(counts - probs * n), 4.5 * np.sqrt(n * probs * (1 - probs)) + 1e-9)
  assert counts[1, 2] == n and counts[2, 1] == counts[2, 2] == 0
  index = dists.Categorical(logits, low=-1).sample(jax.random.PRNGKey(4))
  index = np.asarray(index)
  assert index.dtype == np.int32 and index.min() >= -1 and index.max() <= 2
  counts = np.stack([(index == k - 1).sum(0) for k in range(4)], -1)
  np.testing.assert_array_less(
      np.abs(counts - probs * n), 4.5 * np.sqrt(n * probs * (1 - probs)) + 1e-9)


def test_categorical_without_unimix_survives_peaked_logits():
  # A gap of 200 underflows softmax to exactly 0; log-softmax stays exact.
  logits = jnp.array([200.0, 0.0, -5.0])
  dist = dists.Categorical(logits)
  logp = np.array([float(dist.logp(i)) for i in range(3)])
  np.testing.assert_allclose(logp, [0.0, -200.0, -205.0], atol=1e-4)
  assert float(dist.loss(1)) == pytest.approx(200.0, rel=1e-6)
  assert float(dist.entropy()) == pytest.approx(0.0, abs=1e-6)
  # d logp(1) / d logits = onehot(1) - softmax = [-1, 1, 0].
  grad = jax.grad(lambda x: dists.Categorical(x).logp(1))(logits)
  np.testing.assert_allclose(grad, [-1.0, 1.0, 0.0], atol=1e-6)
  grad = jax.grad(lambda x: dists.Categorical(x).entropy())(logits)
  assert np.isfinite(grad).all()
  # KL(p || q) with p = onehot(0): -log q(0), here log(1 + e^2 + e^-3).
  other = dists.OneHot(jnp.array([0.0, 2.0, -3.0]))
  kl = dists.OneHot(logits).kl(other)
  assert float(kl) == pytest.approx(np.log(1 + np.e ** 2 + np.e ** -3), 1e-5)
  grad = jax.grad(lambda x: dists.OneHot(x).kl(other))(logits)
  assert np.isfinite(grad).all()


def test_agc_zero_turns_clipping_off():
  # Upstream: clip_by_agc(0) passes gradients through unchanged. Two steps
  # of different gradient scale, so clipping would change the LaProp state.
  lr, b1, b2, eps = 0.1, 0.9, 0.999, 1e-20
  params = {'a': jnp.array([1.0, -2.0, 0.5])}
  grads = [{'a': jnp.array([3.0, 1.0, -40.0])},
           {'a': jnp.array([-0.2, 0.0, 0.1])}]
  opt = optim.make_optimizer(lr, 0.0, eps, b1, b2, warmup=0)
  state = opt.init(params)
  nu = mu = np.zeros(3)
  for t, g in enumerate(grads, 1):
    update, state = opt.update(g, state, params)
    gk = np.asarray(g['a'], np.float64)
    nu = b2 * nu + (1 - b2) * gk ** 2
    step = gk / (np.sqrt(nu / (1 - b2 ** t)) + eps)
    mu = b1 * mu + (1 - b1) * step
    want = -lr * mu / (1 - b1 ** t)
    np.testing.assert_allclose(update['a'], want, rtol=1e-5)
    assert np.abs(want).max() > 0.01
  # With clipping on, the second step would differ.
  clipped = optim.make_optimizer(lr, 0.3, eps, b1, b2, warmup=0)
  cstate = clipped.init(params)
  for g in grads:
    cupdate, cstate = clipped.update(g, cstate, params)
  assert not np.allclose(cupdate['a'], update['a'], rtol=1e-3)


def test_float16_compute_is_rejected():
  obs, act = spaces()
  cfg = small_config(**{'jax.compute_dtype': 'float16'})
  with pytest.raises(ValueError, match='bfloat16'):
    agentlib.Agent(obs, act, cfg)


def test_lambda_return_across_an_episode_end():
  # rew/boot at steps 0..4; step 2 ends an episode (terminal, or only last).
  rew = jnp.array([[0.0, 1.0, 2.0, 3.0, 4.0]])
  boot = jnp.array([[10.0, 20.0, 30.0, 40.0, 50.0]])
  end = jnp.array([[0.0, 0.0, 1.0, 0.0, 0.0]])
  none = jnp.zeros_like(end)
  d, lam = 0.5, 0.5
  r3 = 4 + d * ((1 - lam) * 50 + lam * 50)
  r2 = 3 + d * ((1 - lam) * 40 + lam * r3)
  # Terminal: no value after step 2 is seen from steps before it.
  r1 = 2.0
  r0 = 1 + d * ((1 - lam) * 20 + lam * r1)
  ret = behavior.lambda_return(end, end, rew, boot, d, lam)
  np.testing.assert_allclose(ret, [[r0, r1, r2, r3]], rtol=1e-6)
  # Episode cut without termination: bootstrap from the value at step 2.
  r1 = 2 + d * 30
  r0 = 1 + d * ((1 - lam) * 20 + lam * r1)
  ret = behavior.lambda_return(end, none, rew, boot, d, lam)
  np.testing.assert_allclose(ret, [[r0, r1, r2, r3]], rtol=1e-6)
  # The replay value loss skips the last step of an episode (and step T-1).
  val = dists.TwoHot(jnp.zeros((1, 5, 5)), dists.symexp_bins(5))
  loss = behavior.replay_value_loss(
      end, end, rew, boot, val, val, horizon=2, lam=lam, slowreg=1.0)
  assert loss.shape == (1, 4) and float(loss[0, 2]) == 0.0
  assert (np.asarray(loss)[0, [0, 1, 3]] > 0).all()


# --------------------------------------------------------------- agent

def test_discrete_spaces_with_low_use_the_env_range_everywhere():
  obs, act = spaces(token_low=3, action_low=2)
  agent = agentlib.Agent(obs, act, small_config())
  params = agent.init_params(0)
  # Encoder: value low + i is class i.
  onehot = rssm.concat_vectors(
      {'token': obs['token']}, {'token': jnp.array([[3, 6]])}, lambda x: x)
  np.testing.assert_array_equal(onehot, [[1, 0, 0, 0, 0, 0, 0, 1]])
  # Decoder: the target 6 is the last class, its loss is -log p(class 3).
  r = agent.config.agent.rssm
  feat = {'deter': jnp.ones((1, 1, r.deter)),
          'stoch': jnp.ones((1, 1, r.stoch, r.classes)) / r.classes}
  recon = agent.dec.apply({'params': params['dec']}, feat, 2)['token']
  logp = jax.nn.log_softmax(recon.logits, -1)[0, 0]
  loss = recon.loss(jnp.array([[[3, 6]]]))
  assert float(loss[0, 0]) == pytest.approx(
      -float(logp[0, 0] + logp[1, 3]), rel=1e-6)
  assert ((recon.mode() >= 3) & (recon.mode() < 7)).all()
  # Policy: samples and modes are in [2, 5), and all three values occur.
  B = 64
  batch = make_batch(agent, 1, B)
  step_obs = {k: batch[k][0] for k in agent.obs_space}
  actions = {}
  for mode in ('sample', 'greedy'):
    _, action, _ = agent.policy(params, agent.init_carry(B), step_obs,
                                jax.random.PRNGKey(0), mode=mode)
    actions[mode] = set(np.asarray(action['action']).tolist())
  assert actions['sample'] == {2, 3, 4}
  assert actions['greedy'] <= {2, 3, 4}
  # ... and their log-probs (the policy gradient's) use the same classes.
  vec = jnp.zeros((1, agent.feat_size))
  pol = agent.pol.apply({'params': params['pol']}, vec)['action']
  np.testing.assert_allclose(
      [float(pol.logp(jnp.array([v]))[0]) for v in (2, 3, 4)],
      pol.logits[0], rtol=1e-6)


def _tiny_agent(**overrides):
  obs, act = spaces()
  return agentlib.Agent(obs, act, small_config(**overrides))


def test_replay_context_starts_from_the_stored_latent_and_action_of_c_minus_1():
  # With C = 1, a [B, 1 + T] batch must train exactly like C = 0 on the
  # last T steps from the carry (latent and action) stored at step 0.
  agent1 = _tiny_agent(replay_context=1)
  agent0 = _tiny_agent(replay_context=0)
  params = perturbed(agent1.init_params(0))
  state = agent1.init_state(params)
  B, T = 2, 4
  batch = make_batch(agent1, B, 1 + T)
  terms1 = jax.jit(agent1.loss_terms)
  terms0 = jax.jit(agent0.loss_terms)
  base = terms1(params, state, agent1.init_carry(B), batch)
  carry = {'deter': batch['dyn/deter'][:, 0], 'stoch': batch['dyn/stoch'][:, 0],
           'action': {'action': batch['action'][:, 0]}}
  rest = {k: v[:, 1:] for k, v in batch.items()}
  ref = terms0(params, state, carry, rest)
  assert set(base) == set(ref)
  for k in base:
    np.testing.assert_allclose(base[k], ref[k], rtol=1e-5, atol=1e-6,
                               err_msg=k)

  def changed(key, index, value):
    other = {k: np.array(v) for k, v in batch.items()}
    other[key][:, index] = value
    terms = terms1(params, state, agent1.init_carry(B), other)
    return not np.array_equal(terms['dyn'][:, 0], base['dyn'][:, 0])

  # Only the latent and the action of step C - 1 = 0 reach the first step.
  assert changed('dyn/deter', 0, 0.5)
  assert changed('action', 0, (batch['action'][:, 0] + 1) % 3)
  assert not changed('dyn/deter', 1, 0.5)
  assert not changed('dyn/stoch', 1, 0.0)
  assert not changed('action', 1, (batch['action'][:, 1] + 1) % 3)
  assert not changed('action', T, (batch['action'][:, T] + 1) % 3)


# Which parameter groups each loss term trains in upstream: the actor and
# critic see imagined states behind stop_gradient; the replay value,
# reward, continue and decoder losses train the world model's posterior
# path; the KL terms each train one side.
WM = {'enc', 'dyn/core', 'dyn/obs'}
REACH = {
    'policy': {'pol'},
    'value': {'val'},
    'repval': {'val'} | WM,
    'rew': {'rew'} | WM,
    'con': {'con'} | WM,
    'vector': {'dec'} | WM,
    'token': {'dec'} | WM,
    'rep': WM,
    # Later steps reach the posterior through the straight-through stoch
    # sample that feeds the next deter; the first step cannot.
    'dyn': {'dyn/prior'} | WM,
    'dyn@0': {'dyn/prior', 'dyn/core'},
}


def _group(path):
  names = [p.key for p in path]
  if names[0] != 'dyn':
    return names[0]
  for prefix in ('prior', 'obs'):
    if names[1].startswith(prefix):
      return f'dyn/{prefix}'
  return 'dyn/core'  # dynin*, dynhid*, dyngru


def test_each_loss_term_trains_exactly_the_modules_upstream_lets_it():
  # Free nats off, so that no KL entry is clipped to a constant.
  agent = _tiny_agent(**{'agent.rssm.free_nats': 0.0})
  params = perturbed(agent.init_params(0))
  state = agent.init_state(params)
  B, T = 2, 4
  batch = make_batch(agent, B, 1 + T)
  carry = agent.init_carry(B)
  names = sorted(REACH)
  assert set(names) - {'dyn@0'} == set(agent.scales)

  def terms(p):
    losses = agent.loss_terms(p, state, carry, batch)
    losses['dyn@0'] = losses['dyn'][:, :1]
    return jnp.stack([losses[k].mean() for k in names])

  jac = jax.jit(jax.jacrev(terms))(params)
  norms = {}
  for path, x in jax.tree_util.tree_flatten_with_path(jac)[0]:
    x = np.asarray(x).reshape((len(names), -1))
    group = _group(path)
    norms[group] = norms.get(group, 0) + np.square(x).sum(1)
  for i, name in enumerate(names):
    reached = {g for g, n in norms.items() if n[i] > 0}
    assert reached == REACH[name], name


def test_kl_free_nats_in_the_agent_loss():
  B, T = 2, 4
  agent = _tiny_agent(**{'agent.rssm.free_nats': 0.0})
  params = perturbed(agent.init_params(0))
  state = agent.init_state(params)
  batch = make_batch(agent, B, 1 + T)
  carry = agent.init_carry(B)
  raw = jax.jit(agent.loss_terms)(params, state, carry, batch)
  np.testing.assert_allclose(raw['dyn'], raw['rep'], rtol=1e-6)
  # A threshold inside the KL range: entries below it become the threshold.
  nats = float(np.median(raw['dyn']))
  assert (raw['dyn'] < nats - 1e-3).any() and (raw['dyn'] > nats + 1e-3).any()
  agent = _tiny_agent(**{'agent.rssm.free_nats': nats})
  clipped = jax.jit(agent.loss_terms)(params, state, carry, batch)
  for k in ('dyn', 'rep'):
    np.testing.assert_allclose(
        clipped[k], np.maximum(nats, raw[k]), rtol=1e-6)
  # Above every KL, both terms are constant and train nothing.
  agent = _tiny_agent(**{'agent.rssm.free_nats': 1e3})
  kl = lambda p: sum(
      v.mean() for k, v in agent.loss_terms(p, state, carry, batch).items()
      if k in ('dyn', 'rep'))
  value, grads = jax.jit(jax.value_and_grad(kl))(params)
  assert float(value) == 2e3
  assert all((np.asarray(g) == 0).all() for g in jax.tree.leaves(grads))


def test_train_loss_is_the_scaled_sum_of_the_terms_and_slow_critic_mixes_2pct():
  # A large step from the start, so that mixing in the critic from before
  # the update instead of after it would show.
  agent = _tiny_agent(**{'agent.opt.lr': 1e-2, 'agent.opt.warmup': 0})
  cfg = agent.config.agent
  assert (cfg.slowvalue.rate, cfg.slowvalue.every) == (0.02, 1)
  params = perturbed(agent.init_params(0))
  state = agent.init_state(params)
  state['slowval'] = perturbed(state['slowval'], seed=2)
  B, T = 2, 4
  batch = make_batch(agent, B, 1 + T)
  carry = agent.init_carry(B)
  terms = jax.jit(agent.loss_terms)(params, state, carry, batch)
  want = sum(float(v.mean()) * agent.scales[k] for k, v in terms.items())
  for step in range(2):
    slow = jax.tree.map(np.asarray, state['slowval'])
    state, carry, _, mets = agent.train(state, carry, batch)
    if step == 0:
      assert float(mets['opt/loss']) == pytest.approx(want, rel=1e-5)
    expected = jax.tree.map(lambda s, v: 0.98 * s + 0.02 * np.asarray(v),
                            slow, state['params']['val'])
    for a, b in zip(jax.tree.leaves(state['slowval']),
                    jax.tree.leaves(expected)):
      np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_bfloat16_trains_like_float32_from_the_same_params(record_property):
  # bfloat16 compute with float32 params: N updates on the same batches
  # from the same params stay finite, keep float32 params and latents, and
  # track float32's losses and updates. The gaps are recorded (junit XML
  # properties), so a GPU run states them; on a 2-core AMD EPYC they were
  # 0.07-0.7 % per loss and 4-8 % of the update after 8 updates (the
  # tests' XLA flags and XLA's defaults).
  B, T, N = 2, 4, 8
  runs = {}
  for dtype in ('float32', 'bfloat16'):
    agent = _tiny_agent(**{'jax.compute_dtype': dtype})
    params = agent.init_params(0)
    start = jax.tree.map(np.asarray, params)
    state, carry, losses = agent.init_state(params), agent.init_carry(B), []
    for step in range(N):
      state, carry, outs, mets = agent.train(
          state, carry, make_batch(agent, B, 1 + T, seed=step))
      assert all(np.isfinite(float(v)) for v in mets.values()), dtype
      losses.append(float(mets['opt/loss']))
    for x in jax.tree.leaves(state['params']):
      assert x.dtype == jnp.float32 and np.isfinite(x).all()
    assert outs['replay']['dyn/deter'].dtype == jnp.float32
    flat = lambda tree: np.concatenate([x.ravel() for x in jax.tree.leaves(tree)])
    runs[dtype] = (np.array(losses), flat(start), flat(state['params']))
  (loss32, start32, end32), (loss16, start16, end16) = runs.values()
  np.testing.assert_array_equal(start16, start32)
  loss_gap = float(np.max(np.abs(loss16 / loss32 - 1)))
  update_gap = float(np.linalg.norm(end16 - end32)
                     / np.linalg.norm(end32 - start32))
  record_property('updates', N)
  record_property('loss_gap_max', loss_gap)
  record_property('update_gap', update_gap)
  assert loss_gap < 0.03, loss16 / loss32 - 1
  assert update_gap < 0.3
