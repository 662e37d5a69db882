"""An env process: steps one env and asks the actor for every action.

It uses a plain `portal.Client` and never imports JAX, so it starts fast and
stays small. Each env has exactly one request in flight. When the actor goes
away the worker reconnects by itself and starts a fresh episode (the actor
sees `is_first` and resets that env's carry).
"""

import numpy as np
import portal

from dreamer_ver.envs import make_env
from dreamer_ver.runtime.process import StopSignal


def run_env(config, envid, is_eval=False, stop=None):
  """Runs env `envid` until SIGINT/SIGTERM (or `stop` is set). Returns 0."""
  stop = stop or StopSignal()
  env = make_env(config.task, config.env, seed=config.seed * 100_000 + envid)
  reset = {k: np.zeros(s.shape, s.dtype) for k, s in env.act_space.items()}
  reset['reset'] = np.bool_(True)
  client = portal.Client(
      config.run.actor_addr, f'Env{envid:05d}', maxinflight=1, autoconn=False,
      logging=False)
  _connect(client, stop)
  action = reset
  while not stop and action is not None:
    obs = env.step(action)
    request = {k: np.asarray(v) for k, v in obs.items()}
    request['envid'] = np.int64(envid)
    request['is_eval'] = np.bool_(is_eval)
    try:
      action = _ask(client, request, stop)
    except portal.Disconnected:
      _connect(client, stop)
      action = reset
  client.close(timeout=1)
  env.close()
  return 0


def _ask(client, request, stop):
  """The actor's reply; None once `stop` is set. A server-side error (a bad
  request) raises RuntimeError with the actor's message."""
  future = client.act(request)
  while not future.wait(0.5):
    if stop:
      return None
  return future.result()


def _connect(client, stop):
  while not stop:
    try:
      client.connect(timeout=1.0)
      return
    except TimeoutError:
      continue
