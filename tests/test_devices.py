"""`jax.policy_devices` / `jax.train_devices`: the actor's params and carry
table live on one device, the learner's state on another. Run in a fresh
process that splits the CPU into two XLA devices."""

import os
import subprocess
import sys
import textwrap

import pytest

from dreamer_ver import config as configlib
from dreamer_ver.runtime import devices

SCRIPT = textwrap.dedent('''
    import jax, numpy as np
    from dreamer_ver import config as configlib
    from dreamer_ver.agent.agent import Agent, policy_params
    from dreamer_ver.envs import make_env
    from dreamer_ver.runtime import devices
    from dreamer_ver.runtime.actor import Actor
    from dreamer_ver.runtime.params import ParamsStore

    config = configlib.compose(['debug'], {
        'task': 'synthetic_bandit', 'jax.policy_devices': [1],
        'jax.train_devices': [0]})
    policy_device, train_device = devices.setup(config)
    env = make_env(config.task, config.env)
    agent = Agent(env.obs_space, env.act_space, config)
    state = jax.device_put(agent.init_state(agent.init_params(0), 0),
                           train_device)
    store = ParamsStore(policy_params(state['params']), 0,
                        device=policy_device)
    actor = Actor(agent, store, slots=2, buckets=[1, 2])
    actor.compile()
    obs = {k: np.zeros(s.shape, s.dtype) for k, s in env.obs_space.items()
           if not k.startswith('log/')}
    obs['is_first'] = np.bool_(True)
    actor.step([{**obs, 'envid': np.int64(0)}])
    where = lambda tree: {d.id for x in jax.tree.leaves(tree)
                          for d in x.devices()}
    print('table', where(actor.table), 'state', where(state['params']),
          'store', where(store.latest()[0]))
''')


def test_actor_and_learner_on_their_own_devices():
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu',
         'XLA_FLAGS': '--xla_force_host_platform_device_count=2'}
  proc = subprocess.run([sys.executable, '-c', SCRIPT], env=env,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert 'table {1} state {0} store {1}' in proc.stdout, proc.stdout


def test_a_device_index_that_does_not_exist_is_a_clear_error():
  config = configlib.compose(['debug'], {'jax.policy_devices': [7]})
  with pytest.raises(ValueError, match='jax.policy_devices names device 7, '
                     'but this process has 1 cpu device'):
    devices.setup(config)
