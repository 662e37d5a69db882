"""Where the EvalWorker lives and what happens when it dies: the agent's
PeriodicEvaluation starts a new worker process when its worker is killed,
and a worker hosted by Ray is restarted by Ray, found again by its handle
and by `from_name` in another process, and scores by value there (the
cue params of tests/test_eval_worker.py). Loopback only."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dreamer_ver import config as configlib
from dreamer_ver.agent.agent import Agent
from dreamer_ver.envs import make_run_env
from dreamer_ver.runtime.eval_worker import (
    EvalWorker, PeriodicEvaluation, record_path)
from test_eval_worker import FLAGS, LENGTH, cue_params

ROOT = Path(__file__).resolve().parent.parent


def wait_for(predicate, timeout, what):
  deadline = time.monotonic() + timeout
  while True:
    value = predicate()
    if value:
      return value
    assert time.monotonic() < deadline, f'timed out waiting for {what}'
    time.sleep(0.1)


@pytest.fixture(scope='module')
def config(tmp_path_factory):
  logdir = tmp_path_factory.mktemp('hosts')
  return configlib.load_config([*FLAGS, '--logdir', str(logdir)])


@pytest.fixture(scope='module')
def agent(config):
  env = make_run_env(config, config.run.envs)
  yield Agent(env.obs_space, env.act_space, config)
  env.close()


def test_periodic_evaluation_replaces_a_worker_that_died(
    config, agent, monkeypatch):
  monkeypatch.setattr(PeriodicEvaluation, 'RETRY_SECONDS', 0.5)
  sent = []
  versions = iter(range(1, 10_000))
  best = cue_params(agent, True)
  evaluation = PeriodicEvaluation(
      config.update({'run.eval_every': 0.5}),
      latest=lambda: (best, next(versions)), version=lambda: 10_000,
      send=sent.append, name='periodic').start()
  try:
    wait_for(lambda: sent, 300, 'a first result')
    worker = evaluation.worker
    first_pid = worker.status()['pid']
    os.kill(first_pid, signal.SIGKILL)
    wait_for(lambda: evaluation.started == 2, 120, 'a second worker')
    count = len(sent)
    wait_for(lambda: len(sent) > count, 300, 'a result of the new worker')
    assert evaluation.worker.status()['pid'] != first_pid
  finally:
    evaluation.close()
  assert evaluation.worker is None and not record_path(
      config.logdir, 'periodic').exists()
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


def _status(worker):
  try:
    return worker.status()
  except Exception:  # Restarting: the call waits and may time out.
    return None


def test_a_ray_hosted_worker_scores_restarts_and_is_found_by_name(
    config, agent, local_ray):
  worker = EvalWorker(config, name='onray', host='ray', num_cpus=1)
  try:
    worker.submit(cue_params(agent, True), 1, episodes=2)
    result = worker.poll(timeout=120)
    assert (result['version'], result['scores']) == (1, [LENGTH] * 2)

    # Another process, without Ray, reaches it through its record.
    worker.submit(cue_params(agent, False), 2, episodes=2)
    script = (
        'import json, sys\n'
        'from dreamer_ver.runtime.eval_worker import EvalWorker\n'
        'worker = EvalWorker.from_name("onray", sys.argv[1])\n'
        'result = worker.poll(timeout=120)\n'
        'print(json.dumps([result["version"], result["scores"]]))\n'
        'worker.close()\n')
    done = subprocess.run(
        [sys.executable, '-c', script, config.logdir], capture_output=True,
        text=True, timeout=300, env={**os.environ, 'JAX_PLATFORMS': 'cpu'})
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout.splitlines()[-1]) == [2, [0, 0]]

    # Its process dies: Ray starts it again and the handle follows it.
    pid = worker.status()['pid']
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: (_status(worker) or {'pid': pid})['pid'] != pid, 300,
             'the restarted worker')
    record = json.loads(record_path(config.logdir, 'onray').read_text())
    assert record['pid'] == worker.status()['pid'], record  # The new one's.
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


def test_the_ray_script_evaluates_with_a_ray_hosted_worker(tmp_path):
  pytest.importorskip('ray')
  logdir = tmp_path / 'run'
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu',
         'PYTHONUNBUFFERED': '1'}
  done = subprocess.run(
      [sys.executable, '-m', 'dreamer_ver.main', '--script', 'ray',
       '--ray.address', 'local', '--logdir', str(logdir),
       '--configs', 'debug', '--task', 'synthetic_bandit',
       '--env.synthetic.length', '20', '--env.synthetic.step_time', '0.005',
       '--run.envs', '2', '--run.eval_envs', '1', '--run.eval_every', '2',
       '--run.log_every', '2', '--run.duration', '75',
       '--ray.env_cpus', '0.25', '--ray.replay_cpus', '0.25',
       '--ray.logger_cpus', '0.25', '--ray.eval_cpus', '0.25'],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  out = done.stdout + done.stderr
  assert done.returncode == 0, out[-3000:]
  assert 'eval_worker_agent started on node' in out, out[-3000:]
  metrics = [json.loads(line) for line in
             (logdir / 'metrics.jsonl').read_text().splitlines()]
  evals = [m for m in metrics if 'eval/score' in m]
  assert evals, out[-3000:]
  for m in evals:
    assert 0 <= m['eval/score'] <= 20 and m['eval/length'] == 20, m
    assert m['eval/policy_lag'] >= 0, m
