"""EvalWorker: scores of submitted params, measured in a process of its own
so that whoever submits never waits for them (after TorchRL's
RayEvalWorker; hosting, queueing and finding a worker by name:
docs/architecture.md, Evaluation). It works on its own, as a library, or
as a part of a run (`config=`):

  worker = EvalWorker(make_env, make_policy)    # starts the worker process
  worker.submit(params, version, episodes=4, mode='greedy')
  result = worker.poll(timeout=60)              # None, or one result
  worker.shutdown()                             # ends the process

* `EvalWorker(env_maker, policy_maker, init_fn, *, config, name, host,
  num_envs, reward_keys, eval_timeout, seed, logdir, num_cpus, num_gpus,
  start_timeout, cancel, **remote_kwargs)`:
  - Its envs are `env_maker(i)` for i < `num_envs`, its policy
    `policy_maker(obs_space, act_space)` (an object with the agent's
    `init_params`, `init_carry` and `policy`); `init_fn()` runs first in
    the worker, before JAX starts. Each is a 'module:function' string or a
    picklable top-level function, refused in the caller otherwise.
  - `config`, a run's config, gives each keyword left None: `num_envs`
    (run.eval_worker_envs), `eval_timeout` (run.eval_timeout), `seed`,
    `logdir`, `num_cpus` and `num_gpus` (ray.eval_cpus, ray.eval_gpus), and
    the run's envs and Agent where a maker is None, its token and network
    settings. Without one, both makers are needed; the defaults are
    configs/defaults.yaml's (eval_timeout 1800 s, seed 0, 1 CPU) with one
    env and, on Ray, one GPU (as TorchRL's).
  - `reward_keys`: the scalar observations summed into each step's reward
    (default the env's `reward`). One the env does not give is a
    ValueError from the constructor once the worker has built its envs.
  - `logdir` (a config's: its run's) keeps the worker's record and its
    token (`run.token`, else $DREAMER_VER_TOKEN, else `logdir/token`, made
    fresh and owner-only); without one, a temporary folder that
    `shutdown()` removes (`worker.logdir` names it).
  - `host` 'process': a child process that ends with its starter, on the
    caller's machine with JAX's default device there (`num_cpus`,
    `num_gpus` and Ray's options are refused: they mean nothing there).
    'ray': a Ray actor `eval_worker_<name>` (after `ray.init`) with
    `num_cpus` and `num_gpus` (0 where the cluster has fewer GPUs),
    detached (it outlives its handle) when `name` is given, and
    `remote_kwargs`, Ray's actor options (`lifetime='non_detached'`, ...).
  - `name` (default a fresh one) is how `from_name` finds it;
    `start_timeout` (seconds) bounds its start and `cancel` (an Event)
    ends the wait for it.
* `submit(params, version, episodes, mode, max_steps, timeout,
  break_when_any_done)` returns once the job is checked and queued: params
  that do not fit the worker's policy are an error to the caller; `mode`
  'greedy' or 'sample'; `max_steps` (0 = none) cuts an episode (counted as
  truncated); `timeout` (default `eval_timeout`) bounds the evaluation;
  `break_when_any_done` ends it at the first episode end in any env (the
  result holds the episodes that ended then). One job runs, at most one
  waits: a submit replaces the waiting one (returned as `replaced`).
* `poll(timeout=0)`: None, or the oldest result not returned yet, once:
  version, mode, episodes, scores (each episode's summed reward), lengths,
  reward (their mean: the same number as score_mean), score_mean,
  score_std, length_mean, length_std, truncated, seconds and frames (uint8
  [T, H, W, C] of the first episode when the env renders, else None); or
  {'error': '<type>: <message>', 'version': v}.
* `EvalWorker.from_name(name, logdir or token=...)` connects from any
  process, and follows a worker restarted under that name; it does not own
  the worker (`close()` disconnects, `shutdown()` still stops it).
* `PeriodicEvaluation` (`evaluation/periodic.py`) is the runs' use of it.
"""

import os
import pickle
import re
import secrets
import shutil
import tempfile
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from dreamer_ver.config import loading as configlib
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
# EvalWorker's settings, and the config entries they stand for.
SETTINGS = {'num_envs': 'run.eval_worker_envs',
            'eval_timeout': 'run.eval_timeout', 'seed': 'seed',
            'logdir': 'logdir', 'num_cpus': 'ray.eval_cpus',
            'num_gpus': 'ray.eval_gpus'}
# Without a run's config: one env, not a run's four; a GPU on Ray.
LIBRARY_DEFAULTS = {'run.eval_worker_envs': 1, 'ray.eval_gpus': 1.0}


class EvalWorker:
  """The caller's handle of an evaluation worker process (module docstring)."""

  def __init__(self, env_maker=None, policy_maker=None, init_fn=None, *,
               config=None, name=None, host='process', num_envs=None,
               reward_keys=('reward',), eval_timeout=None, seed=None,
               logdir=None, num_cpus=None, num_gpus=None,
               start_timeout=START_SECONDS, cancel=None, **remote_kwargs):
    if host not in HOSTS:
      raise ValueError(f'host must be one of {HOSTS}, got {host!r}')
    if host == 'process' and (num_cpus, num_gpus, remote_kwargs) != (
        None, None, {}):
      raise ValueError("num_cpus, num_gpus and Ray's options are for "
                       "host='ray'; a 'process' worker runs on this machine")
    if config is None and (env_maker is None or policy_maker is None):
      raise ValueError(
          'without a config, an EvalWorker needs an env_maker and a '
          'policy_maker')
    if isinstance(reward_keys, str) or not reward_keys:
      raise ValueError(f'reward_keys must be a non-empty tuple of '
                       f'observation keys, got {reward_keys!r}')
    named = name is not None
    name = name if named else f'eval-{secrets.token_hex(4)}'
    _check_name(name)
    args = (name, _portable(env_maker, 'env_maker'),
            _portable(init_fn, 'init_fn'),
            _portable(policy_maker, 'policy_maker'), tuple(reward_keys))
    config = worker_config(
        config, num_envs=num_envs, eval_timeout=eval_timeout, seed=seed,
        logdir=logdir, num_cpus=num_cpus, num_gpus=num_gpus)
    self.name = name
    self._owner = True
    self._children = self._process = self._actor = self._client = None
    self._tempdir = None
    if not config.logdir:
      self._tempdir = tempfile.mkdtemp(prefix='eval_worker_')
      config = config.update({'logdir': self._tempdir})
    self.logdir = Path(config.logdir)
    self.record = record_path(config.logdir, name)
    try:
      config = with_token(config)
      if host == 'process':
        addr = self._start_process(config, args, start_timeout, cancel)
      else:
        addr = self._start_actor(config, args, ray_options(
            config, named, remote_kwargs))
      self._client = Client(
          addr, f'EvalWorker{name}', **Links.of(config).client_kwargs())
      # Placed, started and serving.
      scalars = self._call('scalars', wait=start_timeout, cancel=cancel)
      _check_reward_keys(reward_keys, scalars)
    except BaseException:
      self.shutdown(timeout=5)
      raise

  def _start_process(self, config, args, start_timeout, cancel):
    """Starts the worker as a child process; its address once it serves."""
    clear_stale_record(self.record)
    self._children = Supervisor()
    self._process = self._children.start(
        component_name(self.name), EVAL_WORKER, config, *args,
        restart=False)
    return wait_for_record(
        self.record, self._process, start_timeout, cancel)['addr']

  def _start_actor(self, config, args, options):
    """Starts the worker as a Ray actor; a lookup of where it serves."""
    from dreamer_ver.cluster import ray_host
    actor = component_name(self.name)
    gpus = ray_host.available_gpus(options['num_gpus'])
    self._actor = ray_host.start(
        config, actor, EVAL_WORKER, *args, serves='run.eval_addr',
        **{**options, 'num_gpus': gpus})
    return ray_host.Lookup(actor)

  @classmethod
  def from_name(cls, name, logdir=None, token=None, timeout=10.0):
    """A handle of the running worker `name` whose records are in `logdir`
    (a run's, or its EvalWorker's `logdir`), or with `logdir` None, of the
    Ray-hosted worker `name` in the caller's Ray namespace (the caller has
    called `ray.init` on its cluster)."""
    _check_name(name)
    token = token or os.environ.get(TOKEN_ENV, '')
    if logdir is None:
      from dreamer_ver.cluster import ray_host
      path, addr = None, ray_host.Lookup(component_name(name))
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
    worker.logdir = logdir and Path(logdir)
    worker.record = path
    worker._owner, worker._tempdir = False, None
    worker._children = worker._process = worker._actor = None
    worker._client = Client(
        addr, f'EvalWorker{name}', handshake=addresses.handshake(token))
    try:
      worker._call('status', wait=timeout)
    except Exception as e:
      worker.close()
      raise ConnectionError(f'eval worker {name!r} ({path or addr}) does '
                            f'not answer: {e!r}') from None
    return worker

  def submit(self, params, version, episodes=1, mode='greedy', max_steps=0,
             timeout=None, break_when_any_done=False):
    """Queues an evaluation of `params`; returns {'version', 'replaced'}
    (the version of the waiting job this one replaced, or None).
    `max_steps` (0 = none) cuts each episode after that many steps (it
    counts as truncated); `timeout` (seconds; None: the worker's
    `eval_timeout`) bounds the whole evaluation; `break_when_any_done` ends
    it at the first episode end in any of its envs."""
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
                      int(max_steps), float(timeout or 0),
                      bool(break_when_any_done))

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
    """Ends the worker (an evaluation in progress is dropped) and removes
    the temporary folder it was given."""
    try:
      if not self._owner:  # A from_name handle: errors are the caller's.
        try:
          self._call('shutdown', wait=min(timeout, CALL_SECONDS))
        finally:
          self.close()
      elif self._actor is not None:
        from dreamer_ver.cluster import ray_host
        self.close()
        ray_host.remove(  # Its Host stops the server.
            self._actor, component_name(self.name), timeout)
      elif self._process is not None:
        self._stop_process(timeout)
    finally:
      if self._tempdir is not None:
        shutil.rmtree(self._tempdir, ignore_errors=True)

  def _stop_process(self, timeout):
    """Asks the child process to stop once it served, then ends it."""
    if self._client is not None:  # It served: it stops when asked.
      if self.alive():
        try:
          self._call('shutdown', wait=min(timeout, CALL_SECONDS))
        except Exception:
          pass  # It may be gone already; the owner below makes sure.
      self.close()
      self._process.join(timeout)
    self._children.stop_all()  # Terminates it if it did not stop.
    remove_record(self.record, self._process.pid)

  def close(self):
    """Disconnects this handle; the worker keeps running."""
    if self._client is not None:
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


def component_name(name):
  """The eval worker `name`'s component name: its Ray actor's or process's."""
  return f'eval_worker_{name}'


def worker_config(config=None, **settings):
  """The worker's config: `config` (a run's), else the package defaults
  with LIBRARY_DEFAULTS, with each of EvalWorker's `settings` (SETTINGS)
  that is not None in place of its entry."""
  if config is None:
    config = configlib.compose(overrides=LIBRARY_DEFAULTS)
  given = {SETTINGS[k]: v for k, v in settings.items() if v is not None}
  config = config.update({**given, 'jax.prealloc': False})
  if int(config.run.eval_worker_envs) < 1:
    raise ValueError(f'an EvalWorker needs num_envs (run.eval_worker_envs) '
                     f'>= 1, got {config.run.eval_worker_envs}')
  return config


def ray_options(config, named, remote_kwargs):
  """Ray's options for the worker's actor: `ray.eval_cpus` and
  `ray.eval_gpus` of its config, detached when the caller named it (it
  outlives its handle, as TorchRL's named workers), then `remote_kwargs`."""
  detached = {'lifetime': 'detached'} if named else {}
  return {'num_cpus': float(config.ray.eval_cpus),
          'num_gpus': float(config.ray.eval_gpus), **detached,
          **remote_kwargs}


def _check_reward_keys(reward_keys, scalars):
  """ValueError naming the `reward_keys` that are not among `scalars`,
  the env's scalar observations."""
  missing = [key for key in reward_keys if key not in scalars]
  if missing:
    raise ValueError(
        f'reward_keys {missing} are not scalar observations of the eval '
        f'env (it gives {", ".join(scalars)})')


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


