"""The ray script: a whole run on a Ray cluster.

    dreamer-ver --script ray --configs dmc_proprio --logdir /shared/run1 \\
        --ray.address auto

Ray is the control plane: it places the logger, the replay, the agent
(actor + learner, on a GPU when the cluster has one), with `jax.processes`
> 1 the other learner processes of a multi-host learner (`learner1`, ...;
placed like the agent and spread over the nodes), one env fleet per
`run.envs_per_worker` envs and, with `run.eval_every`, the agent's eval
worker (`evaluation/worker.py`; the agent creates it, so it goes when
the agent goes), restarts whatever dies (on another node when a node is
gone), and tells the components where the others serve: the learners find
JAX's coordinator where the agent's Host serves it. The data
plane stays on our sockets: envs ask the actor for actions, transitions and
samples travel between agent and replay exactly as in `--script parallel`
(`bench/system/ray_bench.py` measures why). This driver assigns every fleet's
env ids, so fleets never collide, and passes the run token to everyone.

Every component resumes from the logdir after a restart, so the logdir must
be on storage that every node sees (NFS, a shared volume). The run stops at
`run.steps`, or on SIGINT/SIGTERM to this driver: every component saves and
stops, and the run's Ray actors are removed. A rerun with the same logdir
resumes. Ray itself is imported only by this script (`pip install
'dreamer_ver[ray]'`).
"""

import hashlib
import math
import os
import time

from dreamer_ver.runtime.env_worker import fleets
from dreamer_ver.cluster.links import RAY_PREFIX
from dreamer_ver.cluster.signals import StopSignal
from dreamer_ver.cluster.targets import AGENT, ENVS, LEARNER, LOGGER, REPLAY
from dreamer_ver.cluster.token import with_token


STOP_SECONDS = 15  # per group: a component's save, before it is removed
PLACE_SECONDS = 60  # then the driver says which components wait for room


def ray_cluster(config):
  """Runs the job on the Ray cluster at `ray.address`; returns 0 once the
  agent finished (or on SIGINT/SIGTERM), with everything stopped."""
  import ray

  config = with_token(config).update({
      'run.actor_addr': RAY_PREFIX + 'agent',
      'run.replay_addr': RAY_PREFIX + 'replay',
      'run.logger_addr': RAY_PREFIX + 'logger'})
  if config.ray.address == 'local':
    # Every component on this machine, as under --script parallel: the
    # CPUs they reserve may exceed the cores, which they share. A new Ray
    # instance, even where another one runs.
    ray.init(address='local', namespace=namespace(config.logdir),
             num_cpus=max(os.cpu_count() or 1, math.ceil(_cpus(config))))
  else:
    ray.init(address=config.ray.address, namespace=namespace(config.logdir))
  stop = StopSignal()  # After ray.init, which installs its own handler.
  hosts = {}  # name -> actor handle, in the order started
  try:
    start_run(config, hosts)
    _report_unplaced(ray, hosts, stop)
    return _wait(ray, hosts['agent'], stop)
  finally:
    # Envs and agent first, so the servers they feed save everything.
    servers = ('logger', 'replay')
    _stop(ray, hosts, [n for n in hosts if n not in servers])
    _stop(ray, hosts, [n for n in servers if n in hosts])
    ray.shutdown()


def namespace(logdir):
  """The Ray namespace of the run in `logdir`: its components' names are
  unique per run, and a second driver on the same logdir is refused."""
  return 'dreamer_ver-' + hashlib.sha1(str(logdir).encode()).hexdigest()[:12]


def start_run(config, hosts):
  """Creates the run's Ray actors, adding each to `hosts` (name -> handle)
  as it is created: logger, replay, agent, the other learner processes,
  env fleets."""
  import ray

  from dreamer_ver.cluster import ray_host

  r = config.ray
  hosts['logger'] = ray_host.start(
      config, 'logger', LOGGER, serves='run.logger_addr',
      num_cpus=r.logger_cpus)
  hosts['replay'] = ray_host.start(
      config, 'replay', REPLAY, serves='run.replay_addr',
      num_cpus=r.replay_cpus)
  gpus = ray_host.available_gpus(r.agent_gpus)
  processes = config.jax.processes
  serves = ('run.actor_addr',) + (('jax.coordinator',) if processes > 1 else ())
  hosts['agent'] = ray_host.start(
      config, 'agent', AGENT, 'ray', serves=serves, num_cpus=r.agent_cpus,
      num_gpus=gpus)
  for process in range(1, processes):
    learner = config.update({
        'jax.process_id': process,
        'jax.coordinator': RAY_PREFIX + 'agent/jax.coordinator'})
    hosts[f'learner{process}'] = ray_host.start(
        learner, f'learner{process}', LEARNER, num_cpus=r.agent_cpus,
        num_gpus=gpus, scheduling_strategy='SPREAD')
  # The agent is placed before the fleets spread over the nodes, so their
  # CPUs cannot leave it no node with room (while Ray can place it).
  ray.wait([hosts['agent'].address.remote()], timeout=PLACE_SECONDS)
  for name, ids, is_eval in fleets(config.run):
    hosts[name] = ray_host.start(
        config, name, ENVS, ids, is_eval, num_cpus=r.env_cpus,
        scheduling_strategy=r.env_strategy)


def _cpus(config):
  """The CPUs the run's components reserve, all together."""
  r = config.ray
  evaluation = r.eval_cpus if config.run.eval_every > 0 else 0
  return (r.logger_cpus + r.replay_cpus + r.agent_cpus * config.jax.processes
          + evaluation + r.env_cpus * len(fleets(config.run)))


def _report_unplaced(ray, hosts, stop):
  """Says which components Ray has not placed after PLACE_SECONDS (the
  cluster lacks the CPUs or GPUs they ask for); the run waits for them."""
  calls = {host.address.remote(): name for name, host in hosts.items()}
  deadline = time.monotonic() + PLACE_SECONDS
  pending = list(calls)
  while pending and not stop and time.monotonic() < deadline:
    _, pending = ray.wait(pending, num_returns=len(pending), timeout=0.5)
  if pending and not stop:
    names = ', '.join(calls[ref] for ref in pending)
    print(f'[ray] not placed after {PLACE_SECONDS} s: {names}; the cluster '
          f'has {ray.available_resources()} free.', flush=True)


def _wait(ray, agent, stop):
  """Until the agent finished (Ray retries the wait across its restarts)
  or SIGINT/SIGTERM; the agent's exit code, or 0 when stopped."""
  done = agent.join.remote(None)
  while not stop:
    ready, _ = ray.wait([done], timeout=0.5)
    if ready:
      return ray.get(done)
  return 0


def _stop(ray, hosts, names):
  """Asks the components `names` to save and stop, then removes their
  actors (also those that did not stop within STOP_SECONDS)."""
  if not names:
    return
  calls = {hosts[name].stop.remote(STOP_SECONDS): name for name in names}
  _, late = ray.wait(list(calls), num_returns=len(calls),
                     timeout=STOP_SECONDS + 5)
  if late:
    print(f"[ray] did not stop within {STOP_SECONDS} s: "
          f"{', '.join(calls[ref] for ref in late)}; removing them.",
          flush=True)
  for name in names:
    ray.kill(hosts[name], no_restart=True)
