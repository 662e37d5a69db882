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
This module only wires processes; what runs in each is in `runtime/`. The
agent process is imported only where it runs, so the env-only scripts never
load JAX.
"""

from dreamer_ver.rpc.addresses import fill_auto_ports
from dreamer_ver.runtime.env_worker import run_env
from dreamer_ver.runtime.logger_server import serve_logger
from dreamer_ver.runtime.process import StopSignal, with_token
from dreamer_ver.runtime.replay_server import serve_replay
from dreamer_ver.runtime.supervisor import Children

SERVERS_STOP_LAST = 1  # envs and agent stop first, so the servers save all


def parallel(config):
  """All components on this machine; the agent runs in this process."""
  config = with_token(_with_ports(config))
  run = config.run
  children = Children()
  children.start('logger', 'dreamer_ver.runtime.logger_server:serve_logger',
                 config, stop_order=SERVERS_STOP_LAST)
  if not run.remote_replay:
    children.start('replay', 'dreamer_ver.runtime.replay_server:serve_replay',
                   config, stop_order=SERVERS_STOP_LAST)
  if not run.remote_envs:
    _start_env_workers(children, config, offset=0)
  # Supervise on a thread of its own: the agent's loop can block on a client
  # call to a dead server (once a client's in-flight window is full it
  # waits for the reconnect), and that server must still get restarted.
  children.supervise_in_background()
  try:
    if run.agent_process:
      children.start('agent', 'dreamer_ver.runtime.agent_process:run_agent',
                     config, restart=False)
      code = children.wait_for('agent', StopSignal())
    else:
      from dreamer_ver.runtime.agent_process import run_agent
      code = run_agent(config)
  finally:
    children.stop_all()
  return code


def parallel_env(config):
  config = with_token(config)
  return run_env(config, config.replica, config.replica >= config.run.envs)


def parallel_envs(config):
  config = with_token(config)
  children = Children()
  _start_env_workers(children, config, offset=config.run.envid_offset)
  stop = StopSignal()
  while not stop:
    children.supervise()
    stop.wait(0.5)
  children.stop_all()
  return 0


def parallel_replay(config):
  return serve_replay(with_token(config))


def parallel_logger(config):
  return serve_logger(with_token(config))


def parallel_agent(config):
  from dreamer_ver.runtime.agent_process import run_agent
  return run_agent(config)


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
                     config, group, is_eval, restart=run.restart_envs)
