"""`jax.policy_devices` / `jax.train_devices`: the actor's params and carry
tables live on the policy devices (one lane each), the learner's state on
the train device. Run in a fresh process that splits the CPU into two XLA
devices."""

import os
import subprocess
import sys
import textwrap

import pytest

from dreamer_ver.config import loading as configlib
from dreamer_ver.config import validation
from dreamer_ver.cluster import devices

SCRIPT = textwrap.dedent('''
    import sys
    import jax, numpy as np
    from dreamer_ver.config import loading as configlib
    from dreamer_ver.agent.agent import Agent, policy_params
    from dreamer_ver.envs import make_env
    from dreamer_ver.cluster import devices
    from dreamer_ver.actor.actor import Actor
    from dreamer_ver.actor.params import ParamsStore

    config = configlib.compose(['debug'], {
        'task': 'synthetic_bandit',
        'jax.policy_devices': [int(i) for i in sys.argv[1:]],
        'jax.train_devices': [0]})
    policy_devices, (train_device,) = devices.setup(config)
    env = make_env(config.task, config.env)
    agent = Agent(env.obs_space, env.act_space, config)
    state = jax.device_put(agent.init_state(agent.init_params(0), 0),
                           train_device)
    store = ParamsStore(policy_params(state['params']), 0,
                        devices=policy_devices)
    actor = Actor(agent, store, slots=2, buckets=[1, 2])
    actor.compile()
    obs = {k: np.zeros(s.shape, s.dtype) for k, s in env.obs_space.items()
           if not k.startswith('log/')}
    obs['is_first'] = np.bool_(True)
    where = lambda tree: {d.id for x in jax.tree.leaves(tree)
                          for d in x.devices()}
    for lane in actor.lanes:
      trans = actor.step([{**obs, 'envid': np.int64(0)}], lane.index)
      assert trans['action'].shape == (1,)
      print(f'lane {lane.index}: table', where(lane.table),
            'store', where(store.latest(lane.index)[0]))
    print('state', where(state['params']))
''')


@pytest.mark.parametrize('policy,expected', [
    ([1], ['lane 0: table {1} store {1}', 'state {0}']),
    ([1, 0], ['lane 0: table {1} store {1}', 'lane 1: table {0} store {0}',
              'state {0}']),
])
def test_actor_lanes_and_learner_on_their_own_devices(policy, expected):
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu',
         'XLA_FLAGS': '--xla_force_host_platform_device_count=2'}
  proc = subprocess.run(
      [sys.executable, '-c', SCRIPT, *map(str, policy)], env=env,
      capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  lines = [line for line in proc.stdout.splitlines()
           if line.startswith(('lane', 'state'))]
  assert lines == expected, proc.stdout


PUBLISH_SCRIPT = textwrap.dedent('''
    import jax, jax.numpy as jnp, numpy as np
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
    from dreamer_ver.actor.params import ParamsStore

    mesh = Mesh(np.array(jax.devices()), ('data',))
    params = {'w': jax.device_put(jnp.arange(4.0), NamedSharding(mesh, P()))}
    store = ParamsStore({'w': jnp.zeros(4)}, devices=jax.devices())
    store.publish(params, 1)
    # The learner's next step donates its params.
    jax.jit(lambda p: jax.tree.map(lambda x: x + 1, p), donate_argnums=0)(params)
    for lane in range(2):
      copy, version = store.latest(lane)
      print(lane, version, copy['w'].devices(), np.asarray(copy['w'] * 2))
''')


def test_published_params_outlive_the_learners_replicated_buffers():
  """The learner's params are replicated over its train devices; a policy
  device among them must still get a copy of its own, not the learner's
  shard, which the next train step donates."""
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu',
         'XLA_FLAGS': '--xla_force_host_platform_device_count=2'}
  proc = subprocess.run([sys.executable, '-c', PUBLISH_SCRIPT], env=env,
                        capture_output=True, text=True, timeout=300)
  assert proc.returncode == 0, proc.stderr[-3000:]
  assert proc.stdout.splitlines() == [
      '0 1 {CpuDevice(id=0)} [0. 2. 4. 6.]',
      '1 1 {CpuDevice(id=1)} [0. 2. 4. 6.]'], proc.stdout


def test_a_device_index_that_does_not_exist_is_a_clear_error():
  config = configlib.compose(['debug'], {'jax.policy_devices': [7]})
  with pytest.raises(ValueError, match='jax.policy_devices names device 7, '
                     'but this process has 1 cpu device'):
    devices.setup(config)


def test_a_policy_device_named_twice_is_a_clear_error():
  with pytest.raises(ValueError, match='jax.policy_devices names a device twice'):
    validation.validate(
        configlib.compose(['debug'], {'jax.policy_devices': [0, 0]}))


@pytest.mark.parametrize('overrides,message', [
    ({'jax.train_devices': [1, 1]}, 'jax.train_devices names a device twice'),
    ({'batch_size': 6, 'jax.train_devices': [0, 1, 2, 3]},
     r'batch_size \(6\) must be a multiple of the number of train devices '
     r'\(4: jax.train_devices times jax.processes\)'),
    ({'batch_size': 6, 'jax.train_devices': [0, 1], 'jax.processes': 2,
      'jax.coordinator': 'a:1', 'run.replay_addr': 'b:2'},
     r'batch_size \(6\) must be a multiple of the number of train devices '
     r'\(4'),
    ({'script': 'train', 'jax.train_devices': [0, 1]},
     "script 'train' trains on one device"),
    ({'script': 'train', 'jax.processes': 2, 'jax.coordinator': 'a:1'},
     "script 'train' trains on one device"),
    ({'script': 'eval_only', 'jax.processes': 2, 'jax.coordinator': 'a:1'},
     "script 'eval_only' runs in one process"),
    ({'script': 'ray', 'jax.processes': 2, 'jax.process_id': 1},
     "script 'ray' starts every learner process itself"),
    ({'jax.processes': 2, 'run.replay_addr': 'b:2'},
     r'jax.coordinator \(host:port of process 0\) is required'),
    ({'jax.processes': 2, 'jax.process_id': 2, 'jax.coordinator': 'a:1'},
     r'jax.process_id must be in \[0, jax.processes\)'),
    ({'jax.processes': 2, 'jax.coordinator': 'a:1'},
     'run.replay_addr needs an explicit port'),
    ({'script': 'parallel_learner', 'jax.processes': 2,
      'jax.coordinator': 'a:1', 'run.replay_addr': 'b:2'},
     r"process 0 is the agent .*\(got script 'parallel_learner'\)"),
    ({'script': 'parallel_agent', 'jax.processes': 2, 'jax.process_id': 1,
      'jax.coordinator': 'a:1', 'run.actor_addr': 'a:3',
      'run.replay_addr': 'b:2', 'run.logger_addr': 'a:4'},
     "the others run parallel_learner .*got script 'parallel_agent'"),
])
def test_train_devices_and_processes_that_cannot_share_the_batch_are_a_clear_error(
    overrides, message):
  with pytest.raises(ValueError, match=message):
    validation.validate(configlib.compose(['debug'], overrides))


CACHE_SCRIPT = textwrap.dedent('''
    import sys
    import jax, jax.numpy as jnp
    from dreamer_ver.config import loading as configlib
    from dreamer_ver.cluster import devices

    def run(logdir, cache, scale):
      devices.setup(configlib.compose(['debug'], {
          'logdir': logdir, 'jax.compile_cache': cache}))
      print('dir', jax.config.jax_compilation_cache_dir)
      jax.jit(lambda x: x * scale + 1)(jnp.arange(5.0)).block_until_ready()

    first, second = sys.argv[1:]
    run(first, 'jax_cache', 2.0)   # relative: inside the logdir
    run(second, 'jax_cache', 3.0)  # a second run in one process moves it
    run(second, '', 4.0)           # off
    run('', 'jax_cache', 5.0)      # no logdir: off, not the working dir
''')


def test_the_compile_cache_lives_in_the_logdir_and_a_restart_hits_it(
    tmp_path):
  first, second = tmp_path / 'first', tmp_path / 'second'
  cwd = tmp_path / 'cwd'
  cwd.mkdir()

  # Without the test session's shared cache, which would replace the logdir's.
  env = {k: v for k, v in os.environ.items() if k != 'JAX_COMPILATION_CACHE_DIR'}
  env['JAX_PLATFORMS'] = 'cpu'

  def run():
    proc = subprocess.run(
        [sys.executable, '-c', CACHE_SCRIPT, str(first), str(second)],
        env=env, cwd=cwd,
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run.stderr = proc.stderr
    return [line for line in proc.stdout.splitlines() if line.startswith('dir')]

  entries = lambda folder: sorted(
      p.name for p in folder.glob('*') if p.name.endswith('-cache'))
  assert run() == [f'dir {first / "jax_cache"}', f'dir {second / "jax_cache"}',
                   'dir None', 'dir None']
  written = entries(first / 'jax_cache'), entries(second / 'jax_cache')
  assert written[0] and written[1]  # each run's programs, in its own logdir
  assert not list(cwd.iterdir())
  # The same programs again in a new process (a restart) are found in the
  # cache: nothing new is compiled, so nothing new is written.
  run()
  assert (entries(first / 'jax_cache'), entries(second / 'jax_cache')) == written
  # A damaged entry (a flipped byte) is one line and goes; the program is
  # compiled and written again, so the next start reads it without a word.
  for name in written[0]:
    path = first / 'jax_cache' / name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
  run()
  lines = run.stderr.splitlines()
  assert len(lines) == len(written[0]), lines
  assert all(line.startswith('Removed the unreadable compile cache entry ')
             and line.endswith('; it is compiled again.') for line in lines)
  assert entries(first / 'jax_cache') == written[0]
  run()
  assert 'compile cache' not in run.stderr, run.stderr


def test_jax_compilation_cache_dir_replaces_the_logdir_cache_but_not_off(
    tmp_path, monkeypatch):
  import jax
  shared = tmp_path / 'shared'
  monkeypatch.setenv('JAX_COMPILATION_CACHE_DIR', str(shared))
  before = jax.config.jax_compilation_cache_dir
  try:
    devices._compile_cache(configlib.compose(['debug'], {
        'logdir': str(tmp_path / 'run'), 'jax.compile_cache': 'jax_cache'}))
    assert jax.config.jax_compilation_cache_dir == str(shared)
    devices._compile_cache(configlib.compose(['debug'], {
        'logdir': str(tmp_path / 'run'), 'jax.compile_cache': ''}))
    assert jax.config.jax_compilation_cache_dir is None
  finally:
    from jax.experimental.compilation_cache import compilation_cache
    compilation_cache.reset_cache()
    jax.config.update('jax_compilation_cache_dir', before)


@pytest.mark.parametrize('coordinator, bind_host, expected', [
    ('localhost:4321', '', '127.0.0.1:4321'),
    ('127.0.0.1:4321', '', '127.0.0.1:4321'),
    ('10.1.2.3:4321', '0.0.0.0', '0.0.0.0:4321'),
])
def test_the_jax_coordinator_binds_where_the_run_binds(
    monkeypatch, coordinator, bind_host, expected):
  import jax
  joined = {}

  def initialize(*args, **kwargs):
    joined.update(kwargs)
    raise RuntimeError('stop here')

  monkeypatch.setattr(jax.distributed, 'initialize', initialize)
  monkeypatch.setattr(jax.config, 'update', lambda *a: None)
  config = configlib.compose(['debug'], {
      'jax.processes': 2, 'jax.coordinator': coordinator,
      'run.bind_host': bind_host, 'jax.compile_cache': ''})
  with pytest.raises(RuntimeError, match='stop here'):
    devices.setup(config)
  assert joined['coordinator_bind_address'] == expected


def test_a_learner_process_needs_only_the_replay_address():
  validation.validate(configlib.compose(['debug'], {
      'script': 'parallel_learner', 'jax.processes': 2, 'jax.process_id': 1,
      'jax.coordinator': 'a:1', 'run.replay_addr': 'b:2'}))


def test_the_ray_script_picks_the_coordinator_itself():
  validation.validate(configlib.compose(['debug'], {
      'script': 'ray', 'jax.processes': 2}))
