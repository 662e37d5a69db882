"""The agent process's learner thread: it compiles the learner, then trains
until the stop, and hands the learner's state back to the process main.

XLA cannot interrupt a compile, and the learner's takes minutes on a cold
cache while the actor already serves. A stop that lands during it must not
wait for it (the supervisor's grace is 15 s): `finish` then leaves the
thread behind, and the state, which the compile never touches (it runs on a
copy), is the caller's to save at once.
"""

import threading
import traceback


class LearnerThread:
  """`compile()`, then `train()` (the loop until the stop) in a daemon
  thread named Learner."""

  def __init__(self, compile, train, may_leave=True):
    """`may_leave`: whether `finish` may leave a compile behind (not where
    learner processes on other hosts train in lockstep with this one: they
    wait for its first step's gather, which must still say stop)."""
    self.errors = []  # what the thread raised
    self._compile, self._train = compile, train
    self._may_leave = may_leave
    self._lock = threading.Lock()
    self._training = False  # past the compile
    self._left = False  # `finish` left the compile behind
    self._thread = threading.Thread(target=self._main, name='Learner',
                                    daemon=True)

  def start(self):
    self._thread.start()
    return self

  def finish(self):
    """After the stop: waits for `train` to return or, while the compile
    still runs, leaves it. True where it was left: the state is the
    caller's, and the process must exit without finalizing
    (`supervisor.exit_leaving`)."""
    with self._lock:
      if (self._may_leave and not self._training
          and self._thread.is_alive()):
        self._left = True
        return True
    self._thread.join()
    return False

  def _main(self):
    try:
      self._compile()
      with self._lock:
        if self._left:
          return  # The stop came first; the process main saved the state.
        self._training = True
      self._train()
    except Exception as error:
      traceback.print_exc()
      self.errors.append(error)
