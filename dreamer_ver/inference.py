"""Serve a jitted batched policy to many callers, without the CLI
(TorchRL's InferenceServer, InferenceClient and weight sync).

  server = InferenceServer(fn, spec, carry=None, params=None,
                           max_batch_size=64, timeout=None,
                           transports=('thread',), weight_sync=False)
  server.start()
  InferenceClient(server)(obs)                    # this process
  InferenceClient(server.endpoint('shm'))(obs)    # this host (picklable)
  InferenceClient(server.endpoint('tcp'))(obs)    # any host (picklable)
  InferenceClient(mp_transport.client())(obs)     # a process it started
  server.update(new_params, version)              # a trainer here
  WeightSender(server.weight_sync_addr, server.handshake).send(p, version)
  server.shutdown()                               # a trainer elsewhere

The batch server (`rpc/batch_server.py`) gathers the calls of all clients
of every transport and asks a cutoff (`actor/preemption.py`) when they
become a batch: by default VER's rule with a minimum batch of one (cut
whatever is queued whenever the policy is free); with `timeout`, TorchRL's
rule (wait at most that long for `max_batch_size` calls); or any `cutoff`.
`actor/batched_policy.py` checks each call, gathers the envs' carries by
env id, runs the policy once on the batch padded to a compiled size
(powers of two up to `max_batch_size`, default `slots`) and hands each
caller its row. `fn`, `spec`, `carry`, `params`, `slots`, `buckets` and
`device` are those of `BatchedPolicy`: with `params`, `fn` takes them
first, new ones replace them between batches without a recompile, and
every reply says the `version` that acted. `start()` compiles every size
before serving.

Callers from other processes must know the server's token: `handshake`
(a fresh secret unless given) is what their clients pass. With
`plain_handshake=True` an unmodified `portal.Client(server.addr,
handshake=server.handshake)` gets in too, but then sends the token in
clear (docs/faults.md, threat model).
"""

import dataclasses
import secrets
import threading
import time

import jax
import numpy as np
from portal.client_socket import Disconnected

from dreamer_ver.actor import batching, preemption
from dreamer_ver.actor.batched_policy import BatchedPolicy
from dreamer_ver.rpc import (
    BatchServer, BlockingClient, Server, ShmClient, free_port, handshake)


@dataclasses.dataclass(frozen=True)
class Endpoint:
  """How a process reaches a server's 'tcp' (any host) or 'shm' (its host)
  transport: picklable, it holds the server's token."""
  kind: str
  addr: str
  handshake: str
  out_spec: dict
  method: str = 'act'


class InferenceServer(BatchServer):

  def __init__(self, fn, spec, carry=None, *, max_batch_size=None,
               timeout=None, cutoff=None, slots=64, buckets=None,
               device=None, addr=None, transports=('thread',), workers=1,
               params=None, version=0, weight_sync=False, **socket_kwargs):
    if max_batch_size is not None and buckets is None:
      buckets = batching.powers_of_two(int(max_batch_size))
    self.policy = BatchedPolicy(fn, spec, carry, slots, buckets, device,
                                params=params, version=version)
    largest = self.policy.max_batch
    if max_batch_size is not None and max_batch_size != largest:
      raise ValueError(f'max_batch_size {max_batch_size} is not the largest '
                       f'of the buckets {self.policy.buckets}')
    if cutoff is not None and timeout is not None:
      raise ValueError('give a cutoff or a timeout, not both')
    if cutoff is None:
      cutoff = (preemption.VER(1, largest) if timeout is None
                else preemption.Deadline(largest, timeout))
    if getattr(cutoff, 'max_batch', 0) > largest:
      raise ValueError(
          f'the cutoff cuts batches of up to {cutoff.max_batch}, but the '
          f'largest bucket is {largest}')
    self.addr = addr or f'localhost:{free_port()}'
    self.handshake = socket_kwargs.pop(
        'handshake', None) or handshake(secrets.token_hex(16))
    super().__init__(
        self.addr, self.policy.handle, cutoff, workers=workers,
        transports=transports, name='InferenceServer',
        handshake=self.handshake, **socket_kwargs)
    self.weights = None
    if weight_sync:
      if params is None:
        raise ValueError('weight_sync needs params')
      self.weights = _WeightSync(self.policy, self.handshake)

  @property
  def out_spec(self):
    """One reply: key -> (shape, dtype) (what `ShmClient` needs)."""
    return self.policy.out_spec

  @property
  def weight_sync_addr(self):
    """Where `WeightSender`s push params ('host:port'); needs
    `weight_sync=True`."""
    if self.weights is None:
      raise ValueError('this server was built without weight_sync=True')
    return self.weights.addr

  def endpoint(self, kind):
    """How another process calls this server over transport `kind`."""
    if kind not in ('tcp', 'shm') or kind not in self.transports:
      raise ValueError(f"endpoint() takes a transport of this server, "
                       f"'tcp' or 'shm'; it has {sorted(self.transports)}")
    return Endpoint(kind, self.addr, self.handshake, self.out_spec,
                    self.method)

  def update(self, params, version):
    """New params (same structure) for the batches cut from now on."""
    self.policy.update(params, version)

  def start(self):
    self.policy.compile()
    if self.weights is not None:
      self.weights.server.start()
    return super().start()

  def close(self, timeout=5.0):
    if self.weights is not None:
      self.weights.server.close(timeout)
    super().close(timeout)

  def shutdown(self, timeout=5.0):
    """TorchRL's name for `close`."""
    self.close(timeout)


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
    stop = _Deadline(timeout)
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
    stop = _Deadline(self.timeout)
    if self._client is None:
      self._client = BlockingClient(self.addr, self.handshake)
      if not self._client.connect(stop):
        self._client = None
        raise TimeoutError(f'no weight sync at {self.addr} within '
                           f'{self.timeout} s')
    paths, leaves = _flat(params)
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


class _WeightSync:
  """Serves `update(version, paths, leaves)` on a port of its own, for
  `WeightSender`s: the batch server's transports carry one method."""

  def __init__(self, policy, token):
    self.policy = policy
    params, _ = policy.store.latest()
    self.paths, leaves = _flat(params)
    self.specs = [(x.shape, x.dtype) for x in leaves]
    self.treedef = jax.tree.structure(params)
    self.addr = f'localhost:{free_port()}'
    size = sum(x.nbytes for x in leaves) + 2 ** 20
    self.server = Server(self.addr, 'WeightSync', quiet=(ValueError,),
                         handshake=token, max_msg_size=size)
    self.server.bind('update', self.update)

  def update(self, version, paths, leaves):
    """Checks the pushed params against the served ones, then swaps."""
    if list(paths) != self.paths:
      extra = sorted(set(paths) - set(self.paths))
      lacking = sorted(set(self.paths) - set(paths))
      raise ValueError(f'the params differ from the served ones: '
                       f'unknown {extra[:3]}, missing {lacking[:3]}')
    for path, leaf, (shape, dtype) in zip(paths, leaves, self.specs):
      if leaf.shape != shape or leaf.dtype != dtype:
        raise ValueError(f'{path} is {leaf.dtype}{list(leaf.shape)}, the '
                         f'served one {dtype}{list(shape)}')
    self.policy.update(jax.tree.unflatten(self.treedef, leaves), version)
    return version


class _Deadline:
  """A stop event (`is_set`, `wait`) that sets itself after `seconds`."""

  def __init__(self, seconds):
    self.seconds = seconds
    self.end = time.monotonic() + seconds
    self._never = threading.Event()

  def is_set(self):
    return time.monotonic() >= self.end

  def wait(self, seconds):
    self._never.wait(max(0.0, min(seconds, self.end - time.monotonic())))
    return self.is_set()


def _flat(params):
  """(leaf names 'a/b/c', numpy leaves) of a pytree, in JAX's order."""
  flat = jax.tree_util.tree_flatten_with_path(params)[0]
  return ([jax.tree_util.keystr(path, simple=True, separator='/')
           for path, _ in flat],
          [np.asarray(leaf) for _, leaf in flat])
