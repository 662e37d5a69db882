"""The chaos soak across hosts (`bench/soaks/chaos.py --hosts`): a split launch on
network namespaces (bench/hosts/netns.py) whose processes keep getting killed and
stopped and whose hosts keep getting cut off.

Hosts: `servers` (replay and logger, `--script parallel_replay` and
`parallel_logger`), `agent`, two env hosts with half the envs each
(`parallel_envs`), and a spare; each component supervises its own process,
as on real hosts. Every 20-40 s one fault, in shuffled rounds:

  kill       SIGKILL to one process of a kind (env, replay, logger, agent);
             its supervisor restarts it
  stop       SIGSTOP for 30-120 s, then SIGCONT
  partition  a host (servers, agent, or an env host) cut off both ways for
             30 s, then healed
  oneway     what a host sends is lost for 30 s; what it is sent arrives
  vanish     an env host cut off for good and its processes killed, so the
             agent's connections to it stay half open; its fleet starts on
             the spare host, and the vanished host becomes the spare

Then each component gets SIGTERM in the operators' order (envs, agent,
servers), and the stored rows are checked as bench/soaks/chaos.py checks them:
every exit 0, 0 acknowledged rows lost, 0 stored twice, 0 carries mixed,
0 episodes twice or with holes, every long server stop named.
"""

import collections
import json
import os
import random
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from bench.soaks import faults as faultlib
from bench.soaks import watch
from bench.hosts.netns import Hosts

ROOT = Path(__file__).resolve().parents[2]
HOST_FAULTS = ('kill', 'stop', 'partition', 'oneway', 'vanish')
CUT = 30  # seconds a partition or a one-way loss lasts
# A link silent through a 30 s cut answers again within it (TCP's resends
# back off: up to about 55 s).
PEER_TIMEOUT = 120
STOP_ORDER = ('envs', 'agent', 'replay', 'logger')
SHUTDOWN_BUDGET = 60


def run_flags(envs, length, step_time=0.01, peer_timeout=PEER_TIMEOUT):
  """The run checked by bench/soaks/chaos.py's row checks (see its docstring):
  tagged steps, no learning (lr 0), no latents written back, no eval."""
  return {'configs': 'debug', 'task': 'synthetic_tagged', 'run.envs': envs,
          'run.eval_envs': 0, 'env.synthetic.length': length,
          'env.synthetic.step_time': step_time, 'agent.opt.lr': 0,
          'replay_context': 0, 'replay.size': '1e7', 'run.steps': '1e9',
          'run.log_every': 2, 'run.save_every': 10,
          'run.peer_timeout': peer_timeout}


class Run:
  """The components of one split launch on `hosts`, each a process group
  whose output goes to `logdir/../<name>.log`."""

  def __init__(self, hosts, logdir, flags):
    self.hosts, self.logdir = hosts, Path(logdir)
    addr = hosts.addr
    self.flags = {**flags, 'logdir': str(logdir),
                  'run.replay_addr': f"{addr['servers']}:7001",
                  'run.logger_addr': f"{addr['servers']}:7002",
                  'run.actor_addr': f"{addr['agent']}:7003"}
    self.env = {**os.environ, 'JAX_PLATFORMS': 'cpu',
                'PYTHONUNBUFFERED': '1',
                'DREAMER_VER_TOKEN': secrets.token_hex(16)}
    self.procs = {}

  def start_servers_and_agent(self):
    self.start('logger', 'servers', 'parallel_logger')
    self.start('replay', 'servers', 'parallel_replay')
    self.start('agent', 'agent', 'parallel_agent', **{
        'run.remote_envs': True, 'run.remote_replay': True})

  def start(self, name, host, script, **flags):
    argv = [sys.executable, '-m', 'dreamer_ver.main', '--script', script]
    for key, value in {**self.flags, **flags}.items():
      argv += [f'--{key}', str(value)]
    self.logdir.parent.mkdir(parents=True, exist_ok=True)
    log = open(self.logdir.parent / f'{name}.log', 'a')
    self.procs[name] = self.hosts.popen(
        host, argv, cwd=ROOT, env=self.env, stdout=log,
        stderr=subprocess.STDOUT)
    log.close()

  def start_fleet(self, host, envs, name=None):
    """A fleet of env ids `envs` on `host`, named after it by default."""
    self.start(name or host, host, 'parallel_envs', **{
        'run.envs': len(envs), 'run.envid_offset': envs[0]})

  def stop(self, name, timeout=60):
    """SIGTERM to the component, as its operator would; its exit code (None
    if it had not exited after `timeout` s)."""
    proc = self.procs[name]
    proc.send_signal(signal.SIGTERM)
    try:
      return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
      return None

  def output(self, name):
    return (self.logdir.parent / f'{name}.log').read_text(errors='replace')

  def episodes(self, envs, since):
    """Episodes of `envs` the logger wrote since the time `since`."""
    path = self.logdir / 'scores.jsonl'
    if not path.exists():
      return 0
    lines = [json.loads(line) for line in path.read_text().splitlines()
             if line.strip()]
    return sum(1 for s in lines if s['env'] in envs and s['time'] >= since)


def chaos_hosts(logdir, minutes, kill_every, envs=4, length=50,
                step_time=0.01, seed=0, startup=600.0,
                faults=HOST_FAULTS, stop_for=(30, 120)):
  """Runs the soak; returns the report (`ok` says if it passed)."""
  rng = random.Random(seed)
  logdir = Path(logdir) / 'run'
  flags = run_flags(envs, length, step_time)
  half = envs // 2
  fleets = {'envs_a': list(range(half)), 'envs_b': list(range(half, envs))}
  report = {'hosts': True, 'minutes': minutes, 'kill_every': list(kill_every),
            'faults': list(faults), 'stop_for': list(stop_for),
            'peer_timeout': PEER_TIMEOUT, 'envs': envs}
  hits, codes = [], {}
  with Hosts(['servers', 'agent', 'envs_a', 'envs_b', 'spare']) as hosts:
    run = Run(hosts, logdir, flags)
    run.start_servers_and_agent()
    fleet_hosts = {name: name for name in fleets}  # fleet -> its host now
    for name, ids in fleets.items():
      run.start_fleet(name, ids)
    spare = ['spare']
    try:
      if not watch.wait(lambda: run.episodes(range(envs), 0) >= envs, startup):
        raise RuntimeError(f'the run never served every env (see {logdir})')
      start = time.monotonic()
      deadline = start + minutes * 60
      plan = _plan(faults, hosts.names)
      order = []
      next_hit = start + rng.uniform(*kill_every)
      while time.monotonic() < deadline:
        now = time.monotonic()
        if now >= next_hit and now < deadline - faultlib.QUIET_END - CUT:
          order = order or rng.sample(plan, len(plan))
          fault, target = order.pop()
          at = now - start
          if fault == 'kill':
            hits.append(faultlib.kill(logdir, target, rng, at))
          elif fault == 'stop':
            hits.append(faultlib.stop(logdir, target, rng, at,
                                    stop_for=stop_for))
          elif fault == 'vanish':
            fleet = rng.choice(sorted(fleets))
            hits.append(_vanish(run, hosts, fleet, fleets[fleet],
                                fleet_hosts, spare, at))
          else:
            host = fleet_hosts.get(target, target)
            hits.append(_cut(hosts, fault, host, at))
          next_hit = now + rng.uniform(*kill_every)
        time.sleep(0.5)
      for hit in hits:  # Stops and cuts that outlasted the soak end first.
        if hit.get('resume') is not None:
          hit['resume'].join()
      stop_at = time.monotonic()
      for kind in STOP_ORDER:
        names = list(fleets) if kind == 'envs' else [kind]
        for name in names:
          codes[name] = run.stop(name, SHUTDOWN_BUDGET)
      report['shutdown_s'] = round(time.monotonic() - stop_at, 1)
    finally:
      output = '\n'.join(run.output(name) for name in run.procs)
  for hit in hits:
    hit.pop('resume', None)
  leftover = [n for n, pid in watch.pids(logdir).items() if watch.alive(pid)]
  report.update({
      'exit_codes': codes, 'left_running': leftover, 'faults_done': dict(
          collections.Counter(f"{h['kind']} {h['fault']}" for h in hits)),
      'hits': hits,
      'unreported_stops': faultlib.unreported(hits, output, PEER_TIMEOUT),
      'steps': watch.read_json(logdir / 'ckpt' / 'logger.json').get(
          'step', 0)})
  report.update(faultlib.check_rows(logdir, length))
  report['ok'] = bool(
      all(code == 0 for code in codes.values()) and not leftover and
      report['lost_rows'] == 0 and report['duplicated_rows'] == 0 and
      report['carries_mixed'] == 0 and report['episodes_twice'] == 0 and
      report['episodes_with_holes'] == 0 and not report['unreported_stops']
      and report['score_lines_cut'] == 0)
  return report


def _plan(faults, host_names):
  """One round of (fault, target): kill and stop per process kind, cuts
  per host (a fleet's name stands for the host it runs on now)."""
  plan = []
  for fault in faults:
    if fault in ('kill', 'stop'):
      plan += [(fault, kind) for kind in faultlib.KINDS]
    elif fault in ('partition', 'oneway'):
      plan += [(fault, host) for host in host_names if host != 'spare']
    else:
      plan.append((fault, None))
  return plan


def _cut(hosts, fault, host, at):
  """Cuts `host` off (both ways, or its sending only) and heals it after
  CUT seconds, on a thread."""
  (hosts.partition if fault == 'partition' else hosts.drop_outgoing)(host)

  def heal():
    time.sleep(CUT)
    hosts.heal(host)
  resume = threading.Thread(target=heal, daemon=True)
  resume.start()
  return {'t': round(at, 1), 'kind': host, 'fault': fault, 'name': host,
          'pid': None, 'resume': resume}


def _vanish(run, hosts, fleet, ids, fleet_hosts, spare, at):
  """The host of `fleet` vanishes with its processes; the fleet restarts on
  the spare host. The vanished host stays cut off (the agent's connections
  to it half open) until it is needed as the spare again."""
  host = fleet_hosts[fleet]
  hosts.partition(host)
  proc = run.procs[fleet]
  pids = [pid for name, pid in watch.pids(run.logdir).items()
          if name.startswith('env') and int(name[3:]) in ids]
  os.killpg(proc.pid, signal.SIGKILL)
  for pid in pids:
    try:
      os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
      pass
  proc.wait()
  new = spare.pop()
  hosts.heal(new)  # Empty: its old connections were given up on.
  run.start_fleet(new, ids, name=fleet)
  fleet_hosts[fleet] = new
  spare.append(host)
  return {'t': round(at, 1), 'kind': fleet, 'fault': 'vanish',
          'name': f'{host} -> {new}', 'pid': None, 'resume': None}


def format_report(report):
  lines = [f"chaos soak across hosts: {'PASS' if report['ok'] else 'FAIL'} "
           f"({report['minutes']} min, a fault every "
           f"{report['kill_every'][0]:g}-{report['kill_every'][1]:g} s)"]
  for key in ('steps', 'faults_done', 'unreported_stops', 'exit_codes',
              'shutdown_s', 'left_running', 'stored_rows', 'lost_rows',
              'duplicated_rows', 'checked_carries', 'carries_mixed',
              'episodes_logged', 'score_lines_cut', 'episodes_twice',
              'episodes_with_holes', 'longest_idle_s'):
    lines.append(f'  {key:20} {report.get(key)}')
  return '\n'.join(lines)
