"""EvalWorker: scores of submitted params, measured in a process of its own
so training never waits for them (after TorchRL's RayEvalWorker).

  worker = EvalWorker(config, name='eval')      # starts the worker process
  worker.submit(policy_params(params), version, episodes=4, mode='greedy')
  result = worker.poll(timeout=0)               # None, or one result
  worker.shutdown()                             # ends the process

* Process: a spawned child (`supervisor.Children`, not restarted; its code
  is `runtime/eval_process.py`) that
  builds `run.eval_envs` envs (ids `run.envs + i`, seeded as in every script
  by `envs.make_run_env`), or `env_maker(i)` for i < `run.eval_envs`, an
  Agent from `config`, and an RPC server that only accepts the run's token.
  It runs the episode loop of `runtime/evaluation.py` with the agent's
  jitted policy on its own copy of the params and its own carry; it never
  touches the actor. The handle lives in the caller and imports neither JAX
  nor the agent. The worker never preallocates GPU memory (it shares the
  device with the run), and exits when the process that started it dies.
* `submit(params, version, episodes, mode)` returns once the worker has
  checked and queued the job, without waiting for its episodes. `params`:
  the policy params (`agent.policy_params(params)`; all params are accepted
  and cut down to them), nested dicts of arrays, sent as numpy; shapes that
  do not match the worker's agent are an error to the caller. `mode`:
  'greedy' or 'sample'. Episodes are split evenly over
  min(`run.eval_envs`, episodes) envs, as in `--script eval_only`.
* Queue: one evaluation runs and at most one waits. A submit while one runs
  replaces the waiting job, if any (submit returns its version as
  `replaced`): evaluating params that newer ones have superseded is wasted
  work, and the queue stays bounded when evaluating is slower than
  training. A running evaluation is never interrupted, so every submit that
  is not replaced gets a result.
* `poll(timeout=0)` returns None, or the oldest result not returned yet
  (each exactly once): version, mode, episodes, scores, lengths (per
  episode), score_mean, score_std, length_mean, length_std, seconds (wall
  clock of the evaluation) and frames (uint8 [T, H, W, C] of the first
  episode when the env renders, `evaluation.frame_key`; else None). An
  evaluation that raised (e.g. an env failed) gives {'error': '<type>:
  <message>', 'version': v} instead; the worker then builds its envs anew
  for the next job.
* Callables: `env_maker(index) -> Env` and `init_fn()` (run first in the
  worker, before JAX starts: e.g. to register an env suite or set XLA
  flags) are 'module:function' strings or picklable top-level functions;
  both are checked in the caller (a lambda or closure is refused there), as
  the spawned worker can only import them.
* `EvalWorker.from_name(name, logdir)` connects from any process: the worker
  writes `<logdir>/eval_workers/<name>.json` (name, addr, pid) once it
  serves and removes it when it exits; the token is `token`, else
  DREAMER_VER_TOKEN, else `<logdir>/token` (never in that file). Such a
  handle does not own the worker: `close()` disconnects, `shutdown()` still
  asks the worker to stop.
"""

import importlib
import json
import os
import pickle
import re
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np

from dreamer_ver.rpc import addresses
from dreamer_ver.rpc.client import Client
from dreamer_ver.runtime import process
from dreamer_ver.runtime.supervisor import Children

MODES = ('greedy', 'sample')
START_SECONDS = 300  # the worker imports JAX and builds its envs first
CALL_SECONDS = 60  # slack for an RPC reply on top of what it waits for


def record_path(logdir, name):
  """The file that tells other processes where worker `name` listens."""
  return Path(logdir) / 'eval_workers' / f'{name}.json'


class EvalWorker:
  """The caller's handle of an evaluation worker process (module docstring)."""

  def __init__(self, config, name='eval', env_maker=None, init_fn=None,
               start_timeout=START_SECONDS):
    _check_name(name)
    if int(config.run.eval_envs) < 1:
      raise ValueError(
          f'an EvalWorker needs run.eval_envs >= 1, got {config.run.eval_envs}')
    env_maker = _portable(env_maker, 'env_maker')
    init_fn = _portable(init_fn, 'init_fn')
    config = process.with_token(config).update({'jax.prealloc': False})
    self.name = name
    self.record = record_path(config.logdir, name)
    _clear_stale_record(self.record)
    self._children = Children()
    self._process = self._children.start(
        f'eval_worker_{name}', 'dreamer_ver.runtime.eval_process:serve',
        config, name, env_maker, init_fn, restart=False)
    try:
      info = _wait_for_record(self.record, self._process, start_timeout)
    except BaseException:
      self._children.stop_all()
      raise
    self._client = Client(
        info['addr'], f'EvalWorker{name}', **process.client_kwargs(config))

  @classmethod
  def from_name(cls, name, logdir, token=None, timeout=10.0):
    """A handle of the running worker `name` of the run in `logdir`."""
    _check_name(name)
    path = record_path(logdir, name)
    if not path.is_file():
      raise FileNotFoundError(
          f'no eval worker named {name!r} runs for {logdir} (no {path})')
    info = json.loads(path.read_text())
    token = token or os.environ.get(process.TOKEN_ENV, '')
    if not token and (Path(logdir) / 'token').is_file():
      token = (Path(logdir) / 'token').read_text().strip()
    worker = cls.__new__(cls)
    worker.name = name
    worker.record = path
    worker._children = worker._process = None  # Not its owner.
    worker._client = Client(
        info['addr'], f'EvalWorker{name}',
        handshake=addresses.handshake(token))
    try:
      worker._call('status', wait=timeout)
    except Exception as e:
      worker.close()
      raise ConnectionError(
          f'eval worker {name!r} (pid {info["pid"]}, {info["addr"]}) does not '
          f'answer: {e!r}') from None
    return worker

  def submit(self, params, version, episodes=1, mode='greedy'):
    """Queues an evaluation of `params`; returns {'version', 'replaced'}
    (the version of the waiting job this one replaced, or None)."""
    if mode not in MODES:
      raise ValueError(f'mode must be one of {MODES}, got {mode!r}')
    if int(episodes) != episodes or episodes < 1:
      raise ValueError(f'episodes must be an integer >= 1, got {episodes!r}')
    if int(version) != version:
      raise ValueError(f'version must be an integer, got {version!r}')
    if not isinstance(params, Mapping):
      raise TypeError(
          f'params must be a dict of arrays, got {type(params).__name__}')
    params = _numpy_tree(params)
    return self._call('submit', params, int(version), int(episodes), mode)

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

  def shutdown(self, timeout=30.0):
    """Ends the worker process (an evaluation in progress is dropped)."""
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

  def _call(self, method, *args, wait=CALL_SECONDS):
    return _plain(self._client.call(method, *args).result(wait))


class PeriodicEvaluation:
  """Every `run.eval_every` seconds, the newest params to an EvalWorker
  named `name`, and its results to the logger, on a thread of its own so
  that neither training nor acting ever waits for it (the agent process's
  evaluation).

  `latest()` returns (policy params as numpy, their version), `version()`
  the learner's version now, and `send(metrics)` logs scalars and videos.
  Each result is logged as eval/score, eval/length (episode means),
  eval/version, eval/policy_lag (learner updates since the evaluated
  params) and, when the env renders, eval/video (its first episode). A
  version is submitted once; a worker that fails to start or dies ends the
  evaluation with a message, never the run."""

  def __init__(self, config, latest, version, send, name='agent'):
    if int(config.run.eval_envs) < 1:
      raise ValueError(
          f'run.eval_every = {config.run.eval_every} needs run.eval_envs >= 1')
    self.config = config
    self.every = float(config.run.eval_every)
    self.latest = latest
    self.version = version
    self.send = send
    self.name = name
    self.stop = threading.Event()
    self.thread = threading.Thread(
        target=self._run, name='Evaluation', daemon=True)

  def start(self):
    self.thread.start()
    return self

  def close(self, timeout=60.0):
    """Stops submitting and ends the worker."""
    self.stop.set()
    self.thread.join(timeout)

  def _run(self):
    try:
      worker = EvalWorker(self.config, name=self.name)
    except Exception as e:
      print(f'Evaluation is off: the eval worker did not start: {e}',
            file=sys.stderr, flush=True)
      return
    submitted = None
    due = time.monotonic() + self.every
    try:
      while not self.stop.is_set():
        if time.monotonic() >= due:
          due += self.every
          params, version = self.latest()
          if version != submitted:
            worker.submit(params, version, self.config.run.eval_envs,
                          self.config.run.eval_mode)
            submitted = version
        result = worker.poll(timeout=min(1.0, self.every))
        if result is not None:
          self._log(result)
    except Exception as e:
      print(f'Evaluation is off: the eval worker failed: {e!r}',
            file=sys.stderr, flush=True)
    finally:
      worker.shutdown()

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
    resolve(value, what)
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


def resolve(spec, what='callable'):
  if callable(spec):
    return spec
  module, _, attr = spec.partition(':')
  if not module or not attr:
    raise ValueError(f'{what} must be "module:function", got {spec!r}')
  try:
    value = getattr(importlib.import_module(module), attr)
  except (ImportError, AttributeError) as e:
    raise ValueError(f'{what} {spec!r} cannot be imported: {e}') from None
  if not callable(value):
    raise TypeError(f'{what} {spec!r} is not callable')
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


def remove_record(path, pid):
  """Removes `path` if process `pid` wrote it (a newer worker's stays)."""
  try:
    if json.loads(path.read_text())['pid'] == pid:
      path.unlink()
  except (FileNotFoundError, ValueError, KeyError):
    pass


def _clear_stale_record(path):
  """Refuses a name that a live worker holds; forgets a dead one's file."""
  try:
    pid = json.loads(path.read_text())['pid']
  except (FileNotFoundError, ValueError, KeyError):
    return
  try:
    os.kill(pid, 0)
  except ProcessLookupError:
    path.unlink(missing_ok=True)
    return
  except PermissionError:
    pass  # Alive, someone else's.
  raise RuntimeError(
      f'an eval worker named {path.stem!r} already runs (pid {pid}, {path}); '
      'shut it down or pick another name')


def _wait_for_record(path, proc, timeout):
  """The worker's record once the process `proc` has written it."""
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    try:
      info = json.loads(path.read_text())
      if info['pid'] == proc.pid:
        return info
    except (FileNotFoundError, ValueError, KeyError):
      pass
    if not proc.is_alive():
      raise RuntimeError(
          f'the eval worker exited with code {proc.exitcode} before it '
          'served (its error is above, on stderr)')
    time.sleep(0.1)
  raise TimeoutError(f'the eval worker did not serve within {timeout} s')
