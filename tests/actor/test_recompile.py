"""Nothing traces or compiles after start-up: serving every
bucket with newly published params and new env ids, and training step
after step on the carries the previous step returned, reuse what start-up
compiled. A retrace while serving stalls every env for the compile time; one
while training stalls the learner.

Counted with JAX's own monitoring events: a trace of any jitted function
(`jaxpr_trace_duration`) or a backend compile.
"""

import jax
import jax.numpy as jnp
import numpy as np

from dreamer_ver.actor.actor import Actor
from dreamer_ver.actor.params import ParamsStore
from dreamer_ver.agent import agent as agentlib
from dreamer_ver.rpc.batch_server import Request
from helpers.agent import make_batch, small_config, vector_spaces
from helpers.compiles import EVENTS, compiles

def test_the_counter_sees_a_new_trace():
  with compiles() as seen:
    jax.jit(lambda x: x * 3 + 1)(jnp.arange(5))
  assert any(event == EVENTS[0] for event, _ in seen)


def _requests(agent, envids, step):
  rng = np.random.default_rng(step)
  requests = []
  for envid in envids:
    data = {k: rng.uniform(-1, 1, s.shape).astype(s.dtype)
            if np.issubdtype(s.dtype, np.floating) else np.zeros(s.shape, s.dtype)
            for k, s in agent.obs_space.items()}
    data['is_first'] = np.bool_(step == 0)
    data['envid'] = np.int64(envid)
    requests.append(Request(conn=envid, reqnum=step, data=data, arrival=0.0,
                            envid=envid))
  return requests


def test_serving_and_training_after_start_up_compile_nothing():
  obs_space, act_space = vector_spaces()
  cfg = small_config()
  agent = agentlib.Agent(obs_space, act_space, cfg)
  params = agent.init_params(0)
  store = ParamsStore(params)
  actor = Actor(agent, store, slots=8, buckets=[1, 2, 4, 8])
  state = agent.init_state(jax.tree.map(jnp.copy, params))
  carry = agent.init_carry(cfg.batch_size)
  length = cfg.batch_length + cfg.replay_context
  # Start-up: the actor compiles its buckets, the learner its first step.
  actor.compile()
  state, carry, _, _ = agent.train(state, carry, make_batch(
      agent, cfg.batch_size, length, seed=0))
  with compiles() as seen:
    for step in range(3):
      state, carry, _, mets = agent.train(state, carry, make_batch(
          agent, cfg.batch_size, length, seed=step + 1))
      store.publish(state['params'], step + 1)
      for size in (1, 3, 8, 2):  # every bucket, padded and full
        envids = [(7 * step + i) % 8 for i in range(size)]
        replies, (trans, _) = actor.handle(_requests(agent, envids, step))
        assert not any(isinstance(r, Exception) for r in replies), replies
    assert np.isfinite(float(mets['loss/dyn']))
    assert trans['version'].tolist() == [3, 3]  # the newest params served
  assert seen == []


def test_params_the_learner_publishes_compile_nothing():
  """The learner publishes its params committed to its device (as
  `DataParallel.local` hands them out), the store's first copies came from
  `init_params`: the actor's compiled steps must fit both."""
  obs_space, act_space = vector_spaces()
  agent = agentlib.Agent(obs_space, act_space, small_config())
  params = agent.init_params(0)
  store = ParamsStore(params)  # JAX's default device
  actor = Actor(agent, store, slots=4, buckets=[2, 4])
  actor.compile()
  committed = jax.device_put(agent.init_params(1), jax.devices()[0])
  with compiles() as seen:
    store.publish(committed, 1)
    for size in (2, 4):
      replies, _ = actor.handle(_requests(agent, list(range(size)), 0))
      assert not any(isinstance(r, Exception) for r in replies), replies
  assert seen == []
