"""The actor: turns a batch of env requests into actions.

`handle` is the batch server's handler: it checks each request against the
observation space, runs the policy of the request's lane on the valid rows
and returns one reply (or error) per request, with the batch's transitions
as the context that `post` ships once the replies are out.

Each policy device is a lane (`carries.CarryLane`) with its own carry table
and slots; the batch server routes each connection to one lane
(`Request.lane`), so an env's carry stays on one device.
"""

import threading

import jax
import numpy as np

from dreamer_ver.actor.batched_policy import BatchedPolicy
from dreamer_ver.actor.shipping import Shipper
from dreamer_ver.agent.agent import policy_params
from dreamer_ver.core.transitions import META, is_log


class Actor:
  """`handle` and `post` are the batch server's handler and postfn. One
  lane per device of `params_store`; `replay` and `logger` are the clients
  the transitions are shipped to (or None)."""

  def __init__(self, agent, params_store, slots, buckets, seed=0,
               mode='sample', replay=None, logger=None):
    self.agent = agent
    self.params = params_store
    self.mode = mode
    self.obs_space = agent.obs_space
    carry = jax.tree.map(lambda x: x[0], agent.init_carry(1))
    self.policy = BatchedPolicy(
        self._policy_step, agent.obs_space, carry=carry, slots=slots,
        buckets=sorted(set(int(b) for b in buckets)), params=params_store,
        meta=META, keyed=True, seed=seed)
    self.shipper = Shipper(replay, logger)
    # Per served batch: updates the learner published while it ran.
    self._lags, self._lags_lock = [], threading.Lock()

  @property
  def lanes(self):
    return self.policy.lanes

  @property
  def buckets(self):
    return self.policy.buckets

  @property
  def key(self):
    return self.policy.key

  def compile(self):
    """Compiles every bucket size on every lane's device before serving, so
    jit never compiles while envs wait. Returns the inference seconds per
    bucket, one dict per lane."""
    return self.policy.compile()

  # -------------------------------------------------------------- serving

  def handle(self, requests):
    """Batch server handler: (one reply or exception per request, in order;
    the transitions for `post`, or None when no request was valid)."""
    datas = [r.data for r in requests]
    batch = self.policy.admit(datas, requests[0].lane)
    replies = batch.errors
    if not batch.valid:
      return replies, None
    trans = self._run(batch, requests[0].lane)
    for row, i in enumerate(batch.valid):
      reply = {k: trans[k][row] for k in self.agent.act_space}
      reply['reset'] = trans['is_last'][row]
      replies[i] = reply
    return replies, (trans, _log_keys([datas[i] for i in batch.valid]))

  def post(self, requests, context):
    """Batch server postfn: ships the transitions of a served batch."""
    del requests
    if context is not None:
      self.shipper.ship(*context)

  def step(self, datas, lane=0):
    """Runs the policy of lane `lane` on a list of request dicts (raises
    the first one's RequestError). Returns the transitions of those rows:
    obs, actions, latents, envid, is_eval and the params version that
    acted."""
    batch = self.policy.admit(datas, lane)
    for error in batch.errors:
      if error is not None:
        raise error
    return self._run(batch, lane)

  def take_lags(self):
    """The policy lag of each batch served since the last call: how many
    updates the learner published between reading the batch's params and
    its actions coming back."""
    with self._lags_lock:
      lags, self._lags = self._lags, []
    return lags

  def forward(self, lane, params, slots, obs, number=0):
    """The jitted step alone (`BatchedPolicy.forward`): actions and outputs
    in one dict, on the device."""
    return self.policy.forward(lane, params, slots, obs, number)

  def max_request_bytes(self, margin=1 << 20):
    """The largest legal request: two observations plus a margin for the
    packing and `log/` keys. Larger frames are refused before buffering."""
    obs = sum(int(np.prod(s.shape)) * s.dtype.itemsize
              for s in self.obs_space.values())
    return 2 * obs + margin

  # -------------------------------------------------------------- helpers

  def _run(self, batch, lane):
    """The transitions of an admitted batch's valid rows (see `step`)."""
    out, version = self.policy.run(batch, lane)
    with self._lags_lock:
      self._lags.append(self.params.version - version)
    n = len(batch.valid)
    trans = {**{k: v[:n] for k, v in batch.obs.items()}, **out}
    trans['envid'] = np.array(batch.envids, np.int64)
    trans['is_eval'] = batch.meta['is_eval']
    trans['version'] = np.full((n,), version, np.int64)
    return trans

  def _policy_step(self, params, carry, obs, key):
    carry, acts, outs = self.agent.policy_step(
        policy_params(params), carry, obs, key, self.mode)
    return carry, {**acts, **outs}


def _log_keys(datas):
  """Stacks the `log/` keys that every request of the batch carries (those
  of the first, looked up in the others: a set of each row's keys cost
  0.6 us a row)."""
  keys = [k for k in datas[0] if is_log(k)]
  logs = {}
  for key in sorted(k for k in keys if all(k in d for d in datas)):
    try:
      logs[key] = np.stack([np.asarray(d[key]) for d in datas])
    except ValueError:
      continue  # Shapes differ between envs: not a per-step scalar to log.
  return logs
