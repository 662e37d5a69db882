"""The EvalWorker on synthetic_bandit, by value: hand-built params that read
the cue score every step (the maximum, `LENGTH`), params that act against it
score nothing, and each result comes back once, with its version. (Its
process killed, on Ray, in a run: tests/system/test_evaluation.py.)"""

import json
import os

import elements
import jax
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from dreamer_ver.envs import make_env, make_run_env
from dreamer_ver.envs.wrappers import Wrapper
from dreamer_ver.evaluation import episodes as evaluation
from dreamer_ver.evaluation.worker import EvalWorker, record_path
from helpers.evaluation import (  # noqa: F401  (config, agent: fixtures)
    LENGTH, agent, config, cue_params, cue_policy, poll_from_another_process)
from helpers.runs import wait_until


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
def worker(config):
  worker = EvalWorker(config=config, name='main')
  yield worker
  worker.shutdown()


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
  wait_until(lambda: worker.status()['running'] == 10, 60, 'the run',
             poll=0.02)
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
  worker = EvalWorker(flaky_env, config=config, name='flaky')
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
    EvalWorker(lambda i: None, config=config, name='x')
  with pytest.raises(ValueError, match='cannot be imported'):
    EvalWorker(init_fn='dreamer_ver.envs:no_such_thing', config=config,
               name='x')
  with pytest.raises(ValueError, match='name'):
    EvalWorker(config=config, name='../x')


def endless_env(index):
  """An env without a time limit (its episodes never end)."""
  return make_env('synthetic_bandit', {'synthetic': {'length': 10 ** 9}},
                  seed=200 + index)


def test_time_limits_end_evaluations_of_an_env_without_a_time_limit(
    config, agent):
  """An env whose episodes never end: `max_steps` cuts them (they count,
  truncated); without it the evaluation is an error result past the
  worker's eval_timeout, or past a shorter `timeout` of its own."""
  worker = EvalWorker(endless_env, config=config, name='endless',
                      eval_timeout=2.0)
  try:
    worker.submit(cue_params(agent, True), 1, episodes=3, max_steps=7)
    result = worker.poll(timeout=120)
    assert result['lengths'] == [7, 7, 7] and result['truncated'] == 3, result
    worker.submit(cue_params(agent, True), 2, episodes=2)
    result = worker.poll(timeout=120)
    assert result['version'] == 2
    assert 'time limit (2 s: the worker\'s eval_timeout' in result['error']
    assert '0 of 2 episodes' in result['error'], result
    worker.submit(cue_params(agent, True), 3, episodes=1, timeout=1.0)
    result = worker.poll(timeout=120)
    assert result['version'] == 3 and 'time limit (1 s' in result['error']
  finally:
    worker.shutdown()


def test_a_custom_policy_scores_exactly_what_its_params_say(config):
  worker = EvalWorker(policy_maker=cue_policy, config=config, name='custom')
  try:
    for version, flip, score in ((1, 0, LENGTH), (2, 1, 0)):
      worker.submit({'flip': np.int32(flip)}, version, episodes=3)
      result = worker.poll(timeout=120)
      assert result['version'] == version, result
      assert result['scores'] == [score] * 3, result
  finally:
    worker.shutdown()


def test_a_record_whose_pid_now_belongs_to_another_process_is_stale(tmp_path):
  # After a container restart, the recorded pid may be any live process:
  # that must not block the name (and evaluation) for the whole run.
  from dreamer_ver.evaluation import records
  path = record_path(str(tmp_path), 'main')
  path.parent.mkdir(parents=True)
  path.write_text(json.dumps({'name': 'main', 'addr': '127.0.0.1:1',
                              'pid': os.getpid(),
                              'identity': ['an-earlier-boot', 12345]}))
  records.clear_stale_record(path)
  assert not path.exists()
  # The live worker's own record (this process, its identity) is kept.
  path.write_text(json.dumps({
      'name': 'main', 'addr': '127.0.0.1:1', 'pid': os.getpid(),
      'identity': records.process_identity(os.getpid())}))
  with pytest.raises(RuntimeError, match='already runs'):
    records.clear_stale_record(path)


@settings(derandomize=True, deadline=None, database=None, max_examples=25,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_malformed_params_are_an_error_to_their_caller_only(
    worker, agent, data):
  """Fuzzing the worker's input path: params with leaves of other shapes
  or dtypes, missing or extra ones, or any tree at all, are refused with
  an error to the caller; nothing is queued and the worker serves on."""
  leaf = hnp.arrays(
      st.sampled_from([np.float32, np.float64, np.int32, np.bool_]),
      hnp.array_shapes(min_dims=0, max_dims=2, max_side=3))
  params = cue_params(agent, True)
  paths = [(k, name) for k, sub in params.items() for name in sub]
  how = data.draw(st.sampled_from(['reshape', 'retype', 'drop', 'add',
                                   'random']))
  if how == 'random':
    params = data.draw(st.dictionaries(
        st.sampled_from(['enc', 'dyn', 'pol', 'x']),
        st.dictionaries(st.text('abc', min_size=1, max_size=2), leaf),
        max_size=3))
  else:
    top, name = data.draw(st.sampled_from(paths))
    if how == 'drop':
      del params[top][name]
    elif how == 'add':
      params[top]['extra'] = data.draw(leaf)
    else:
      first = next(iter(jax.tree.leaves(params[top][name])))
      wrong = (np.zeros(first.shape + (2,), first.dtype) if how == 'reshape'
               else first.astype(np.int32))
      params[top][name] = jax.tree.map(lambda _: wrong, params[top][name])
  with pytest.raises((RuntimeError, TypeError, ValueError)):
    worker.submit(params, 1)
  assert worker.status()['pending'] is None
