"""What the Ray path costs: our sockets vs Ray calls per step, and a whole
run under `--script ray` vs `--script parallel`.

  transport  the same env loops (dm_control cartpole_balance from
             proprioception, about 0.2 ms a step: the `fast` fleet's env),
             E of them, each a Ray actor on a local Ray cluster, ask a
             policy server for every action, in turn by
               socket  our BlockingClient -> our rpc Server, the server
                       hosted in a Ray actor (the data plane of --script ray)
               ray     a Ray actor method call per step (`ray.get`), what
                       a Ray-only design would do
               batch_tcp  our BlockingClient -> the actor's BatchServer
                       (VER cutoff) over TCP, hosted in a Ray actor
               batch_ray  `RayTransport`'s client -> the same BatchServer
                       through Ray only (for nodes that cannot open
                       sockets to each other)
             The server answers with a zero action, no policy: the ratio is
             the transport's. env steps/s over a fixed window, each mode
             `--rounds` times, interleaved.
  run        the `fast` fleet (`--task dmc_cartpole_balance`, debug model,
             E envs in W = E / envs_per_worker processes) trained for
             `--seconds` by `--script parallel` on this machine and by
             `--script ray` on a local 3-node Ray cluster: the actor's env
             steps/s (`fps/policy`, mean of the rows after the first
             action), side by side.

Usage (from the repository root):

  .venv/bin/python -m bench.system.ray_bench --out bench/results/ray_bench.json
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import ray
from ray.cluster_utils import Cluster

from bench import stamp

ROOT = Path(__file__).resolve().parents[2]
LOOPBACK = {'RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER': '0'}
# The fast fleet's env: proprioception only, nothing rendered.
DMC_PROPRIO = {'dmc': {'image': False, 'log_image': False}}
MODES = ('socket', 'ray', 'batch_tcp', 'batch_ray')


# ------------------------------------------------------------ transport

class PolicyServer:
  """The zero-action server, reachable four ways: our socket (`addr`), Ray
  calls (`act`), and a BatchServer over TCP (`batch_addr`) and over Ray
  (`batch_client`)."""

  def __init__(self, act_space, envs):
    from dreamer_ver.actor.preemption import VER
    from dreamer_ver.rpc.addresses import free_port
    from dreamer_ver.rpc.batch_server import BatchServer
    from dreamer_ver.rpc.ray_transport import RayTransport
    from dreamer_ver.rpc.server import Server
    self.action = {k: np.zeros(s.shape, s.dtype) for k, s in act_space.items()}
    self.addr = f'127.0.0.1:{free_port()}'
    self.server = Server(self.addr, 'Policy', workers=1)
    self.server.bind('act', self.act)
    self.server.start()
    self.batch_addr = f'127.0.0.1:{free_port()}'
    self.ray_transport = RayTransport()
    self.batch = BatchServer(
        self.batch_addr, lambda requests: ([self.action] * len(requests), None),
        VER(max(1, int(envs / 1.5)), envs), name='BatchPolicy',
        transports=('tcp', self.ray_transport))
    self.batch.start()

  def act(self, obs):
    del obs
    return self.action

  def address(self, batch=False):
    return self.batch_addr if batch else self.addr

  def batch_client(self):
    return self.ray_transport.client()


class EnvLoop:
  """One env stepping as fast as its actions come back."""

  def __init__(self, seed):
    from dreamer_ver.envs import make_env
    self.env = make_env('dmc_cartpole_balance', DMC_PROPRIO, seed=seed)
    self.seed = seed
    self.steps = 0
    self.running = threading.Event()

  def act_space(self):
    return self.env.act_space

  def run(self, mode, policy, seconds):
    """Steps for `seconds`, asking `policy` (a Ray handle) or our server at
    its address for each action; returns the steps done."""
    from dreamer_ver.rpc.blocking_client import BlockingClient
    client = ray_client = None
    if mode in ('socket', 'batch_tcp'):
      client = BlockingClient(ray.get(policy.address.remote(
          mode == 'batch_tcp')))
      client.connect(threading.Event())
    elif mode == 'batch_ray':
      ray_client = ray.get(policy.batch_client.remote())
    action = {k: np.zeros(s.shape, s.dtype)
              for k, s in self.env.act_space.items()}
    action['reset'] = np.bool_(True)
    steps, end = 0, time.monotonic() + seconds
    while time.monotonic() < end:
      obs = {k: np.asarray(v, order='C')
             for k, v in self.env.step(action).items()}
      obs['envid'] = np.int64(self.seed)
      if client is not None:
        action = client.call('act', obs)
      elif ray_client is not None:
        action = ray_client.call(obs)
      else:
        action = ray.get(policy.act.remote(obs))
      steps += 1
    if client is not None:
      client.close()
    if ray_client is not None:
      ray_client.close()
    return steps


def transport(envs, seconds, rounds):
  space = EnvLoop(0).act_space()
  policy = ray.remote(PolicyServer).options(
      max_concurrency=envs + 1).remote(space, envs)
  loops = [ray.remote(EnvLoop).options(num_cpus=0.1).remote(i)
           for i in range(envs)]
  ray.get([loop.act_space.remote() for loop in loops])
  results = {mode: [] for mode in MODES}
  for r in range(rounds):
    for mode in (MODES if r % 2 == 0 else MODES[::-1]):
      steps = ray.get([loop.run.remote(mode, policy, seconds)
                       for loop in loops])
      results[mode].append(sum(steps) / seconds)
      time.sleep(1.0)  # the server sees the closed clients free their ids
      print(f'transport {mode}: {results[mode][-1]:.0f} env steps/s',
            flush=True)
  for actor in loops + [policy]:
    ray.kill(actor)
  return {mode: float(np.mean(sps)) for mode, sps in results.items()} | {
      'rounds': results}


# ------------------------------------------------------------------ run

def run(script, address, envs, per_worker, seconds, logdir):
  """Env steps/s of a --script parallel or ray run of the fast fleet."""
  flags = ['--configs', 'debug', '--task', 'dmc_cartpole_balance',
           '--env.dmc.image', 'False', '--env.dmc.log_image', 'False',
           '--run.envs', str(envs), '--run.eval_envs', '0',
           '--run.envs_per_worker', str(per_worker), '--run.log_every', '2',
           '--run.duration', str(seconds), '--logdir', str(logdir),
           '--script', script]
  if script == 'ray':
    flags += ['--ray.address', address, '--ray.env_cpus', '0.5',
              '--ray.replay_cpus', '0.5', '--ray.logger_cpus', '0.5']
  env = {**os.environ, **LOOPBACK, 'JAX_PLATFORMS': 'cpu'}
  with open(Path(logdir).with_suffix('.log'), 'w') as output:
    subprocess.run([sys.executable, '-m', 'dreamer_ver.main', *flags],
                   cwd=ROOT, env=env, stdout=output, stderr=subprocess.STDOUT,
                   check=True, timeout=seconds + 600)
  rows = [json.loads(line) for line in
          (Path(logdir) / 'metrics.jsonl').read_text().splitlines()]
  fps = [row['fps/policy'] for row in rows
         if row.get('fps/policy') and row.get('actor/served', 0) > 0]
  fps = fps[1:]  # The first row holds the start-up.
  return float(np.mean(fps)) if fps else 0.0


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--envs', type=int, default=16)
  parser.add_argument('--envs_per_worker', type=int, default=4)
  parser.add_argument('--seconds', type=float, default=10.0)
  parser.add_argument('--rounds', type=int, default=2)
  parser.add_argument('--run_seconds', type=float, default=90.0)
  parser.add_argument('--transport_only', action='store_true',
                      help='skip the whole-run comparison')
  parser.add_argument('--out', default='')
  args = parser.parse_args()
  os.environ.update(LOOPBACK)
  cluster = Cluster(initialize_head=True, head_node_args={'num_cpus': 2})
  for _ in range(2):
    cluster.add_node(num_cpus=2)
  cluster.wait_for_nodes()
  ray.init(address=cluster.address)
  result = {'envs': args.envs, 'envs_per_worker': args.envs_per_worker,
            'nodes': 3, 'cpus': os.cpu_count()}
  try:
    result['transport'] = transport(args.envs, args.seconds, args.rounds)
    t = result['transport']
    print(f"transport: socket {t['socket']:.0f} vs ray {t['ray']:.0f} env "
          f"steps/s = {t['socket'] / t['ray']:.2f}x; batch server over "
          f"tcp {t['batch_tcp']:.0f} vs RayTransport {t['batch_ray']:.0f} = "
          f"{t['batch_ray'] / t['batch_tcp']:.2f}x", flush=True)
    ray.shutdown()
    if not args.transport_only:
      with tempfile.TemporaryDirectory() as tmp:
        result['run'] = {
            script: run(script, cluster.address, args.envs,
                        args.envs_per_worker, args.run_seconds,
                        Path(tmp) / script)
            for script in ('parallel', 'ray')}
      r = result['run']
      print(f"run: ray {r['ray']:.0f} vs parallel {r['parallel']:.0f} env "
            f"steps/s = {r['ray'] / r['parallel']:.2f}x", flush=True)
  finally:
    ray.shutdown()
    cluster.shutdown()
  if args.out:
    stamp.write(args.out, result)


if __name__ == '__main__':
  main()
