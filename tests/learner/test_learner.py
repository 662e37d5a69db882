"""The learner's policy lag, by value (each trained row's lag is the
learner's version minus the version that acted on the row; the context
steps at the start of a sequence are not trained on and do not count), and
how the learner processes of a multi-host run agree to stop."""

import concurrent.futures
import threading
import time

import numpy as np
import portal
from helpers.agent import make_batch, small_config, vector_spaces

from dreamer_ver.actor.params import ParamsStore
from dreamer_ver.agent.agent import Agent, policy_params
from dreamer_ver.learner.learner import Learner, Options
from dreamer_ver.rpc.addresses import free_port
from dreamer_ver.rpc.client import Client


class Recorder:
  """Stands in for the replay and logger clients: keeps what it is sent."""

  def __init__(self):
    self.sent = []

  def add(self, metrics):
    self.sent.append(metrics)

  def update(self, latents):
    self.sent.append(latents)


def test_the_learner_logs_the_policy_lag_of_the_rows_it_trains_on():
  B = 4
  config = small_config(batch_size=B, replay_context=1)
  agent = Agent(*vector_spaces(), config)
  state = agent.init_state(agent.init_params(0), 0)
  logger = Recorder()
  learner = Learner(
      agent, state, ParamsStore(policy_params(state['params']), 7),
      Options.of(config),
      replay=Recorder(), logger=logger, ckpt=None, counters={'version': 7})
  T = config.batch_length + config.replay_context
  first = make_batch(agent, B, T, seed=0)
  # Row i acted with version 7 - i; the context step claims an old version.
  first['version'] = np.repeat(7 - np.arange(B), T).reshape(B, T)
  first['version'][:, 0] = -100
  second = make_batch(agent, B, T, seed=1)
  second['version'] = np.full((B, T), 8)  # Acted with the params of update 8.
  learner.train_step(first)
  learner.train_step(second)
  learner.log({})
  trained = T - 1
  lags = np.concatenate([np.repeat(np.arange(B), trained),  # learner at 7
                         np.zeros(B * trained)])            # learner at 8
  summary = logger.sent[-1]
  assert summary['train/updates'] == 9
  assert summary['train/policy_lag/mean'] == np.mean(lags)  # 0.75
  assert summary['train/policy_lag/p50'] == np.percentile(lags, 50)
  assert summary['train/policy_lag/p95'] == np.percentile(lags, 95)
  assert summary['train/policy_lag/max'] == 3
  # The next interval starts afresh.
  learner.train_step({**make_batch(agent, B, T, seed=2),
                      'version': np.full((B, T), 9)})
  learner.log({})
  assert logger.sent[-1]['train/policy_lag/max'] == 0


def test_fused_updates_count_lag_and_write_back_latents_per_batch():
  """`run.train_fuse` 2: two batches in one call are two updates: each
  batch's lag against its own update, both batches' latents written back
  (the rows of the first, then the second's), params published once at
  the version after both."""
  B = 2
  config = small_config(**{'batch_size': B, 'replay_context': 1,
                           'run.train_fuse': 2})
  agent = Agent(*vector_spaces(), config)
  state = agent.init_state(agent.init_params(0), 0)
  logger, replay = Recorder(), Recorder()
  store = ParamsStore(policy_params(state['params']), 7)
  learner = Learner(agent, state, store, Options.of(config), replay=replay,
                    logger=logger, ckpt=None, counters={'version': 7})
  assert learner.options.fuse == 2
  T = config.batch_length + config.replay_context
  batches = [make_batch(agent, B, T, seed) for seed in range(2)]
  for i, batch in enumerate(batches):
    batch['version'] = np.full((B, T), 6)  # lag 1, then 2
    batch['stepid'][:, :, 0] = 10 * i + np.arange(B)[:, None]
  learner.train_step(*batches)
  assert store.version == learner.counters['version'] == 9
  assert replay.sent == []  # sent one step late: at the next, or the stop
  learner.send_latents()
  latents, = replay.sent
  np.testing.assert_array_equal(latents['stepid'][:, 0, 0], [0, 1, 10, 11])
  assert latents['dyn/deter'].shape[:2] == (2 * B, T - 1)
  learner.log({})
  summary = logger.sent[-1]
  assert summary['train/updates'] == 9
  assert summary['train/policy_lag/mean'] == 1.5
  assert summary['train/policy_lag/max'] == 2


class Numbered(Recorder):
  """A replay client whose train batches are real, their step ids numbered
  0, 1, 2, ... batch by batch; keeps the latents written back."""

  def __init__(self, agent, rows, length):
    super().__init__()
    self.agent, self.rows, self.length, self.served = agent, rows, length, 0

  def sample_batch_train(self, rows):
    batch = make_batch(self.agent, rows, self.length, seed=self.served)
    batch['stepid'][..., 0] = self.served
    self.served += 1
    future = concurrent.futures.Future()
    future.set_result(batch)
    return future


def test_every_steps_latents_reach_replay_in_order_the_last_at_the_stop():
  """Latents go back one step late (fetching them at once would wait for
  the device); none is lost, the last step's are sent when the run stops."""
  config = small_config(**{'batch_size': 2, 'replay_context': 1,
                           'run.log_every': -1, 'run.report_every': -1})
  agent = Agent(*vector_spaces(), config)
  state = agent.init_state(agent.init_params(0), 0)
  replay = Numbered(agent, 2, config.batch_length + 1)
  counters = {'version': 0}
  learner = Learner(agent, state, None, Options.of(config), replay=replay,
                    logger=None, ckpt=None, counters=counters)
  assert learner.run(lambda: counters['version'] >= 3) is False
  assert [int(u['stepid'][0, 0, 0]) for u in replay.sent] == [0, 1, 2]
  assert all(u['dyn/deter'].shape == (2, config.batch_length,
                                      config.agent.rssm.deter)
             and np.isfinite(u['dyn/deter']).all() for u in replay.sent)


class Replay(Recorder):
  """A replay client whose train batches never arrive."""

  def sample_batch_train(self, rows):
    return concurrent.futures.Future()


def test_every_learner_stops_with_process_0_and_restarts_if_its_agent_failed():
  """One update's agreement (`Learner.gather`, a collective across the
  learner processes) stood in for by the other process's flags: [ready,
  report, log, failing]. The run stops once a process is not ready; a
  process other than 0 returns True (exit to restart) exactly when process
  0 said it stopped because its agent failed."""
  config = small_config(batch_size=4)
  agent = Agent(*vector_spaces(), config)
  state = agent.init_state(agent.init_params(0), 0)
  learner = Learner(agent, state, None, Options.of(config), replay=Replay(),
                    logger=None, ckpt=None, counters={'version': 0})
  sent = []

  def gather_with(other, first):
    """Flags as process 0 and process 1 would see them; `first`: whether
    this learner is process 0."""
    def gather(*flags):
      sent.append(flags)
      rows = [flags, other] if first else [other, flags]
      return np.array(rows, bool)
    return gather

  # Process 0, asked to stop while its agent fails: stops, says so.
  learner.gather = gather_with([True, False, False, False], first=True)
  assert learner.run(lambda: True, failing=lambda: True) is True
  assert (sent[-1][0], sent[-1][3]) == (False, True)  # not ready, failing
  # Process 0 stopped at the end of the run (not failing).
  assert learner.run(lambda: True) is False
  assert (sent[-1][0], sent[-1][3]) == (False, False)
  # Process 1 (no limiter, no batch of its own to wait for).
  learner.lead = False
  for failing in (True, False):
    learner.gather = gather_with([False, False, False, failing], first=False)
    assert learner.run(lambda: False) is failing
    assert sent[-1][0]  # this one was ready
  # Process 1 stopped itself (SIGTERM) while process 0 was fine; only
  # process 0's failing flag counts.
  learner.gather = gather_with([True, False, False, False], first=False)
  assert learner.run(lambda: True, failing=lambda: True) is False
  assert learner.counters['version'] == 0  # no update was trained


class Batches(Recorder):
  """A replay client whose train batches are ready at once."""

  def sample_batch_train(self, rows):
    future = concurrent.futures.Future()
    future.set_result({'rows': rows})
    return future


def test_the_learner_reports_each_updates_device_time_to_the_decider():
  """VER's learner_time report: `on_update` hears one time per update, the
  update's own (here a stand-in update of at least 20 ms; the real one is
  timed past the device's work)."""
  config = small_config(**{'batch_size': 4, 'run.log_every': -1,
                           'run.report_every': -1})
  agent = Agent(*vector_spaces(), config)
  state = agent.init_state(agent.init_params(0), 0)
  times, counters = [], {'version': 0}
  learner = Learner(agent, state, None, Options.of(config), replay=Batches(),
                    logger=None, ckpt=None, counters=counters,
                    on_update=times.append)

  def update(batch):
    assert batch == {'rows': 4}
    time.sleep(0.02)
    counters['version'] += 1

  learner.train_step = update
  # (bounded by updates too, so a learner that never reports stops)
  assert learner.run(lambda: len(times) >= 3 or counters['version'] >= 6) is (
      False)
  assert counters['version'] == len(times) == 3
  assert all(0.02 <= t < 1.0 for t in times)


def test_a_fusing_learner_trains_each_group_of_batches_in_one_call():
  """`run.train_fuse` 3: the loop hands three batches at a time to one
  train step and counts them as three updates (one device time each
  call)."""
  config = small_config(**{'batch_size': 4, 'run.log_every': -1,
                           'run.report_every': -1, 'run.train_fuse': 3})
  agent = Agent(*vector_spaces(), config)
  state = agent.init_state(agent.init_params(0), 0)
  times, calls, counters = [], [], {'version': 0}
  learner = Learner(agent, state, None, Options.of(config), replay=Batches(),
                    logger=None, ckpt=None, counters=counters,
                    on_update=times.append)

  def update(*batches):
    calls.append(batches)
    counters['version'] += len(batches)

  learner.train_step = update
  assert learner.run(lambda: counters['version'] >= 6) is False
  assert calls == [({'rows': 4},) * 3] * 2
  assert len(times) == 2


class Sampled(Recorder):
  """A replay client whose train, report and eval batches are ready at once
  (real batches of the agent's spaces)."""

  def __init__(self, agent, config):
    super().__init__()
    self.agent, self.config = agent, config

  def _batch(self, rows, length):
    future = concurrent.futures.Future()
    future.set_result(make_batch(self.agent, rows, length))
    return future

  def sample_batch_train(self, rows):
    return self._batch(rows, self.config.batch_length)

  def sample_batch_report(self, rows):
    return self._batch(rows, self.config.report_length)

  sample_batch_eval = sample_batch_report


def logging_learner(logger, report_every=-1):
  """A learner of batches that are ready at once, sending to `logger`,
  logging at its first update and then not for 1000 s; and its counters."""
  config = small_config(**{'batch_size': 2, 'run.log_every': 1000,
                           'run.report_every': report_every})
  agent = Agent(*vector_spaces(), config)
  state = agent.init_state(agent.init_params(0), 0)
  counters = {'version': 0}
  learner = Learner(agent, state, None, Options.of(config),
                    replay=Sampled(agent, config), logger=logger, ckpt=None,
                    counters=counters)
  return learner, counters


def test_a_busy_logger_gets_an_updates_losses_and_reports_in_one_call():
  """The agent's link to the logger lets two calls wait for a logger that
  is slow to answer and drops any more (a slow logger never holds up
  training). An update's report, eval report and losses go in one call,
  so none of them is dropped."""
  port = free_port()
  received, busy = [], threading.Event()
  server = portal.Server(port, 'Logger', host='127.0.0.1', errors=False,
                         logging=False)

  def add(metrics):
    received.append(metrics)
    busy.wait(timeout=60)  # Answers only once the test is done.

  server.bind('add', add, workers=4)
  server.start(block=False)
  logger = Client(f'127.0.0.1:{port}', 'LearnerLogger', maxinflight=2,
                  when_full='drop')
  try:
    learner, counters = logging_learner(logger, report_every=1000)
    assert learner.run(lambda: counters['version'] >= 1) is False
    deadline = time.monotonic() + 30
    while not received and time.monotonic() < deadline:
      time.sleep(0.05)
    assert logger.dropped == 0
    assert len(received) == 1, [sorted(r)[:3] for r in received]
    keys = set(received[0])
    assert {'train/loss/dyn', 'train/updates', 'fps/train',
            'report/openloop/vector_mse', 'eval/openloop/vector_mse'} <= keys
    assert received[0]['train/updates'] == 1
  finally:
    busy.set()
    logger.close(timeout=2)
    server.close()


def test_the_updates_since_the_last_log_are_logged_when_the_learner_stops():
  """A run that stops between two logs still logs its last updates: the
  first update is logged at once (the log clock starts due), the other two
  when the learner stops."""
  logger = Recorder()
  learner, counters = logging_learner(logger)
  assert learner.run(lambda: counters['version'] >= 3) is False
  assert [s['train/updates'] for s in logger.sent] == [1, 3]
  assert all(np.isfinite(s['train/loss/dyn']) and s['fps/train'] > 0
             for s in logger.sent)
  learner.run(lambda: True)  # Stopped before an update: nothing to log.
  assert len(logger.sent) == 2


class FailsAfterOne(Recorder):
  """A logger link that fails after its first call."""

  def add(self, metrics):
    if self.sent:
      raise ConnectionError('the link to the logger failed')
    super().add(metrics)


def test_a_failed_logger_link_costs_the_last_log_not_the_stop(capsys):
  # (A failed link is one of the causes that stop a run; the save after
  # the stop must not be lost to it.)
  logger = FailsAfterOne()
  learner, counters = logging_learner(logger)
  assert learner.run(lambda: counters['version'] >= 2) is False
  assert [s['train/updates'] for s in logger.sent] == [1]
  assert ('[learner] the last metrics were not sent: ConnectionError('
          "'the link to the logger failed')") in capsys.readouterr().out
