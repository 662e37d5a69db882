"""The EvalWorker as a library, without a run config, by value: on
`counting_env` (episodes of 3 steps on env 0 and 10 on env 1, a = 1, b = 2
and reward = 5 on each step) its reward keys, `break_when_any_done` and
its temporary folder; and the settings and Ray options it derives from
its keywords or a run's config, without starting Ray."""

import tempfile

import numpy as np
import pytest

from dreamer_ver.evaluation.worker import (
    EvalWorker, ray_options, worker_config)
from helpers.evaluation import (  # noqa: F401  (config: a fixture)
    config, counting_b_ten, counting_env, idle_policy)

PARAMS = {'flip': np.int32(0)}  # idle_policy's; it acts 0 whatever they say


@pytest.fixture(scope='module')
def worker():
  worker = EvalWorker(counting_env, idle_policy, reward_keys=('a', 'b'),
                      num_envs=2)
  yield worker
  worker.shutdown()


@pytest.fixture
def tempdir(monkeypatch, tmp_path):
  """The folder where temporary folders are made during the test."""
  monkeypatch.setattr(tempfile, 'tempdir', str(tmp_path))
  return tmp_path


def test_reward_keys_are_summed_into_each_steps_reward(worker):
  worker.submit(PARAMS, 1, episodes=2)
  result = worker.poll(timeout=120)
  # a + b = 3 on each step of the episodes of 3 and 10 steps.
  assert result['scores'] == [9, 30] and result['lengths'] == [3, 10]
  assert result['reward'] == result['score_mean'] == 19.5


def test_break_when_any_done_ends_at_the_first_episode_end(worker):
  worker.submit(PARAMS, 2, episodes=4, break_when_any_done=True)
  result = worker.poll(timeout=120)
  assert result['version'] == 2 and result['episodes'] == 1
  assert result['lengths'] == [3] and result['reward'] == 9
  # Env 1, left mid-episode, starts the next evaluation afresh.
  worker.submit(PARAMS, 3, episodes=2)
  assert worker.poll(timeout=120)['lengths'] == [3, 10]


def test_init_fn_runs_in_the_worker():
  worker = EvalWorker(counting_env, idle_policy, counting_b_ten,
                      reward_keys=('b',))
  try:
    worker.submit(PARAMS, 1, episodes=1)
    # Env 0's episode of 3 steps at b = 10 (init_fn's), not 2.
    assert worker.poll(timeout=120)['scores'] == [30]
  finally:
    worker.shutdown()


def test_a_worker_without_a_config_is_found_by_name_in_its_folder(worker):
  other = EvalWorker.from_name(worker.name, worker.logdir)
  try:
    assert other.status()['pid'] == worker.status()['pid']
  finally:
    other.close()


def test_a_worker_without_a_config_scores_the_reward_then_removes_its_folder(
    tempdir):
  worker = EvalWorker(counting_env, idle_policy)  # one env; obs['reward']
  try:
    assert worker.logdir.parent == tempdir and worker.record.is_file()
    worker.submit(PARAMS, 1, episodes=2)
    assert worker.poll(timeout=120)['scores'] == [15, 15]  # 3 steps of 5
  finally:
    worker.shutdown()
  assert list(tempdir.iterdir()) == []


def test_a_reward_key_the_env_does_not_give_is_an_error_at_start(tempdir):
  with pytest.raises(ValueError, match=r"reward_keys \['c'\] are not scalar "
                     r'observations of the eval env \(it gives a, b, '):
    EvalWorker(counting_env, idle_policy, reward_keys=('a', 'c'))
  assert list(tempdir.iterdir()) == []  # Its worker ended, its folder gone.


def test_settings_that_mean_nothing_are_refused_before_anything_starts(
    tempdir):
  for kwargs, message in (
      (dict(num_gpus=1), "num_cpus, num_gpus and Ray's options are for "
                         "host='ray'"),
      (dict(lifetime='detached'), "Ray's options are for host='ray'"),
      (dict(reward_keys='reward'), 'reward_keys must be a non-empty tuple'),
      (dict(num_envs=0), r'needs num_envs \(run.eval_worker_envs\) >= 1')):
    with pytest.raises(ValueError, match=message):
      EvalWorker(counting_env, idle_policy, **kwargs)
  with pytest.raises(ValueError, match='needs an env_maker and a policy'):
    EvalWorker(counting_env)
  assert list(tempdir.iterdir()) == []


def test_keywords_replace_the_library_defaults_or_the_run_configs(config):
  def settings(config):
    return (config.run.eval_worker_envs, config.run.eval_timeout,
            config.seed, config.logdir, config.ray.eval_cpus,
            config.ray.eval_gpus, config.jax.prealloc)
  given = dict(num_envs=3, eval_timeout=5, seed=7, logdir='x', num_cpus=0.5,
               num_gpus=2)
  assert settings(worker_config()) == (1, 1800.0, 0, '', 1.0, 1.0, False)
  assert settings(worker_config(config)) == (
      2, config.run.eval_timeout, config.seed, config.logdir, 1.0, 0.0,
      False)
  assert settings(worker_config(**given)) == settings(
      worker_config(config, **given)) == (3, 5.0, 7, 'x', 0.5, 2.0, False)


def test_ray_options_detach_a_named_worker_unless_told_otherwise(config):
  library = worker_config()
  assert ray_options(library, named=True, remote_kwargs={}) == {
      'num_cpus': 1.0, 'num_gpus': 1.0, 'lifetime': 'detached'}
  assert ray_options(library, False, {'max_restarts': 0}) == {
      'num_cpus': 1.0, 'num_gpus': 1.0, 'max_restarts': 0}
  run = worker_config(config.update({'ray.eval_cpus': 0.25,
                                     'ray.eval_gpus': 0.5}))
  assert ray_options(run, True, {'lifetime': 'non_detached'}) == {
      'num_cpus': 0.25, 'num_gpus': 0.5, 'lifetime': 'non_detached'}
