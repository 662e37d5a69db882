"""The env ids the scripts hand out to their env processes."""

import pytest

from dreamer_ver.config import loading as config_module
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


def test_ids_another_connection_holds_are_asked_for_again_for_a_while(
    monkeypatch):
  """A vanished host's connection keeps its env ids until the actor knows
  it is dead: its replacement asks again instead of crashing, for
  TAKEN_SECONDS; other errors, and a wait past that, are raised."""
  import threading
  from dreamer_ver.rpc.batch_server import ENV_ID_TAKEN
  from dreamer_ver.rpc.wire import RemoteError, failure
  from dreamer_ver.runtime import env_worker
  now = [100.0]
  monkeypatch.setattr(env_worker.time, 'monotonic', lambda: now[0])
  stop = threading.Event()
  stop.set()  # No real waiting.
  taken = RemoteError(failure('act', ENV_ID_TAKEN,
                              'env id 3 is already used by conn 7'))
  since = env_worker._wait_for_ids(taken, None, stop)
  assert since == 100.0
  now[0] += env_worker.TAKEN_SECONDS
  assert env_worker._wait_for_ids(taken, since, stop) == 100.0
  now[0] += 1
  with pytest.raises(RuntimeError, match='already used'):
    env_worker._wait_for_ids(taken, since, stop)
  with pytest.raises(RuntimeError, match='bad key'):
    env_worker._wait_for_ids(RuntimeError('bad key'), None, stop)
  # The words alone do not make it a taken id: the error's kind does.
  words = RemoteError('act: ValueError: env id 3 is already used by conn 7')
  with pytest.raises(RemoteError, match='already used'):
    env_worker._wait_for_ids(words, None, stop)
