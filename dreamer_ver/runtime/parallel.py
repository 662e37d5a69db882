"""The parallel scripts: every component, alone or all together.

  parallel         everything on one machine: env processes, replay and
                   logger processes, and the agent (actor + learner threads)
  parallel_env     one env process (`--replica i` is its env id)
  parallel_envs    a fleet of env processes (ids from `run.envid_offset`)
  parallel_replay  the replay server
  parallel_logger  the logger server
  parallel_agent   the actor and learner

Components find each other by `run.actor_addr`, `run.replay_addr` and
`run.logger_addr`. The run stops by itself once `run.steps` train env steps
are served, or on SIGINT/SIGTERM; every component saves before it exits.
"""

import threading

import elements
import jax

from dreamer_ver.agent.agent import Agent, policy_params
from dreamer_ver.envs import make_env
from dreamer_ver.runtime import cutoff as cutofflib
from dreamer_ver.runtime import devices
from dreamer_ver.runtime.actor import Actor
from dreamer_ver.runtime.batcher import BatchServer
from dreamer_ver.runtime.client import Client
from dreamer_ver.runtime.env_worker import run_env
from dreamer_ver.runtime.learner import Checkpoint, Learner
from dreamer_ver.runtime.params import ParamsStore
from dreamer_ver.runtime.supervisor import Children
from dreamer_ver.runtime.process import (
    StopSignal, client_kwargs, fill_auto_ports, server_kwargs, with_token)


# ------------------------------------------------------------------ scripts

def parallel(config):
  """All components on this machine; the agent runs in this process."""
  config = with_token(_with_ports(config))
  run = config.run
  children = Children(run.restart_envs)
  children.start('logger', 'dreamer_ver.runtime.logger_server:serve_logger',
                 config)
  if not run.remote_replay:
    children.start('replay', 'dreamer_ver.runtime.replay_server:serve_replay',
                   config)
  if not run.remote_envs:
    _start_env_workers(children, config, offset=0)
  # Supervise on a thread of its own: the agent's loop can block on a client
  # call to a dead server (once a client's in-flight window is full it
  # waits for the reconnect), and that server
  # must still get restarted.
  children.supervise_in_background()
  try:
    if run.agent_process:
      children.start('agent', 'dreamer_ver.runtime.parallel:parallel_agent',
                     config)
      code = children.wait_for('agent', StopSignal())
    else:
      code = parallel_agent(config)
  finally:
    children.stop_all()
  return code


def parallel_env(config):
  config = with_token(config)
  return run_env(config, config.replica, config.replica >= config.run.envs)


def parallel_envs(config):
  config = with_token(config)
  children = Children(config.run.restart_envs)
  _start_env_workers(children, config, offset=config.run.envid_offset)
  stop = StopSignal()
  while not stop:
    children.supervise()
    stop.wait(0.5)
  children.stop_all()
  return 0


def parallel_replay(config):
  from dreamer_ver.runtime.replay_server import serve_replay
  return serve_replay(with_token(config))


def parallel_logger(config):
  from dreamer_ver.runtime.logger_server import serve_logger
  return serve_logger(with_token(config))


def parallel_agent(config):
  """The actor (batch server + policy) and the learner thread.

  Returns once `run.steps` env steps are served or on SIGINT/SIGTERM, after
  saving the agent checkpoint.
  """
  config = with_token(config)
  run = config.run
  stop = StopSignal()
  policy_devices, train_device = devices.setup(config)
  env = make_env(config.task, config.env)
  agent = Agent(env.obs_space, env.act_space, config)
  env.close()

  ckpt = Checkpoint(config.logdir)
  state = agent.init_state(agent.init_params(config.seed), config.seed)
  counters = {'steps': 0, 'version': 0}
  if ckpt.exists:
    state, counters = ckpt.load(state)
    print(f'Agent resumed at step {counters["steps"]} '
          f'(params version {counters["version"]}).')
  # The learner's state lives on the train device; the actor's params
  # copies (and so its carry tables, which the jitted step keeps beside
  # them) on the policy devices, one inference lane each.
  state = jax.device_put(state, train_device)
  store = ParamsStore(policy_params(state['params']), counters['version'],
                      devices=policy_devices)

  envs = run.envs + run.eval_envs
  max_batch = run.actor_max_batch if run.actor_max_batch > 0 else envs
  actor = Actor(
      agent, store, slots=max(envs, max_batch), buckets=_buckets(run, max_batch),
      seed=config.seed,
      replay=Client(
          run.replay_addr, 'ActorReplay', maxinflight=8, **client_kwargs(config)),
      logger=Client(
          run.logger_addr, 'ActorLogger', maxinflight=8, when_full='drop',
          **client_kwargs(config)))
  actor.served = counters['steps']
  inference = actor.compile()  # seconds per bucket, one dict per lane
  for lane, times in enumerate(inference):
    print(f'Policy compiled on {policy_devices[lane]}; inference ms per bucket:',
          {k: round(v * 1000, 2) for k, v in times.items()})

  logger = Client(
      run.logger_addr, 'LearnerLogger', maxinflight=2, when_full='drop',
      **client_kwargs(config))
  learner = Learner(
      agent, state, store, config,
      replay=Client(
          run.replay_addr, 'LearnerReplay', maxinflight=8, **client_kwargs(config)),
      logger=logger, ckpt=ckpt, counters=counters)
  clients = (actor.replay, actor.logger, learner.replay, logger)
  learner.compile()
  print('Learner compiled.')
  done = lambda: bool(stop) or actor.served >= run.steps
  server = BatchServer(
      run.actor_addr, actor.handle,
      [cutofflib.make_cutoff(run, envs, actor.buckets, times, len(inference))
       for times in inference],
      postfn=actor.post, workers=run.actor_threads, name='Actor',
      max_msg_size=actor.max_request_bytes(),
      **server_kwargs(run.actor_addr, config))
  server.start()

  def learn():
    should_save = elements.when.Clock(run.save_every)
    def stop_or_save():
      if should_save():
        counters['steps'] = actor.served
        learner.save()
      return done()
    learner.run(stop_or_save)

  learner_thread = threading.Thread(target=learn, name='Learner', daemon=True)
  learner_thread.start()
  should_log = elements.when.Clock(run.log_every)
  fps = elements.FPS()
  last = actor.served
  while not done():
    stop.wait(0.2)
    fps.step(actor.served - last)
    last = actor.served
    if should_log():
      stats = actor_stats(server.stats())
      stats['fps/policy'] = fps.result()
      stats['actor/served'] = actor.served
      # Updates the learner made since the params of the latest batch.
      stats['actor/policy_lag'] = store.version - actor.version
      logger.add(stats)

  server.close()
  learner_thread.join()
  counters['steps'] = actor.served
  learner.save()
  print(f'Agent saved at step {actor.served}.')
  for client in clients:
    client.close(timeout=1)
  return 0


# ------------------------------------------------------------------ helpers

def actor_stats(stats):
  """The batch server's stats as logger scalars; the batch-size histogram
  becomes one count per size (`actor/batch_size/007`, zero-padded so the
  keys sort by size)."""
  scalars = {f'actor/{k}': v for k, v in stats.items()
             if isinstance(v, (int, float))}
  for size, count in stats.get('batch_sizes', {}).items():
    scalars[f'actor/batch_size/{size:03d}'] = count
  return scalars


def _with_ports(config):
  run = config.run
  return config.update({
      'run.actor_addr': fill_auto_ports(run.actor_addr),
      'run.replay_addr': fill_auto_ports(run.replay_addr),
      'run.logger_addr': fill_auto_ports(run.logger_addr)})


def _start_env_workers(children, config, offset):
  """Train envs get ids offset .. offset+envs-1, eval envs the next ids;
  each process hosts up to `run.envs_per_worker` envs of one kind."""
  run = config.run
  per = max(1, run.envs_per_worker)
  for first, count, is_eval in ((0, run.envs, False),
                                (run.envs, run.eval_envs, True)):
    ids = [offset + first + i for i in range(count)]
    for group in (ids[i:i + per] for i in range(0, count, per)):
      name = f'env{group[0]}' if len(group) == 1 else (
          f'env{group[0]}-{group[-1]}')
      children.start(name, 'dreamer_ver.runtime.env_worker:run_envs',
                     config, group, is_eval)


def _buckets(run, max_batch):
  if list(run.actor_buckets) != [0]:
    return sorted(set(list(run.actor_buckets) + [max_batch]))
  sizes, size = [], 1
  while size < max_batch:
    sizes.append(size)
    size *= 2
  return sizes + [max_batch]
