"""The agent process: the actor's batch server and policy lanes, the learner
thread, and the loop that logs them until the run is done.

  build_agent(config)                            -> Agent
  build_actor(config, agent, store, counters, links)
                                                 -> (Actor, BatchServer,
                                                     preemption.Shared)
  build_learner(config, agent, state, store, ckpt, counters, links, logger)
                                                 -> Learner (compile_learner
                                                    compiles it)
  run_agent(config, eval_host)                   -> an AgentLife built,
                                                    served and finished
  run_learner(config)                            -> a multi-host run's learner
                                                    on another host

The learner's state lives on the train device; the actor's params copies
(and so its carry tables, which the jitted step keeps beside them) on the
policy devices, one inference lane each.
"""

import sys
import time

import elements
import jax
import numpy as np

from dreamer_ver.actor import batching, preemption
from dreamer_ver.actor.actor import Actor
from dreamer_ver.actor.params import ParamsStore
from dreamer_ver.agent import checkpoint
from dreamer_ver.agent.agent import Agent, policy_params
from dreamer_ver.core.atomic import storage_fault
from dreamer_ver.cluster import devices
from dreamer_ver.cluster.links import Links, resolve
from dreamer_ver.cluster.signals import StopSignal, every
from dreamer_ver.cluster.supervisor import (USER_ERROR, exit_leaving,
                                            stop_for_storage)
from dreamer_ver.cluster.token import with_token
from dreamer_ver.envs import make_env
from dreamer_ver.evaluation.periodic import PeriodicEvaluation
from dreamer_ver.learner.learner import Learner, loggable
from dreamer_ver.learner.learner import Options as LearnerOptions
from dreamer_ver.rpc import shm_protocol
from dreamer_ver.rpc.batch_server import BatchServer
from dreamer_ver.runtime.learner_thread import LearnerThread


def build_agent(config):
  """The agent for the run's task (the spaces of one env, then closed)."""
  env = make_env(config.task, config.env)
  try:
    return Agent(env.obs_space, env.act_space, config)
  finally:
    env.close()


def build_actor(config, agent, store, counters, links):
  """The actor with its links to replay and logger, compiled on every
  policy device, and its (not yet started) batch server: TCP for any
  host, shared memory for env processes on this one."""
  run = config.run
  envs = run.envs + run.eval_envs
  largest = batching.max_batch(run, envs)
  actor = Actor(
      agent, store, slots=max(envs, largest),
      buckets=batching.bucket_sizes(run, largest), seed=config.seed,
      replay=links.connect('replay', 'ActorReplay', maxinflight=8),
      logger=links.connect('logger', 'ActorLogger', maxinflight=8,
                           when_full='drop'))
  actor.shipper.served = actor.shipper.stored = counters['steps']
  print(f'Compiling the policy for batches of {actor.buckets} on '
        f'{len(actor.lanes)} device(s) (cached in jax.compile_cache for '
        'restarts)...', flush=True)
  inference = actor.compile()  # seconds per bucket, one dict per lane
  for lane, times in enumerate(inference):
    print(f'Policy compiled on {store.devices[lane]}; inference ms per '
          f'bucket:', {k: round(v * 1000, 2) for k, v in times.items()})
  shared = preemption.Shared()  # one decider for all lanes (preempt)
  cutoffs = [
      batching.make_cutoff(run, envs, actor.buckets, times, len(inference),
                             shared)
      for times in inference]
  transports = ('tcp',) if run.actor_transport == 'tcp' or not (
      shm_protocol.available()) else ('tcp', 'shm')
  server = BatchServer(
      run.actor_addr, actor.handle, cutoffs, postfn=actor.post,
      workers=run.actor_threads, name='Actor', transports=transports,
      max_msg_size=actor.max_request_bytes(), **links.server_kwargs())
  return actor, server, shared


def build_learner(config, agent, state, store, ckpt, counters, links, logger,
                  train_devices, on_update=None):
  """The learner on the train devices, not yet compiled (`compile_learner`);
  `on_update(seconds)` hears each update's device time."""
  learner = Learner(
      agent, state, store, LearnerOptions.of(config),
      replay=links.connect('replay', 'LearnerReplay', maxinflight=8),
      logger=logger, ckpt=ckpt, counters=counters, devices=train_devices,
      on_update=on_update)
  return learner


def compile_learner(learner):
  print('Compiling the learner...', flush=True)
  learner.compile()
  print('Learner compiled.', flush=True)


def run_agent(config, eval_host='process', stop=None):
  """Serves and trains until `run.steps` env steps are served, `run.duration`
  seconds passed, or SIGINT/SIGTERM (or `stop` is set), then saves the
  agent and returns 0. Its eval worker (`run.eval_every` > 0) runs on
  `eval_host`: 'process' (a child) or 'ray' (a Ray actor).

  If a part of the agent dies -- the learner thread, a batch-server loop, a
  link to replay or logger -- it prints the cause once, saves what is sound
  (not the learner's state after the learner failed: the last checkpoint
  stands) and returns 1, so the supervisor restarts the agent from its
  checkpoint instead of serving on with frozen params or not at all.
  """
  life = AgentLife.build(config, eval_host, stop)
  life.serve()
  return life.finish()


class AgentLife:
  """One life of the agent process, in three steps: `build` makes its parts
  and starts them, `serve` logs them until the run is done or a part failed
  (`cause` says which), `finish` stops them, saves what is sound and closes
  them (the exit code)."""

  @classmethod
  def build(cls, config, eval_host='process', stop=None):
    """The parts, started: the actor serving, the learner thread compiling
    (the envs act and fill replay meanwhile), the eval worker."""
    life = cls()
    life.began = time.monotonic()
    life.config = config = with_token(config)
    run = config.run
    life.stop = stop = stop if stop is not None else StopSignal()
    policy_devices, train_devices = devices.setup(config)
    agent = build_agent(config)
    ckpt, state, counters = checkpoint.restore(
        agent, config.logdir, config.seed, config.run.from_checkpoint,
        config.run.keep_checkpoints)
    store = ParamsStore(policy_params(state['params']), counters['version'],
                        devices=policy_devices)
    life.links = links = Links.of(config)
    life.actor, life.server, shared = build_actor(
        config, agent, store, counters, links)
    life.logger = links.connect('logger', 'LearnerLogger', maxinflight=2,
                                when_full='drop')
    # VER's learner time: only where the learner takes the policy's device.
    shares = run.actor_cutoff == 'preempt' and bool(
        set(policy_devices) & set(train_devices))
    life.learner = build_learner(
        config, agent, state, store, ckpt, counters, links, life.logger,
        train_devices, shared.learner_time if shares else None)
    life.shipper = life.actor.shipper
    life.counters = counters
    life.faults = []  # A save's StorageFault: no later save is tried.
    life.cause = None  # Why the agent cannot go on, once `serve` finds it.
    life.start = time.monotonic()
    life.should_save = every(run.save_every)
    life.server.start()
    life.learner_thread = LearnerThread(
        lambda: compile_learner(life.learner), life._train,
        may_leave=config.jax.processes == 1).start()
    life.evaluation = life.eval_logger = None
    if run.eval_every > 0:
      # A link of its own that waits rather than drops: its rows are rare.
      life.eval_logger = links.connect('logger', 'EvalLogger', maxinflight=2)
      life.evaluation = PeriodicEvaluation.of(
          config, lambda: jax.device_get(store.latest()),
          lambda: store.version,
          lambda metrics: life.eval_logger.add(loggable(metrics)),
          host=eval_host).start()
    life.clients = {'actor to replay': life.shipper.replay,
                    'actor to logger': life.shipper.logger,
                    'learner to replay': life.learner.replay,
                    'learner to logger': life.logger}
    return life

  def done(self):
    """Stopped, or `run.steps` served, or `run.duration` passed."""
    run = self.config.run
    return bool(self.stop) or self.shipper.served >= run.steps or (
        run.duration > 0 and time.monotonic() - self.start >= run.duration)

  def serve(self):
    """Until done or a part failed: watches the parts and logs the actor's
    stats every `run.log_every` seconds."""
    server, shipper, actor = self.server, self.shipper, self.actor
    should_log = every(self.config.run.log_every)
    fps = elements.FPS()
    last = shipper.served
    first = shipper.served  # None once the first action is out
    try:
      while not self.done():
        self.stop.wait(0.2)
        self.cause = failure(self.learner_thread.errors, server, self.clients)
        if self.cause:
          self.stop.set()  # Ends the learner's loop too.
          break
        if first is not None and shipper.served > first:
          first = None  # The start-up time a restart costs (bench/system/startup.py).
          print(f'First action served {time.monotonic() - self.began:.1f} s '
                f'after the agent started.', flush=True)
        fps.step(shipper.served - last)
        last = shipper.served
        if should_log():
          stats = actor_stats(server.stats(), max(actor.buckets))
          stats['fps/policy'] = fps.result()
          stats['actor/served'] = shipper.served
          stats['actor/ship_errors'] = shipper.errors
          stats['actor/carry_refused'] = sum(
              lane.refused for lane in actor.lanes)
          lags = actor.take_lags()
          if lags:
            stats['actor/policy_lag/mean'] = sum(lags) / len(lags)
            stats['actor/policy_lag/max'] = max(lags)
          self.logger.add(stats)
    finally:
      if self.evaluation is not None:
        # No new evaluations (also when the loop raised: a worker left
        # running would keep this process from exiting); it ends after
        # the save.
        self.evaluation.stop.set()

  def finish(self):
    """Stops the parts, saves unless the learner failed, closes the links;
    returns the exit code (1: a part failed, USER_ERROR: the disk refused
    a save). With the learner's compile left behind it ends the process
    itself (`exit_leaving`)."""
    shipper = self.shipper
    self.server.close()
    self.stop.set()  # A learner still compiling then never trains.
    left_compiling = self.learner_thread.finish()
    # What a compile left behind raises later is not this run's.
    failed = [] if left_compiling else self.learner_thread.errors
    cause = self.cause or failure(failed, self.server, self.clients)
    if failed:
      print(f'Agent failed: {cause}. Not saving the learner state; a restart '
            f'resumes from the last checkpoint.', file=sys.stderr, flush=True)
    else:
      release_last_shipments(self.links, shipper)
      self.counters['steps'] = shipper.stored  # What replay holds.
      if self._save():
        print(f'Agent saved at step {shipper.stored}.')
      if cause:
        print(f'Agent failed: {cause}.', file=sys.stderr, flush=True)
    links = dict(self.clients)
    if self.evaluation is not None:
      self.evaluation.close(timeout=30)
      links['evaluation to logger'] = self.eval_logger
    # The last metrics are answered before their links close (a close cuts
    # off what is still being sent): 2 s at most in all. Not the replay
    # links: their sample calls wait on a limiter that no longer opens.
    deadline = time.monotonic() + 2
    for name, client in links.items():
      if name.endswith('to logger'):
        client.settle(max(0.0, deadline - time.monotonic()))
    for client in links.values():
      client.close(timeout=1)
    code = 1 if cause else USER_ERROR if self.faults else 0
    if left_compiling:
      exit_leaving(code)
    return code

  def _train(self):
    """The learner thread's loop after its compile: trains, saving every
    `run.save_every` seconds, until done or a part failed."""
    self.learner.run(self._stop_or_save,
                     failing=lambda: self.cause is not None)
    # The learners stopped (another process may have): so do we.
    self.stop.set()

  def _stop_or_save(self):
    if self.should_save():
      self.counters['steps'] = self.shipper.served
      self._save()
    return self.done()

  def _save(self):
    """Saves the learner; after a full or read-only disk, says so once
    and stops the run in order (later saves are not tried)."""
    if self.faults:
      return False
    try:
      self.learner.save()
      return True
    except Exception as error:
      fault = storage_fault(error, self.config.logdir)
      if fault is None:
        raise
      self.faults.append(fault)
      stop_for_storage('agent', f'{fault}; the last checkpoint stands',
                       self.stop)
      return False


def run_learner(config, stop=None):
  """A learner process of a multi-host run (`jax.process_id` > 0; see
  learner/learner.py): trains its share of every batch in lockstep with the
  agent process until the agent's learner stops, or SIGINT/SIGTERM (or
  `stop`) stops this one, which stops them all. Returns 0, or 1 when the
  agent stopped for a failure (it restarts, and this process must restart
  to join it). It has no actor and saves nothing: process 0 saves the
  state they share."""
  config = with_token(config)
  stop = stop if stop is not None else StopSignal()
  # Under --script ray, 'ray:agent/jax.coordinator': process 0's Host
  # picks the port on whichever node Ray placed it.
  coordinator = resolve(config.jax.coordinator, stop)
  if coordinator is None:
    return 0
  config = config.update({'jax.coordinator': coordinator})
  _, train_devices = devices.setup(config)
  agent = build_agent(config)
  state = agent.init_state(agent.init_params(config.seed), config.seed)
  learner = build_learner(config, agent, state, None, None,
                          {'steps': 0, 'version': 0}, Links.of(config), None,
                          train_devices)
  compile_learner(learner)
  print(f'Learner process {config.jax.process_id} of {config.jax.processes} '
        f'training from params version {learner.counters["version"]}.',
        flush=True)
  try:
    agent_failed = learner.run(lambda: bool(stop))
  finally:
    learner.replay.close(timeout=1)
  print(f'Learner process {config.jax.process_id} stopped at params version '
        f'{learner.counters["version"]} (params checksum '
        f'{learner.checksum()!r}).', flush=True)
  if agent_failed:
    print('The agent process failed: restarting with it.', flush=True)
  return 1 if agent_failed else 0


def release_last_shipments(links, shipper, timeout=5.0):
  """At a stop: asks replay to store this agent's last shipments without
  waiting for the limiter (the learner no longer samples) and waits up to
  `timeout` seconds for each step of it, so the saved step count is what
  replay holds."""
  if shipper.replay is None:
    return
  client = links.connect('replay', 'AgentRelease', maxinflight=1)
  try:
    client.release_inserts(np.int64(shipper.sender)).result(timeout=timeout)
  except Exception as error:
    print(f'[agent] replay did not release the last shipments: {error!r}',
          flush=True)
  finally:
    client.close(timeout=1)
  if not shipper.drain(timeout):
    print(f'[agent] shipments replay did not answer within {timeout:g} s '
          'are not counted', flush=True)


def failure(learner_errors, server, links):
  """Why the agent cannot go on, or None while every part is alive: the
  learner thread (the exceptions it raised), the batch server (its loops and
  socket) and the client links (name -> Client)."""
  if learner_errors:
    return f'the learner raised {learner_errors[0]!r}'
  error = server.error
  if error is not None:
    return f'the batch server failed: {error!r}'
  for name, client in links.items():
    if client.error is not None:
      return f'the {name} link failed: {client.error!r}'
  return None


def actor_stats(stats, largest):
  """The batch server's stats as logger scalars; the batch-size histogram
  becomes one count per power-of-two bin up to `largest` (the key names
  its smallest size, zero-padded so the keys sort: `actor/batch_size/004`
  counts the batches of 4 to 7), every bin in every report, zeros too: the
  logger averages each key over the reports of its interval, and a bin
  missing from one of them would break the sum (the batches)."""
  scalars = {f'actor/{k}': v for k, v in stats.items()
             if isinstance(v, (int, float))}
  lower = 1
  while lower <= largest:
    scalars[f'actor/batch_size/{lower:03d}'] = 0
    lower *= 2
  for size, count in stats.get('batch_sizes', {}).items():
    scalars[f'actor/batch_size/{1 << (size.bit_length() - 1):03d}'] += count
  return scalars
