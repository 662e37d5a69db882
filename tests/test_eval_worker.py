"""The EvalWorker on synthetic_bandit, by value: hand-built params that read
the cue score every step (the maximum, `LENGTH`), params that act against it
score nothing, and each result comes back once, with its version. Then
where it lives and what happens when it dies: the agent's
PeriodicEvaluation starts a new worker process when its worker is killed,
and a worker hosted by Ray is restarted by Ray, found again by its handle
and by `from_name` in another process, and scores there too. Loopback
only."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import elements
import jax
import numpy as np
import pytest

from dreamer_ver import config as configlib
from dreamer_ver.agent.agent import Agent, policy_params
from dreamer_ver.envs import make_env, make_run_env
from dreamer_ver.envs.wrappers import Wrapper
from dreamer_ver.runtime import evaluation
from dreamer_ver.runtime.eval_worker import (
    EvalWorker, PeriodicEvaluation, record_path)

LENGTH = 10
STEP_TIME = 0.02  # seconds per env step: an evaluation lasts long enough to poll
# Unimix 0: the latent that carries the cue is then exactly its class, and
# a sampled action the policy's mode (with 0.01, about one step in 130 would
# draw another class at random).
FLAGS = ['--configs', 'debug', '--task', 'synthetic_bandit',
         '--env.synthetic.length', str(LENGTH),
         '--env.synthetic.step_time', str(STEP_TIME),
         '--agent.rssm.unimix', '0', '--agent.policy.unimix', '0',
         '--run.eval_envs', '2']
MARGIN = 100.0  # logit gap: no other class keeps any probability


def cue_params(agent, best=True):
  """Policy params whose action is the cue (`best`) or its opposite.

  One path carries vector[0] (the cue), all other weights on it are zero:
  encoder units 0 and 1 get +-(cue - 1/2), the posterior's units 0 and 1
  their difference, latent 0 takes class 1 for cue 1 and class 0 for cue 0
  (by MARGIN), the policy's units 0 and 1 get +-(class 1 - class 0), and the
  action logits +-MARGIN times theirs. Each RMS norm sees two opposite units,
  so every sign survives it."""
  params = jax.tree.map(np.array, policy_params(agent.init_params(0)))
  enc = params['enc']['mlp']['layer0']['linear']
  # The encoder's input is symlog of [count, vector] (sorted keys).
  assert sorted(agent.model_space) == ['count', 'vector']
  cue = 1
  half = float(np.log1p(1.0)) / 2  # symlog(cue) is 0 or log(2)
  enc['kernel'][:] = 0
  enc['bias'][:] = 0
  enc['kernel'][cue, :2] = [10, -10]
  enc['bias'][:2] = [-10 * half, 10 * half]
  deter = agent.config.agent.rssm.deter
  post = params['dyn']['obs0']['linear']
  post['kernel'][:] = 0
  post['bias'][:] = 0
  post['kernel'][deter:deter + 2, 0] = [1, -1]  # tokens 0 and 1
  post['kernel'][deter:deter + 2, 1] = [-1, 1]
  logit = params['dyn']['obslogit']
  logit['kernel'][:] = 0
  logit['bias'][:] = 0
  logit['kernel'][:2, 1] = [MARGIN, -MARGIN]  # latent 0, class 1
  logit['kernel'][:2, 0] = [-MARGIN, MARGIN]  # latent 0, class 0
  pol = params['pol']['mlp']['layer0']['linear']
  pol['kernel'][:] = 0
  pol['bias'][:] = 0
  pol['kernel'][deter:deter + 2, 0] = [-1, 1]  # latent 0's classes 0, 1
  pol['kernel'][deter:deter + 2, 1] = [1, -1]
  head = params['pol']['action_logits']
  sign = 1 if best else -1
  head['kernel'][:] = 0
  head['bias'][:] = 0
  head['kernel'][:2, 1] = [sign * MARGIN, -sign * MARGIN]
  head['kernel'][:2, 0] = [-sign * MARGIN, sign * MARGIN]
  return params


class Flaky(Wrapper):
  """synthetic_bandit that renders `log/image` (every pixel is the step
  count) while its frames are on, counting its renders, and whose first
  instance in a process raises on its third step."""

  failed = False  # per process: only the first evaluation fails

  def __init__(self, env, fail):
    super().__init__(env)
    self.fail = fail
    self.steps = 0
    self.frames_on = False
    self.renders = 0

  @property
  def obs_space(self):
    return {**self.env.obs_space,
            'log/image': elements.Space(np.uint8, (4, 4, 3))}

  def render_frames(self, on):
    self.frames_on = on

  def step(self, action):
    self.steps += 1
    if self.fail and self.steps == 3:
      raise RuntimeError('the env broke')
    obs = self.env.step(action)
    if self.frames_on:
      obs['log/image'] = np.full((4, 4, 3), obs['count'], np.uint8)
      self.renders += 1
    return obs


def flaky_env(index):
  env = make_env('synthetic_bandit', {'synthetic': {'length': LENGTH}},
                 seed=100 + index)
  fail, Flaky.failed = not Flaky.failed, True
  return Flaky(env, fail)


@pytest.fixture(scope='module')
def config(tmp_path_factory):
  logdir = tmp_path_factory.mktemp('run')
  return configlib.load_config([*FLAGS, '--logdir', str(logdir)])


@pytest.fixture(scope='module')
def agent(config):
  env = make_run_env(config, config.run.envs)
  yield Agent(env.obs_space, env.act_space, config)
  env.close()


@pytest.fixture(scope='module')
def worker(config):
  worker = EvalWorker(config, name='main')
  yield worker
  worker.shutdown()


def wait_for(predicate, timeout=60, what='a condition'):
  deadline = time.monotonic() + timeout
  while True:
    value = predicate()
    if value:
      return value
    assert time.monotonic() < deadline, f'timed out waiting for {what}'
    time.sleep(0.02)


def test_cue_params_score_the_maximum_and_the_minimum_in_process(
    config, agent):
  envs = [make_run_env(config, config.run.envs + i) for i in range(2)]
  try:
    for best, score in ((True, LENGTH), (False, 0)):
      results, frames = evaluation.run_episodes(
          agent, cue_params(agent, best), envs, [2, 1], 'greedy',
          record=True)
      assert [r['score'] for r in results] == [score] * 3
      assert [r['length'] for r in results] == [LENGTH] * 3
      assert frames is None  # synthetic_bandit does not render
  finally:
    for env in envs:
      env.close()


def test_only_the_first_episode_of_env_0_renders_its_frames():
  config = {'synthetic': {'length': LENGTH}}
  envs = [Flaky(make_env('synthetic_bandit', config, seed=i), fail=False)
          for i in range(3)]
  # Random actions: the agent and its params are unused.
  results, frames = evaluation.run_episodes(
      None, None, envs, [3, 2, 2], 'random', record=True)
  assert sorted((r['env'], r['episode']) for r in results) == [
      (0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (2, 0), (2, 1)]
  # Env 0's first episode: the reset frame and LENGTH steps, counts 0 ..
  # LENGTH, each rendered once; then no env renders again.
  assert frames.shape == (LENGTH + 1, 4, 4, 3)
  assert (frames[:, 0, 0, 0] == np.arange(LENGTH + 1)).all()
  assert [env.renders for env in envs] == [LENGTH + 1, 0, 0]
  assert envs[0].steps == 3 * (LENGTH + 1) and not envs[0].frames_on


def test_best_and_worst_params_score_the_known_extremes(worker, agent):
  worker.submit(cue_params(agent, True), 3, episodes=3)
  best = worker.poll(timeout=120)
  assert best['version'] == 3 and best['mode'] == 'greedy'
  assert best['scores'] == [LENGTH] * 3 and best['lengths'] == [LENGTH] * 3
  assert best['score_mean'] == LENGTH and best['score_std'] == 0
  assert best['episodes'] == 3 and best['frames'] is None
  assert best['seconds'] > 0
  worker.submit(cue_params(agent, False), 4, episodes=2, mode='sample')
  worst = worker.poll(timeout=120)
  assert worst['version'] == 4 and worst['mode'] == 'sample'
  assert worst['scores'] == [0, 0] and worst['length_mean'] == LENGTH


def test_poll_returns_none_while_running_and_each_result_once(worker, agent):
  params = cue_params(agent, True)
  worker.submit(params, 10, episodes=40)  # ~5 s: room for the submits
  wait_for(lambda: worker.status()['running'] == 10)
  assert worker.poll() is None  # returns at once while it runs
  # A newer submit replaces the waiting one, never the running one.
  assert worker.submit(params, 11, episodes=1) == {
      'version': 11, 'replaced': None}
  assert worker.submit(params, 12, episodes=1) == {
      'version': 12, 'replaced': 11}
  assert worker.status()['pending'] == 12
  first = worker.poll(timeout=120)
  second = worker.poll(timeout=120)
  assert (first['version'], second['version']) == (10, 12)
  assert first['scores'] == [LENGTH] * 40 and second['scores'] == [LENGTH]
  assert worker.poll(timeout=0.5) is None  # 11 never ran; 10 and 12 once
  assert worker.status() == {'pid': worker.status()['pid'], 'running': None,
                             'pending': None, 'results': 0}


def test_bad_submits_are_errors_to_the_caller(worker, agent):
  params = cue_params(agent, True)
  with pytest.raises(ValueError, match='mode'):
    worker.submit(params, 1, mode='random')
  with pytest.raises(ValueError, match='episodes'):
    worker.submit(params, 1, episodes=0)
  params['pol']['action_logits']['bias'] = np.zeros(3, np.float32)
  with pytest.raises(RuntimeError, match='pol/action_logits/bias'):
    worker.submit(params, 1)
  del params['enc']
  with pytest.raises(RuntimeError, match='missing: enc/'):
    worker.submit(params, 1)
  assert worker.status()['pending'] is None


def poll_from_another_process(name, logdir):
  """[version, scores] of the result that `EvalWorker.from_name(name,
  logdir).poll()` gets in a fresh Python process."""
  script = (
      'import json, sys\n'
      'from dreamer_ver.runtime.eval_worker import EvalWorker\n'
      'worker = EvalWorker.from_name(sys.argv[1], sys.argv[2])\n'
      'result = worker.poll(timeout=120)\n'
      'print(json.dumps([result["version"], result["scores"]]))\n'
      'worker.close()\n')
  done = subprocess.run(
      [sys.executable, '-c', script, name, str(logdir)], capture_output=True,
      text=True, timeout=300, env={**os.environ, 'JAX_PLATFORMS': 'cpu'})
  assert done.returncode == 0, done.stderr
  return json.loads(done.stdout.splitlines()[-1])


def test_from_name_in_another_process_polls_the_same_worker(
    worker, agent, config):
  worker.submit(cue_params(agent, True), 21, episodes=2)
  assert poll_from_another_process('main', config.logdir) == [
      21, [LENGTH, LENGTH]]
  assert worker.poll(timeout=0.5) is None  # it went to the other process
  with pytest.raises(FileNotFoundError, match='no eval worker named'):
    EvalWorker.from_name('other', config.logdir)


def test_an_env_error_is_a_result_and_the_worker_recovers(config, agent):
  Flaky.failed = False  # in this process; the worker has its own
  worker = EvalWorker(config, name='flaky', env_maker=flaky_env)
  try:
    pid = worker.status()['pid']
    params = cue_params(agent, True)
    worker.submit(params, 1, episodes=2)
    assert worker.poll(timeout=120) == {
        'error': 'RuntimeError: the env broke', 'version': 1}
    worker.submit(params, 2, episodes=2)
    result = worker.poll(timeout=120)
    assert result['version'] == 2 and result['scores'] == [LENGTH] * 2
    frames = result['frames']  # env 0's first episode: counts 0 .. LENGTH
    assert frames.dtype == np.uint8 and frames.shape == (LENGTH + 1, 4, 4, 3)
    assert (frames[:, 0, 0, 0] == np.arange(LENGTH + 1)).all()
  finally:
    worker.shutdown()
  assert not record_path(config.logdir, 'flaky').exists()
  with pytest.raises(ProcessLookupError):
    os.kill(pid, 0)


def test_callables_must_reach_the_worker_process(config):
  with pytest.raises(TypeError, match='top-level function'):
    EvalWorker(config, name='x', env_maker=lambda i: None)
  with pytest.raises(ValueError, match='cannot be imported'):
    EvalWorker(config, name='x', init_fn='dreamer_ver.envs:no_such_thing')
  with pytest.raises(ValueError, match='name'):
    EvalWorker(config, name='../x')


# Hosts and restarts.

ROOT = Path(__file__).resolve().parent.parent


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
    wait_for(lambda: evaluation.started >= 2, 120, 'a second worker')
    count = len(sent)
    wait_for(lambda: len(sent) > count, 300, 'a result of the new worker')
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


def test_a_ray_hosted_worker_scores_restarts_and_is_found_by_name(
    config, agent, local_ray):
  worker = EvalWorker(config, name='onray', host='ray', num_cpus=1)
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
    wait_for(lambda: (_status(worker) or {'pid': pid})['pid'] != pid, 300,
             'the restarted worker')
    # The new worker writes its record once it serves, so just after.
    new_pid = worker.status()['pid']
    record = wait_for(lambda: _record(config.logdir, 'onray', new_pid), 60,
                      'the new worker\'s record')
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


@pytest.mark.slow
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
