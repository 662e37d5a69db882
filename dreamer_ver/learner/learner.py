"""The learner: trains on batches streamed from the replay server.

Each step takes the next prefetched batch, trains, writes the fresh latents
back to replay (fire and forget, one step late so that the learner never
waits for the device), and publishes the new policy params with a version. With `run.train_fuse` K > 1, a step takes the next K batches and
makes their K updates in one compiled call (`Agent.train_many`): the same
updates, one dispatch; params are then published, and the latents written
back, once per K updates (the version still counts updates). Each batch's
rows carry the params version that acted; the
learner logs the distribution of its policy lag, the updates between
that version and its own (VER's measure of how off-policy the data is),
as `train/policy_lag/*` over each log interval (the last one ends when
the learner stops). Training is data-parallel
over the train devices (`agent/data_parallel.py`): each batch's rows are
split across them, the state is replicated; with one device it is the
plain jitted step. Reports, metrics and checkpoints happen on wall-clock
intervals.
The logger gets scalars as float64 and the report's open-loop videos as
uint8 [T, H, W, C]; the report's other arrays are not sent.

Multi-host (`jax.processes` > 1): one learner per process, the first in
the agent process, the others in `--script parallel_learner` processes,
all training the same steps together (every step is a collective). They
start from process 0's state (its checkpoint, broadcast). Each samples its
own share of every batch from the replay server: process 0 through the
limiter, which counts the whole batch, the others without it
(`sample_share_train`, once process 0 has its share). Once per update the
processes agree: they go on only while every one is ready (so a process
that stops, at the end of the run or on SIGTERM, stops them all after the
same update, and when process 0 stops for a failure of its agent, the
others exit to be restarted with it), and report and log when process 0's
clocks say so. Process 0 alone publishes params to its actor, logs (the
policy lag of its own rows) and saves; each process writes back its own
rows' latents. A process that dies leaves the others blocked in their next
collective until JAX's coordination service ends them; their supervisors
restart every one from process 0's last checkpoint.
"""

import collections
import dataclasses
import time

import elements
import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from dreamer_ver.agent.agent import policy_params
from dreamer_ver.agent.data_parallel import DataParallel


class Prefetch:
  """Keeps `depth` calls of one replay method in flight."""

  def __init__(self, client, method, *args, depth=2):
    self.call = lambda: getattr(client, method)(*args)
    self.futures = collections.deque(self.call() for _ in range(depth))

  def next(self, stop):
    """The next result; None if `stop` is set while waiting."""
    result = wait(self.futures[0], stop)
    if result is not None:
      self.futures.popleft()
      self.futures.append(self.call())
    return result

  def take(self, count, stop):
    """The next `count` results; None if `stop` is set while waiting."""
    results = []
    while len(results) < count:
      results.append(self.next(stop))
      if results[-1] is None:
        return None
    return results


def wait(future, stop, poll=0.2):
  """A future's result, or None once `stop()` is true."""
  while True:
    try:
      return future.result(timeout=poll)
    except TimeoutError:
      if stop():
        return None


@dataclasses.dataclass(frozen=True)
class Options:
  """What the learner uses of a run config: the batch shape and the
  wall-clock intervals of its metrics and reports."""

  batch_size: int  # rows of a batch, over all learner processes
  batch_length: int  # trained steps of a row
  report_length: int  # steps of a report batch's rows
  context: int  # replay_context: steps before each row, not trained on
  log_every: float  # seconds between metric summaries
  report_every: float  # seconds between reports
  fuse: int = 1  # updates per compiled call, each on its own batch

  @classmethod
  def of(cls, config):
    return cls(
        batch_size=int(config.batch_size),
        batch_length=int(config.batch_length),
        report_length=int(config.report_length),
        context=int(config.replay_context),
        log_every=float(config.run.log_every),
        report_every=float(config.run.report_every),
        fuse=int(config.run.train_fuse))


class Learner:

  def __init__(self, agent, state, params_store, options, replay, logger,
               ckpt, counters, devices=None, on_update=None):
    self.agent = agent
    self.parallel = DataParallel(agent, devices or jax.devices()[:1])
    self.lead = jax.process_index() == 0  # The process that logs and saves.
    self.rows = options.batch_size // self.parallel.processes  # Its share.
    if self.parallel.processes > 1:
      state, version = multihost_utils.broadcast_one_to_all(
          (state, counters['version']))
      counters['version'] = int(version)
    self.state = self.parallel.put_state(state)
    self.params = params_store  # None: a process without an actor.
    self.options = options
    self.replay = replay  # client.Client of the replay server
    self.logger = logger  # client.Client of the logger server, or None
    self.ckpt = ckpt
    self.counters = counters  # shared with the agent loop: steps, version
    self.carry = self.parallel.put_rows(agent.init_carry(self.rows))
    self.metrics = collections.defaultdict(list)
    self.lags = []  # per trained batch: the policy lag of each row
    self.latents = None  # the last step's fresh latents, not yet sent
    self.on_update = on_update  # hears each update's device seconds

  def compile(self):
    """Compiles train and report on zero batches of the replay's shapes, so
    the learner never compiles mid-run (a compile cannot be interrupted,
    which would hold up a shutdown)."""
    opts = self.options
    put = self.parallel.put_rows
    train = put(self.zero_batch(opts.batch_length + opts.context))
    report = put(self.zero_batch(opts.report_length + opts.context))
    state = jax.tree.map(jnp.copy, self.state)  # train donates its state
    if opts.fuse == 1:
      outs = self.parallel.train(state, self.carry, train)
    else:
      stacked = jax.tree.map(lambda x: jnp.stack([x] * opts.fuse), train)
      outs = self.parallel.train_many(state, self.carry, stacked)
    jax.block_until_ready((outs, self.parallel.report(self.state, report)))

  def zero_batch(self, length):
    """A batch of zeros with exactly the keys, shapes and dtypes the replay
    server returns, as the jitted step sees them: the actor's transitions
    (their version taken out) plus stepid and consec; this process's rows."""
    B = self.rows
    spaces = {**self.agent.obs_space, **self.agent.act_space}
    batch = {k: np.zeros((B, length, *s.shape), s.dtype)
             for k, s in spaces.items()}
    carry = self.agent.init_carry(1)
    for key in ('deter', 'stoch'):  # The latents, as the actor ships them.
      batch[f'dyn/{key}'] = np.zeros((B, length, *carry[key].shape[1:]),
                                     np.float32)
    batch['stepid'] = np.zeros((B, length, 20), np.uint8)
    batch['consec'] = np.zeros((B, length), np.int32)
    return batch

  def run(self, stop, failing=lambda: False):
    """Trains until `stop()` is true in any process. Returns True where
    process 0 stopped because `failing()` (its agent failed and restarts,
    so the others must too), else False."""
    fuse = self.options.fuse
    if self.lead:
      train = Prefetch(self.replay, 'sample_batch_train', self.rows,
                       depth=fuse + 1)
    should_log = elements.when.Clock(self.options.log_every)
    should_report = elements.when.Clock(self.options.report_every)
    fps = elements.FPS()
    while True:
      if self.lead:
        batches = None if stop() else train.take(fuse, stop)
        ready = batches is not None
      else:
        ready = not stop()
      flags = self.gather(ready, should_report(), should_log(), failing())
      if not flags[:, 0].all():
        self.send_latents()
        if self.metrics and self.options.log_every >= 0:
          self.last_log({'fps/train': fps.result()})
        return bool(flags[0, 3])
      report, log = flags[0, 1:3]  # Process 0's clocks decide.
      if not self.lead:
        # Sampled once process 0 passed the limiter for this update, so a
        # share never comes from a buffer still filling up.
        batches = [self.replay.sample_share_train(self.rows).result()
                   for _ in range(fuse)]
      began = time.perf_counter()
      self.train_step(*batches)
      if self.on_update is not None:
        # Waits for the device, so the time is the update's, not dispatch's.
        jax.block_until_ready(self.state['params'])
        self.on_update(time.perf_counter() - began)
      fps.step(fuse * self.options.batch_size * self.options.batch_length)
      # One call per update: the logger link lets two wait, drops more.
      reported = self.report(stop) if report else {}
      if log:
        self.log({**reported, 'fps/train': fps.result()})
      elif reported:
        self.send(reported)

  def checksum(self):
    """The sum of |params| in float64; the same in every learner process."""
    params = jax.device_get(self.parallel.local(self.state['params']))
    return sum(float(np.abs(np.asarray(x, np.float64)).sum())
               for x in jax.tree.leaves(params))

  def gather(self, *flags):
    """[processes, len(flags)]: every learner process's flags, in process
    order; a collective that each process must call at the same point."""
    flags = np.array(flags, bool)
    if self.parallel.processes == 1:
      return flags[None]
    return np.asarray(multihost_utils.process_allgather(flags))

  def train_step(self, *batches):
    """One update per batch, in one compiled call when there are several;
    then one publish and one write-back of the fresh latents."""
    for i, batch in enumerate(batches):
      acted = batch.pop('version', None)  # absent in replays from before it
      if acted is not None:
        trained = acted[:, self.options.context:]  # not the context
        self.lags.append(self.counters['version'] + i - trained.ravel())
    if len(batches) == 1:
      self.state, self.carry, outs, mets = self.parallel.train(
          self.state, self.carry, self.parallel.put_rows(batches[0]))
    else:
      stacked = {k: np.stack([b[k] for b in batches]) for k in batches[0]}
      self.state, self.carry, outs, mets = self.parallel.train_many(
          self.state, self.carry, self.parallel.put_rows(stacked, axis=1))
    self.counters['version'] += len(batches)
    if self.params is not None:
      self.params.publish(self.parallel.local(
          policy_params(self.state['params'])), self.counters['version'])
    if 'replay' in outs:  # Only with replay_context: nothing reads them else.
      # Sent one step late, so that the learner never waits for the device
      # here: fetching them now would wait for this step to finish.
      self.send_latents()
      for x in jax.tree.leaves(outs['replay']):
        x.copy_to_host_async()
      self.latents = (outs['replay'], len(batches))
    for key, value in mets.items():
      self.metrics[key].append(value)

  def send_latents(self):
    """Writes the fresh latents of the last train step back to replay (the
    rows of each of its batches in turn), if not sent yet."""
    if self.latents is None:
      return
    latents, fused = self.latents
    self.latents = None
    if fused == 1:
      self.replay.update(self.parallel.local_rows(latents))
    else:  # [K, rows, ...] -> [K * rows, ...]
      latents = self.parallel.local_rows(latents, axis=1)
      self.replay.update({k: v.reshape((-1, *v.shape[2:]))
                          for k, v in latents.items()})

  def report(self, stop):
    """The report on a train batch (`report/...`), then on an eval batch
    (`eval/...`) where every process has one (no eval episode yet: none)."""
    batch = wait(self.replay.sample_batch_report(self.rows), stop)
    if not self.gather(batch is not None).all():
      return {}
    reported = {f'report/{k}': v for k, v in self._report(batch).items()}
    batch = wait(self.replay.sample_batch_eval(self.rows), stop)
    if self.gather(bool(batch)).all():
      reported.update(
          {f'eval/{k}': v for k, v in self._report(batch).items()})
    return reported

  def _report(self, batch):
    batch = {k: v for k, v in batch.items() if k != 'version'}
    mets = self.parallel.report(self.state, self.parallel.put_rows(batch))
    return jax.device_get(self.parallel.local(mets))

  def log(self, extra):
    """Sends the means of the updates' metrics since the last log, their
    policy lags, the update count and `extra` to the logger, in one call."""
    mets = jax.device_get(self.parallel.local(dict(self.metrics)))
    self.metrics.clear()
    summary = {f'train/{k}': float(np.mean(v)) for k, v in mets.items()}
    if self.lags:
      summary.update(lag_summary(np.concatenate(self.lags)))
      self.lags.clear()
    summary.update(extra)
    summary['train/updates'] = self.counters['version']
    self.send(summary)

  def last_log(self, extra):
    """`log` at a stop: the updates since the last log. A link that failed
    (what may have stopped the run) costs these metrics, said in a line,
    not the save that follows."""
    try:
      self.log(extra)
    except Exception as error:
      print(f'[learner] the last metrics were not sent: {error!r}',
            flush=True)

  def save(self):
    self.ckpt.save(self.parallel.local(self.state), dict(self.counters))

  def send(self, metrics):
    """Sends `metrics` to the logger in one call (`loggable`)."""
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
