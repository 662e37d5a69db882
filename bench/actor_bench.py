"""Actor throughput benchmark: DreamerV3's fixed batch vs our batch cutoffs.

For each fleet of env processes, in one invocation and on the same fleet
(the same processes, which reconnect by themselves when the server changes),
it serves the fleet with

  baseline  portal.BatchServer with a fixed batch of E/2 (DreamerV3's actor:
            the batcher in its own process, one worker thread)
  fixed     our BatchServer, preemption.Fixed(E/2)
  ver       our BatchServer, preemption.VER (min/max/adaptive wait)
  preempt   our BatchServer, preemption.Preempt (throughput-optimal)

all four calling the same jitted RSSM policy (`Actor.step`, size1m by
default), with the learner, replay and limiter off. The policy is compiled
once before any timing. Each mode gets a warm-up (after every live env was
served once) and then a fixed measuring window; `--repeats` rounds go through
all modes in turn, so drifts in the machine's other load hit every mode.

Every fleet runs once per `--transports` entry: its env processes reach our
server over TCP (portal's protocol) or through shared memory (`rpc/shm.py`);
the baseline speaks TCP only, so it runs with the tcp fleet and the shm rows
take their x baseline from it.

Fleets (E envs, one per process unless said otherwise; `--step_time` mean
seconds per step):

  constant   every env takes step_time
  hetero     every 4th env (exactly E/4 of them) is 4x slower
  lognormal  per-step lognormal factor (sigma `--jitter`), mean step_time
  bimodal    half the envs take 5 ms per step, the other half 80 ms
  faults     env 0 stalls for 2 s every 5 s; E/2 + 1 envs die (abruptly,
             os._exit) 40% into each window and are restarted before the
             next one; windows are at least 6.7 s here, so that a fleet
             that hangs after the deaths is seen to stall
  fast       dm_control cartpole_balance from proprioception (about 0.2 ms
             per step): measures the runtime's overhead, not env time
  fast_multi the same with `--envs_per_worker` envs per process (E / 4
             processes; double-buffered multi-env calls). portal's
             BatchServer cannot batch multi-env calls, so this fleet has no
             baseline of its own; its x baseline refers to `fast`'s.

Measurements, per fleet and mode:

  sps        env steps served in the window / window seconds (rows counted
             where the policy runs), summed over the rounds. A fleet that
             stalls (no step served for 3 s) ends its window early; its sps
             counts the full window, since it would serve nothing more.
  limit_sps  the env-bound limit: sum over envs of 1 / mean step time,
             weighted by the time each env is alive and not stalled. For
             `fast` it is E / the measured mean env step time.
  p50/p99    request latency as the env sees it, the same probe for every
             mode: the env processes wrap their env so that each step records
             the time from returning an observation to being called with the
             next action (send, queue, batch, policy, reply, receive). Taken
             over the replies received inside the windows; requests never
             answered (a stalled fleet) are not in them.
  extras     ratio_baseline, ratio_limit, batch_mean, policy_ms_mean (handler
             time per batch), policy_share (the fraction of the window the
             policy ran: the rest of the server's CPU is overhead),
             cpu_server / cpu_envs (cores used by the benchmark process plus
             the baseline's batcher process / by the env processes), our
             server's own latency and cut reasons, and `load`, the machine's 1-minute load average at the end of
             the window (other work on the machine skews every number).

With `--learner` a learner thread trains the same agent beside the actor,
in the same process and on the same device (zero batches of the replay's
shapes, publishing its params to the actor after each update, as
`--script parallel` does on one device), through every mode's warm-up and
window. Its updates per second are reported as `learner_ups`, beside
`learner_alone_ups`, measured before the fleet starts (the learner alone in
the process: what it keeps beside the actor is against that); with
`preempt` it reports each update's device time to the cutoff (VER's
learner time, LT). The baseline's batcher process is left out of the CPU
comparison by nothing: the learner's cores are counted in `cpu_server`.

With `--wal` the actor ships every served transition to a replay server
process (`serve_replay`, as `--script parallel` runs it; no learner, no
limiter), and every mode runs twice per round, once against a replay with
`replay.wal off` and once against one with `flush`, interleaved (the order
alternates between rounds); both replays live through the whole fleet. The
baseline is left out: portal's BatchServer calls Actor.step and ships
nothing. The summary gives env steps/s both ways, their ratio, and the
replay process's cores (`cpu_replay`).

Usage (from the repository root; see docs/benchmarks.md):

  .venv/bin/python bench/actor_bench.py --out bench/results/actor_cutoffs_cpu.json \
      --plot bench/results/actor_cutoffs_cpu.png
  .venv/bin/python bench/actor_bench.py --quick

Every child process (env processes, the baseline's batcher process) is
stopped at the end of each fleet or on any error (terminate, join, kill).
"""

import argparse
import json
import math
import multiprocessing
import os
import signal
import sys
import tempfile
import threading
import time

import numpy as np

from dreamer_ver.envs.wrappers import Wrapper
from dreamer_ver.runtime import env_worker

MODES = ('baseline', 'fixed', 'ver', 'preempt')
WAL_MODES = ('off', 'flush')  # the replays of --wal, by `replay.wal`
REPLAY_SIZE = 1e5  # --wal replays' capacity: bounds their memory
FLEETS = ('constant', 'hetero', 'lognormal', 'bimodal', 'faults', 'fast',
          'fast_multi')
TRANSPORTS = ('tcp', 'shm')
BIMODAL = (0.005, 0.080)  # step seconds of the bimodal fleet's two halves
STALL_SECONDS = 3.0  # no step served for this long = the fleet stalled
STARTUP_SECONDS = 300.0  # time for the env processes to import and build
READY_SECONDS = 60.0  # time for every live env to be served once
STALL_EVERY, STALL_TIME = 5.0, 2.0  # the faults fleet's stalling env
DEATH_AT = 0.4  # fraction of the window after which envs die (faults)
# The faults window must outlast the deaths by the stall detection time.
FAULTS_MIN_SECONDS = (STALL_SECONDS + 1.0) / (1.0 - DEATH_AT)
SLOW_FACTOR = 4.0  # hetero


# --------------------------------------------------------------- fleets

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


def _with_extra(env_config, extra):
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
    env = make_env(task, _with_extra(env_config, extra), *args, **kwargs)
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


# -------------------------------------------------------------- servers

class Counter:
  """Rows served, by whom, and when the last batch was served."""

  def __init__(self):
    self.lock = threading.Lock()
    self.rows = 0
    self.batches = 0
    self.envids = set()
    self.last = time.monotonic()
    self.policy_seconds = 0.0

  def add(self, envids, seconds):
    with self.lock:
      self.rows += len(envids)
      self.batches += 1
      self.envids.update(int(e) for e in envids)
      self.last = time.monotonic()
      self.policy_seconds += seconds

  def snapshot(self):
    with self.lock:
      return self.rows, self.batches, self.policy_seconds


class Baseline:
  """DreamerV3's actor server: portal.BatchServer, exactly `batch` requests
  per call; its workfn gets the stacked requests and runs Actor.step."""

  def __init__(self, port, actor, batch, counter):
    import portal
    keys = list(actor.agent.act_space)

    def workfn(data):
      start = time.perf_counter()
      count = len(data['envid'])
      datas = [{k: v[i] for k, v in data.items()} for i in range(count)]
      trans = actor.step(datas)
      result = {k: trans[k] for k in keys}
      result['reset'] = trans['is_last']
      counter.add(trans['envid'], time.perf_counter() - start)
      return result

    self.server = _retry_bind(lambda: portal.BatchServer(
        port, 'Baseline', workers=1, process=True, logging=False))
    self.server.bind('act', workfn, batch=batch)
    self.server.start(block=False)

  def stats(self):
    return {}

  def child_pids(self):
    batcher = getattr(self.server, 'batcher', None)
    return [batcher.pid] if batcher is not None and batcher.pid else []

  def close(self):
    self.server.close(timeout=5)


class Ours:
  """Our BatchServer with the cutoff named by `mode`, from make_cutoff."""

  def __init__(self, addr, actor, config, envs, inference, counter, mode):
    from dreamer_ver.config import loading as configlib
    from dreamer_ver.actor import batching
    from dreamer_ver.rpc.batch_server import BatchServer
    from dreamer_ver.cluster.links import Links
    run = configlib.override(config, {'run.actor_cutoff': mode}).run
    self.cutoff = batching.make_cutoff(run, envs, actor.buckets, inference)

    def handler(requests):
      start = time.perf_counter()
      replies, context = actor.handle(requests)
      served = [r.envid for r, reply in zip(requests, replies)
                if not isinstance(reply, BaseException)]
      counter.add(served, time.perf_counter() - start)
      return replies, context

    kwargs = {**Links.of(config).server_kwargs(), 'logging': False}
    if hasattr(actor, 'max_request_bytes'):
      kwargs['max_msg_size'] = actor.max_request_bytes()
    transports = ('tcp', 'shm') if run.actor_transport == 'shm' else ('tcp',)
    self.server = _retry_bind(lambda: BatchServer(
        addr, handler, self.cutoff, postfn=actor.post,
        workers=run.actor_threads, name=f'Actor_{mode}',
        transports=transports, **kwargs))
    self.server.start()

  def stats(self):
    return self.server.stats()

  def child_pids(self):
    return []

  def close(self):
    self.server.close()


def _die_with_parent():
  """Runs in portal's child processes: SIGKILL when the parent exits."""
  try:
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG (Linux)
  except Exception:
    pass


def _retry_bind(make, seconds=15.0):
  """The previous server's socket may take a moment to release the port."""
  deadline = time.monotonic() + seconds
  while True:
    try:
      return make()
    except OSError:
      if time.monotonic() > deadline:
        raise
      time.sleep(0.2)


class _Shipped:
  """The actor's link to a --wal replay: a futures client whose last
  add_batch is kept, so a window's shipping can drain before the next."""

  def __init__(self, client):
    self.client = client
    self.last = None

  def add_batch(self, trans):
    self.last = self.client.add_batch(trans)
    return self.last

  def close(self, timeout=30.0):
    # The replay answers add_batch calls in order: the last reply comes last.
    if self.last is not None:
      try:
        self.last.result(timeout)
      except Exception as error:
        print(f'  replay add_batch failed: {error!r}', flush=True)
    self.client.close(timeout=2)


def start_replays(config, outdir):
  """One replay server process per mode of WAL_MODES (--wal), on the
  fleet's config; returns {wal: (process, address)} once each answers."""
  from dreamer_ver.config import loading as configlib
  from dreamer_ver.rpc.addresses import free_port
  from dreamer_ver.rpc.client import Client
  context = multiprocessing.get_context('spawn')
  replays = {}
  for wal in WAL_MODES:
    replay_config = configlib.override(config, {
        'logdir': os.path.join(outdir, f'replay_{wal}'), 'replay.wal': wal,
        'replay.size': REPLAY_SIZE, 'run.train_ratio': 0.0,
        'run.replay_addr': f'127.0.0.1:{free_port()}',
        # Nobody listens: the replay's stats are dropped.
        'run.logger_addr': f'127.0.0.1:{free_port()}'})
    log = os.path.join(outdir, f'replay_{wal}.log')
    proc = context.Process(target=_replay_child, args=(replay_config, log),
                           name=f'replay_{wal}', daemon=True)
    proc.start()
    replays[wal] = (proc, replay_config.run.replay_addr)
  for _, addr in replays.values():
    probe = Client(addr, 'BenchReplayProbe')
    try:
      probe.sample_batch_eval().result(STARTUP_SECONDS)
    finally:
      probe.close(timeout=2)
  return replays


def _replay_child(config, log):
  """A --wal replay server process; its output (a line per connection)
  goes to `log`."""
  from dreamer_ver.runtime.replay_process import serve_replay
  with open(log, 'w') as file:
    os.dup2(file.fileno(), 1)
    os.dup2(file.fileno(), 2)
    sys.exit(serve_replay(config))


def stop_replays(replays):
  for proc, _ in replays.values():
    proc.kill()  # Its data is thrown away: no save.
    proc.join()


# ------------------------------------------------------------ one mode

class _CPU:
  """CPU seconds used by a set of processes since start. Processes that die
  keep their last sample (taken every `update`)."""

  def __init__(self, pids):
    self.first = {p: t for p, t in self._read(pids).items()}
    self.last = dict(self.first)

  def update(self):
    self.last.update(self._read(list(self.first)))

  def seconds(self):
    return sum(self.last[p] - self.first[p] for p in self.first)

  @staticmethod
  def _read(pids):
    import psutil
    times = {}
    for pid in pids:
      try:
        cpu = psutil.Process(pid).cpu_times()
        times[pid] = cpu.user + cpu.system
      except psutil.Error:
        pass
    return times


class LearnerLoad:
  """A learner thread training beside the actor (`--learner`): updates on
  zero batches, each one timed past the device's work and told to
  `listener` (the preempt cutoff's `learner_time`, else nobody)."""

  def __init__(self, actor, config):
    from dreamer_ver.learner.learner import Learner, Options

    class NoReplay:
      def update(self, rows):
        pass

    agent = actor.agent
    state = agent.init_state(agent.init_params(config.seed), config.seed)
    self.learner = Learner(
        agent, state, actor.params, Options.of(config),
        replay=NoReplay(), logger=None,
        ckpt=None, counters={'version': actor.params.version})
    self.learner.compile()
    self.batch = self.learner.zero_batch(
        config.batch_length + config.replay_context)
    self.listener = None
    self.updates = 0
    self.stopped = threading.Event()
    self.thread = threading.Thread(target=self._loop, daemon=True)
    self.thread.start()

  def _heard(self, seconds):
    self.updates += 1
    listener = self.listener
    if listener is not None:
      listener(seconds)

  def _update(self):
    """One update, timed past the device's work."""
    import jax
    began = time.perf_counter()
    self.learner.train_step(self.learner.parallel.put_rows(dict(self.batch)))
    jax.block_until_ready(self.learner.state['params'])
    return time.perf_counter() - began

  def _loop(self):
    while not self.stopped.is_set():
      self._heard(self._update())

  def alone(self, warmup, seconds):
    """Updates/s with nothing else served in this process (before the
    fleet starts): what the learner keeps beside the actor is against
    this."""
    time.sleep(warmup)
    before, start = self.updates, time.monotonic()
    time.sleep(seconds)
    return (self.updates - before) / (time.monotonic() - start)

  def close(self):
    self.stopped.set()
    self.thread.join(timeout=60)


def run_mode(mode, fleet, spec, args, actor, config, inference,
             replay=None, learner=None):
  """One window of `mode`; with `replay` (wal mode, address, pid) the
  actor ships its transitions there."""
  counter = Counter()
  shipped = None
  if replay is not None:
    from dreamer_ver.rpc.client import Client
    wal, addr, replay_pid = replay
    shipped = _Shipped(Client(addr, f'BenchReplay_{wal}', maxinflight=8))
    actor.shipper.replay = shipped
  port = int(str(config.run.actor_addr).rsplit(':', 1)[1])
  if mode == 'baseline':
    server = Baseline(port, actor, max(1, args.envs // 2), counter)
  else:
    server = Ours(config.run.actor_addr, actor, config, args.envs,
                  inference, counter, mode)
  if learner is not None:
    learner.listener = getattr(getattr(server, 'cutoff', None),
                               'learner_time', None)
  record = dict(fleet=spec['name'], mode=mode, envs=args.envs,
                wal=replay[0] if replay else None)
  window = args.seconds
  if spec['deaths']:
    window = max(window, FAULTS_MIN_SECONDS)
  try:
    # Envs that died (faults) or crashed while the previous server went
    # away are restarted now that this one listens; then every env is
    # served once (reconnects), then the warm-up, then the window.
    started = time.monotonic()
    ready = False
    while not ready and time.monotonic() < started + READY_SECONDS:
      fleet.revive()
      fleet.wait_started()
      time.sleep(0.05)
      with counter.lock:
        ready = fleet.alive() <= counter.envids
    record['ready_s'] = time.monotonic() - started if ready else None
    time.sleep(args.warmup)
    if fleet.revive():  # a crash during the warm-up: serve it once more
      fleet.wait_started()
      time.sleep(args.warmup)
    crashes = fleet.crashes
    server.stats()  # resets our server's counters
    own = [os.getpid()] + server.child_pids()
    envs = fleet.pids()
    cpu = _CPU(own), _CPU(envs), _CPU([replay_pid] if replay else [])
    sampled = time.monotonic()
    rows0, batches0, policy0 = counter.snapshot()
    updates0 = learner.updates if learner is not None else 0
    t0 = time.monotonic()
    end = t0 + window
    killed = not spec['deaths']
    stalled = False
    while True:
      now = time.monotonic()
      if now >= end:
        break
      if not killed and now >= t0 + DEATH_AT * window:
        fleet.kill(spec['deaths'])
        killed = True
      if now - max(counter.last, t0) > STALL_SECONDS:
        stalled = True
        break
      if now - sampled > 0.5:
        cpu[1].update()
        sampled = now
      time.sleep(min(0.05, end - now))
    t1 = time.monotonic()
    rows1, batches1, policy1 = counter.snapshot()
    updates = (learner.updates if learner is not None else 0) - updates0
    for each in cpu:
      each.update()
    stats = server.stats()
    stalled = stalled or rows1 == rows0  # a window shorter than STALL_SECONDS
    record['load'] = os.getloadavg()[0]  # the machine's other load shows
    fleet.revive()  # counts the env processes that crashed in the window
    record['env_crashes'] = fleet.crashes - crashes
  finally:
    server.close()
    if learner is not None:
      learner.listener = None
    if shipped is not None:
      shipped.close()
      actor.shipper.replay = None
  rows, batches = rows1 - rows0, batches1 - batches0
  # A stalled fleet would serve nothing for the rest of its window.
  seconds = window if stalled else t1 - t0
  record.update(
      sps=rows / seconds, stalled=stalled, rows=rows, seconds=seconds,
      t0=t0, t1=t1, batches=batches,
      batch_mean=rows / batches if batches else 0.0,
      policy_ms_mean=1000 * (policy1 - policy0) / batches if batches else 0.0,
      policy_share=(policy1 - policy0) / (t1 - t0),
      cpu_server=cpu[0].seconds() / (t1 - t0),
      cpu_envs=cpu[1].seconds() / (t1 - t0),
      cpu_replay=cpu[2].seconds() / (t1 - t0))
  if learner is not None:
    record['learner_ups'] = updates / (t1 - t0)
  if mode != 'baseline':
    record['server_p50_ms'] = stats.get('latency_ms/p50', 0.0)
    record['server_p99_ms'] = stats.get('latency_ms/p99', 0.0)
    record['queue_wait_p50_ms'] = stats.get('queue_wait_ms/p50', 0.0)
    record['cuts'] = {k[4:]: v for k, v in stats.items()
                      if k.startswith('cut/')}
    for key in ('wait_error_ms', 'learner_ms_per_batch', 'expected_batch',
                'real_batch'):
      if f'preempt/{key}' in stats:
        record[key] = stats[f'preempt/{key}']
  return record


# --------------------------------------------------------------- fleets

def make_actor(config, extra):
  """Agent, params and a compiled Actor for the config's task."""
  from dreamer_ver.agent.agent import Agent, policy_params
  from dreamer_ver.envs import make_env
  from dreamer_ver.actor.actor import Actor
  from dreamer_ver.actor.batching import bucket_sizes
  from dreamer_ver.actor.params import ParamsStore
  env = make_env(config.task, _with_extra(config.env, extra))
  agent = Agent(env.obs_space, env.act_space, config)
  env.close()
  store = ParamsStore(policy_params(agent.init_params(config.seed)))
  envs = config.run.envs
  actor = Actor(agent, store, slots=envs,
                buckets=bucket_sizes(config.run, envs), seed=config.seed)
  start = time.monotonic()
  actor.compile()
  # compile()'s single timing per bucket is noisy; re-measure so Preempt
  # starts from a fair estimate (it keeps learning while serving).
  inference = _measure_inference(actor)
  print(f'  compiled {config.task} ({time.monotonic() - start:.1f} s); '
        'inference ms per bucket:',
        {k: round(v * 1000, 2) for k, v in inference.items()}, flush=True)
  return actor, inference


def zero_requests(actor, size):
  """`size` valid requests of envs 0..size-1 with all-zero observations,
  as an env worker sends them."""
  datas = []
  for i in range(size):
    obs = {k: np.zeros(s.shape, s.dtype) for k, s in actor.obs_space.items()}
    obs['is_first'] = np.bool_(True)
    datas.append(env_worker.request([obs], [i], False, single=True))
  return datas


def _measure_inference(actor, repeats=20):
  times = {}
  for size in actor.buckets:
    datas = zero_requests(actor, size)
    samples = []
    for _ in range(repeats):
      start = time.perf_counter()
      actor.step(datas)
      samples.append(time.perf_counter() - start)
    times[size] = float(np.median(samples))
  return times


def run_fleet(name, args, actors, port, transport):
  from dreamer_ver.config import loading as configlib
  spec = fleet_spec(name, args.envs, args.step_time, args.jitter,
                    args.envs_per_worker)
  config = configlib.compose([args.size], {
      'task': spec['task'], 'run.envs': args.envs, 'run.eval_envs': 0,
      'run.actor_addr': f'127.0.0.1:{port}', 'run.actor_transport': transport,
      **spec['shared']})
  key = (spec['task'], args.size)
  if key not in actors:
    actors[key] = make_actor(config, spec['env_extra'])
  actor, inference = actors[key]
  server_config = config
  if args.rtt_ms:  # The envs reach the server through a delaying proxy.
    from dreamer_ver.rpc.addresses import free_port
    config = configlib.override(
        config, {'run.actor_addr': f'127.0.0.1:{free_port()}'})
  per = max(1, spec['per_worker'])
  groups = [list(range(i, min(i + per, args.envs)))
            for i in range(0, args.envs, per)]
  # Per-env overrides (hetero) need one env per process.
  configs = [configlib.override(config, spec['per_env'][g[0]]) if
             spec['per_env'][g[0]] else config for g in groups]
  modes = list(args.modes)
  if (per > 1 or args.wal or transport != 'tcp') and 'baseline' in modes:
    # portal.BatchServer stacks whole calls: a multi-env call would become
    # [batch, envs, ...]; upstream DreamerV3 has one env per process. It
    # calls Actor.step: nothing is shipped to a replay (--wal). It speaks
    # TCP only.
    modes.remove('baseline')
  wals = WAL_MODES if args.wal else (None,)
  rtts = args.rtt_ms or [None]
  rounds = {(rtt, mode, wal): [] for rtt in rtts for mode in modes
            for wal in wals}
  with tempfile.TemporaryDirectory(prefix='actor_bench_') as outdir:
    fleet = Fleet(configs, groups, outdir, spec['stall'], spec['env_extra'])
    replays = {}
    learner = None
    alone = None
    try:
      if args.learner:
        learner = LearnerLoad(actor, config)
        alone = learner.alone(args.warmup, args.seconds)
        print(f'  learner alone: {alone:.2f} updates/s', flush=True)
      if args.wal:
        replays = start_replays(config, outdir)
      began = time.monotonic()
      fleet.start_all()
      fleet.wait_started()
      print(f'  {args.envs} envs in {len(groups)} processes started in '
            f'{time.monotonic() - began:.1f} s', flush=True)
      # Rounds through all modes: slow drifts of the machine (other load)
      # hit every mode alike instead of one of them. The WAL variants of a
      # mode run back to back, first one and then the other in turn.
      for index in range(args.repeats):
        for rtt in rtts:
          proxy = _proxy(config, server_config, rtt)
          try:
            for mode in modes:
              for wal in (wals if index % 2 == 0 else wals[::-1]):
                replay = None
                if wal is not None:
                  proc, addr = replays[wal]
                  replay = (wal, addr, proc.pid)
                record = run_mode(mode, fleet, spec, args, actor,
                                  server_config, inference, replay, learner)
                record['rtt_ms'] = rtt
                rounds[(rtt, mode, wal)].append(record)
                print('  ' + _row(record, partial=True), flush=True)
          finally:
            if proxy is not None:
              proxy.close()
    finally:
      if learner is not None:
        learner.close()
      fleet.stop()
      stop_replays(replays)
    times, latency, durations = fleet.samples()
  if spec['mean_step'] is None:
    step = float(durations.mean()) if len(durations) else float('nan')
    limit = args.envs / step
  else:
    limit = nominal_limit(spec, args.envs)
  records = [_combine(each, times, latency) for each in rounds.values()]
  for record in records:
    record['envs_per_process'] = per
    record['transport'] = transport
    if alone is not None:
      record['learner_alone_ups'] = alone
  bases = {r['rtt_ms']: r['sps'] for r in records if r['mode'] == 'baseline'}
  for record in records:
    base = bases.get(record['rtt_ms'])
    record['limit_sps'] = limit
    record['ratio_limit'] = record['sps'] / limit
    record['ratio_baseline'] = record['sps'] / base if base else None
    if spec['mean_step'] is None:
      record['env_step_ms'] = 1000 * args.envs / limit
  return records


def _proxy(config, server_config, rtt_ms):
  """With --rtt_ms: the delay proxy from the envs' address to the server's,
  for one round trip time."""
  if rtt_ms is None:
    return None
  from delay_proxy import DelayProxy
  port = int(str(config.run.actor_addr).rsplit(':', 1)[1])
  host, target = str(server_config.run.actor_addr).rsplit(':', 1)
  return DelayProxy(port, (host, int(target)), rtt_ms)


def _combine(rounds, times, latency):
  """One record from the rounds of one mode: rows over seconds in all, the
  env-side latency percentiles over every window, averages of the rest."""
  first = rounds[0]
  seconds = sum(r['seconds'] for r in rounds)
  rows = sum(r['rows'] for r in rounds)
  batches = sum(r['batches'] for r in rounds)
  inside = np.zeros(len(times), bool)
  for r in rounds:
    inside |= (times >= r['t0']) & (times <= r['t1'])
  lat = latency[inside] * 1000
  record = dict(
      fleet=first['fleet'], mode=first['mode'], envs=first['envs'],
      wal=first['wal'], rtt_ms=first['rtt_ms'], sps=rows / seconds,
      p50_ms=float(np.percentile(lat, 50)) if len(lat) else None,
      p99_ms=float(np.percentile(lat, 99)) if len(lat) else None,
      stalled=any(r['stalled'] for r in rounds),
      rows=rows, seconds=seconds, rounds=len(rounds), batches=batches,
      batch_mean=rows / batches if batches else 0.0,
      latency_samples=int(len(lat)),
      round_sps=[r['sps'] for r in rounds])
  weigh = lambda key: sum(r[key] * r['seconds'] for r in rounds) / seconds
  for key in ('cpu_server', 'cpu_envs', 'cpu_replay', 'load', 'policy_share'):
    record[key] = weigh(key)
  record['env_crashes'] = sum(r['env_crashes'] for r in rounds)
  record['policy_ms_mean'] = (
      sum(r['policy_ms_mean'] * r['batches'] for r in rounds) / batches
      if batches else 0.0)
  if 'learner_ups' in first:
    record['learner_ups'] = weigh('learner_ups')
  for key in ('server_p50_ms', 'server_p99_ms', 'queue_wait_p50_ms',
              'wait_error_ms', 'learner_ms_per_batch', 'expected_batch',
              'real_batch'):
    if key in first:
      record[key] = float(np.mean([r[key] for r in rounds]))
  if 'cuts' in first:
    cuts = {}
    for r in rounds:
      for k, v in r['cuts'].items():
        cuts[k] = cuts.get(k, 0) + v
    record['cuts'] = cuts
  return record


# --------------------------------------------------------------- output

def _fmt(value, digits=1):
  if value is None:
    return '-'
  return f'{value:.{digits}f}'


HEADER = ('| fleet | mode | env steps/s | x baseline | x limit | limit | '
          'p50 ms | p99 ms | batch | policy share | stalled |')


def _name(r):
  """The mode, its transport, and with --wal the replay's WAL mode."""
  return (r['mode'] + (f' {r["transport"]}' if r.get('transport') else '') +
          (f' wal {r["wal"]}' if r['wal'] else '') +
          (f' rtt {r["rtt_ms"]:g} ms' if r.get('rtt_ms') is not None else ''))


def _row(r, partial=False):
  if partial:
    return (f'{r["fleet"]:10s} {_name(r):8s} {r["sps"]:8.1f} steps/s  '
            f'batch {r["batch_mean"]:5.2f}  policy {r["policy_ms_mean"]:5.2f} '
            f'ms  cpu server {r["cpu_server"]:.2f} envs {r["cpu_envs"]:.2f}'
            f'{"  replay %.2f" % r["cpu_replay"] if r["wal"] else ""}'
            f'{"  learner %.2f/s" % r["learner_ups"] if "learner_ups" in r else ""}'
            f'  ready {_fmt(r.get("ready_s"))} s  load {r["load"]:.1f}'
            f'{"  STALLED" if r["stalled"] else ""}'
            f'{"  env crashes %d" % r["env_crashes"] if r["env_crashes"] else ""}')
  return (f'| {r["fleet"]} | {_name(r)} | {r["sps"]:.0f} | '
          f'{_fmt(r["ratio_baseline"], 2)} | {_fmt(r["ratio_limit"], 2)} | '
          f'{r["limit_sps"]:.0f} | {_fmt(r["p50_ms"])} | {_fmt(r["p99_ms"])} '
          f'| {r["batch_mean"]:.1f} | {_fmt(r.get("policy_share"), 2)} | '
          f'{"yes" if r["stalled"] else "no"} |')


def table(records):
  lines = [HEADER, '|' + ' --- |' * 11]
  lines += [_row(r) for r in records]
  notes = []
  multi = next((r for r in records if r['fleet'] == 'fast_multi'), None)
  if multi:
    notes.append(
        f'fast_multi: {multi["envs_per_process"]} envs per process; portal\'s '
        'BatchServer cannot batch multi-env calls, so its x baseline is '
        'against the fast fleet\'s baseline.')
  if notes:
    lines += [''] + notes
  return '\n'.join(lines)


def latency_table(records):
  """--rtt_ms: env steps/s against the round trip between the env processes
  and the server, per fleet (envs per process) and mode."""
  lines = ['| fleet | envs per process | mode | round trip ms | env steps/s '
           '| x no delay | p50 ms | batch |', '|' + ' --- |' * 8]
  zero = {(r['fleet'], r['mode']): r['sps'] for r in records
          if r['rtt_ms'] == 0}
  for r in records:
    base = zero.get((r['fleet'], r['mode']))
    lines.append(
        f'| {r["fleet"]} | {r["envs_per_process"]} | {r["mode"]} | '
        f'{r["rtt_ms"]:g} | {r["sps"]:.0f} | '
        f'{_fmt(r["sps"] / base if base else None, 2)} | {_fmt(r["p50_ms"])} '
        f'| {r["batch_mean"]:.1f} |')
  return '\n'.join(lines)


def learner_table(records):
  """--learner: env steps/s and learner updates/s of every mode, against
  `ver` (the default) on the same fleet, with preempt's VER report."""
  lines = ['| fleet | mode | env steps/s | x ver | learner updates/s | x ver '
           '| x learner alone | batch | expected batch '
           '| learner ms per batch |',
           '|' + ' --- |' * 10]
  ver = {(r['fleet'], r['transport']): r for r in records
         if r['mode'] == 'ver'}
  for r in records:
    base = ver.get((r['fleet'], r['transport']))
    ratio = lambda key: (_fmt(r[key] / base[key], 2)
                         if base and base.get(key) else 'n/a')
    lines.append(
        f'| {r["fleet"]} | {_name(r)} | {r["sps"]:.0f} | {ratio("sps")} | '
        f'{r["learner_ups"]:.2f} | {ratio("learner_ups")} | '
        f'{_fmt(r["learner_ups"] / r["learner_alone_ups"], 2)} | '
        f'{r["batch_mean"]:.1f} | {_fmt(r.get("expected_batch"))} | '
        f'{_fmt(r.get("learner_ms_per_batch"))} |')
  return '\n'.join(lines)


def wal_table(records):
  """--wal: env steps/s against the replay without and with its log."""
  lines = ['| fleet | mode | env steps/s, wal off | wal flush | flush / off '
           '| flush / off per round | replay cores, off / flush |',
           '|' + ' --- |' * 7]
  for off in [r for r in records if r['wal'] == 'off']:
    on = next(r for r in records if r['wal'] == 'flush' and
              (r['fleet'], r['mode']) == (off['fleet'], off['mode']))
    per_round = ', '.join(
        f'{b / a:.2f}' for a, b in zip(off['round_sps'], on['round_sps']))
    lines.append(
        f'| {off["fleet"]} | {off["mode"]} | {off["sps"]:.0f} | '
        f'{on["sps"]:.0f} | {on["sps"] / off["sps"]:.3f} | {per_round} | '
        f'{off["cpu_replay"]:.3f} / {on["cpu_replay"]:.3f} |')
  return '\n'.join(lines)


def plot(records, path):
  try:
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
  except ImportError:
    print(f'matplotlib is not installed; skipping the plot {path}.')
    return
  fleets = list(dict.fromkeys(r['fleet'] for r in records))
  modes = list(dict.fromkeys(_name(r) for r in records))
  colors = dict(zip(MODES, ('#888888', '#4c72b0', '#55a868', '#c44e52')))
  fig, axes = plt.subplots(
      1, len(fleets), figsize=(3.2 * len(fleets), 3.6), squeeze=False)
  for ax, fleet in zip(axes[0], fleets):
    rows = {_name(r): r for r in records if r['fleet'] == fleet}
    xs = range(len(modes))
    values = [rows[m]['sps'] if m in rows else 0 for m in modes]
    bars = ax.bar(xs, values, color=[colors.get(m.split()[0], 'k')
                                     for m in modes])
    for bar, mode in zip(bars, modes):
      if mode in rows and rows[mode]['stalled']:
        bar.set_hatch('//')
        ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(),
                'stalled', ha='center', va='bottom', fontsize=7)
    if rows:
      limit = next(iter(rows.values()))['limit_sps']
      ax.axhline(limit, color='k', ls='--', lw=1)
    ax.set_xticks(list(xs), modes, rotation=30, fontsize=8)
    ax.set_title(fleet, fontsize=10)
    ax.set_ylabel('env steps/s' if fleet == fleets[0] else '')
  envs = records[0]['envs']
  fig.suptitle(
      f'{envs} env processes: env steps/s per actor mode (dashed: env-bound '
      f'limit; hatched: stalled)', fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  print(f'Wrote {path}.')


# ----------------------------------------------------------------- main

def parse_args(argv=None):
  parser = argparse.ArgumentParser(
      description=__doc__.split('\n\n')[0])
  parser.add_argument('--fleets', nargs='+', default=list(FLEETS),
                      choices=FLEETS, help='fleets to run (all)')
  parser.add_argument('--modes', nargs='+', default=list(MODES),
                      choices=MODES, help='modes to run (all; the '
                      'baseline always runs first)')
  parser.add_argument('--transports', nargs='+', default=list(TRANSPORTS),
                      choices=TRANSPORTS, help='how the env processes reach '
                      'our server; each fleet runs once per transport (tcp '
                      'shm)')
  parser.add_argument('--envs', type=int, default=None,
                      help='env processes per fleet (16; 8 with --quick)')
  parser.add_argument('--seconds', type=float, default=None,
                      help='measuring window per mode and round (6; 3 with '
                      '--quick); at least %.1f s for the faults fleet'
                      % FAULTS_MIN_SECONDS)
  parser.add_argument('--warmup', type=float, default=None,
                      help='seconds served before each window (2; 1 with '
                      '--quick)')
  parser.add_argument('--repeats', type=int, default=None,
                      help='rounds through all modes per fleet; sps sums '
                      'rows and seconds over the rounds (2; 1 with --quick)')
  parser.add_argument('--step_time', type=float, default=0.02,
                      help='mean env step seconds of the synthetic fleets '
                      '(0.02)')
  parser.add_argument('--jitter', type=float, default=0.5,
                      help='lognormal sigma of the lognormal fleet (0.5)')
  parser.add_argument('--envs_per_worker', type=int, default=4,
                      help='envs per process in the fast_multi fleet (4)')
  parser.add_argument('--size', default='size1m',
                      help='model size block of the policy (size1m; e.g. '
                      'size12m)')
  parser.add_argument('--quick', action='store_true',
                      help='8 envs, one 3 s window per mode: under 3 minutes '
                      'on 2 cores')
  parser.add_argument('--wait_load', type=float, default=0.0,
                      help='before each fleet, wait (up to 15 min) until the '
                      '1-minute load average is below this (0: do not wait)')
  parser.add_argument('--wal', action='store_true',
                      help='ship transitions to a replay server process and '
                      'run every mode against one with replay.wal off and '
                      'one with flush, interleaved (no baseline)')
  parser.add_argument('--learner', action='store_true',
                      help='a learner thread trains beside the actor on the '
                      'same device through every window (see above)')
  parser.add_argument('--rtt_ms', nargs='+', type=float, default=None,
                      help='the envs reach the server through a proxy that '
                      'adds each of these round trips (bench/delay_proxy.py;'
                      ' 0: the proxy alone), in turn on the same fleet; tcp '
                      'only')
  parser.add_argument('--out', default=None, help='write the records as JSON')
  parser.add_argument('--plot', default=None, help='write a PNG bar chart')
  args = parser.parse_args(argv)
  quick = args.quick
  if args.envs is None:
    args.envs = 8 if quick else 16
  if args.seconds is None:
    args.seconds = 3.0 if quick else 6.0
  if args.repeats is None:
    args.repeats = 1 if quick else 2
  if args.warmup is None:
    args.warmup = 1.0 if quick else 2.0
  if args.envs < 2:
    parser.error('--envs must be >= 2')
  if args.rtt_ms and args.transports != ['tcp']:
    parser.error('--rtt_ms delays TCP only: pass --transports tcp')
  if args.repeats < 1 or args.seconds <= 0 or args.warmup < 0:
    parser.error('need --repeats >= 1, --seconds > 0 and --warmup >= 0')
  # The baseline first, as the ratios refer to it.
  args.modes = [m for m in MODES if m in args.modes]
  args.fleets = [f for f in FLEETS if f in args.fleets]
  return args


def _wait_for_quiet(threshold, timeout=900.0):
  """Waits until the 1-minute load average is below `threshold` (other
  work on a shared machine skews every number), at most `timeout` s."""
  start = time.monotonic()
  if os.getloadavg()[0] < threshold:
    return
  print(f'waiting for the load average ({os.getloadavg()[0]:.2f}) to fall '
        f'below {threshold:g}...', flush=True)
  while os.getloadavg()[0] >= threshold:
    if time.monotonic() - start > timeout:
      print(f'  still {os.getloadavg()[0]:.2f} after {timeout:.0f} s; '
            'going on.', flush=True)
      return
    time.sleep(5.0)
  print(f'  waited {time.monotonic() - start:.0f} s.', flush=True)


def main(argv=None):
  args = parse_args(argv)
  # SIGTERM unwinds like Ctrl-C, so every finally block stops its children.
  signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
  start = time.monotonic()
  print(f'load average {os.getloadavg()[0]:.2f}; '
        f'actor_bench: {args.envs} envs, {args.step_time * 1000:.0f} ms '
        f'steps, {args.repeats} x {args.seconds:g} s windows per mode, policy '
        f'{args.size}, '
        f'{os.cpu_count()} CPU cores', flush=True)
  import portal
  from dreamer_ver.rpc.addresses import free_port
  portal.setup(host='127.0.0.1')  # the baseline binds loopback only
  # The baseline's batcher process dies with this process, even on SIGKILL.
  portal.initfn(_die_with_parent, call_now=False)
  actors, records = {}, []
  for name in args.fleets:
    if args.wait_load > 0:
      _wait_for_quiet(args.wait_load)
    for transport in args.transports:
      print(f'fleet {name} over {transport}:', flush=True)
      began = time.monotonic()
      records += run_fleet(name, args, actors, free_port(), transport)
      print(f'  ({time.monotonic() - began:.0f} s)', flush=True)
  # Rows without a baseline of their own (shm; fast_multi, see run_fleet)
  # compare with the tcp baseline of the same env, one env per process.
  baselines = {(r['fleet'], r['rtt_ms']): r['sps'] for r in records
               if r['mode'] == 'baseline'}
  for record in records:
    of = 'fast' if record['fleet'] == 'fast_multi' else record['fleet']
    base = baselines.get((of, record['rtt_ms']))
    if record['ratio_baseline'] is None and base:
      record['ratio_baseline'] = record['sps'] / base
      record['baseline_of'] = f'{of} over tcp'
  print()
  print(table(records))
  if args.wal:
    print()
    print(wal_table(records))
  if args.learner:
    print()
    print(learner_table(records))
  if args.rtt_ms:
    print()
    print(latency_table(records))
  print(f'\n{time.monotonic() - start:.0f} s in all.')
  if args.out:
    with open(args.out, 'w') as f:
      json.dump(records, f, indent=1)
    print(f'Wrote {args.out}.')
  if args.plot:
    plot(records, args.plot)
  return 0


if __name__ == '__main__':
  sys.exit(main())
