"""The evaluation worker's own process (`evaluation/worker.py` has the
contract and the caller's handle): `serve` builds the envs, the agent and an
RPC server; `_Evaluations` keeps at most one job running and one waiting and
the results not polled yet, and runs the jobs with the episode loop of
`evaluation/episodes.py` on the worker's own copy of the params, each
step's reward the sum of its `reward_keys` observations.
"""

import collections
import os
import socket
import threading
import time
import traceback
from collections.abc import Mapping

import numpy as np

from dreamer_ver.core.atomic import write_json
from dreamer_ver.rpc import addresses
from dreamer_ver.rpc.server import Server
from dreamer_ver.cluster.links import Links
from dreamer_ver.cluster.signals import StopSignal
from dreamer_ver.cluster.targets import load
from dreamer_ver.evaluation.records import (
    MODES, process_identity, record_path, remove_record)
from dreamer_ver.core.transitions import is_log


def serve(config, name, env_maker, init_fn, policy_maker, reward_keys,
          stop=None):
  """The worker: a child process of its EvalWorker's owner (`stop` None;
  it also ends when that process dies), or a thread of a Ray Host (`stop`
  is the Host's; Ray restarts it if its worker process dies). It serves at
  `run.eval_addr`, else at a free port."""
  parent = None
  if stop is None:
    parent, stop = os.getppid(), StopSignal()
  if init_fn is not None:
    load(init_fn)()
  from dreamer_ver.cluster import devices
  device = devices.setup(config)[0][0]  # the first policy device
  if env_maker is None:
    from dreamer_ver.envs import make_run_env
    make = lambda i: make_run_env(config, config.run.envs + i)
  else:
    make = load(env_maker)

  def make_policy(obs_space, act_space):
    """(the policy, a template of the params it takes)."""
    if policy_maker is None:
      from dreamer_ver.agent.agent import Agent, policy_params
      agent = Agent(obs_space, act_space, config)
      return agent, policy_params(agent.init_params(0))
    # A user's policy, with the agent's policy interface.
    policy = load(policy_maker)(obs_space, act_space)
    return policy, policy.init_params(0)

  evaluations = _Evaluations(
      make, make_policy, int(config.run.eval_worker_envs), device, stop,
      seed=int(config.seed), timeout=float(config.run.eval_timeout),
      reward_keys=tuple(reward_keys), hosted=parent is None)
  addr = config.run.eval_addr
  if not addr:
    port = addresses.free_port()
    addr = f'{_advertised(config.run.bind_host)}:{port}'
    bind = f'localhost:{port}'  # run.bind_host, when set, is used instead
  else:
    bind = addr
  server = Server(bind, f'EvalWorker{name}', **Links.of(config).server_kwargs())
  server.bind('submit', evaluations.submit)
  server.bind('poll', evaluations.poll, workers=2)  # Owner and from_name.
  server.bind('status', evaluations.status)
  server.bind('scalars', evaluations.scalars)
  server.bind('shutdown', evaluations.shutdown)
  server.start()
  thread = threading.Thread(
      target=evaluations.run, name='Evaluation', daemon=True)
  thread.start()
  path = record_path(config.logdir, name)
  write_json(path, {'name': name, 'addr': addr, 'pid': os.getpid(),
                    'identity': process_identity(os.getpid())})
  try:
    # An owner killed outright cannot shut the worker down: it goes too.
    while not stop.wait(0.5) and parent in (None, os.getppid()):
      pass
  finally:
    remove_record(path, os.getpid())
    server.close()
    thread.join(10)
    if not thread.is_alive():  # Else it still steps them; the exit ends both.
      evaluations.close_envs()
  return 0


class _Evaluations:
  """The worker's side: at most one job running and one waiting, and the
  results not polled yet. `submit`, `poll` and `status` run on the server's
  threads, `run` on the evaluation thread."""

  def __init__(self, make_env, make_policy, count, device, stop, seed,
               timeout, reward_keys, hosted=False):
    self.make_env = make_env  # env index -> env
    self.count = count  # envs, each running a share of a job's episodes
    self.device = device
    self.stop = stop
    self.seed = seed
    self.timeout = timeout  # seconds a job may run unless it says otherwise
    self.reward_keys = reward_keys
    self.hosted = hosted  # by a Ray Host, which alone may end it
    self.envs = self._build_envs()
    env = self.envs[0]
    self.scalar_keys = sorted(k for k, space in env.obs_space.items()
                              if space.shape == () and not is_log(k))
    self.agent, template = make_policy(env.obs_space, env.act_space)
    self.keys = tuple(template)
    self.shapes = {path: (tuple(np.shape(leaf)), np.asarray(leaf).dtype)
                   for path, leaf in _leaves(template)}
    self.cond = threading.Condition()
    self.pending = None  # the job waiting to run
    self.running = None  # the version being evaluated
    self.results = collections.deque()

  def submit(self, params, version, episodes, mode, max_steps=0, timeout=0,
             break_when_any_done=False):
    # Scalars arrive as numpy values from the wire.
    version, episodes, mode = int(version), int(episodes), str(mode)
    max_steps, timeout = int(max_steps), float(timeout)
    break_when_any_done = bool(break_when_any_done)
    if max_steps < 0 or timeout < 0:
      raise ValueError(
          f'max_steps and timeout must be >= 0, got {max_steps}, {timeout}')
    if mode not in MODES:
      raise ValueError(f'mode must be one of {MODES}, got {mode!r}')
    if episodes < 1:
      raise ValueError(f'episodes must be >= 1, got {episodes}')
    if not isinstance(params, Mapping):
      raise TypeError('params must be a dict of arrays')
    params = {k: params[k] for k in self.keys if k in params}
    _check_shapes(params, self.shapes)
    job = dict(params=params, version=version, episodes=episodes, mode=mode,
               max_steps=max_steps, timeout=timeout,
               break_when_any_done=break_when_any_done)
    with self.cond:
      replaced = self.pending['version'] if self.pending else None
      self.pending = job
      self.cond.notify_all()
    return {'version': version, 'replaced': replaced}

  def poll(self, timeout):
    timeout = float(timeout)
    if timeout < 0:
      raise ValueError(f'timeout must be >= 0, got {timeout}')
    with self.cond:
      self.cond.wait_for(lambda: self.results, timeout)
      return self.results.popleft() if self.results else None

  def status(self):
    with self.cond:
      pending = self.pending['version'] if self.pending else None
      return {'pid': os.getpid(), 'running': self.running,
              'pending': pending, 'results': len(self.results)}

  def scalars(self):
    """The keys of the env's scalar observations: what `reward_keys` may
    name (the caller checks them before it submits anything)."""
    return self.scalar_keys

  def shutdown(self):
    if self.hosted:
      # Ended here, the Host would sit idle with its resources and name.
      raise RuntimeError(
          'this eval worker runs on Ray: shut it down with the EvalWorker '
          'that started it (or ray.kill its actor)')
    self.stop.set()
    with self.cond:
      self.cond.notify_all()
    return {}

  def run(self):
    try:
      self._run_jobs()
    finally:
      self.close_envs()  # On the thread that used them (MuJoCo's GL context).

  def _run_jobs(self):
    while True:
      with self.cond:
        # A timeout, as SIGTERM sets `stop` without notifying.
        while self.pending is None and not self.stop.is_set():
          self.cond.wait(0.5)
        if self.stop.is_set():
          return
        job, self.pending = self.pending, None
        self.running = job['version']
      result = self._evaluate(**job)
      with self.cond:
        self.running = None
        if result is not None:
          self.results.append(result)
        self.cond.notify_all()

  def _evaluate(self, params, version, episodes, mode, max_steps, timeout,
                break_when_any_done):
    import jax
    from dreamer_ver.evaluation.episodes import episode_shares, run_episodes
    start = time.time()
    try:
      if self.envs is None:
        self.envs = self._build_envs()
      count = min(len(self.envs), episodes)
      timeout = timeout or self.timeout
      episodes_run, frames = run_episodes(
          self.agent, jax.device_put(params, self.device), self.envs[:count],
          episode_shares(episodes, count), mode, self.seed,
          duration=timeout, record=True, stop=self.stop, max_steps=max_steps,
          reward_keys=self.reward_keys,
          break_when_any_done=break_when_any_done)
      if self.stop.is_set():
        return None  # Shutting down: the episodes were cut short.
      if len(episodes_run) < (1 if break_when_any_done else episodes):
        self.close_envs()  # Mid-episode: the next evaluation starts afresh.
        return {'error': (
            f'the evaluation ran past its time limit ({timeout:g} s: '
            'the worker\'s eval_timeout, or the submit timeout) with '
            f'{len(episodes_run)} of {episodes} episodes finished; do the '
            'eval envs end their episodes (a time limit)?'),
            'version': version}
    except Exception as e:
      traceback.print_exc()
      self.close_envs()  # A failed env may be in any state: start afresh.
      return {'error': f'{type(e).__name__}: {e}', 'version': version}
    scores = [r['score'] for r in episodes_run]
    lengths = [r['length'] for r in episodes_run]
    mean = float(np.mean(scores))
    return {
        'version': version, 'mode': mode, 'episodes': len(scores),
        'scores': scores, 'lengths': lengths, 'reward': mean,
        'score_mean': mean,
        'score_std': float(np.std(scores)),
        'length_mean': float(np.mean(lengths)),
        'truncated': sum(r['truncated'] for r in episodes_run),
        'length_std': float(np.std(lengths)),
        'seconds': time.time() - start, 'frames': frames}

  def _build_envs(self):
    return [self.make_env(i) for i in range(self.count)]

  def close_envs(self):
    envs, self.envs = self.envs, None
    for env in envs or ():
      try:
        env.close()
      except Exception:
        traceback.print_exc()  # Closing a broken env; the rest still close.


def _leaves(tree, prefix=''):
  """(path, leaf) of a tree of nested dicts, in sorted key order."""
  for key in sorted(tree):
    value = tree[key]
    if isinstance(value, Mapping):
      yield from _leaves(value, f'{prefix}{key}/')
    else:
      yield f'{prefix}{key}', value


def _check_shapes(params, shapes):
  """ValueError naming every leaf of `params` missing, unexpected, or of
  another shape or dtype than `shapes` (path -> (shape, dtype)): one of
  another dtype would make the jitted policy compile again, or fail."""
  got = {path: (tuple(np.shape(leaf)), np.asarray(leaf).dtype)
         for path, leaf in _leaves(params)}
  missing = sorted(set(shapes) - set(got))
  extra = sorted(set(got) - set(shapes))
  wrong = [f'{p} {got[p][1]}{list(got[p][0])} (expected '
           f'{shapes[p][1]}{list(shapes[p][0])})' for p in sorted(got)
           if p in shapes and got[p] != shapes[p]]
  problems = [f'{label}: {", ".join(items[:5])}' for label, items in (
      ('missing', missing), ('unexpected', extra),
      ('wrong shape or dtype', wrong)) if items]
  if problems:
    raise ValueError(
        'params do not fit the eval worker\'s agent (same config as the run?) '
        + '; '.join(problems))


def _advertised(host):
  """The host other processes reach a server bound at `host` at."""
  if not host or host in ('localhost', '127.0.0.1'):
    return 'localhost'
  return socket.gethostname() if host in ('0.0.0.0', '::') else host
