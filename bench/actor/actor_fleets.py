"""The actor bench's fleets (bench/actor/actor_bench.py): what each fleet of env
processes is (`fleet_spec`, its nominal limit) and the processes that run
it (`Fleet`: env processes that count and stall as their spec says)."""

import math
import multiprocessing
import os
import signal
import sys
import threading
import time

import numpy as np

from dreamer_ver.envs.wrappers import Wrapper
from dreamer_ver.runtime import env_worker

FLEETS = ('constant', 'hetero', 'lognormal', 'bimodal', 'faults', 'fast',
          'fast_multi')
BIMODAL = (0.005, 0.080)  # step seconds of the bimodal fleet's two halves
STARTUP_SECONDS = 300.0  # time for the env processes to import and build
STALL_EVERY, STALL_TIME = 5.0, 2.0  # the faults fleet's stalling env
DEATH_AT = 0.4  # fraction of the window after which envs die (faults)
SLOW_FACTOR = 4.0  # hetero


def fleet_spec(name, envs, step_time, jitter, per_worker=4):
  """What a fleet is: task, config overrides (shared and per env), envs
  per process, faults, and its nominal env-bound limit."""
  spec = dict(
      name=name, task='synthetic_bench', shared={}, per_env=[{}] * envs,
      stall={}, deaths=[], mean_step=[step_time] * envs, env_extra={},
      per_worker=1)
  spec['shared'] = {'env.synthetic.step_time': step_time}
  if name == 'constant':
    pass
  elif name == 'hetero':
    # Slowness per env is drawn from the env's seed with probability
    # slow_frac; 1.0 / 0.0 per env makes exactly every 4th env slow.
    slow = [i % 4 == 3 for i in range(envs)]
    spec['per_env'] = [{'env.synthetic.slow_frac': 1.0 if s else 0.0,
                        'env.synthetic.slow_factor': SLOW_FACTOR}
                       for s in slow]
    spec['mean_step'] = [step_time * (SLOW_FACTOR if s else 1.0) for s in slow]
  elif name == 'lognormal':
    # E[exp(N(0, s^2))] = exp(s^2 / 2): scale so the mean is step_time.
    base = step_time / math.exp(jitter ** 2 / 2)
    spec['shared'] = {'env.synthetic.step_time': base,
                      'env.synthetic.jitter': jitter}
  elif name == 'bimodal':
    times = [BIMODAL[i % 2] for i in range(envs)]
    spec['per_env'] = [{'env.synthetic.step_time': t} for t in times]
    spec['mean_step'] = times
  elif name == 'faults':
    spec['stall'] = {0: (STALL_EVERY, STALL_TIME)}
    spec['deaths'] = list(range(envs - (envs // 2 + 1), envs))
  elif name in ('fast', 'fast_multi'):
    spec['task'] = 'dmc_cartpole_balance'
    if name == 'fast_multi':
      spec['per_worker'] = per_worker
    spec['shared'] = {'env.dmc.image': False}
    # The dmc suite's `log_image` has no config key: passed to make_env.
    spec['env_extra'] = {'dmc': {'log_image': False}}
    spec['mean_step'] = None  # measured
  else:
    raise ValueError(f'unknown fleet {name!r}; choose from {FLEETS}')
  return spec


def nominal_limit(spec, envs):
  """Env steps/s if the actor answered instantly, averaged over the window."""
  total = 0.0
  for i in range(envs):
    rate = 1.0 / spec['mean_step'][i]
    if i in spec['stall']:
      every, stall = spec['stall'][i]
      rate *= (every - stall) / every
    if i in spec['deaths']:
      rate *= DEATH_AT
    total += rate
  return total


# ------------------------------------------------------ env processes


class _ProbeEnv(Wrapper):
  """Wraps the env inside an env process: records, per step, the request
  latency seen by the env (from returning the observation to being called
  with the next action) and the env's own step time; optionally stalls."""

  def __init__(self, env, stall):
    super().__init__(env)
    self.stall = stall
    self.last = None
    self.times, self.latency, self.durations = [], [], []
    self.next_stall = None
    if stall:
      every, _ = stall
      self.next_stall = time.monotonic() + every * np.random.uniform(0.2, 1)

  def step(self, action):
    start = time.monotonic()
    if self.last is not None:
      self.times.append(start)
      self.latency.append(start - self.last)
    if self.next_stall is not None and start >= self.next_stall:
      every, seconds = self.stall
      time.sleep(seconds)  # A hung env: counts as env time, not latency.
      self.next_stall += every
    obs = self.env.step(action)
    self.last = time.monotonic()
    self.durations.append(self.last - start)
    return obs

  def save(self, path):
    np.savez(path, times=np.array(self.times), latency=np.array(self.latency),
             durations=np.array(self.durations))


def with_extra(env_config, extra):
  """env_config with suite kwargs that the config has no keys for."""
  if not extra:
    return env_config
  merged = dict(env_config or {})
  for suite, kwargs in extra.items():
    merged[suite] = {**dict(merged.get(suite) or {}), **kwargs}
  return merged


def _env_child(config, envids, outdir, stall, extra, parent):
  """Env process entry: dreamer_ver's run_env (run_envs for several envs per
  process) with the probe around each env. SIGUSR1 makes it save its probes
  and exit at once, without a goodbye to the server (like a crash): the
  faults fleet's deaths, and the end of every fleet. If the benchmark
  process goes away without stopping it, it stops itself."""
  from dreamer_ver import envs
  probes = {}
  order = iter(envids)
  make_env = envs.make_env  # what envs.make_run_env calls

  def make_probed(task, env_config=None, *args, **kwargs):
    envid = next(order)  # run_envs makes the envs in the order of envids
    env = make_env(task, with_extra(env_config, extra), *args, **kwargs)
    probes[envid] = _ProbeEnv(env, stall.get(envid))
    if len(probes) == len(envids):
      open(os.path.join(outdir, f'started_{os.getpid()}'), 'w').close()
    return probes[envid]

  def save():
    for envid, probe in probes.items():
      probe.save(os.path.join(outdir, f'env{envid}_{os.getpid()}.npz'))

  def leave(signum, frame):
    del signum, frame
    save()
    os._exit(0)

  def watchdog():
    while os.getppid() == parent:
      time.sleep(1.0)
    os.kill(os.getpid(), signal.SIGTERM)

  envs.make_env = make_probed
  signal.signal(signal.SIGUSR1, leave)
  threading.Thread(target=watchdog, daemon=True).start()
  try:
    if len(envids) == 1:
      code = env_worker.run_env(config, envids[0])
    else:
      code = env_worker.run_envs(config, list(envids))
  finally:
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    save()
  sys.exit(code)


class Fleet:
  """Env processes (spawned), each hosting a group of env ids (one env per
  process unless the fleet says otherwise), all talking to one address."""

  def __init__(self, configs, groups, outdir, stall, extra):
    self.context = multiprocessing.get_context('spawn')
    self.configs = configs  # one per group
    self.groups = groups
    self.outdir = outdir
    self.stall = stall
    self.extra = extra
    self.procs = {}  # group index -> process
    self.crashes = 0  # processes that exited with an error (not SIGUSR1)

  def start(self, index):
    group = self.groups[index]
    name = f'env{group[0]}' + (f'-{group[-1]}' if len(group) > 1 else '')
    proc = self.context.Process(
        target=_env_child, name=name, daemon=True,
        args=(self.configs[index], group, self.outdir, self.stall,
              self.extra, os.getpid()))
    proc.start()
    self.procs[index] = proc

  def start_all(self):
    for index in range(len(self.groups)):
      self.start(index)

  def revive(self):
    """Restarts the env processes that died: the faults fleet kills some,
    and an env worker that reconnects while a server closes can crash
    (ConnectionResetError in BlockingClient.connect's handshake)."""
    revived = 0
    for index, proc in list(self.procs.items()):
      if not proc.is_alive():
        proc.join()
        if proc.exitcode:
          self.crashes += 1
          print(f'  {proc.name} exited with code {proc.exitcode}; '
                'restarting it.', flush=True)
        self.start(index)
        revived += 1
    return revived

  def wait_started(self, timeout=STARTUP_SECONDS):
    """Waits until every env process has built its envs (imports done), so
    that process start-up never counts against a mode."""
    deadline = time.monotonic() + timeout
    while True:
      waiting = [p for p in self.procs.values() if p.is_alive() and not
                 os.path.exists(os.path.join(self.outdir, f'started_{p.pid}'))]
      if not waiting:
        return
      if time.monotonic() > deadline:
        raise RuntimeError(
            f'{len(waiting)} env processes did not start within {timeout} s')
      time.sleep(0.1)

  def alive(self):
    return {e for i, p in self.procs.items() if p.is_alive()
            for e in self.groups[i]}

  def kill(self, envids):
    """Abrupt death of the processes hosting `envids`."""
    for index, proc in self.procs.items():
      if proc.is_alive() and set(self.groups[index]) & set(envids):
        os.kill(proc.pid, signal.SIGUSR1)

  def pids(self):
    return [p.pid for p in self.procs.values() if p.is_alive()]

  def stop(self, timeout=5.0):
    """SIGUSR1 (save and exit), then SIGTERM, then SIGKILL; joins all."""
    procs = list(self.procs.values())
    for sig in (signal.SIGUSR1, signal.SIGTERM, signal.SIGKILL):
      alive = [p for p in procs if p.is_alive()]
      if not alive:
        break
      if sig != signal.SIGUSR1:
        print(f'{len(alive)} env processes did not stop; sending '
              f'{signal.Signals(sig).name}.')
      for proc in alive:
        try:
          os.kill(proc.pid, sig)
        except ProcessLookupError:
          pass
      deadline = time.monotonic() + timeout
      for proc in alive:
        proc.join(max(0.0, deadline - time.monotonic()))
    for proc in procs:
      proc.join()

  def samples(self):
    """(reply times, latencies, env step durations) of every env."""
    times, latency, durations = [], [], []
    for name in sorted(os.listdir(self.outdir)):
      if not name.endswith('.npz'):
        continue
      with np.load(os.path.join(self.outdir, name)) as data:
        times.append(data['times'])
        latency.append(data['latency'])
        durations.append(data['durations'])
    cat = lambda xs: np.concatenate(xs) if xs else np.zeros(0)
    return cat(times), cat(latency), cat(durations)


