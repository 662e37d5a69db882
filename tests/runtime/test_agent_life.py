"""The agent process's stop (runtime/agent_process.py `AgentLife.finish`)
without a whole run: fakes stand in for the learner, its thread, the batch
server and the shipper, and the checks are what was saved, with which step
count, and the exit code."""

import errno
import threading
import types

import pytest

from dreamer_ver.cluster.supervisor import USER_ERROR
from dreamer_ver.runtime import agent_process
from dreamer_ver.runtime.agent_process import AgentLife


class FakeLearner:

  def __init__(self, fault=None):
    self.fault, self.saves = fault, 0
    self.replay = None

  def save(self):
    self.saves += 1
    if self.fault:
      raise self.fault


class FakeThread:

  def __init__(self, errors=(), left_compiling=False):
    self.errors, self.left_compiling = list(errors), left_compiling

  def finish(self):
    return self.left_compiling


def life(learner, thread, served=30, stored=28):
  """An AgentLife as `build` leaves it, on fakes."""
  part = AgentLife()
  part.config = types.SimpleNamespace(
      logdir='/nowhere', run=types.SimpleNamespace(steps=10 ** 9, duration=0))
  part.stop = threading.Event()
  part.links = None
  part.server = types.SimpleNamespace(error=None, close=lambda: None)
  part.shipper = types.SimpleNamespace(
      served=served, stored=stored, replay=None, logger=None)
  part.learner, part.learner_thread = learner, thread
  part.counters = {'steps': 0, 'version': 3}
  part.faults, part.cause = [], None
  part.evaluation = part.eval_logger = None
  part.clients = {}
  return part


def test_a_stop_saves_the_steps_replay_holds_and_exits_0():
  learner = FakeLearner()
  part = life(learner, FakeThread())
  assert part.finish() == 0
  assert learner.saves == 1
  assert part.counters['steps'] == 28  # stored, not the 30 served
  assert part.stop.is_set()


class Link:
  """A client link that records `settle` and `close` into `calls`."""

  def __init__(self, name, calls, error=None):
    self.name, self.calls, self.error = name, calls, error

  def settle(self, timeout):
    self.calls.append(('settle', self.name))
    return True

  def close(self, timeout=None):
    self.calls.append(('close', self.name))


def test_the_logger_links_settle_before_every_link_closes():
  # Their last metrics are answered first; the replay links, whose sample
  # calls may wait on the limiter for ever, are closed without waiting.
  part = life(FakeLearner(), FakeThread())
  calls = []
  part.clients = {name: Link(name, calls) for name in (
      'actor to replay', 'actor to logger', 'learner to replay',
      'learner to logger')}
  assert part.finish() == 0
  assert calls[:2] == [('settle', 'actor to logger'),
                       ('settle', 'learner to logger')]
  assert sorted(calls[2:]) == sorted(('close', name) for name in part.clients)


def test_a_failed_learner_is_not_saved_and_exits_1(capsys):
  learner = FakeLearner()
  part = life(learner, FakeThread(errors=[ValueError('nan loss')]))
  assert part.finish() == 1
  assert learner.saves == 0  # the last checkpoint stands
  assert "the learner raised ValueError('nan loss')" in capsys.readouterr().err


def test_a_full_disk_is_one_line_a_user_error_and_no_second_save(capsys):
  learner = FakeLearner(OSError(errno.ENOSPC, 'No space left on device',
                                '/nowhere/ckpt/agent.npz'))
  part = life(learner, FakeThread())
  assert part._save() is False  # a periodic save: the run stops in order
  assert part.stop.is_set() and len(part.faults) == 1
  assert part.finish() == USER_ERROR
  assert learner.saves == 1  # the stop's save is not tried after the fault
  lines = capsys.readouterr().err.splitlines()
  assert len(lines) == 1 and 'no space left' in lines[0], lines


def test_another_save_error_is_raised_not_taken_for_a_full_disk():
  part = life(FakeLearner(ValueError('a bug')), FakeThread())
  with pytest.raises(ValueError, match='a bug'):
    part._save()
  assert part.faults == [] and not part.stop.is_set()


def test_a_compile_left_behind_saves_and_ends_the_process(monkeypatch):
  ended = []
  monkeypatch.setattr(agent_process, 'exit_leaving', ended.append)
  learner = FakeLearner()
  # What the compile raises after the stop is not this run's failure.
  part = life(learner, FakeThread(errors=[RuntimeError('late')],
                                  left_compiling=True))
  part.finish()
  assert learner.saves == 1 and ended == [0]
