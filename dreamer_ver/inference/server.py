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

(`InferenceClient`, `Endpoint` and `WeightSender`: `client.py`.)

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

import secrets

import jax

from dreamer_ver.actor import batching, preemption
from dreamer_ver.actor.batched_policy import BatchedPolicy
from dreamer_ver.inference.client import Endpoint, flat_params
from dreamer_ver.rpc import BatchServer, Server, free_port, handshake


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


class _WeightSync:
  """Serves `update(version, paths, leaves)` on a port of its own, for
  `WeightSender`s: the batch server's transports carry one method."""

  def __init__(self, policy, token):
    self.policy = policy
    params, _ = policy.store.latest()
    self.paths, leaves = flat_params(params)
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
