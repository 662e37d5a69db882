"""An env process: steps its envs and asks the actor for every action.

It never imports JAX, so it starts fast and stays small. It reaches the
actor through shared memory when both run on this host, else over TCP
(`run.actor_transport`, `actor_client`). With one env it has
one request in flight. With several (`run.envs_per_worker`), the envs travel
in one request per half on one connection, and the halves alternate: one
half steps while the other waits for its actions (double buffering). The
actor still treats every env as its own row. When the actor goes away the
worker reconnects by itself and starts fresh episodes (the actor sees
`is_first` and resets those carries). Env ids that another connection
still holds (a vanished host's, until the actor knows it is dead) are
asked for again for up to TAKEN_SECONDS.
"""

import time

import numpy as np
from portal.client_socket import Disconnected

from dreamer_ver.cluster.links import client_address
from dreamer_ver.cluster.signals import StopSignal
from dreamer_ver.envs import make_run_env
from dreamer_ver.rpc import shm_protocol
from dreamer_ver.rpc.addresses import handshake as token_handshake
from dreamer_ver.rpc.addresses import split_addr
from dreamer_ver.rpc.batch_server import ENV_ID_TAKEN
from dreamer_ver.rpc.blocking_client import BlockingClient
from dreamer_ver.rpc.shm_client import ShmClient
from dreamer_ver.rpc.wire import RemoteError


TAKEN_SECONDS = 40  # past the actor's keepalive bound on a dead peer (25 s)


def run_env(config, envid, is_eval=False, stop=None):
  """Runs env `envid` until SIGINT/SIGTERM (or `stop` is set). Returns 0."""
  return run_envs(config, [envid], is_eval, stop)


def run_envs(config, envids, is_eval=False, stop=None):
  """Runs the envs `envids` in this process until SIGINT/SIGTERM."""
  stop = stop if stop is not None else StopSignal()
  envs = [make_run_env(config, i) for i in envids]
  n = len(envs)
  halves = [list(range(n))] if n == 1 else [
      list(range(n // 2)), list(range(n // 2, n))]
  client = actor_client(config, envs[0].act_space)
  client.connect(stop)
  taken = None  # when the actor first said another connection has an id
  while not stop:
    try:
      _serve(client, envs, envids, halves, is_eval, stop)
    except Disconnected:
      client.connect(stop)
    except RuntimeError as error:
      taken = _wait_for_ids(error, taken, stop)
      client.connect(stop)
  client.close()
  for env in envs:
    env.close()
  return 0


def _serve(client, envs, envids, halves, is_eval, stop):
  """Steps and asks, half by half, until `stop`; every env starts with a
  reset. Raises Disconnected when the actor goes away."""
  reset = {k: np.zeros(s.shape, s.dtype) for k, s in envs[0].act_space.items()}
  reset['reset'] = np.bool_(True)
  actions = [reset] * len(envs)

  def ask(half):
    obs = [envs[i].step(actions[i]) for i in half]
    return client.send('act', request(
        obs, [envids[i] for i in half], is_eval, single=len(envs) == 1))

  pending = [ask(half) for half in halves]
  while not stop:
    for h, half in enumerate(halves):
      reply = client.recv(pending[h], stop)
      if reply is None:
        return
      if len(envs) == 1:
        actions[half[0]] = reply
      else:
        for row, i in enumerate(half):
          actions[i] = {k: v[row] for k, v in reply.items()}
      pending[h] = ask(half)


def _wait_for_ids(error, since, stop):
  """After the actor refused env ids that another connection holds: a
  wait before asking again, and the time of the first refusal. That
  connection may be a dead host's, which the actor closes once its
  keepalive probes go unanswered (`rpc/server_socket.py`, 25 s); after
  TAKEN_SECONDS the error is raised (two hosts with the same ids)."""
  if not (isinstance(error, RemoteError) and error.kind == ENV_ID_TAKEN):
    raise error
  now = time.monotonic()
  if since is None:
    print(f'{error}; asking again until that connection closes (a '
          f'vanished host\'s does within {TAKEN_SECONDS} s).', flush=True)
    since = now
  elif now - since > TAKEN_SECONDS:
    raise error
  stop.wait(1.0)
  return since


def actor_client(config, act_space):
  """The client an env process asks the actor with: a ShmClient when the
  transport is shm (or auto and the actor's address is loopback), else a
  BlockingClient over TCP. Both have the same calls. Neither has a
  deadline: reconnecting to a stopped actor would not help, and its own
  supervisor restarts it (`run.peer_timeout`)."""
  handshake = token_handshake(config.run.token)
  if uses_shm(config.run):
    reply = {k: (s.shape, s.dtype) for k, s in act_space.items()}
    reply['reset'] = ((), bool)
    return ShmClient(config.run.actor_addr, reply, handshake=handshake)
  return BlockingClient(client_address(config.run.actor_addr),
                        handshake=handshake)


def uses_shm(run):
  if run.actor_transport != 'auto':
    return run.actor_transport == 'shm'
  addr = str(run.actor_addr)
  return (shm_protocol.available() and not callable(client_address(addr))
          and split_addr(addr)[0] in ('localhost', '127.0.0.1', '::1'))


def fleets(run, offset=0):
  """(name, env ids, is_eval) of each env process of a run: train envs get
  ids offset .. offset+envs-1, eval envs the next ids, and each process
  hosts up to `run.envs_per_worker` envs of one kind."""
  per = max(1, run.envs_per_worker)
  groups = []
  for first, count, is_eval in ((0, run.envs, False),
                                (run.envs, run.eval_envs, True)):
    ids = [offset + first + i for i in range(count)]
    for group in (ids[i:i + per] for i in range(0, count, per)):
      name = f'env{group[0]}' if len(group) == 1 else (
          f'env{group[0]}-{group[-1]}')
      groups.append((name, group, is_eval))
  return groups


def request(obs, envids, is_eval, single):
  """The `act` request for the observations `obs` of the envs `envids`:
  one env's arrays as they are (`single`), else stacked with one row per
  env. Arrays are made C-contiguous, as the wire needs (dm_control renders
  flipped views)."""
  if single:
    data = {k: np.asarray(v, order='C') for k, v in obs[0].items()}
    data['envid'] = np.int64(envids[0])
    data['is_eval'] = np.bool_(is_eval)
  else:
    data = {k: np.stack([o[k] for o in obs]) for k in obs[0]}
    data['envid'] = np.array(envids, np.int64)
    data['is_eval'] = np.full(len(envids), is_eval, bool)
  return data
