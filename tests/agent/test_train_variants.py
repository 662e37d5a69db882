"""The learner's speed variants change no number the agent learns: K updates
fused into one compiled call (`train_many`), and unrolled scans
(`agent.scan_unroll`), each against K plain `train` calls from the same
state, carry and batches, in float32 on the CPU."""

import jax
import numpy as np
import pytest

from dreamer_ver.agent import agent as agentlib
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
                         small_config(**{'agent.scan_unroll': 4}))
  assert_close(plain_updates(agent, batches), want)
