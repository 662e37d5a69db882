"""A run's evaluation (`PeriodicEvaluation.of`): the worker it starts and
the jobs it submits, read from the run's config. (Its loop against a real
worker, killed and replaced: tests/system/test_evaluation.py.)"""

import pytest

from dreamer_ver.evaluation import periodic
from helpers.evaluation import config  # noqa: F401  (a fixture)


def test_a_runs_evaluation_starts_its_worker_where_the_launcher_says(
    config, monkeypatch):
  """`PeriodicEvaluation.of` reads `run.eval_*` once and hands the config
  to the worker; the launcher, not the config, says whether the worker
  runs on Ray, where it goes with the agent that started it."""
  started = []
  monkeypatch.setattr(periodic, 'EvalWorker',
                      lambda *args, **kwargs: started.append((args, kwargs)))
  config = config.update({
      'run.eval_every': 7.5, 'run.eval_worker_envs': 3,
      'run.eval_mode': 'sample', 'run.eval_max_steps': 11})
  cancel = object()
  for host in ('process', 'ray'):
    evaluation = periodic.PeriodicEvaluation.of(
        config, latest=None, version=None, send=None, host=host, name='x')
    assert (evaluation.every, evaluation.job) == (7.5, (3, 'sample', 11))
    evaluation.start_worker(cancel)
  run = {'config': config, 'name': 'x', 'cancel': cancel}
  assert started == [
      ((), {**run, 'host': 'process'}),
      ((), {**run, 'host': 'ray', 'lifetime': 'non_detached'})]
  with pytest.raises(ValueError, match='run.eval_worker_envs >= 1'):
    periodic.PeriodicEvaluation.of(
        config.update({'run.eval_worker_envs': 0}), None, None, None)
