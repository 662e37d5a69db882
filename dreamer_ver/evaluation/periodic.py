"""PeriodicEvaluation: a run's use of an EvalWorker (`evaluation/worker.py`,
the contract): the newest params submitted every `run.eval_every` seconds
and the results logged, never waited for.
"""

import sys
import threading
import time

from dreamer_ver.evaluation.worker import EvalWorker


class PeriodicEvaluation:
  """Every `every` seconds, the newest params to the EvalWorker that
  `start_worker(cancel)` starts, and its results to the logger, on a thread
  of its own so that neither training nor acting ever waits for it (the
  agent process's evaluation). Each submit asks for `episodes` episodes in
  `mode`, each cut at `max_steps` (0: never).

  `latest()` returns (policy params as numpy, their version), `version()`
  the learner's version now, and `send(metrics)` logs scalars and videos.
  Each result is logged as eval/score, eval/length (episode means),
  eval/version, eval/policy_lag (learner updates since the evaluated
  params) and, when the env renders, eval/video (its first episode). A
  version is submitted once. A worker
  that fails to start, dies or stops answering is shut down and a new one
  starts after a delay (RETRY_SECONDS, doubling while it keeps failing, up
  to RETRY_MAX); the run goes on meanwhile."""

  RETRY_SECONDS = 5.0
  RETRY_MAX = 300.0

  def __init__(self, start_worker, every, episodes, mode, max_steps, latest,
               version, send):
    self.start_worker = start_worker
    self.every = every
    self.job = (episodes, mode, max_steps)
    self.latest = latest
    self.version = version
    self.send = send
    self.worker = None
    self.started = 0  # workers started so far
    self.stop = threading.Event()
    self.thread = threading.Thread(
        target=self._run, name='Evaluation', daemon=True)

  @classmethod
  def of(cls, config, latest, version, send, host='process', name='agent'):
    """A run's evaluation (`run.eval_*`): its worker named `name` runs on
    `host`, 'ray' (with `ray.eval_cpus` and `ray.eval_gpus`, and removed
    by Ray with the process that started it) or 'process' (a child
    process)."""
    run = config.run
    if int(run.eval_worker_envs) < 1:
      raise ValueError(f'run.eval_every = {run.eval_every} needs '
                       'run.eval_worker_envs >= 1')
    # Not detached: the worker goes when its agent goes (Ray restarts the
    # agent, which starts a new one).
    owned = {'lifetime': 'non_detached'} if host == 'ray' else {}
    return cls(
        lambda cancel: EvalWorker(
            config=config, name=name, host=host, cancel=cancel, **owned),
        float(run.eval_every), int(run.eval_worker_envs), str(run.eval_mode),
        int(run.eval_max_steps), latest, version, send)

  def start(self):
    self.thread.start()
    return self

  def close(self, timeout=60.0):
    """Stops submitting and ends the worker."""
    self.stop.set()
    self.thread.join(timeout)
    if self.thread.is_alive():  # Stuck (e.g. sending to a logger that is
      self._shutdown()          # gone): the worker must not outlive us.

  def _run(self):
    self.delay = self.RETRY_SECONDS
    while not self.stop.is_set():
      try:
        self.started += 1
        self.worker = self.start_worker(self.stop)
        self._evaluate(self.worker)
      except Exception as e:
        if self.stop.is_set():
          break  # Closing: not a failure.
        print(f'Evaluation: the eval worker failed ({e!r}); a new one starts '
              f'in {self.delay:.0f} s.', file=sys.stderr, flush=True)
        self._shutdown()
        self.stop.wait(self.delay)
        self.delay = min(2 * self.delay, self.RETRY_MAX)
    self._shutdown()

  def _evaluate(self, worker):
    """Submits and polls until stopped; raises if the worker is lost."""
    submitted = None
    due = time.monotonic() + self.every
    while not self.stop.is_set():
      if not worker.alive():
        raise RuntimeError('its process exited')
      if time.monotonic() >= due:
        due += self.every
        params, version = self.latest()
        if version != submitted:
          worker.submit(params, version, *self.job)
          submitted = version
      result = worker.poll(timeout=min(1.0, self.every))
      if result is not None:
        self.delay = self.RETRY_SECONDS  # It works: the next failure is new.
        self._log(result)

  def _shutdown(self):
    worker, self.worker = self.worker, None
    if worker is not None:
      try:
        worker.shutdown()
      except Exception as e:
        print(f'Evaluation: shutting the eval worker down: {e!r}',
              file=sys.stderr, flush=True)

  def _log(self, result):
    if 'error' in result:
      print(f"Evaluation of version {result['version']} failed: "
            f"{result['error']}", file=sys.stderr, flush=True)
      return
    metrics = {
        'eval/score': result['score_mean'],
        'eval/length': result['length_mean'],
        'eval/version': result['version'],
        'eval/policy_lag': self.version() - result['version']}
    if result['frames'] is not None:
      metrics['eval/video'] = result['frames']
    self.send(metrics)
