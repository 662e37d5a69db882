"""Batches of transitions from N envs served by an inference server, for
library users who train on their own (TorchRL's AsyncBatchedCollector):
no replay or logger server needed.

  server = InferenceServer(policy, spec, carry=..., transports=('thread',))
  server.start()
  with Collector(server, [make_env(i) for i in range(8)], rows=256) as c:
    for batch in c:  # a dict of [rows, ...] arrays
      train(batch)

Each env steps on a thread of its own and asks the server for its action
(the server batches the envs' calls), so slow envs never hold the others
back. A transition is the env's observation, the policy's reply to it, and
`envid`; `rows` of them make a batch. One env's transitions keep their
order across batches. The server needs the 'thread' transport; a request
holds the observation's keys of the server's spec and `envid` (the env's
index). An env follows the project's interface (`envs/base.py`:
`step(action)` with a `reset` entry, `obs_space`, `act_space`); the policy's
reply must hold the env's action keys (anything else in it, e.g. `version`
or values, travels in the transition too). `steps` (per env, None: for
ever) ends collection; the iterator then yields the last, shorter batch.
"""

import queue
import threading

import numpy as np


class Collector:

  def __init__(self, server, envs, rows, steps=None, timeout=60.0):
    self.client = server.client
    self.spec = server.policy.spec
    self.envs = list(envs)
    self.rows = int(rows)
    self.steps = steps
    self.timeout = timeout
    self._queue = queue.Queue(maxsize=4 * max(1, len(self.envs)))
    self._stop = threading.Event()
    self._threads = [
        threading.Thread(target=self._guard, args=(i,), daemon=True,
                         name=f'CollectorEnv{i}')
        for i in range(len(self.envs))]
    self._started = False

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  def __iter__(self):
    if not self._started:
      self._started = True
      for thread in self._threads:
        thread.start()
    running, rows = len(self._threads), []
    while running:
      item = self._queue.get(timeout=self.timeout)
      if item is None:  # An env finished its steps.
        running -= 1
        continue
      if isinstance(item, BaseException):
        raise RuntimeError('an env of the collector failed') from item
      rows.append(item)
      if len(rows) == self.rows:
        yield _stack(rows)
        rows = []
    if rows:
      yield _stack(rows)

  def close(self):
    """Stops the envs (each after its step in progress)."""
    self._stop.set()
    for thread in self._threads:
      if thread.is_alive():
        thread.join(self.timeout)

  def _guard(self, index):
    try:
      self._run(index)
    except Exception as error:
      self._put(error)
    self._put(None)

  def _run(self, index):
    env, client = self.envs[index], self.client()
    try:
      self._steps(index, env, client)
    finally:
      client.close()

  def _steps(self, index, env, client):
    act_keys = [k for k in env.act_space if k != 'reset']
    action = {k: np.zeros(s.shape, s.dtype) for k, s in env.act_space.items()}
    action['reset'] = np.bool_(True)
    step = 0
    while not self._stop.is_set() and (self.steps is None or step < self.steps):
      obs = {k: np.asarray(v) for k, v in env.step(action).items()}
      request = {k: obs[k] for k in self.spec}
      request['envid'] = np.int64(index)
      reply = client.call(request, timeout=self.timeout)
      missing = [k for k in act_keys if k not in reply]
      if missing:
        raise KeyError(f'the policy reply lacks the action keys {missing}')
      action = {k: reply[k] for k in act_keys}
      action['reset'] = np.bool_(obs['is_last'])
      self._put({**obs, 'envid': np.int64(index),
                 **{k: np.asarray(v) for k, v in reply.items()}})
      step += 1

  def _put(self, item):
    while not self._stop.is_set():
      try:
        self._queue.put(item, timeout=0.2)
        return
      except queue.Full:
        continue


def _stack(rows):
  return {k: np.stack([row[k] for row in rows]) for k in rows[0]}
