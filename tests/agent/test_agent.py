"""The agent's numerics and API, on tiny CPU configs."""

import elements
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from dreamer_ver.config import loading as configlib
from dreamer_ver.agent import agent as agentlib
from dreamer_ver.agent import behavior, checkpoint, dists, nets, optim
from dreamer_ver.envs.dummy import Dummy
from helpers.agent import make_batch, small_config, vector_spaces

f32 = np.float32


@pytest.fixture(scope='module')
def dummy_agent():
  env = Dummy('disc')
  agent = agentlib.Agent(env.obs_space, env.act_space, small_config())
  return env, agent, agent.init_params(0)


# ------------------------------------------------------------ numerics

def test_symlog_symexp_round_trip():
  x = jnp.array([-1e6, -10.0, -1.0, 0.0, 0.5, 3.0, 1e6])
  np.testing.assert_allclose(nets.symexp(nets.symlog(x)), x, rtol=1e-5)
  assert float(nets.symlog(jnp.float32(np.e - 1))) == pytest.approx(1.0)


def test_twohot_round_trip_and_zero_init():
  bins = dists.symexp_bins(255)
  assert bins.shape == (255,) and float(bins[127]) == 0.0
  np.testing.assert_array_equal(bins, -bins[::-1])
  # Uniform logits predict exactly zero thanks to the symmetric sum.
  assert float(dists.TwoHot(jnp.zeros(255), bins).pred()) == 0.0
  for target in [-123.4, -1.0, 0.0, 0.37, 5.0, 2500.0]:
    # d loss / d logits = softmax - twohot, so the gradient at uniform logits
    # exposes the two-hot encoding; its expectation over bins is the target.
    loss = lambda l: dists.TwoHot(l, bins).loss(jnp.float32(target))
    twohot = 1 / 255 - jax.grad(loss)(jnp.zeros(255))
    assert (twohot > -1e-6).all() and int((twohot > 1e-6).sum()) <= 2
    assert float(twohot.sum()) == pytest.approx(1.0, abs=1e-5)
    assert float((twohot * bins).sum()) == pytest.approx(target, rel=1e-4, abs=1e-4)
    # Logits concentrated on that encoding predict the target.
    pred = dists.TwoHot(jnp.log(twohot + 1e-30), bins).pred()
    assert float(pred) == pytest.approx(target, rel=1e-3, abs=1e-3)


def test_one_exp_softmax_pair_and_mirrored_pred_match_their_direct_forms():
  logits = 8 * jax.random.normal(jax.random.PRNGKey(3), (6, 255))
  logits = logits.at[0, :3].set(-1e4)  # far apart: log(softmax) underflows
  probs, logp = dists.softmax_and_log(logits)
  np.testing.assert_allclose(probs, jax.nn.softmax(logits), rtol=1e-5, atol=1e-7)
  np.testing.assert_allclose(logp, jax.nn.log_softmax(logits), rtol=1e-5, atol=1e-4)
  assert np.isfinite(logp).all()
  # Gradients through both outputs, against jax.nn's.
  weights = jax.random.normal(jax.random.PRNGKey(4), (2, 6, 255))
  ours = lambda l: sum((w * o).sum() for w, o in zip(weights, dists.softmax_and_log(l)))
  theirs = lambda l: ((weights[0] * jax.nn.softmax(l)).sum() +
                      (weights[1] * jax.nn.log_softmax(l)).sum())
  np.testing.assert_allclose(jax.grad(ours)(logits), jax.grad(theirs)(logits),
                             rtol=1e-4, atol=1e-5)
  # Unimix: probs and log-probs of the mixture.
  mixed, logmixed = dists.mix_uniform(logits[:, :4], 0.01)
  expect = 0.99 * jax.nn.softmax(logits[:, :4]) + 0.0025
  np.testing.assert_allclose(mixed, expect, rtol=1e-6)
  np.testing.assert_allclose(logmixed, np.log(expect), rtol=1e-5, atol=1e-6)
  # The prediction is the expectation over all bins (float64 reference), for
  # an odd and an even number of bins.
  for num in (255, 16):
    bins = dists.symexp_bins(num)
    dist = dists.TwoHot(logits[:, :num] / 4, bins)
    expect = (np.asarray(dist.probs, np.float64) * np.asarray(bins, np.float64)).sum(-1)
    np.testing.assert_allclose(dist.pred(), expect, rtol=1e-4, atol=1e-4)
    assert float(dists.TwoHot(jnp.zeros(num), bins).pred()) == 0.0


def test_free_nats_clip_small_kls_to_one_and_leave_large_ones():
  cfg = small_config().agent.rssm
  logits = jax.random.normal(jax.random.PRNGKey(0), (4, 2, 4))
  same = dists.OneHot(logits, cfg.unimix, 1)
  assert np.allclose(same.kl(same), 0.0, atol=1e-6)
  assert np.allclose(jnp.maximum(cfg.free_nats, same.kl(same)), 1.0)
  far = dists.OneHot(logits * 30, cfg.unimix, 1)
  kl = far.kl(dists.OneHot(-logits * 30, cfg.unimix, 1))
  assert (kl > 1.0).all()
  np.testing.assert_allclose(jnp.maximum(1.0, kl), kl)


def test_lambda_return_matches_hand_computation_and_stops_at_terminal():
  rew = jnp.array([[0.0, 1.0, 2.0, 3.0]])
  boot = jnp.array([[10.0, 20.0, 30.0, 40.0]])
  zeros = jnp.zeros_like(rew)
  disc, lam = 0.5, 0.5
  ret = behavior.lambda_return(zeros, zeros, rew, boot, disc, lam)
  r2 = 3.0 + disc * 40.0
  r1 = 2.0 + disc * ((1 - lam) * 30.0 + lam * r2)
  r0 = 1.0 + disc * ((1 - lam) * 20.0 + lam * r1)
  np.testing.assert_allclose(ret, [[r0, r1, r2]], rtol=1e-6)
  # A terminal at step 2 zeroes the bootstrap from there on.
  term = jnp.array([[0.0, 0.0, 1.0, 0.0]])
  ret = behavior.lambda_return(zeros, term, rew, boot, disc, lam)
  assert float(ret[0, 1]) == pytest.approx(2.0)


def test_percentile_norm_floor_and_ema():
  state = {'lo': jnp.float32(0), 'hi': jnp.float32(0)}
  vals = jnp.arange(101, dtype=jnp.float32)
  state, scale = behavior.percentile_norm(state, vals, 0.5, 1.0, 5.0, 95.0)
  assert float(state['lo']) == pytest.approx(2.5)
  assert float(state['hi']) == pytest.approx(47.5)
  assert float(scale) == pytest.approx(45.0)
  state, scale = behavior.percentile_norm(
      {'lo': jnp.float32(0), 'hi': jnp.float32(0)}, vals * 0, 0.5, 1.0, 5.0, 95.0)
  assert float(scale) == 1.0  # floor at `limit`


def test_optimizer_matches_numpy_reference():
  params = {'a': jnp.array([1.0, -2.0, 0.5]), 'b': jnp.array([[0.01]])}
  grads = [{'a': jnp.array([0.3, 0.1, -4.0]), 'b': jnp.array([[5.0]])},
           {'a': jnp.array([-0.2, 0.0, 1.0]), 'b': jnp.array([[-1.0]])}]
  lr, agc, eps, b1, b2, warmup = 0.1, 0.3, 1e-20, 0.9, 0.999, 4
  opt = optim.make_optimizer(lr, agc, eps, b1, b2, warmup)
  state = opt.init(params)
  ref = {k: np.asarray(v, np.float64) for k, v in params.items()}
  nu = {k: 0 * v for k, v in ref.items()}
  mu = {k: 0 * v for k, v in ref.items()}
  p = params
  for t, g in enumerate(grads, 1):
    updates, state = opt.update(g, state, p)
    p = jax.tree.map(jnp.add, p, updates)
    for k in ref:
      gk = np.asarray(g[k], np.float64)
      upper = agc * max(1e-3, np.linalg.norm(ref[k]))
      gk = gk / max(1.0, np.linalg.norm(gk) / upper)
      nu[k] = b2 * nu[k] + (1 - b2) * gk ** 2
      gk = gk / (np.sqrt(nu[k] / (1 - b2 ** t)) + eps)
      mu[k] = b1 * mu[k] + (1 - b1) * gk
      step_lr = lr * (t - 1) / warmup  # linear warm-up starts at 0
      ref[k] = ref[k] - step_lr * mu[k] / (1 - b1 ** t)
  for k in ref:
    np.testing.assert_allclose(p[k], ref[k], rtol=1e-5, atol=1e-7)
  assert not np.allclose(p['a'], params['a'])


# ------------------------------------------------------------- modules

def test_encoder_decoder_and_heads_output_expected_shapes_and_dtypes(dummy_agent):
  env, agent, params = dummy_agent
  B, T = 2, 3
  batch = make_batch(agent, B, T)
  obs = {k: batch[k] for k in agent.model_space}
  tokens = agent.enc.apply({'params': params['enc']}, obs, 2)
  assert tokens.shape[:2] == (B, T) and tokens.dtype == jnp.float32
  r = agent.config.agent.rssm
  feat = {'deter': jnp.zeros((B, T, r.deter)),
          'stoch': jnp.zeros((B, T, r.stoch, r.classes))}
  recons = agent.dec.apply({'params': params['dec']}, feat, 2)
  assert set(recons) == set(agent.model_space)
  assert recons['image'].pred().shape == (B, T, 64, 64, 3)
  assert recons['vector'].pred().shape == (B, T, 7)
  assert recons['token'].logits.shape == (B, T, 256)
  assert recons['int2d'].logits.shape == (B, T, 2, 3, 4)
  for k, recon in recons.items():
    assert recon.loss(jnp.asarray(batch[k][..., :] if k != 'image' else
                      batch[k] / 255)).shape == (B, T), k
  vec = agent._featvec(feat)
  assert vec.shape == (B, T, agent.feat_size)
  rew = agent.rew.apply({'params': params['rew']}, vec)
  assert rew.pred().shape == (B, T) and rew.pred().dtype == jnp.float32
  # A zero-init output layer: uniform bins, whose mean is 0 up to the
  # rounding of a summation order (a GPU's differs from a CPU's).
  np.testing.assert_allclose(rew.pred(), 0.0, atol=1e-6)
  val = agent.val.apply({'params': params['val']}, vec)
  np.testing.assert_allclose(val.pred(), 0.0, atol=1e-6)
  con = agent.con.apply({'params': params['con']}, vec)
  assert con.prob().shape == (B, T)
  pol = agent.pol.apply({'params': params['pol']}, vec)
  key = jax.random.PRNGKey(0)
  assert pol['act_disc'].sample(key).shape == (B, T)
  assert pol['act_disc'].sample(key).dtype == jnp.int32
  assert pol['act_cont'].sample(key).shape == (B, T, 6)
  assert pol['act_cont'].entropy().shape == (B, T)
  # Unimix keeps every discrete action's probability >= 1% / classes.
  assert float(pol['act_disc'].probs.min()) >= 0.01 / 5 - 1e-7


def test_size1m_param_count_matches_upstream():
  env = Dummy('disc')
  cfg = configlib.compose(['size1m'])
  agent = agentlib.Agent(env.obs_space, env.act_space, cfg)
  shapes = jax.eval_shape(agent.init_params, 0)
  count = agent.param_count(shapes)
  assert count == 789_431, count  # upstream's optimizer summary, exactly


# -------------------------------------------------------------- policy

def _policy_obs(env, B, rng):
  obs = {}
  for k, s in env.obs_space.items():
    if s.dtype == bool:
      obs[k] = np.zeros((B,), bool)
    elif np.issubdtype(s.dtype, np.integer):
      obs[k] = rng.integers(0, nets.num_classes(s), (B, *s.shape)).astype(s.dtype)
    else:
      obs[k] = rng.uniform(0, 255 if s.dtype == np.uint8 else 1, (B, *s.shape)).astype(s.dtype)
  return obs


def test_policy_rows_are_independent(dummy_agent):
  env, agent, params = dummy_agent
  B = 4
  rng = np.random.default_rng(1)
  obs = _policy_obs(env, B, rng)
  key = jax.random.PRNGKey(3)
  carry = agent.init_carry(B)
  carry, _, _ = agent.policy(params, carry, obs, key)
  base, act, outs = agent.policy(params, carry, obs, key, mode='greedy')
  perturbed = dict(carry)
  perturbed['deter'] = carry['deter'].at[2].add(1.0)
  new, act2, outs2 = agent.policy(params, perturbed, obs, key, mode='greedy')
  changed = np.abs(np.asarray(new['deter'] - base['deter'])).sum(-1) > 0
  np.testing.assert_array_equal(changed, [False, False, True, False])
  # Row 2's stoch is a sample with a fixed key and need not move with its
  # deter; the other rows must not move at all.
  for k in ('dyn/deter', 'dyn/stoch'):
    same = np.asarray(outs[k]) == np.asarray(outs2[k])
    assert same[[0, 1, 3]].all(), k


def test_policy_is_first_resets_exactly_marked_rows(dummy_agent):
  env, agent, params = dummy_agent
  B = 4
  rng = np.random.default_rng(2)
  obs = _policy_obs(env, B, rng)
  key = jax.random.PRNGKey(4)
  fresh, _, _ = agent.policy(params, agent.init_carry(B), dict(
      obs, is_first=np.ones(B, bool)), key, mode='greedy')
  # A carry with garbage in every row: rows marked is_first must match a
  # fresh start exactly, the other rows must not.
  carry = jax.tree.map(lambda x: x + 3 if x.dtype != jnp.int32 else x + 1,
                       agent.init_carry(B))
  marked = np.array([True, False, True, False])
  out, _, _ = agent.policy(params, carry, dict(obs, is_first=marked), key,
                           mode='greedy')
  equal = np.all(np.asarray(out['deter']) == np.asarray(fresh['deter']), -1)
  np.testing.assert_array_equal(equal, marked)


# --------------------------------------------------------------- train

def test_world_model_overfits_fixed_batch():
  obs_space, act_space = vector_spaces()
  cfg = small_config(**{
      'agent.opt.lr': 3e-3, 'agent.opt.warmup': 0,
      'agent.rssm.deter': 32, 'agent.rssm.hidden': 32, '.*\\.units': 32})
  agent = agentlib.Agent(obs_space, act_space, cfg)
  state = agent.init_state(agent.init_params(0))
  batch = make_batch(agent, 4, cfg.batch_length + cfg.replay_context)
  batch['reward'] = np.round(batch['reward'] * 2)
  carry = agent.init_carry(4)
  wm_keys = ['loss/vector', 'loss/rew', 'loss/con']
  history = []
  for _ in range(300):
    state, carry, outs, mets = agent.train(state, carry, batch)
    history.append(sum(float(mets[k]) for k in wm_keys))
  assert np.isfinite(history).all()
  first, last = np.mean(history[:5]), np.mean(history[-5:])
  assert last < first / 5, (first, last)
  # Params stay finite and the train outs carry fresh latents per step.
  assert all(np.isfinite(x).all() for x in jax.tree.leaves(state['params']))
  T = cfg.batch_length
  assert outs['replay']['dyn/deter'].shape == (4, T, 32)
  assert np.abs(outs['replay']['dyn/deter']).sum() > 0


def test_train_and_report_on_all_encoder_paths(dummy_agent):
  env, agent, params = dummy_agent
  cfg = agent.config
  state = agent.init_state(jax.tree.map(jnp.copy, params))
  batch = make_batch(agent, cfg.batch_size, cfg.batch_length + cfg.replay_context)
  before = jax.tree.map(np.asarray, state['params'])
  state, carry, outs, mets = agent.train(state, agent.init_carry(cfg.batch_size), batch)
  assert int(state['step']) == 1
  for k in ['loss/image', 'loss/vector', 'loss/token', 'loss/count',
            'loss/float2d', 'loss/int2d', 'loss/dyn', 'loss/rep', 'loss/rew',
            'loss/con', 'loss/policy', 'loss/value', 'loss/repval']:
    assert np.isfinite(float(mets[k])), k
  assert float(mets['opt/param_count']) == agent.param_count(before)
  report = agent.report(state, batch)
  assert 'loss/image' in report and 'openloop/image_mse' in report
  assert np.isfinite(float(report['openloop/image_mse']))


def test_agent_ignores_log_keys_that_batches_do_not_carry():
  # dmc proprio renders `log/image` for videos; the replay server drops
  # `log/` keys, so training must not look for them.
  obs_space, act_space = vector_spaces()
  cfg = small_config()
  plain = agentlib.Agent(obs_space, act_space, cfg)
  logged = agentlib.Agent(
      {**obs_space, 'log/image': elements.Space(np.uint8, (8, 8, 3))},
      act_space, cfg)
  assert 'log/image' not in logged.obs_space
  batch = make_batch(plain, cfg.batch_size, cfg.batch_length + cfg.replay_context)
  state = logged.init_state(logged.init_params(0))
  state, _, _, mets = logged.train(state, logged.init_carry(cfg.batch_size), batch)
  assert int(state['step']) == 1 and np.isfinite(float(mets['loss/vector']))


def test_save_load_round_trip_is_exact(tmp_path):
  obs_space, act_space = vector_spaces()
  cfg = small_config()
  agent = agentlib.Agent(obs_space, act_space, cfg)
  state = agent.init_state(agent.init_params(0))
  batch = make_batch(agent, cfg.batch_size, cfg.batch_length + cfg.replay_context)
  carry = agent.init_carry(cfg.batch_size)
  state, carry, _, _ = agent.train(state, carry, batch)
  checkpoint.save(state, tmp_path / 'agent.npz')
  template = agent.init_state(agent.init_params(1))
  loaded = checkpoint.load(tmp_path / 'agent.npz', template)
  for a, b in zip(jax.tree.leaves(state), jax.tree.leaves(loaded)):
    np.testing.assert_array_equal(a, b)
  # The next train step and a policy step agree bit for bit.
  s1, _, _, m1 = agent.train(jax.tree.map(jnp.copy, state), carry, batch)
  s2, _, _, m2 = agent.train(loaded, carry, batch)
  for a, b in zip(jax.tree.leaves(s1), jax.tree.leaves(s2)):
    np.testing.assert_array_equal(a, b)
  assert float(m1['opt/loss']) == float(m2['opt/loss'])


def test_load_rejects_other_config(tmp_path):
  obs_space, act_space = vector_spaces()
  small = agentlib.Agent(obs_space, act_space, small_config())
  checkpoint.save(small.init_state(small.init_params(0)), tmp_path / 'a.npz')
  other = agentlib.Agent(obs_space, act_space,
                         small_config(**{'agent.rssm.deter': 16}))
  with pytest.raises(checkpoint.CheckpointMismatch, match=r"\['dyn'\]"):
    checkpoint.load(tmp_path / 'a.npz', other.init_state(other.init_params(0)))


def test_latents_go_back_to_replay_only_when_a_context_reads_them():
  obs_space, act_space = vector_spaces()
  for context in (0, 1):
    cfg = small_config(replay_context=context)
    agent = agentlib.Agent(obs_space, act_space, cfg)
    state = agent.init_state(agent.init_params(0))
    batch = make_batch(agent, 2, cfg.batch_length + context)
    outs = agent.train(state, agent.init_carry(2), batch)[2]
    assert ('replay' in outs) == bool(context)
