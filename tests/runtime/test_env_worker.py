"""The env ids the scripts hand out to their env processes."""

from dreamer_ver import config as config_module
from dreamer_ver.runtime.env_worker import fleets


def test_fleets_give_every_env_id_once_train_ids_first():
  # The env ids every script hands out (parallel's processes, the ray
  # driver's fleets): each id once, train before eval, none past the
  # agent's carry slots (envs + eval_envs), from any offset.
  run = config_module.load_config(
      ['--run.envs', '5', '--run.eval_envs', '3', '--run.envs_per_worker',
       '2']).run
  groups = fleets(run)
  assert [(name, ids, is_eval) for name, ids, is_eval in groups] == [
      ('env0-1', [0, 1], False), ('env2-3', [2, 3], False),
      ('env4', [4], False), ('env5-6', [5, 6], True), ('env7', [7], True)]
  shifted = fleets(run, offset=20)
  assert [ids for _, ids, _ in shifted] == [
      [i + 20 for i in ids] for _, ids, _ in groups]
