"""The callers' side of an InferenceServer (`server.py`): one client
class over any transport, and the trainer's end of the weight sync.

It imports no JAX, so env processes that call a server stay light;
`WeightSender` loads it when it sends (a trainer has it already).
"""

import dataclasses
import threading
import time

import numpy as np
from portal.client_socket import Disconnected

from dreamer_ver.rpc import BatchServer, BlockingClient, ShmClient


@dataclasses.dataclass(frozen=True)
class Endpoint:
  """How a process reaches a server's 'tcp' (any host) or 'shm' (its host)
  transport: picklable, it holds the server's token."""
  kind: str
  addr: str
  handshake: str
  out_spec: dict
  method: str = 'act'


class InferenceClient:
  """One caller of an InferenceServer, whatever the transport:
  `client(obs)` is the server's reply to `obs` (a dict of arrays with the
  spec's keys and, with carries, `envid`). Built from the server (in its
  process), an `Endpoint` (picklable: it connects in the process of its
  first call) or a transport's own client (`MPTransport`, `RayTransport`,
  yours: anything with `call(data, timeout)`). One call at a time. A call
  that takes longer than `timeout` seconds raises TimeoutError, an error
  reply RuntimeError with the server's message, a server that went away
  portal's Disconnected (the next call connects again)."""

  def __init__(self, target, timeout=60.0):
    if isinstance(target, BatchServer):
      target = target.client()
    self.target = target
    self.timeout = timeout
    self._client = None

  def __call__(self, obs):
    return self.call(obs)

  def call(self, obs, timeout=None):
    timeout = self.timeout if timeout is None else timeout
    if not isinstance(self.target, Endpoint):
      return self.target.call(obs, timeout=timeout)
    stop = Deadline(timeout)
    if self._client is None:
      self._client = self._connect(stop)
    try:
      reply = self._client.call(self.target.method, obs, stop=stop)
    except Disconnected:
      self.close()  # The next call connects again (a restarted server).
      raise
    if reply is None:
      raise TimeoutError(f'no reply within {timeout} s')
    return reply

  def close(self):
    """Leaves the server: the env ids of this client are free again."""
    client = self.target if self._client is None else self._client
    if hasattr(client, 'close'):
      client.close()
    self._client = None

  def __enter__(self):
    return self

  def __exit__(self, *exc):
    self.close()

  def __getstate__(self):
    if not isinstance(self.target, Endpoint):
      raise TypeError('only a client of an Endpoint travels between '
                      'processes; send server.endpoint(kind)')
    return {'target': self.target, 'timeout': self.timeout, '_client': None}

  def _connect(self, stop):
    endpoint = self.target
    if endpoint.kind == 'shm':
      client = ShmClient(endpoint.addr, endpoint.out_spec, endpoint.handshake)
    else:
      client = BlockingClient(endpoint.addr, endpoint.handshake)
    if not client.connect(stop):
      raise TimeoutError(f'could not connect to {endpoint.addr} '
                         f'({endpoint.kind}) within {stop.seconds} s')
    return client


class WeightSender:
  """A trainer's end of a server's weight sync (any process, any host):
  `send(params, version)` returns once the server took them; its next
  batch acts with them and its replies say `version`. Params that do not
  match the server's (leaf names, shapes, dtypes) are a ValueError here,
  and the server keeps its own."""

  def __init__(self, addr, handshake, timeout=60.0):
    self.addr = addr
    self.handshake = handshake
    self.timeout = timeout
    self._client = None

  def send(self, params, version):
    stop = Deadline(self.timeout)
    if self._client is None:
      self._client = BlockingClient(self.addr, self.handshake)
      if not self._client.connect(stop):
        self._client = None
        raise TimeoutError(f'no weight sync at {self.addr} within '
                           f'{self.timeout} s')
    paths, leaves = flat_params(params)
    try:
      taken = self._client.call('update', int(version), paths, leaves,
                                stop=stop)
    except RuntimeError as error:  # The server's check: see `_WeightSync`.
      raise ValueError(str(error).removeprefix(
          'update: ValueError: ')) from None
    if taken is None:
      raise TimeoutError(f'the server took no params within {self.timeout} s')
    return taken

  def close(self):
    if self._client is not None:
      self._client.close()
      self._client = None

  def __getstate__(self):
    return {**self.__dict__, '_client': None}


class Deadline:
  """A stop event (`is_set`, `wait`) that sets itself after `seconds`, or
  when `stop` (an Event) is set first."""

  def __init__(self, seconds, stop=None):
    self.seconds = seconds
    self.end = time.monotonic() + seconds
    self.stop = threading.Event() if stop is None else stop

  def is_set(self):
    return self.stop.is_set() or time.monotonic() >= self.end

  def wait(self, seconds):
    self.stop.wait(max(0.0, min(seconds, self.end - time.monotonic())))
    return self.is_set()


def flat_params(params):
  """(leaf names 'a/b/c', numpy leaves) of a pytree, in JAX's order: what
  a sender and the server compare."""
  import jax  # Here: the module's callers in env processes have no JAX.
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  return ([jax.tree_util.keystr(path, simple=True, separator='/')
           for path, _ in flat],
          [np.asarray(leaf) for _, leaf in flat])
