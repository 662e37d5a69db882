"""The actor: turns a batch of env requests into actions.

Per-env RSSM carries live in one device-resident table `[slots + 1, ...]`
indexed by env slot (the extra last row absorbs the padding rows). The jitted
step gathers the batch's rows, runs the policy, and scatters the new carries
back into the donated table, so no per-env Python tree work happens on the
hot path: the host only copies observations in and actions out.
"""

import collections
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np

from dreamer_ver.agent.agent import POLICY_MODULES

META_KEYS = ('envid', 'is_eval')
MAX_ENVID = 2 ** 31 - 1


class RequestError(ValueError):
  """A request that does not match the observation space."""


class Actor:
  """`handle` and `post` are the batch server's handler and postfn."""

  def __init__(self, agent, params_store, slots, buckets, seed=0,
               mode='sample', replay=None, logger=None):
    self.agent = agent
    self.params = params_store
    self.slots = int(slots)
    self.buckets = sorted(set(int(b) for b in buckets))
    self.mode = mode
    self.obs_space = {k: v for k, v in agent.obs_space.items()
                      if not k.startswith('log/')}
    self.table = agent.init_carry(self.slots + 1)
    self.slot_of = collections.OrderedDict()  # envid -> slot, oldest first
    self.key = jax.random.PRNGKey(seed)
    self.batches = 0
    self.lock = threading.Lock()
    self.replay = replay  # client.Client of the replay server, or None
    self.logger = logger  # client.Client of the logger server, or None
    self.pending = {}  # id(requests) -> transitions, from handle to post
    self.served = 0  # train env steps served (eval rows excluded)
    self.post_errors = 0  # add_batch / tran calls that came back failed
    self.version = 0  # params version of the latest batch
    self._step = jax.jit(self._step_fn, donate_argnums=(1,))

  # ------------------------------------------------------------- compile

  def compile(self):
    """Compiles every bucket size before serving, so jit never compiles
    while envs wait. Returns the inference seconds per bucket."""
    times = {}
    for size in self.buckets:
      obs = {k: np.zeros((size, *s.shape), s.dtype)
             for k, s in self.obs_space.items()}
      slots = np.full((size,), self.slots, np.int32)
      params, _ = self.params.latest()
      for _ in range(2):  # The second call measures the compiled step.
        start = time.perf_counter()
        self.table, acts, outs = self._step(
            self._policy_params(params), self.table, slots, obs, self.key)
        jax.block_until_ready(acts)
        times[size] = time.perf_counter() - start
    return times

  # -------------------------------------------------------------- serving

  def handle(self, requests):
    """Batcher handler: one reply (or exception) per request, in order."""
    replies = [None] * len(requests)
    valid = []
    for i, request in enumerate(requests):
      try:
        self._check(request.data)
        valid.append(i)
      except RequestError as e:
        replies[i] = e
    envids = [int(requests[i].data['envid']) for i in valid]
    for envid in [e for e, n in collections.Counter(envids).items() if n > 1]:
      for i in valid:
        if int(requests[i].data['envid']) == envid:
          replies[i] = RequestError(
              f'env id {envid} sent several requests in one batch; each env '
              'may only have one request in flight')
    valid = [i for i in valid if replies[i] is None]
    if not valid:
      return replies
    datas = [requests[i].data for i in valid]
    trans = self.step(datas)
    for row, i in enumerate(valid):
      reply = {k: trans[k][row] for k in self.agent.act_space}
      reply['reset'] = trans['is_last'][row]
      replies[i] = reply
    self.pending[id(requests)] = (trans, _log_keys(datas))
    return replies

  def post(self, requests, replies):
    """After the replies are out: ship the valid rows' transitions to replay
    and logger. The clients' bounded in-flight calls are the back-pressure:
    a full replay (limiter) slows the actor down, never loses data."""
    del replies
    entry = self.pending.pop(id(requests), None)
    if entry is None:
      return
    trans, logs = entry
    self.served += int((~trans['is_eval']).sum())
    if self.replay is not None:
      self._watch(self.replay.add_batch(trans), 'replay.add_batch')
    if self.logger is not None:
      self._watch(self.logger.tran({**trans, **logs}), 'logger.tran')

  def _watch(self, future, what):
    """Nobody waits for the posts' replies; a failed one is counted and
    the first few are printed, so a rejected batch is never silent."""
    def done(future):
      error = future.exception()
      if error is not None:
        self.post_errors += 1
        if self.post_errors <= 5:
          print(f'[actor] {what} failed: {error}', flush=True)
    future.add_done_callback(done)

  def step(self, datas):
    """Runs the policy on a list of valid request dicts. Returns the
    transitions of those rows: obs, actions, latents, envid, is_eval and the
    params version that acted."""
    n = len(datas)
    size = self._bucket(n)
    obs = {}
    for key, space in self.obs_space.items():
      buf = np.zeros((size, *space.shape), space.dtype)
      buf[:n] = [d[key] for d in datas]
      obs[key] = buf
    envids = np.array([int(d['envid']) for d in datas], np.int64)
    with self.lock:
      slots = np.full((size,), self.slots, np.int32)
      slots[:n] = [self._slot(e) for e in envids]
      params, version = self.params.latest()
      self.version = version
      key = jax.random.fold_in(self.key, self.batches)
      self.batches += 1
      self.table, acts, outs = self._step(
          self._policy_params(params), self.table, slots, obs, key)
    acts, outs = jax.device_get((acts, outs))
    trans = {k: v[:n] for k, v in obs.items()}
    trans.update({k: v[:n] for k, v in acts.items()})
    trans.update({k: v[:n] for k, v in outs.items()})
    trans['envid'] = envids
    trans['is_eval'] = np.array(
        [bool(d.get('is_eval', False)) for d in datas], bool)
    trans['version'] = np.full((n,), version, np.int64)
    return trans

  def max_request_bytes(self, margin=1 << 20):
    """The largest legal request: two observations plus a margin for the
    packing and `log/` keys. Larger frames are refused before buffering."""
    obs = sum(int(np.prod(s.shape)) * s.dtype.itemsize
              for s in self.obs_space.values())
    return 2 * obs + margin

  # -------------------------------------------------------------- helpers

  def _step_fn(self, params, table, slots, obs, key):
    carry = jax.tree.map(lambda x: x[slots], table)
    carry, acts, outs = self.agent._policy(params, carry, obs, key, self.mode)
    table = jax.tree.map(lambda t, c: t.at[slots].set(c), table, carry)
    return table, acts, outs

  @staticmethod
  def _policy_params(params):
    return {k: params[k] for k in POLICY_MODULES}

  def _bucket(self, n):
    for size in self.buckets:
      if size >= n:
        return size
    raise RequestError(f'batch of {n} exceeds the largest bucket {self.buckets[-1]}')

  def _slot(self, envid):
    """Slot of an env id; a new id takes a free slot or the least recently
    used one (its carry is reset anyway by that env's is_first)."""
    if envid in self.slot_of:
      self.slot_of.move_to_end(envid)
      return self.slot_of[envid]
    if len(self.slot_of) < self.slots:
      slot = len(self.slot_of)
    else:
      _, slot = self.slot_of.popitem(last=False)
    self.slot_of[envid] = slot
    return slot

  def _check(self, data):
    if not isinstance(data, dict):
      raise RequestError(f'request must be a dict of arrays, got {type(data).__name__}')
    expected = set(self.obs_space) | {'envid'}
    keys = {k for k in data if not k.startswith('log/')}
    missing = sorted(expected - keys)
    extra = sorted(keys - expected - set(META_KEYS))
    if missing:
      raise RequestError(f'missing key {missing[0]!r} (expected keys: {sorted(expected)})')
    if extra:
      raise RequestError(f'unexpected key {extra[0]!r} (expected keys: {sorted(expected)})')
    envid = np.asarray(data['envid'])
    if envid.shape != () or not np.issubdtype(envid.dtype, np.integer):
      raise RequestError(f'envid must be an integer scalar, got {envid.dtype}{list(envid.shape)}')
    if not 0 <= int(envid) <= MAX_ENVID:
      raise RequestError(f'envid must be in [0, {MAX_ENVID}], got {int(envid)}')
    for key, space in self.obs_space.items():
      value = np.asarray(data[key])
      if value.shape != space.shape or value.dtype != space.dtype:
        raise RequestError(
            f'key {key!r}: expected {space.dtype}{list(space.shape)}, '
            f'got {value.dtype}{list(value.shape)}')
      if np.issubdtype(value.dtype, np.floating) and not np.isfinite(value).all():
        raise RequestError(f'key {key!r}: values must be finite')


def _log_keys(datas):
  """Stacks the `log/` keys that every request of the batch carries."""
  keys = set.intersection(*[
      {k for k in d if k.startswith('log/')} for d in datas])
  logs = {}
  for key in sorted(keys):
    try:
      logs[key] = np.stack([np.asarray(d[key]) for d in datas])
    except ValueError:
      continue  # Shapes differ between envs: not a per-step scalar to log.
  return logs
