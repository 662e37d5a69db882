"""One seed, the same envs in every script: `train`, the env workers of the
parallel runtime and `eval_only` seed env id i alike."""

import pytest

from dreamer_ver.config import loading as configlib
from dreamer_ver import envs
from dreamer_ver.runtime import env_worker
from dreamer_ver.scripts import eval_only, train


class Built(Exception):
  """Stops a script at its first env, once its seed is recorded."""


def first_env_seed(monkeypatch, script):
  seeds = []

  def make_env(task, env_config=None, seed=0):
    seeds.append(seed)
    raise Built

  monkeypatch.setattr(envs, 'make_env', make_env)
  with pytest.raises(Built):
    script()
  return seeds[0]


@pytest.mark.parametrize('seed', [0, 3])
def test_env_ids_get_the_same_seed_in_every_script(tmp_path, monkeypatch, seed):
  config = configlib.compose(['debug'], {
      'logdir': str(tmp_path), 'seed': seed, 'task': 'synthetic_bandit'})
  (tmp_path / 'ckpt').mkdir()
  (tmp_path / 'ckpt' / 'agent.npz').touch()  # eval_only checks it first.
  eval_id = config.run.envs  # eval env 0
  seed_of = lambda script: first_env_seed(monkeypatch, script)
  worker_train = seed_of(lambda: env_worker.run_envs(config, [0]))
  worker_eval = seed_of(lambda: env_worker.run_envs(config, [eval_id], True))
  assert seed_of(lambda: train.train(config)) == worker_train
  assert seed_of(lambda: eval_only.eval_only(config)) == worker_eval
  assert worker_train != worker_eval
  other = configlib.override(config, {'seed': seed + 1})
  assert seed_of(lambda: env_worker.run_envs(other, [0])) != worker_train
