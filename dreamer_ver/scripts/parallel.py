"""The parallel scripts: every component, alone or all together.

  parallel         everything on one machine: env processes, replay and
                   logger processes, and the agent process (actor + learner
                   threads), all supervised by this process
  parallel_env     one env process (`--replica i` is its env id)
  parallel_envs    a fleet of env processes (ids from `run.envid_offset`)
  parallel_replay  the replay server, in a supervised child process
  parallel_logger  the logger server, in a supervised child process
  parallel_agent   the actor and learner, in a supervised child process
  parallel_learner a learner of a multi-host run (`jax.process_id` > 0) on
                   another host, in a supervised child process

Components find each other by `run.actor_addr`, `run.replay_addr` and
`run.logger_addr`. The run stops by itself once `run.steps` train env steps
are served, or on SIGINT/SIGTERM; every component saves before it exits.
A component that crashes (exits non-zero) is restarted with backoff and
resumes from its checkpoint; the others reconnect by themselves. This
module only wires processes; what runs in each is in `runtime/`, and the
processes that start them never load JAX.
"""

import contextlib
import time

from dreamer_ver.cluster.signals import StopSignal
from dreamer_ver.cluster.supervisor import Supervisor
from dreamer_ver.cluster.targets import AGENT, ENVS, LEARNER, LOGGER, REPLAY
from dreamer_ver.cluster.token import with_token
from dreamer_ver.logger.summary import summary
from dreamer_ver.rpc.addresses import fill_auto_ports, handshake
from dreamer_ver.runtime.env_worker import fleets, run_env


SERVERS_STOP_LAST = 1  # envs and agent stop first, so the servers save all


def parallel(config):
  """All components on this machine, each in a supervised child process.
  Returns 0 once the agent finished (or on SIGINT/SIGTERM); ends with the
  run's summary."""
  began = time.monotonic()
  with contextlib.ExitStack() as ports:  # Held for the servers till the end.
    config = with_token(_with_ports(config, ports))
    run = config.run
    stop = StopSignal()
    children = _children(config)
    children.start('logger', LOGGER, config, stop_order=SERVERS_STOP_LAST,
                   probe=run.logger_addr)
    if not run.remote_replay:
      children.start('replay', REPLAY, config, stop_order=SERVERS_STOP_LAST,
                     probe=run.replay_addr)
    if not run.remote_envs:
      _start_env_workers(children, config, offset=0)
    children.start('agent', AGENT, config, probe=run.actor_addr)
    code = _wait(children, 'agent', stop)
  print(summary(config.logdir, time.monotonic() - began, code,
                children.reached), flush=True)
  return code


def parallel_env(config):
  config = with_token(config)
  return run_env(config, config.replica, config.replica >= config.run.envs)


def parallel_envs(config):
  config = with_token(config)
  children = _children(config)
  _start_env_workers(children, config, offset=config.run.envid_offset)
  stop = StopSignal()
  while not stop and children.gave_up is None:
    children.supervise()
    stop.wait(0.5)
  children.stop_all()
  return children.failure_code()


def parallel_replay(config):
  return _supervised(config, 'replay', REPLAY, config.run.replay_addr)


def parallel_logger(config):
  return _supervised(config, 'logger', LOGGER, config.run.logger_addr)


def parallel_agent(config):
  return _supervised(config, 'agent', AGENT, config.run.actor_addr)


def parallel_learner(config):
  return _supervised(config, 'learner', LEARNER)


def _supervised(config, name, target, probe=None):
  """One component of a split launch, restarted whenever it crashes or
  hangs."""
  stop = StopSignal()
  config = with_token(config)
  children = _children(config)
  children.start(name, target, config, probe=probe)
  return _wait(children, name, stop)


def _children(config):
  """A supervisor with the run's crash-loop limit, and heartbeats with its
  token and `run.peer_timeout` (needs `with_token` first)."""
  return Supervisor(crash_limit=config.run.crash_limit,
                  crash_window=config.run.crash_window,
                  peer_timeout=config.run.peer_timeout,
                  handshake=handshake(config.run.token))


def _wait(children, name, stop):
  """Supervises until child `name` finishes (or SIGINT/SIGTERM), then stops
  every child. Supervision runs on a thread of its own as well: a child may
  wait on a dead server (a client's full in-flight window blocks until the
  reconnect), and that server must still get restarted."""
  children.supervise_in_background()
  try:
    return children.wait_for(name, stop)
  finally:
    children.stop_all()


def _with_ports(config, held):
  """The config with its `{auto}` ports chosen, each held by a socket in
  `held` until the run ends, so that the servers (and their restarts)
  find them free."""
  run = config.run
  return config.update({
      'run.actor_addr': fill_auto_ports(run.actor_addr, held),
      'run.replay_addr': fill_auto_ports(run.replay_addr, held),
      'run.logger_addr': fill_auto_ports(run.logger_addr, held)})


def _start_env_workers(children, config, offset):
  for name, ids, is_eval in fleets(config.run, offset):
    children.start(name, ENVS,
                   config, ids, is_eval, restart=config.run.restart_envs)
