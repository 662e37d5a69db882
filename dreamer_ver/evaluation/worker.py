"""EvalWorker: scores of submitted params, measured in a process of its own
so training never waits for them (after TorchRL's RayEvalWorker; hosting,
queueing and finding a worker by name: docs/architecture.md, Evaluation).

  worker = EvalWorker(config, name='eval')      # starts the worker process
  worker.submit(policy_params(params), version, episodes=4, mode='greedy')
  result = worker.poll(timeout=0)               # None, or one result
  worker.shutdown()                             # ends the process

* `EvalWorker(config, name, env_maker, init_fn, host, num_cpus, num_gpus,
  start_timeout, cancel, policy_maker, remote_kwargs)`: `host` 'process'
  (a child process that ends with its starter) or 'ray' (a Ray actor
  `eval_worker_<name>` with those resources and Ray options, after
  `ray.init`). Its envs are `run.eval_worker_envs` run envs, or
  `env_maker(i)`; its policy the run's Agent, or `policy_maker(obs_space,
  act_space)` (the agent's `init_params`, `init_carry`, `policy`).
  `env_maker`, `policy_maker` and `init_fn()` (run first in the worker,
  before JAX starts) are 'module:function' strings or picklable top-level
  functions, refused in the caller otherwise. `cancel` (an Event) ends the
  wait for a worker still starting.
* `submit(params, version, episodes, mode, max_steps, timeout)` returns
  once the job is checked and queued: params that do not fit the worker's
  policy are an error to the caller; `mode` 'greedy' or 'sample';
  `max_steps` (0 = none) cuts an episode (counted as truncated); `timeout`
  (default `run.eval_timeout`) bounds the evaluation. One job runs, at most
  one waits: a submit replaces the waiting one (returned as `replaced`).
* `poll(timeout=0)`: None, or the oldest result not returned yet, once:
  version, mode, episodes, scores, lengths, score_mean, score_std,
  length_mean, length_std, truncated, seconds and frames (uint8
  [T, H, W, C] of the first episode when the env renders, else None); or
  {'error': '<type>: <message>', 'version': v}.
* `EvalWorker.from_name(name, logdir or token=...)` connects from any
  process, and follows a worker restarted under that name; it does not own
  the worker (`close()` disconnects, `shutdown()` still stops it).
* `PeriodicEvaluation` (below) is the runs' use of it.
"""

import os
import pickle
import re
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from dreamer_ver.cluster.links import Links
from dreamer_ver.cluster.supervisor import Supervisor
from dreamer_ver.cluster.targets import EVAL_WORKER, load
from dreamer_ver.cluster.token import TOKEN_ENV, with_token
from dreamer_ver.evaluation.records import (
    MODES, clear_stale_record, record_path, recorded_addr, remove_record,
    wait_for_record)
from dreamer_ver.rpc import addresses
from dreamer_ver.rpc.client import Client

HOSTS = ('process', 'ray')
START_SECONDS = 300  # the worker imports JAX and builds its envs first
CALL_SECONDS = 60  # slack for an RPC reply on top of what it waits for


class EvalWorker:
  """The caller's handle of an evaluation worker process (module docstring)."""

  def __init__(self, config, name='eval', env_maker=None, init_fn=None,
               host='process', num_cpus=1.0, num_gpus=0.0,
               start_timeout=START_SECONDS, cancel=None, policy_maker=None,
               remote_kwargs=None):
    _check_name(name)
    if host not in HOSTS:
      raise ValueError(f'host must be one of {HOSTS}, got {host!r}')
    if int(config.run.eval_worker_envs) < 1:
      raise ValueError(f'an EvalWorker needs run.eval_worker_envs >= 1, got '
                       f'{config.run.eval_worker_envs}')
    env_maker = _portable(env_maker, 'env_maker')
    init_fn = _portable(init_fn, 'init_fn')
    policy_maker = _portable(policy_maker, 'policy_maker')
    config = with_token(config).update({'jax.prealloc': False})
    self.name = name
    self.record = record_path(config.logdir, name)
    self._children = self._process = self._actor = None
    if host == 'process':
      clear_stale_record(self.record)
      self._children = Supervisor()
      self._process = self._children.start(
          f'eval_worker_{name}', EVAL_WORKER, config, name, env_maker, init_fn,
          policy_maker, restart=False)
      try:
        addr = wait_for_record(
            self.record, self._process, start_timeout, cancel)['addr']
      except BaseException:
        self._children.stop_all()
        raise
    else:
      from dreamer_ver.cluster import ray_host
      actor = f'eval_worker_{name}'
      self._actor = ray_host.start(
          config, actor, EVAL_WORKER, name, env_maker, init_fn, policy_maker,
          serves='run.eval_addr', **{
              'num_cpus': num_cpus,
              'num_gpus': ray_host.available_gpus(num_gpus),
              **(remote_kwargs or {})})
      addr = ray_host.Lookup(actor)
    self._client = Client(
        addr, f'EvalWorker{name}', **Links.of(config).client_kwargs())
    if host == 'ray':
      try:
        # Placed, started and serving.
        self._call('status', wait=start_timeout, cancel=cancel)
      except BaseException:
        self.shutdown(timeout=5)
        raise

  @classmethod
  def from_name(cls, name, logdir=None, token=None, timeout=10.0):
    """A handle of the running worker `name` of the run in `logdir`, or
    with `logdir` None, of the Ray-hosted worker `name` in the caller's
    Ray namespace (the caller has called `ray.init` on its cluster)."""
    _check_name(name)
    token = token or os.environ.get(TOKEN_ENV, '')
    if logdir is None:
      from dreamer_ver.cluster import ray_host
      path, addr = None, ray_host.Lookup(f'eval_worker_{name}')
    else:
      path = record_path(logdir, name)
      if not path.is_file():
        raise FileNotFoundError(
            f'no eval worker named {name!r} runs for {logdir} (no {path})')
      if not token and (Path(logdir) / 'token').is_file():
        token = (Path(logdir) / 'token').read_text().strip()
      addr = recorded_addr(path)
    worker = cls.__new__(cls)
    worker.name = name
    worker.record = path
    worker._children = worker._process = worker._actor = None  # Not owned.
    worker._client = Client(
        addr, f'EvalWorker{name}', handshake=addresses.handshake(token))
    try:
      worker._call('status', wait=timeout)
    except Exception as e:
      worker.close()
      raise ConnectionError(
          f'eval worker {name!r} ({path or addr}) does not answer: {e!r}') from None
    return worker

  def submit(self, params, version, episodes=1, mode='greedy', max_steps=0,
             timeout=None):
    """Queues an evaluation of `params`; returns {'version', 'replaced'}
    (the version of the waiting job this one replaced, or None).
    `max_steps` (0 = none) cuts each episode after that many steps (it
    counts as truncated); `timeout` (seconds; None: `run.eval_timeout`)
    bounds the whole evaluation."""
    if mode not in MODES:
      raise ValueError(f'mode must be one of {MODES}, got {mode!r}')
    if int(episodes) != episodes or episodes < 1:
      raise ValueError(f'episodes must be an integer >= 1, got {episodes!r}')
    if int(version) != version:
      raise ValueError(f'version must be an integer, got {version!r}')
    if not isinstance(params, Mapping):
      raise TypeError(
          f'params must be a dict of arrays, got {type(params).__name__}')
    if int(max_steps) != max_steps or max_steps < 0:
      raise ValueError(f'max_steps must be an integer >= 0, got {max_steps!r}')
    if timeout is not None and not timeout > 0:
      raise ValueError(f'timeout must be > 0 seconds, got {timeout!r}')
    params = _numpy_tree(params)
    return self._call('submit', params, int(version), int(episodes), mode,
                      int(max_steps), float(timeout or 0))

  def poll(self, timeout=0.0):
    """The next result not returned yet, waiting up to `timeout` seconds
    for one; None if there is none by then."""
    if timeout < 0:
      raise ValueError(f'timeout must be >= 0, got {timeout}')
    return self._call('poll', float(timeout), wait=timeout + CALL_SECONDS)

  def status(self):
    """{'pid': the worker's, 'running': version or None, 'pending': version
    or None, 'results': results not polled yet}."""
    return self._call('status')

  def alive(self):
    """False once the worker's process has exited (Ray restarts a worker
    hosted there instead; a `from_name` handle cannot tell)."""
    return self._process is None or self._process.is_alive()

  def shutdown(self, timeout=30.0):
    """Ends the worker (an evaluation in progress is dropped)."""
    if self._actor is not None:
      from dreamer_ver.cluster import ray_host
      self.close()
      ray_host.remove(self._actor, timeout)  # Its Host stops the server.
      return
    if self._process is None:  # A from_name handle: errors are the caller's.
      try:
        self._call('shutdown', wait=min(timeout, CALL_SECONDS))
      finally:
        self.close()
      return
    if self.alive():
      try:
        self._call('shutdown', wait=min(timeout, CALL_SECONDS))
      except Exception:
        pass  # It may be gone already; the owner below makes sure.
    self.close()
    if self._process is not None:
      self._process.join(timeout)
      self._children.stop_all()  # Terminates it if it did not stop.
      remove_record(self.record, self._process.pid)

  def close(self):
    """Disconnects this handle; the worker keeps running."""
    self._client.close()

  def _call(self, method, *args, wait=CALL_SECONDS, cancel=None):
    """The reply of `method`; waits at most `wait` seconds, and stops
    waiting once the worker's process has exited or `cancel` is set."""
    future = self._client.call(method, *args)
    deadline = time.monotonic() + wait
    while True:
      try:
        left = max(0.0, deadline - time.monotonic())
        return _plain(future.result(min(1.0, left)))
      except TimeoutError:
        if time.monotonic() >= deadline:
          raise
      if not self.alive():
        raise RuntimeError(
            f'the eval worker exited with code {self._process.exitcode}')
      if cancel is not None and cancel.is_set():
        raise RuntimeError('cancelled')


class PeriodicEvaluation:
  """Every `every` seconds, the newest params to the EvalWorker that
  `start_worker(cancel)` starts, and its results to the logger, on a thread
  of its own so that neither training nor acting ever waits for it (the
  agent process's evaluation). Each submit asks for `episodes` episodes in
  `mode`, each cut at `max_steps` (0: never).

  `latest()` returns (policy params as numpy, their version), `version()`
  the learner's version now, and `send(metrics)` logs scalars and videos.
  Each result is logged as eval/score, eval/length (episode means),
  eval/version, eval/policy_lag (learner updates since the evaluated
  params) and, when the env renders, eval/video (its first episode). A
  version is submitted once. A worker
  that fails to start, dies or stops answering is shut down and a new one
  starts after a delay (RETRY_SECONDS, doubling while it keeps failing, up
  to RETRY_MAX); the run goes on meanwhile."""

  RETRY_SECONDS = 5.0
  RETRY_MAX = 300.0

  def __init__(self, start_worker, every, episodes, mode, max_steps, latest,
               version, send):
    self.start_worker = start_worker
    self.every = every
    self.job = (episodes, mode, max_steps)
    self.latest = latest
    self.version = version
    self.send = send
    self.worker = None
    self.started = 0  # workers started so far
    self.stop = threading.Event()
    self.thread = threading.Thread(
        target=self._run, name='Evaluation', daemon=True)

  @classmethod
  def of(cls, config, latest, version, send, host='process', name='agent'):
    """A run's evaluation (`run.eval_*`): its worker named `name` runs on
    `host`, 'ray' (with `ray.eval_cpus` and `ray.eval_gpus`) or 'process'
    (a child process)."""
    run = config.run
    if int(run.eval_worker_envs) < 1:
      raise ValueError(f'run.eval_every = {run.eval_every} needs '
                       'run.eval_worker_envs >= 1')
    where = {}
    if host == 'ray':
      where = dict(host='ray', num_cpus=config.ray.eval_cpus,
                   num_gpus=config.ray.eval_gpus)
    return cls(
        lambda cancel: EvalWorker(config, name, cancel=cancel, **where),
        float(run.eval_every), int(run.eval_worker_envs), str(run.eval_mode),
        int(run.eval_max_steps), latest, version, send)

  def start(self):
    self.thread.start()
    return self

  def close(self, timeout=60.0):
    """Stops submitting and ends the worker."""
    self.stop.set()
    self.thread.join(timeout)
    if self.thread.is_alive():  # Stuck (e.g. sending to a logger that is
      self._shutdown()          # gone): the worker must not outlive us.

  def _run(self):
    self.delay = self.RETRY_SECONDS
    while not self.stop.is_set():
      try:
        self.started += 1
        self.worker = self.start_worker(self.stop)
        self._evaluate(self.worker)
      except Exception as e:
        if self.stop.is_set():
          break  # Closing: not a failure.
        print(f'Evaluation: the eval worker failed ({e!r}); a new one starts '
              f'in {self.delay:.0f} s.', file=sys.stderr, flush=True)
        self._shutdown()
        self.stop.wait(self.delay)
        self.delay = min(2 * self.delay, self.RETRY_MAX)
    self._shutdown()

  def _evaluate(self, worker):
    """Submits and polls until stopped; raises if the worker is lost."""
    submitted = None
    due = time.monotonic() + self.every
    while not self.stop.is_set():
      if not worker.alive():
        raise RuntimeError('its process exited')
      if time.monotonic() >= due:
        due += self.every
        params, version = self.latest()
        if version != submitted:
          worker.submit(params, version, *self.job)
          submitted = version
      result = worker.poll(timeout=min(1.0, self.every))
      if result is not None:
        self.delay = self.RETRY_SECONDS  # It works: the next failure is new.
        self._log(result)

  def _shutdown(self):
    worker, self.worker = self.worker, None
    if worker is not None:
      try:
        worker.shutdown()
      except Exception as e:
        print(f'Evaluation: shutting the eval worker down: {e!r}',
              file=sys.stderr, flush=True)

  def _log(self, result):
    if 'error' in result:
      print(f"Evaluation of version {result['version']} failed: "
            f"{result['error']}", file=sys.stderr, flush=True)
      return
    metrics = {
        'eval/score': result['score_mean'],
        'eval/length': result['length_mean'],
        'eval/version': result['version'],
        'eval/policy_lag': self.version() - result['version']}
    if result['frames'] is not None:
      metrics['eval/video'] = result['frames']
    self.send(metrics)


def _check_name(name):
  if not isinstance(name, str) or not re.fullmatch(r'[A-Za-z0-9_.-]+', name):
    raise ValueError(
        f'an eval worker name is letters, digits, _ . or -, got {name!r}')


def _portable(value, what):
  """`value` if the spawned worker can get it: None, an importable
  'module:function' string, or a picklable callable."""
  if value is None:
    return None
  if isinstance(value, str):
    load(value, what)
    return value
  if not callable(value):
    raise TypeError(f'{what} must be callable or a "module:function" string, '
                    f'got {type(value).__name__}')
  try:
    pickle.dumps(value)
  except Exception as e:
    raise TypeError(
        f'{what} must be a top-level function (or a "module:function" string) '
        f'so the worker process can import it; {value!r} cannot be pickled: '
        f'{e}') from None
  return value


def _numpy_tree(tree):
  return {k: _numpy_tree(v) if isinstance(v, Mapping) else np.asarray(v)
          for k, v in tree.items()}


def _plain(value):
  """A reply with the wire's numpy scalars as Python numbers (arrays such
  as frames stay arrays)."""
  if isinstance(value, Mapping):
    return {k: _plain(v) for k, v in value.items()}
  if isinstance(value, (list, tuple)):
    return [_plain(v) for v in value]
  if isinstance(value, (np.ndarray, np.generic)) and np.ndim(value) == 0:
    return value.item()
  return value


