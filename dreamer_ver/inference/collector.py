"""Batches of transitions from N envs acting with one policy, for library
users who train on their own: TorchRL's AsyncBatchedCollector, with no
replay or logger server needed.

  Collector(create_env_fn, policy, frames_per_batch, total_frames=None,
            processes=False, timeout=60.0, **server_kwargs)

  with Collector([partial(make_env, i) for i in range(8)], policy,
                 frames_per_batch=256, total_frames=10_000,
                 carry=jnp.zeros(4)) as collector:
    for batch in collector:  # a dict of [frames_per_batch, ...] arrays
      train(batch)

`create_env_fn` (TorchRL's name): one env factory (no arguments) per env.
Each env is built and stepped on a thread of its own, or with
`processes=True` in a spawned process of its own, so that envs that hold
the GIL step in parallel: each factory must then pickle (a top-level
function or a `functools.partial` of one). Env processes import no JAX (nor
does this module, until a collector is built), so they start fast: keep it
out of the factories' modules and the main script's top level too (spawn
imports both). An env follows `envs/base.py` (`step(action)` with a
`reset` entry, `obs_space`, `act_space`) and returns fresh arrays at every
step (they are batched without a copy).

`policy`: a started `InferenceServer`, used as is and never closed here (it
needs the 'thread' transport for envs on threads, 'shm' for env processes:
a ValueError otherwise), or a function as InferenceServer takes it
(`fn(carry, obs)`, `fn(params, carry, obs)`, ...), which the collector
serves itself until `shutdown()`: the first env's observation keys (but the
`log/` ones, which are not for the agent) make its spec, and
`server_kwargs` go to its InferenceServer (`carry=`, `params=`, `cutoff=`,
`slots=`, one per env by default). Each env asks for its action and waits
only for its own reply (the server batches the envs' calls), so slow envs
never hold the others back; a request holds the spec's keys and, where the
server keeps carries, `envid`, the env's index, so they follow their env.

A transition is the env's observation, the policy's reply to it (the action
keys and anything else it holds, e.g. `version`) and `envid`;
`frames_per_batch` of them make a batch, and one env's transitions keep
their order across batches. The envs step on while the consumer trains, up
to a batch ahead. `total_frames` (None: for ever) is exact: the envs step
that many times in all and the iterator yields as many transitions, the
last batch shorter if `frames_per_batch` does not divide it.

`shutdown()` (TorchRL's name; also on leaving a `with` block; idempotent)
stops the envs, joins their threads or processes (killing a process that
does not exit within `timeout`) and closes the server the collector built.
An env that raises ends iteration with a RuntimeError naming the env and
holding its traceback. None of the collector's waits (for a transition,
a reply, a join) lasts longer than `timeout` seconds.
"""

import contextlib
import multiprocessing
import queue
import threading
import time
import traceback

import numpy as np

from dreamer_ver.inference.client import Deadline, InferenceClient


class Collector:

  def __init__(self, create_env_fn, policy, frames_per_batch,
               total_frames=None, processes=False, timeout=60.0,
               **server_kwargs):
    # Not at the top: env processes import this module, and no JAX.
    from dreamer_ver.inference.server import InferenceServer
    makers = list(create_env_fn)
    if not makers or frames_per_batch < 1:
      raise ValueError('need at least one env and one frame per batch')
    transport = 'shm' if processes else 'thread'
    given = isinstance(policy, InferenceServer)
    if given and transport not in policy.transports:
      raise ValueError(
          f'envs on {"processes" if processes else "threads"} need the '
          f'server\'s {transport!r} transport; it has '
          f'{sorted(policy.transports)}')
    if given and server_kwargs:
      raise TypeError(f'{sorted(server_kwargs)} are for a server the '
                      f'collector builds, not a given one')
    self.frames_per_batch = frames_per_batch
    self.total_frames = total_frames
    self.processes = processes
    self.timeout = timeout
    self.server = policy if given else None
    self._built = None  # The server the collector built, if any.
    self._yielded = 0
    self._closed = False
    context = multiprocessing.get_context('spawn')
    if processes:
      out, go, stop = (context.Queue(frames_per_batch), context.Queue(),
                       context.Event())
    else:
      out, go, stop = (queue.Queue(frames_per_batch), queue.Queue(),
                       threading.Event())
    frames = None if total_frames is None else context.Value('q', 0)
    self._channel = _Channel(out, go, stop, frames, total_frames, timeout)
    self._workers = [
        self._worker(context, i, make) for i, make in enumerate(makers)]
    try:
      for worker in self._workers:
        worker.start()
      spaces = dict(self._next() for _ in self._workers)
      if not given:
        server_kwargs.setdefault('slots', len(makers))
        spec = {k: s for k, s in spaces[0].items()
                if not k.startswith('log/')}
        self._built = InferenceServer(
            policy, spec, transports=(transport,), **server_kwargs)
        self.server = self._built.start()
      link = _Link(self.server, processes)
      for _ in self._workers:
        self._channel.go.put(link)
    except BaseException:
      self.shutdown()
      raise

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.shutdown()

  def __iter__(self):
    if self._closed:
      raise RuntimeError('the collector is shut down')
    rows = []
    while self.total_frames is None or self._yielded < self.total_frames:
      rows.append(self._next()[1])
      self._yielded += 1
      if len(rows) == self.frames_per_batch:
        yield _stack(rows)
        rows = []
    if rows:
      yield _stack(rows)

  def shutdown(self):
    """Stops the envs (each after its step in progress) and closes the
    server the collector built."""
    if self._closed:
      return
    self._closed = True
    self._channel.stop.set()
    deadline = time.monotonic() + self.timeout
    for worker in self._workers:
      if worker.ident is None:  # Its start failed, or one before it.
        continue
      worker.join(max(0.0, deadline - time.monotonic()))
      if self.processes and worker.is_alive():
        worker.kill()
        worker.join(self.timeout)
    if self._built is not None:
      self._built.close()

  def _worker(self, context, index, make_env):
    name = f'CollectorEnv{index}'
    if self.processes:
      return context.Process(
          target=_env_process, args=(index, make_env, self._channel),
          name=name, daemon=True)
    return threading.Thread(
        target=_env_main, args=(index, make_env, self._channel), name=name,
        daemon=True)

  def _next(self):
    """The next (env index, observation space or transition) from the
    envs; the RuntimeError of an env that failed."""
    try:
      index, failed, payload = self._channel.out.get(timeout=self.timeout)
    except queue.Empty:
      raise TimeoutError(
          f'no env reported within {self.timeout} s') from None
    if failed:
      self._channel.stop.set()
      raise RuntimeError(f'env {index} of the collector failed:\n{payload}')
    return index, payload


class _Channel:
  """What the envs share with the collector (passed to env processes at
  their spawn): the queue they report on, the one their links to the
  server come from, the stop, and how many of `total` frames are taken."""

  def __init__(self, out, go, stop, frames, total, timeout):
    self.out, self.go, self.stop = out, go, stop
    self.frames, self.total, self.timeout = frames, total, timeout

  def put(self, index, failed, payload):
    self._wait(lambda t: self.out.put((index, failed, payload), timeout=t),
               'the collector took nothing')

  def link(self):
    return self._wait(lambda t: self.go.get(timeout=t),
                      'no link to the server came')

  def claim(self):
    """Takes a frame to step; False once all `total` are taken."""
    if self.frames is None:
      return not self.stop.is_set()
    with self.frames.get_lock():
      if self.stop.is_set() or self.frames.value == self.total:
        return False
      self.frames.value += 1
      return True

  def _wait(self, attempt, what):
    """attempt(seconds), a queue's get or put, retried in short slices
    until it succeeds, so that a stop ends the wait."""
    until = Deadline(self.timeout, self.stop)
    while not until.is_set():
      try:
        return attempt(0.1)
      except (queue.Empty, queue.Full):
        continue
    if self.stop.is_set():
      raise _Stopped
    raise TimeoutError(f'{what} within {self.timeout} s')


class _Stopped(Exception):
  """The collector stopped its envs: an env's life ends quietly."""


class _Link:
  """How an env reaches the server: the keys of a request, whether it
  names its env (the server keeps per-env carries), and what its client
  calls: the server itself on a thread, its shared-memory endpoint in a
  process (an endpoint pickles)."""

  def __init__(self, server, processes):
    self.keys = list(server.policy.spec)
    self.names_env = server.policy.carries
    self.target = server.endpoint('shm') if processes else server


def _env_main(index, make_env, channel):
  """One env's life on its thread or process: it is built, reports its
  observation space, gets its link to the server and steps; a failure
  reaches the collector as the env's traceback."""
  try:
    env = make_env()
    try:
      channel.put(index, False, env.obs_space)
      _steps(index, env, channel.link(), channel)
    finally:
      env.close()
  except _Stopped:
    pass
  except Exception:
    with contextlib.suppress(_Stopped, TimeoutError):
      channel.put(index, True, traceback.format_exc())


def _env_process(index, make_env, channel):
  """An env process: the env's life, then a wait for the collector's stop
  while the queue's thread hands over the last transitions; what is left
  once stopped is not wanted (the process exits without flushing it)."""
  _env_main(index, make_env, channel)
  channel.stop.wait(channel.timeout)
  channel.out.cancel_join_thread()


def _steps(index, env, link, channel):
  client = InferenceClient(link.target, channel.timeout)
  try:
    act_keys = [k for k in env.act_space if k != 'reset']
    action = {k: np.zeros(s.shape, s.dtype) for k, s in env.act_space.items()}
    action['reset'] = np.bool_(True)
    envid = np.int64(index)
    named = {'envid': envid} if link.names_env else {}
    while channel.claim():
      obs = {k: np.asarray(v) for k, v in env.step(action).items()}
      reply = client({**{k: obs[k] for k in link.keys}, **named})
      missing = [k for k in act_keys if k not in reply]
      if missing:
        raise KeyError(f'the policy reply lacks the action keys {missing}')
      action = {k: reply[k] for k in act_keys}
      action['reset'] = np.bool_(obs['is_last'])
      channel.put(index, False, {
          **obs, 'envid': envid,
          **{k: np.asarray(v) for k, v in reply.items()}})
  finally:
    client.close()


def _stack(rows):
  return {k: np.stack([row[k] for row in rows]) for k in rows[0]}
