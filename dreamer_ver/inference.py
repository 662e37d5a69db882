"""Serve a jitted batched policy to many callers, without the CLI.

  server = InferenceServer(fn, spec, carry=None, params=None, cutoff=None,
                           slots=64, transports=('thread',)).start()
  server.client().call({'obs': ..., 'envid': 3})  # this process
  ShmClient(server.addr, server.out_spec, server.handshake)  # this host
  BlockingClient(server.addr, server.handshake)   # any host ('tcp')
  server.update(new_params, version)              # a trainer's weights
  server.close()

The batch server (`rpc/batch_server.py`) gathers the calls of all clients
of every transport and asks `cutoff` (`actor/preemption.py`; by default
VER's rule with a minimum batch of one: cut whatever is queued whenever the
policy is free) when they become a batch; `actor/batched_policy.py` checks
each call, gathers the envs' carries by env id, runs the policy once on the
padded batch and hands each caller its row. `fn`, `spec`, `carry`,
`params`, `slots`, `buckets` and `device` are those of `BatchedPolicy`:
with `params`, `fn` takes them first, `update` swaps them between batches
without recompiling, and every reply says the `version` that acted.
`start()` compiles every bucket before serving.

Callers from other processes must know the server's token: `handshake`
(a fresh secret unless given) is what their clients pass. With
`plain_handshake=True` an unmodified `portal.Client(server.addr,
handshake=server.handshake)` gets in too, but then sends the token in
clear (docs/faults.md, threat model).
"""

import secrets

from dreamer_ver.actor import preemption
from dreamer_ver.actor.batched_policy import BatchedPolicy
from dreamer_ver.rpc import BatchServer, free_port, handshake


class InferenceServer(BatchServer):

  def __init__(self, fn, spec, carry=None, cutoff=None, slots=64,
               buckets=None, device=None, addr=None, transports=('thread',),
               workers=1, params=None, version=0, **socket_kwargs):
    self.policy = BatchedPolicy(fn, spec, carry, slots, buckets, device,
                                params=params, version=version)
    if cutoff is None:
      cutoff = preemption.VER(1, self.policy.max_batch)
    largest = getattr(cutoff, 'max_batch', 0)
    if largest > self.policy.max_batch:
      raise ValueError(
          f'the cutoff cuts batches of up to {largest}, but the largest '
          f'bucket is {self.policy.max_batch}')
    self.addr = addr or f'localhost:{free_port()}'
    self.handshake = socket_kwargs.pop(
        'handshake', None) or handshake(secrets.token_hex(16))
    super().__init__(
        self.addr, self.policy.handle, cutoff, workers=workers,
        transports=transports, name='InferenceServer',
        handshake=self.handshake, **socket_kwargs)

  @property
  def out_spec(self):
    """One reply: key -> (shape, dtype) (what `ShmClient` needs)."""
    return self.policy.out_spec

  def update(self, params, version):
    """New params (same structure) for the batches cut from now on."""
    self.policy.update(params, version)

  def start(self):
    self.policy.compile()
    return super().start()
