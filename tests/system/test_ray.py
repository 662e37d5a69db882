"""The run on a Ray cluster (`--script ray`), on a local multi-node cluster
from Ray's own `cluster_utils`: placement over nodes, node loss (env fleets,
then the replay), SIGTERM, and resume; a multi-host learner. Loopback only: Ray is told to use
127.0.0.1 for every node (tests/conftest.py)."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ray = pytest.importorskip('ray')
# One Ray instance at a time where tests run side by side (.ci/run: -n 2
# --dist loadgroup).
pytestmark = pytest.mark.xdist_group('ray')
from ray.cluster_utils import Cluster  # noqa: E402

from dreamer_ver.scripts.ray_cluster import namespace  # noqa: E402
from test_multihost import check_lockstep, wait_for_updates  # noqa: E402

from bench.soaks.watch import logger_step, read_json, wait  # noqa: E402
from helpers import ROOT  # noqa: E402

# The agent fills a node of its own (2 CPUs), so removing another node
# never takes it along; the other components fit on any two nodes.
NODE_CPUS = 2
FLAGS = ['--configs', 'debug', '--task', 'synthetic_bandit',
         '--env.synthetic.length', '20', '--env.synthetic.step_time', '0.005',
         '--run.envs_per_worker', '2', '--run.log_every', '2',
         '--run.save_every', '3', '--ray.agent_cpus', str(NODE_CPUS),
         '--ray.replay_cpus', '0.5', '--ray.logger_cpus', '0.5',
         '--ray.env_cpus', '0.5']
FLEETS = ('env0-1', 'env2-3', 'env4')  # debug: 4 train envs, 1 eval env


@pytest.fixture
def cluster():
  """A head that hosts nothing (the drivers connect there) and three nodes,
  all on 127.0.0.1 (conftest.py)."""
  cluster = Cluster(initialize_head=True, head_node_args={'num_cpus': 0})
  assert cluster.address.startswith('127.0.0.1:'), cluster.address
  for _ in range(3):
    _add_node(cluster)
  cluster.wait_for_nodes()
  ray.init(address=cluster.address)
  yield cluster
  ray.shutdown()
  cluster.shutdown()


def _add_node(cluster, tries=3):
  """`cluster.add_node`, tried again where the node's raylet gave up at
  its start: it waits a hard-coded 15 s for its dashboard agent's port
  file (ray-project/ray issue 65983), which the agent, a Python process
  of its own, can miss on a 2-core machine the other test keeps busy
  ('Timed out waiting for file .../metrics_agent_port_...', then 'The
  current node timed out during startup'). That raylet exits before it
  registers, so the next try starts a clean node."""
  for attempt in range(tries):
    try:
      return cluster.add_node(num_cpus=NODE_CPUS)
    except Exception as error:
      if 'timed out during startup' not in str(error) or attempt + 1 == tries:
        raise
      print(f'[test] a Ray node failed to start ({error}); again', flush=True)


def _driver(cluster, logdir, steps, output, *flags):
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu',
         'PYTHONUNBUFFERED': '1'}
  return subprocess.Popen(
      [sys.executable, '-m', 'dreamer_ver.main', '--script', 'ray',
       '--ray.address', cluster.address, '--logdir', str(logdir),
       '--run.steps', str(steps), *FLAGS, *flags],
      cwd=ROOT, env=env, stdout=output, stderr=subprocess.STDOUT)


def _nodes(logdir, names):
  """{component: node id}; the run's actors live in its own namespace."""
  found = {}
  for name in names:
    try:
      actor = ray.get_actor(name, namespace=namespace(logdir))
      found[name] = ray.get(actor.node.remote(), timeout=10)
    except (ValueError, ray.exceptions.RayError):
      pass  # Not (yet) created, or restarting.
  return found


def _remove_node(cluster, node_id):
  """Removes the node and adds a fresh one, as an autoscaler would."""
  node = next(n for n in cluster.list_all_nodes() if n.node_id == node_id)
  cluster.remove_node(node)
  _add_node(cluster)


def _kill(proc):
  """Cleans up after a failed check: the driver must not outlive the test."""
  if proc.poll() is None:
    proc.kill()
    proc.wait()


def _run_alive(logdir):
  return [a for a in ray.util.list_named_actors(all_namespaces=True)
          if a['namespace'] == namespace(logdir)]


def test_ray_run_survives_node_loss_stops_on_sigterm_and_resumes(
    cluster, tmp_path):
  logdir = tmp_path / 'run'
  log = tmp_path / 'driver.log'
  with log.open('w') as output:
    driver = _driver(cluster, logdir, 10 ** 6, output)
  try:
    # Placement: the fleets are spread over at least two nodes.
    assert wait(lambda: len(_nodes(logdir, FLEETS + ('replay', 'agent')))
                == 5, 120), log.read_text()[-3000:]
    assert wait(lambda: logger_step(logdir) > 100, 240), log.read_text()[-3000:]
    nodes = _nodes(logdir, FLEETS + ('replay', 'agent'))
    fleet_nodes = {nodes[f] for f in FLEETS}
    assert len(fleet_nodes) >= 2, nodes

    # A node with fleets but neither replay nor agent goes away: its fleets
    # come back on other nodes and the run goes on.
    lost = next(n for n in fleet_nodes if n not in (
        nodes['replay'], nodes['agent']))
    moved = [f for f in FLEETS if nodes[f] == lost]
    _remove_node(cluster, lost)
    assert wait(lambda: all(
        _nodes(logdir, moved).get(f, lost) != lost for f in moved), 120)
    step = logger_step(logdir)
    assert wait(lambda: logger_step(logdir) > step + 100, 180), (
        log.read_text()[-3000:])

    # The replay's node goes away: the replay comes back elsewhere from its
    # checkpoint and write-ahead log, and the learner goes on with it.
    _remove_node(cluster, nodes['replay'])
    assert wait(lambda: _nodes(logdir, ['replay']).get(
        'replay', nodes['replay']) != nodes['replay'], 120)
    step = logger_step(logdir)
    assert wait(lambda: logger_step(logdir) > step + 100, 180), (
        log.read_text()[-3000:])
    assert _nodes(logdir, ['agent']).get('agent') == nodes['agent']

    # SIGTERM: every component saves and stops, no actor of the run is left.
    began = time.monotonic()
    driver.send_signal(signal.SIGTERM)
    assert driver.wait(timeout=60) == 0
    assert time.monotonic() - began < 20
    assert wait(lambda: not _run_alive(logdir), 10), _run_alive(logdir)
  finally:
    _kill(driver)
  text = log.read_text()
  assert '[ray] replay started again' in text
  reloaded = text.split('[ray] replay started again')[1]
  loaded = int(reloaded.split('[replay] loaded ')[1].split()[0])
  assert loaded > 0  # Its sequences came back from the logdir.
  saved = _agent_saved(logdir)

  # The same command resumes and stops by itself at run.steps.
  with log.open('w') as output:
    driver = _driver(cluster, logdir, saved + 500, output)
  try:
    assert driver.wait(timeout=300) == 0, log.read_text()[-3000:]
  finally:
    _kill(driver)
  text = log.read_text()
  assert '[logger] resumed at step' in text
  assert _agent_saved(logdir) >= saved + 500  # It went on to run.steps.
  assert not _run_alive(logdir)


def _agent_saved(logdir):
  """The env step of the agent's last save."""
  return read_json(logdir / 'ckpt' / 'counters.json')['steps']



def test_ray_runs_a_learner_per_host_and_restarts_them_together(
    cluster, tmp_path):
  """With jax.processes 2 the driver starts `learner1` beside the agent; it
  finds JAX's coordinator where Ray placed the agent, and both train every
  update together. Its process dies: the agent's collectives fail, the
  agent restarts (Ray), the new learner joins the new agent's coordinator
  and the run ends by itself at run.steps, both at the same params."""
  _add_node(cluster)  # Agent and learner fill one each.
  cluster.wait_for_nodes()
  logdir = tmp_path / 'run'
  log = tmp_path / 'driver.log'
  with log.open('w') as output:
    # At 10 env steps per update past the first ~250, 2,000 steps are ~175
    # updates: the kill lands long before the end, however fast the updates
    # (the 2nd is logged seconds after it ran).
    driver = _driver(cluster, logdir, 2000, output, '--jax.processes', '2')
  try:
    wait_for_updates(logdir, 2)
    nodes = _nodes(logdir, ('agent', 'learner1'))
    learner = ray.get_actor('learner1', namespace=namespace(logdir))
    pid = ray.get(learner.__ray_call__.remote(lambda host: os.getpid()))
    os.kill(pid, signal.SIGKILL)
    assert driver.wait(timeout=300) == 0, log.read_text()[-3000:]
  finally:
    _kill(driver)
  assert len(nodes) == 2 and nodes['agent'] != nodes['learner1'], nodes
  assert not _run_alive(logdir)
  # Each Ray worker writes its own output file (the driver's copy of it
  # may miss the last lines of a run that just ended).
  logs = Path(cluster.head_node.get_logs_dir_path())
  outputs = [path.read_text(errors='replace')
             for path in logs.glob('worker-*.out')]
  learners = [text for text in outputs if 'Learner process 1 of 2' in text]
  assert len(learners) >= 2, learners  # The killed one, the restarted one.
  assert any('[ray] agent started again' in text for text in outputs)
  check_lockstep(logdir, '\n'.join(learners))
