"""One mode of the actor bench (bench/actor/actor_bench.py) measured on a fleet
(`run_mode`), with its CPU and, for `--learner`, a learner training beside
the policy (`LearnerLoad`)."""

import os
import threading
import time

from bench.actor.actor_fleets import DEATH_AT
from bench.actor.actor_servers import Baseline, Counter, Ours, Shipped

MODES = ('baseline', 'fixed', 'ver', 'preempt')
STALL_SECONDS = 3.0  # no step served for this long = the fleet stalled
READY_SECONDS = 60.0  # time for every live env to be served once
# The faults window must outlast the deaths by the stall detection time.
FAULTS_MIN_SECONDS = (STALL_SECONDS + 1.0) / (1.0 - DEATH_AT)


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
    shipped = Shipped(Client(addr, f'BenchReplay_{wal}', maxinflight=8))
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


