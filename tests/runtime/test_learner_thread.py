"""The agent process's learner thread (runtime/learner_thread.py): a stop
during the learner's compile, which cannot be interrupted, does not wait
for it, and the state stays the caller's."""

import threading

from dreamer_ver.runtime.learner_thread import LearnerThread

WAIT = 30  # seconds: a bound on every wait, never reached when it works


class FakeLearner:
  """A compile that lasts until `release`; a training loop that runs until
  `stop`. Records what ran, in order."""

  def __init__(self, fail=False):
    self.calls = []
    self.compiling = threading.Event()
    self.release = threading.Event()
    self.stop = threading.Event()
    self.fail = fail

  def compile(self):
    self.calls.append('compile')
    self.compiling.set()
    assert self.release.wait(WAIT)
    if self.fail:
      raise ValueError('bad shapes')
    self.calls.append('compiled')

  def train(self):
    self.calls.append('train')
    assert self.stop.wait(WAIT)
    self.calls.append('stopped')


def _thread(learner, may_leave=True):
  return LearnerThread(learner.compile, learner.train, may_leave).start()


def test_a_stop_during_the_compile_leaves_it_and_it_never_trains():
  learner = FakeLearner()
  thread = _thread(learner)
  assert learner.compiling.wait(WAIT)
  learner.stop.set()
  assert thread.finish() is True  # at once: the compile still runs
  assert learner.calls == ['compile']
  learner.release.set()  # The compile ends after the caller saved.
  thread._thread.join(WAIT)
  assert not thread._thread.is_alive()
  assert learner.calls == ['compile', 'compiled'] and not thread.errors


def test_a_trained_learner_is_waited_for():
  learner = FakeLearner()
  learner.release.set()
  thread = _thread(learner)
  assert _wait(lambda: learner.calls[-1:] == ['train'])
  finisher = threading.Thread(target=lambda: result.append(thread.finish()))
  result = []
  finisher.start()
  finisher.join(0.2)
  assert finisher.is_alive()  # It waits for the loop to see the stop.
  learner.stop.set()
  finisher.join(WAIT)
  assert result == [False]
  assert learner.calls == ['compile', 'compiled', 'train', 'stopped']


def test_in_lockstep_with_other_hosts_it_waits_for_the_compile():
  learner = FakeLearner()
  thread = _thread(learner, may_leave=False)
  assert learner.compiling.wait(WAIT)
  learner.stop.set()
  threading.Timer(0.2, learner.release.set).start()
  assert thread.finish() is False
  assert learner.calls == ['compile', 'compiled', 'train', 'stopped']


def test_a_failed_compile_is_kept_for_the_caller():
  learner = FakeLearner(fail=True)
  learner.release.set()
  thread = _thread(learner)
  assert _wait(lambda: thread.errors)
  assert thread.finish() is False
  assert [type(e) for e in thread.errors] == [ValueError]


def _wait(condition):
  done = threading.Event()
  for _ in range(WAIT * 100):
    if condition():
      return True
    done.wait(0.01)
  return False
