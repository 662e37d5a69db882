"""Evaluation while training, in each script that runs it (`parallel`,
`train`, `ray`: each run is stopped by SIGTERM once it logged an eval score),
and the eval worker's own process: killed under PeriodicEvaluation, or
hosted by Ray."""

import json
import os
import signal

import pytest

from dreamer_ver.evaluation.periodic import PeriodicEvaluation
from dreamer_ver.evaluation.worker import EvalWorker, record_path
from helpers.evaluation import (  # noqa: F401  (config, agent: fixtures)
    LENGTH, agent, config, cue_params, poll_from_another_process)
from helpers.runs import children_alive, metrics, start, stop, wait_until

DEBUG = ['--configs', 'debug', '--task', 'synthetic_bandit',
         '--run.steps', '1e9', '--run.log_every', '2']


def run_until_evaluated(tmp_path, args, timeout=300):
  """Runs `python -m dreamer_ver.main *args` until it logged an eval score,
  then stops it as a user does (SIGTERM); its logdir, output and eval rows."""
  logdir, log = tmp_path / 'run', tmp_path / 'run.log'
  proc = start([*args, '--logdir', str(logdir)], log)
  try:
    # Also ends when the run does (it failed): its exit code says so.
    wait_until(lambda: proc.poll() is not None or any(
        'eval/score' in m for m in metrics(logdir)), timeout, 'an eval score',
               log)
  finally:
    code = stop(proc)
  out = log.read_text()
  assert code == 0, out[-3000:]
  return logdir, out, [m for m in metrics(logdir) if 'eval/score' in m]


def test_parallel_logs_scores_of_an_eval_worker(tmp_path):
  logdir, out, evals = run_until_evaluated(tmp_path, [
      '--script', 'parallel', *DEBUG, '--env.synthetic.length', '20',
      '--run.eval_every', '3'])
  for m in evals:
    assert 0 <= m['eval/score'] <= 20 and m['eval/length'] == 20, m
    assert m['eval/version'] >= 0 and m['eval/policy_lag'] >= 0, m
  assert not (logdir / 'eval_workers' / 'agent.json').exists()
  assert not children_alive(logdir), 'child processes left behind'


def test_train_logs_scores_of_an_eval_worker_and_saves_on_sigterm(tmp_path):
  logdir, out, evals = run_until_evaluated(tmp_path, [
      '--script', 'train', *DEBUG, '--env.synthetic.length', '10',
      '--run.train_ratio', '16', '--run.eval_envs', '1',
      '--run.eval_every', '2'])
  for m in evals:
    # synthetic_bandit, length 10: a score is the steps that followed the
    # cue, so it lies in [0, 10]; every episode lasts its 10 steps.
    assert 0 <= m['eval/score'] <= 10 and m['eval/length'] == 10, m
    assert m['eval/version'] >= 0 and m['eval/policy_lag'] >= 0, m
  assert not (logdir / 'eval_workers' / 'agent.json').exists()
  counters = json.loads((logdir / 'ckpt' / 'counters.json').read_text())
  assert counters['steps'] >= max(m['step'] for m in evals), counters


@pytest.mark.xdist_group('ray')  # one Ray instance at a time
def test_the_ray_script_evaluates_with_a_ray_hosted_worker(tmp_path):
  pytest.importorskip('ray')
  logdir, out, evals = run_until_evaluated(tmp_path, [
      '--script', 'ray', '--ray.address', 'local', *DEBUG,
      '--env.synthetic.length', '20', '--env.synthetic.step_time', '0.005',
      '--run.envs', '2', '--run.eval_envs', '1', '--run.eval_every', '2',
      '--ray.env_cpus', '0.25', '--ray.replay_cpus', '0.25',
      '--ray.logger_cpus', '0.25', '--ray.eval_cpus', '0.25'], timeout=420)
  assert 'eval_worker_agent started on node' in out, out[-3000:]
  for m in evals:
    assert 0 <= m['eval/score'] <= 20 and m['eval/length'] == 20, m
    assert m['eval/policy_lag'] >= 0, m


# The eval worker's own process.


def test_periodic_evaluation_replaces_a_worker_that_died(
    config, agent, monkeypatch):
  monkeypatch.setattr(PeriodicEvaluation, 'RETRY_SECONDS', 0.5)
  sent = []
  versions = iter(range(1, 10_000))
  best = cue_params(agent, True)
  evaluation = PeriodicEvaluation.of(
      config.update({'run.eval_every': 0.5}),
      latest=lambda: (best, next(versions)), version=lambda: 10_000,
      send=sent.append, name='periodic').start()
  try:
    wait_until(lambda: sent, 300, 'a first result', poll=0.02)
    worker = evaluation.worker
    first_pid = worker.status()['pid']
    os.kill(first_pid, signal.SIGKILL)
    wait_until(lambda: evaluation.started >= 2, 120, 'a second worker',
               poll=0.02)
    count = len(sent)
    wait_until(lambda: len(sent) > count, 300, 'a result of the new worker',
               poll=0.02)
    second_pid = evaluation.worker.status()['pid']
    assert second_pid != first_pid
  finally:
    evaluation.close()
  assert not record_path(config.logdir, 'periodic').exists()
  with pytest.raises(ProcessLookupError):
    os.kill(second_pid, 0)  # close() ended the worker it had started
  # Every result is the cue params' maximum, with its version and lag.
  assert all(m['eval/score'] == LENGTH and m['eval/length'] == LENGTH
             for m in sent), sent
  assert all(m['eval/policy_lag'] == 10_000 - m['eval/version']
             for m in sent), sent


@pytest.fixture
def local_ray():
  """Ray on this machine (127.0.0.1: see conftest.py)."""
  ray = pytest.importorskip('ray')
  ray.init(address='local', num_cpus=2, namespace='eval-hosts',
           include_dashboard=False)
  yield ray
  ray.shutdown()


def _record(logdir, name, pid):
  """The record of worker `name` if process `pid` wrote it, else None."""
  try:
    record = json.loads(record_path(logdir, name).read_text())
  except (FileNotFoundError, ValueError):
    return None
  return record if record['pid'] == pid else None


def _status(worker):
  try:
    return worker.status()
  except Exception:  # Restarting: the call waits and may time out.
    return None


@pytest.mark.xdist_group('ray')  # one Ray instance at a time
def test_a_ray_hosted_worker_scores_restarts_and_is_found_by_name(
    config, agent, local_ray):
  worker = EvalWorker(config=config, name='onray', host='ray', num_cpus=1)
  try:
    worker.submit(cue_params(agent, True), 1, episodes=2)
    result = worker.poll(timeout=120)
    assert (result['version'], result['scores']) == (1, [LENGTH] * 2)

    # Another process, without Ray, reaches it through its record.
    worker.submit(cue_params(agent, False), 2, episodes=2)
    assert poll_from_another_process('onray', config.logdir) == [2, [0, 0]]

    # Its process dies: Ray starts it again and the handle follows it.
    pid = worker.status()['pid']
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: (_status(worker) or {'pid': pid})['pid'] != pid, 300,
               'the restarted worker', poll=0.02)
    # The new worker writes its record once it serves, so just after.
    new_pid = worker.status()['pid']
    record = wait_until(lambda: _record(config.logdir, 'onray', new_pid), 60,
                        'the new worker\'s record', poll=0.02)
    assert record['addr'].startswith('127.0.0.1:'), record
    worker.submit(cue_params(agent, True), 3, episodes=1)
    result = worker.poll(timeout=120)
    assert (result['version'], result['scores']) == (3, [LENGTH])

    # Only its owner ends it (an RPC shutdown would leave an idle actor).
    other = EvalWorker.from_name('onray', config.logdir)
    with pytest.raises(RuntimeError, match='runs on Ray'):
      other.shutdown()
    assert worker.status()['running'] is None  # Still serving.
  finally:
    worker.shutdown()
  with pytest.raises(ValueError):
    local_ray.get_actor('eval_worker_onray')
  assert not record_path(config.logdir, 'onray').exists()
