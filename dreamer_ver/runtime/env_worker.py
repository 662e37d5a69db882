"""An env process: steps one env and asks the actor for every action.

It never imports JAX, so it starts fast and stays small. Each env has exactly
one request in flight (see `env_client`). When the actor goes away the worker
reconnects by itself and starts a fresh episode, so the actor sees
`is_first` and resets that env's carry.
"""

import numpy as np
from portal.client_socket import Disconnected

from dreamer_ver.envs import make_env
from dreamer_ver.runtime.env_client import EnvClient
from dreamer_ver.runtime.process import StopSignal, handshake


def run_env(config, envid, is_eval=False, stop=None):
  """Runs env `envid` until SIGINT/SIGTERM (or `stop` is set). Returns 0."""
  stop = stop or StopSignal()
  env = make_env(config.task, config.env, seed=config.seed * 100_000 + envid)
  reset = {k: np.zeros(s.shape, s.dtype) for k, s in env.act_space.items()}
  reset['reset'] = np.bool_(True)
  client = EnvClient(config.run.actor_addr, handshake(config))
  client.connect(stop)
  action = reset
  while not stop:
    obs = env.step(action)
    request = {k: np.asarray(v) for k, v in obs.items()}
    request['envid'] = np.int64(envid)
    request['is_eval'] = np.bool_(is_eval)
    try:
      action = client.call('act', request, stop=stop)
    except Disconnected:
      client.connect(stop)
      action = reset
  client.close()
  env.close()
  return 0
