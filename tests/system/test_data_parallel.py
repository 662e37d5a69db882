"""The data-parallel learner step is the one-device step on the same global
batch: losses, updated params, returned carry and replay latents agree
within float tolerance on 1, 2 and 4 devices, while the rows really are
split (each device holds B / n of them) and the gradients really are
reduced across devices (an all-reduce in the compiled step). Runs in a
fresh process that splits the CPU into four XLA devices; and across two
processes (`jax.distributed` with CPU collectives over Gloo, as two
hosts would), each feeding only its own half of the rows."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent.parent  # helpers/ for the scripts below
# One worker runs the module (.ci/run: -n 2 --dist loadgroup), so its
# fixture's three compiles run once, not once per worker.
pytestmark = pytest.mark.xdist_group('data_parallel')

SCRIPT = textwrap.dedent('''
    import pickle, sys
    import jax, numpy as np
    sys.path.insert(0, sys.argv[1])
    from helpers.agent import make_batch, small_config, vector_spaces
    from dreamer_ver.agent.agent import Agent
    from dreamer_ver.agent.data_parallel import DataParallel

    B, STEPS = 8, 2
    config = small_config(batch_size=B)
    agent = Agent(*vector_spaces(), config)
    T = config.batch_length + config.replay_context
    results = {}
    for n in (1, 2, 4):
      dp = DataParallel(agent, jax.devices()[:n])
      state = dp.put_state(agent.init_state(agent.init_params(0), 0))
      carry = dp.put_rows(agent.init_carry(B))
      batch = dp.put_rows(make_batch(agent, B, T, seed=0))
      hlo = dp.train.lower(state, carry, batch).compile().as_text()
      losses, replay = [], []
      for step in range(STEPS):
        batch = dp.put_rows(make_batch(agent, B, T, seed=step))
        state, carry, outs, mets = dp.train(state, carry, batch)
        losses.append(float(mets['opt/loss']))
        replay.append(jax.device_get(outs['replay']))
      results[n] = {
          'losses': losses, 'replay': replay,
          'params': jax.device_get(state['params']),
          'carry': jax.device_get(carry),
          'rows_per_device': sorted(
              s.data.shape[0] for s in carry['deter'].addressable_shards),
          'param_devices': {
              len(x.devices()) for x in jax.tree.leaves(state['params'])},
          'all_reduce': 'all-reduce' in hlo,
      }
    with open(sys.argv[2], 'wb') as f:
      pickle.dump(results, f)
''')


MULTI_PROCESS = textwrap.dedent('''
    import pickle, sys
    import jax, numpy as np
    rank, port, tests, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')
    jax.distributed.initialize(f'127.0.0.1:{port}', num_processes=2,
                               process_id=rank)
    sys.path.insert(0, tests)
    from helpers.agent import make_batch, small_config, vector_spaces
    from dreamer_ver.agent.agent import Agent
    from dreamer_ver.agent.data_parallel import DataParallel

    B = 8
    config = small_config(batch_size=B)
    agent = Agent(*vector_spaces(), config)
    T = config.batch_length + config.replay_context
    dp = DataParallel(agent, jax.devices())  # both processes' devices
    half = lambda tree: jax.tree.map(
        lambda x: np.asarray(x)[rank * B // 2:(rank + 1) * B // 2], tree)
    state = dp.put_state(agent.init_state(agent.init_params(0), 0))
    carry = dp.put_rows(half(agent.init_carry(B)))
    losses = []
    for step in range(2):
      batch = dp.put_rows(half(make_batch(agent, B, T, seed=step)))
      state, carry, outs, mets = dp.train(state, carry, batch)
      losses.append(float(mets['opt/loss']))
    with open(out, 'wb') as f:
      pickle.dump({
          'devices': len(jax.devices()), 'losses': losses,
          'params': jax.tree.map(lambda x: np.asarray(x.addressable_data(0)),
                                 state['params']),
          'carry': jax.tree.map(lambda x: np.asarray(x.addressable_data(0)),
                                carry)}, f)
''')


@pytest.fixture(scope='module')
def results(tmp_path_factory):
  out = tmp_path_factory.mktemp('dp') / 'results.pkl'
  # The session's XLA flags (tests/conftest.py) with four CPU devices.
  flags = os.environ.get('XLA_FLAGS', '')
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu',
         'XLA_FLAGS': f'{flags} --xla_force_host_platform_device_count=4'}
  proc = subprocess.run(
      [sys.executable, '-c', SCRIPT, str(TESTS), str(out)],
      env=env, capture_output=True, text=True, timeout=600)
  assert proc.returncode == 0, proc.stderr[-3000:]
  import pickle
  with open(out, 'rb') as f:
    return pickle.load(f)


@pytest.mark.parametrize('n', [2, 4])
def test_n_devices_train_like_one_on_the_same_global_batch(results, n):
  import jax
  import numpy as np
  one, many = results[1], results[n]
  np.testing.assert_allclose(many['losses'], one['losses'], rtol=1e-5)
  close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  jax.tree.map(close, many['params'], one['params'])
  jax.tree.map(close, many['carry'], one['carry'])
  jax.tree.map(close, many['replay'], one['replay'])
  # The training moved the params: agreeing on them is not agreeing on init.
  assert one['losses'][0] != one['losses'][1]


@pytest.mark.parametrize('n', [1, 2, 4])
def test_rows_are_split_params_replicated_gradients_reduced(results, n):
  assert results[n]['rows_per_device'] == [8 // n] * n
  assert results[n]['param_devices'] == {n}
  assert results[n]['all_reduce'] == (n > 1)



def test_two_processes_train_like_one_device(results, tmp_path):
  import jax
  import numpy as np
  from dreamer_ver.rpc.addresses import free_port
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu'}  # the fixture's XLA flags
  port = str(free_port())
  outs = [tmp_path / f'rank{rank}.pkl' for rank in (0, 1)]
  procs = [subprocess.Popen(
      [sys.executable, '-c', MULTI_PROCESS, str(rank), port,
       str(TESTS), str(outs[rank])], env=env,
      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
      for rank in (0, 1)]
  try:
    logs = [proc.communicate(timeout=600)[0] for proc in procs]
  finally:
    for proc in procs:
      proc.kill()
  assert all(p.returncode == 0 for p in procs), logs[0][-2000:] + logs[1][-2000:]
  import pickle
  ranks = [pickle.loads(out.read_bytes()) for out in outs]
  one = results[1]
  close = lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
  for rank, got in enumerate(ranks):
    assert got['devices'] == 2
    np.testing.assert_allclose(got['losses'], one['losses'], rtol=1e-5)
    jax.tree.map(close, got['params'], one['params'])
    # Each process holds the carry of its own rows.
    mine = jax.tree.map(lambda x: x[rank * 4:(rank + 1) * 4], one['carry'])
    jax.tree.map(close, got['carry'], mine)
