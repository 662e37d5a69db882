"""The learner: trains on batches streamed from the replay server.

Each step takes the next prefetched batch, trains, writes the fresh latents
back to replay (fire and forget), and publishes the new policy params with
a version. Each batch's rows carry the params version that acted; the
learner logs the distribution of its policy lag, the updates between
that version and its own (VER's measure of how off-policy the data is),
as `train/policy_lag/*` over each log interval. Training is data-parallel
over the train devices (`agent/data_parallel.py`): each batch's rows are
split across them, the state is replicated; with one device it is the
plain jitted step. Reports, metrics and checkpoints happen on wall-clock
intervals.
The logger gets scalars as float64 and the report's open-loop videos as
uint8 [T, H, W, C]; the report's other arrays are not sent.
"""

import collections

import elements
import jax
import jax.numpy as jnp
import numpy as np

from dreamer_ver.agent.agent import policy_params
from dreamer_ver.agent.data_parallel import DataParallel


class Prefetch:
  """Keeps `depth` calls of one replay method in flight."""

  def __init__(self, client, method, depth=2):
    self.call = getattr(client, method)
    self.futures = collections.deque(self.call() for _ in range(depth))

  def next(self, stop):
    """The next result; None if `stop` is set while waiting."""
    result = wait(self.futures[0], stop)
    if result is not None:
      self.futures.popleft()
      self.futures.append(self.call())
    return result


def wait(future, stop, poll=0.2):
  """A future's result, or None once `stop()` is true."""
  while True:
    try:
      return future.result(timeout=poll)
    except TimeoutError:
      if stop():
        return None


class Learner:

  def __init__(self, agent, state, params_store, config, replay, logger,
               ckpt, counters, devices=None):
    self.agent = agent
    self.parallel = DataParallel(agent, devices or jax.devices()[:1])
    self.state = self.parallel.put_state(state)
    self.params = params_store
    self.config = config
    self.replay = replay  # client.Client of the replay server
    self.logger = logger  # client.Client of the logger server, or None
    self.ckpt = ckpt
    self.counters = counters  # shared with the agent loop: steps, version
    self.carry = self.parallel.put_rows(agent.init_carry(config.batch_size))
    self.metrics = collections.defaultdict(list)
    self.lags = []  # per trained batch: the policy lag of each row

  def compile(self):
    """Compiles train and report on zero batches of the replay's shapes, so
    the learner never compiles mid-run (a compile cannot be interrupted,
    which would hold up a shutdown)."""
    cfg = self.config
    put = self.parallel.put_rows
    train = put(self.zero_batch(cfg.batch_length + cfg.replay_context))
    report = put(self.zero_batch(cfg.report_length + cfg.replay_context))
    state = jax.tree.map(jnp.copy, self.state)  # train donates its state
    outs = self.parallel.train(state, self.carry, train)
    jax.block_until_ready((outs, self.parallel.report(self.state, report)))

  def zero_batch(self, length):
    """A batch of zeros with exactly the keys, shapes and dtypes the replay
    server returns, as the jitted step sees them: the actor's transitions
    (their version taken out) plus stepid and consec."""
    B = self.config.batch_size
    rssm = self.config.agent.rssm
    spaces = {**self.agent.obs_space, **self.agent.act_space}
    batch = {k: np.zeros((B, length, *s.shape), s.dtype)
             for k, s in spaces.items()}
    batch['dyn/deter'] = np.zeros((B, length, rssm.deter), np.float32)
    batch['dyn/stoch'] = np.zeros(
        (B, length, rssm.stoch, rssm.classes), np.float32)
    batch['stepid'] = np.zeros((B, length, 20), np.uint8)
    batch['consec'] = np.zeros((B, length), np.int32)
    return batch

  def run(self, stop):
    """Trains until `stop()` is true."""
    run = self.config.run
    train = Prefetch(self.replay, 'sample_batch_train')
    should_log = elements.when.Clock(run.log_every)
    should_report = elements.when.Clock(run.report_every)
    fps = elements.FPS()
    while not stop():
      batch = train.next(stop)
      if batch is None:
        break
      self.train_step(batch)
      fps.step(self.config.batch_size * self.config.batch_length)
      if should_report():
        self.report(stop)
      if should_log():
        self.log({'fps/train': fps.result()})

  def train_step(self, batch):
    acted = batch.pop('version', None)  # absent in replays from before it
    if acted is not None:
      trained = acted[:, self.config.replay_context:]  # not the context
      self.lags.append(self.counters['version'] - trained.ravel())
    self.state, self.carry, outs, mets = self.parallel.train(
        self.state, self.carry, self.parallel.put_rows(batch))
    self.counters['version'] += 1
    self.params.publish(
        policy_params(self.state['params']), self.counters['version'])
    if 'replay' in outs:  # Only with replay_context: nothing reads them else.
      self.replay.update(jax.device_get(outs['replay']))
    for key, value in mets.items():
      self.metrics[key].append(value)

  def report(self, stop):
    batch = wait(self.replay.sample_batch_report(), stop)
    if batch is None:
      return
    mets = self._report(batch)
    self._send({f'report/{k}': v for k, v in mets.items()})
    batch = wait(self.replay.sample_batch_eval(), stop)
    if batch:
      mets = self._report(batch)
      self._send({f'eval/{k}': v for k, v in jax.device_get(mets).items()})

  def _report(self, batch):
    batch = {k: v for k, v in batch.items() if k != 'version'}
    mets = self.parallel.report(self.state, self.parallel.put_rows(batch))
    return jax.device_get(mets)

  def log(self, extra):
    mets = jax.device_get(dict(self.metrics))
    self.metrics.clear()
    summary = {f'train/{k}': float(np.mean(v)) for k, v in mets.items()}
    if self.lags:
      summary.update(lag_summary(np.concatenate(self.lags)))
      self.lags.clear()
    summary.update(extra)
    summary['train/updates'] = self.counters['version']
    self._send(summary)

  def save(self):
    self.ckpt.save(self.state, dict(self.counters))

  def _send(self, metrics):
    if self.logger is not None:
      self.logger.add(loggable(metrics))


def lag_summary(lags):
  """The distribution of the policy lag of the rows trained on."""
  return {'train/policy_lag/mean': float(np.mean(lags)),
          'train/policy_lag/p50': float(np.percentile(lags, 50)),
          'train/policy_lag/p95': float(np.percentile(lags, 95)),
          'train/policy_lag/max': float(np.max(lags))}


def loggable(metrics):
  """Scalars as float64 and uint8 videos [T, H, W, C] as they are; other
  arrays are left out (the logger would ignore them)."""
  sent = {}
  for key, value in metrics.items():
    if np.ndim(value) == 0:
      sent[key] = np.float64(value)
    elif np.ndim(value) == 4 and np.asarray(value).dtype == np.uint8:
      sent[key] = np.asarray(value)
  return sent
