"""Tests of the Crafter and Atari 57 suites, their config presets, the suite
registry (``register`` and entry points), and gymnasium's make kwargs from
the config (a crafter run through ``--script parallel``: tests/system)."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from dreamer_ver.config import loading as configlib
from dreamer_ver import envs
from dreamer_ver.envs import dummy
from helpers import ROOT
from test_envs import assert_space, run_episode, zero_action

ACHIEVEMENTS = 22  # crafter.constants.achievements


def act(index):
  return {'reset': False, 'action': np.int32(index)}


# Crafter.


def test_crafter_has_image_achievement_logs_and_17_actions():
  pytest.importorskip('crafter')
  env = envs.make_env('crafter_reward')
  obs = env.obs_space
  assert_space(obs['image'], np.uint8, (64, 64, 3))
  assert_space(obs['log/reward'], np.float32, ())
  achievements = [k for k in obs if k.startswith('log/achievement_')]
  assert len(achievements) == ACHIEVEMENTS
  assert 'log/achievement_collect_wood' in achievements
  for key in achievements:
    assert_space(obs[key], np.int32, ())
  assert sorted(env.act_space) == ['action', 'reset']
  assert_space(env.act_space['action'], np.int32, (), 0, 17)
  assert env.act_space['action'].classes == 17


def test_crafter_honours_size_and_logs_and_rejects_unknown_tasks():
  pytest.importorskip('crafter')
  env = envs.make_env(
      'crafter_noreward', {'crafter': {'size': [48, 64], 'logs': False}})
  assert sorted(env.obs_space) == [
      'image', 'is_first', 'is_last', 'is_terminal', 'log/reward', 'reward']
  assert_space(env.obs_space['image'], np.uint8, (48, 64, 3))
  obs = env.step(zero_action(env, reset=True))
  assert obs['image'].shape == (48, 64, 3)  # [height, width], not crafter's.
  with pytest.raises(ValueError, match='crafter_reward, crafter_noreward'):
    envs.make_env('crafter_hard')


def spy_on_crafter(env):
  """Records what the wrapped crafter.Env's step returns: (image, reward,
  done, info) per step. Crafter is not exactly reproducible (it despawns
  creatures picked from sets), so a second raw env cannot serve as the
  reference."""
  inner = env._env  # Reached through the wrappers.
  returns = []
  step = inner.step

  def recording_step(action):
    returns.append(step(action))
    return returns[-1]
  inner.step = recording_step
  return returns


def test_crafter_passes_on_the_env_and_logs_achievements():
  pytest.importorskip('crafter')
  # Mostly 'do' (5), which collects saplings from grass; this seed's player
  # survives these 120 steps.
  actions = [5, 5, 3, 5, 5, 4] * 20
  env = envs.make_env('crafter_reward', seed=0)
  returns = spy_on_crafter(env)
  episode = [env.step(zero_action(env, reset=True))]
  episode += [env.step(act(a)) for a in actions]
  assert [bool(o['is_first']) for o in episode] == [True] + [False] * 120
  assert not any(o['is_last'] or o['is_terminal'] for o in episode)
  assert episode[0]['reward'] == 0 and episode[0]['log/reward'] == 0
  rewards = [float(o['reward']) for o in episode[1:]]
  assert rewards == [np.float32(r) for _, r, _, _ in returns]
  assert sum(rewards) >= 1  # At least one unlock.
  assert [float(o['log/reward']) for o in episode[1:]] == rewards
  for obs, (image, _, _, _) in zip(episode[1:], returns):
    np.testing.assert_array_equal(obs['image'], image)
  names = [k for k in episode[0] if k.startswith('log/achievement_')]
  assert len(names) == ACHIEVEMENTS
  assert all(episode[0][k] == 0 for k in names)
  for key in names:
    counts = [o[key] for o in episode]
    assert all(c.dtype == np.int32 and c >= 0 for c in counts), key
    name = key[len('log/achievement_'):]
    assert counts[1:] == [info['achievements'][name] for *_, info in returns]
  assert episode[-1]['log/achievement_collect_sapling'] > 0

  # Without the task reward, reward is 0 and log/reward still the env's.
  silent = envs.make_env('crafter_noreward', seed=0)
  returns = spy_on_crafter(silent)
  quiet = [silent.step(zero_action(silent, reset=True))]
  quiet += [silent.step(act(a)) for a in actions]
  assert all(o['reward'] == 0 for o in quiet)
  assert [float(o['log/reward']) for o in quiet[1:]] == [
      np.float32(info['reward']) for *_, info in returns]
  assert sum(float(o['log/reward']) for o in quiet) >= 1


def test_crafter_time_limit_is_last_not_terminal_and_seeds_worlds():
  pytest.importorskip('crafter')
  env = envs.make_env('crafter_reward', {'crafter': {'length': 6}}, seed=1)
  episode = run_episode(env, lambda o: act(0))
  assert len(episode) == 7
  assert [bool(o['is_last']) for o in episode] == [False] * 6 + [True]
  assert not any(o['is_terminal'] for o in episode)
  # The step after the time limit starts the next episode by itself.
  assert env.step(act(0))['is_first']

  def first_image(seed):
    env = envs.make_env('crafter_reward', seed=seed)
    return env.step(zero_action(env, reset=True))['image']
  np.testing.assert_array_equal(first_image(1), first_image(1))
  assert (first_image(1) != first_image(2)).any()


def test_crafter_death_is_terminal():
  pytest.importorskip('crafter')
  env = envs.make_env('crafter_reward')
  env.step(zero_action(env, reset=True))
  env._env._player.health = 0  # Crafter's env object, through the wrappers.
  obs = env.step(act(0))
  assert obs['is_last'] and obs['is_terminal']
  assert obs['reward'] < 0  # The health lost, in tenths.
  assert env.step(act(0))['is_first']


# Atari.


def test_atari_suite_takes_the_atari57_defaults():
  pytest.importorskip('ale_py')
  env = envs.make_env('atari_pong', seed=0)
  assert_space(env.obs_space['image'], np.uint8, (96, 96, 1))  # Gray.
  assert_space(env.act_space['action'], np.int32, (), 0, 18)  # Full set.
  assert env._ale.getFloat('repeat_action_probability') == 0.25  # Sticky.
  obs = env.step(zero_action(env, reset=True))
  for i in range(5):
    obs = env.step(act(i))
  assert obs['image'].shape == (96, 96, 1) and obs['image'].std() > 0

  small = envs.make_env('atari100k_pong', seed=0)
  assert_space(small.obs_space['image'], np.uint8, (64, 64, 3))
  assert_space(small.act_space['action'], np.int32, (), 0, 6)
  assert small._ale.getFloat('repeat_action_probability') == 0.0


def test_atari_aggregate_mean_of_the_pooled_frames():
  pytest.importorskip('ale_py')
  config = {'atari': {'aggregate': 'mean', 'gray': False, 'size': [210, 160],
                      'resize': 'numpy', 'noops': 0}}
  env = envs.make_env('atari_pong', config)
  for step in range(30):
    obs = env.step(act(0) if step else zero_action(env, reset=True))
  frames = env._frames  # The two pooled screens of the last step.
  np.testing.assert_array_equal(
      obs['image'], frames.mean(0).astype(np.uint8))
  with pytest.raises(ValueError, match="aggregate must be 'max' or 'mean'"):
    envs.make_env('atari_pong', {'atari': {'aggregate': 'median'}})


# Presets.


def test_crafter_and_atari_presets_match_upstream():
  crafter = configlib.compose(['crafter'])
  assert crafter.task == 'crafter_reward' and crafter.run.steps == 1.1e6
  assert crafter.run.envs == 1 and crafter.run.train_ratio == 512.0
  assert dict(crafter.env.crafter) == {
      'size': (64, 64), 'logs': True, 'length': 10000}
  atari = configlib.compose(['atari'])
  assert atari.task == 'atari_pong' and atari.run.steps == 5.1e7
  assert atari.run.train_ratio == 32.0 and atari.run.envs == 16
  assert dict(atari.env.atari) == {
      'size': (96, 96), 'repeat': 4, 'sticky': True, 'gray': True,
      'actions': 'all', 'lives': 'unused', 'noops': 30, 'autostart': False,
      'pooling': 2, 'aggregate': 'max', 'resize': 'pillow',
      'clip_reward': False}
  # Atari 100k keeps its own options.
  small = configlib.compose(['atari100k']).env.atari100k
  assert small.sticky is False and small.actions == 'needed'


# Registry.


@pytest.fixture
def suites(monkeypatch):
  """The registry, restored after the test."""
  monkeypatch.setattr(envs, '_SUITES', dict(envs._SUITES))
  return envs._SUITES


def test_register_a_callable_suite(suites):
  calls = []

  def build(name, seed, **kwargs):
    calls.append((name, seed, kwargs))
    return dummy.Dummy('disc', length=kwargs.get('length', 100), seed=seed)

  envs.register('mine', build)
  env = envs.make_env('mine_level_1', seed=3)
  # No env.mine section in the defaults: only the config's kwargs arrive.
  assert calls == [('level_1', 3, {})]
  assert env.obs_space['count'].high == 100
  env = envs.make_env('mine_x', {'mine': {'length': 4}}, seed=5)
  assert calls[-1] == ('x', 5, {'length': 4})
  assert len(run_episode(env, lambda o: zero_action(env))) == 5


def test_register_a_module_path_and_override(suites):
  envs.register('alias', 'dreamer_ver.envs.dummy:Dummy')
  assert suites['alias'] == 'dreamer_ver.envs.dummy:Dummy'  # Not imported yet.
  env = envs.make_env('alias_cont')
  assert 'act_cont' in env.act_space
  with pytest.raises(ValueError) as info:
    envs.register('alias', 'dreamer_ver.envs.synthetic:Synthetic')
  message = str(info.value)
  assert "'alias' is already registered" in message
  assert 'override=True' in message and 'dummy, gym' in message
  with pytest.raises(ValueError, match="'dummy' is already registered"):
    envs.register('dummy', lambda name, seed: None)
  envs.register('alias', 'dreamer_ver.envs.synthetic:Synthetic', override=True)
  assert 'vector' in envs.make_env('alias_x').obs_space


def test_register_rejects_bad_prefixes_and_constructors(suites):
  with pytest.raises(ValueError, match='letters and digits'):
    envs.register('my_suite', lambda name, seed: None)
  with pytest.raises(ValueError, match="'module:attr'"):
    envs.register('mine', 'dreamer_ver.envs.dummy.Dummy')
  with pytest.raises(TypeError, match='callable'):
    envs.register('mine', 42)
  assert 'mine' not in suites


def test_unknown_prefix_lists_registered_suites(suites):
  envs.register('mine', lambda name, seed: None)
  with pytest.raises(ValueError) as info:
    envs.make_env('other_task')
  message = str(info.value)
  assert "'other_task'" in message
  assert 'crafter' in message and 'mine' in message


PLUGIN = '''
from dreamer_ver.envs import dummy


def make(name, seed, **kwargs):
  return dummy.Dummy('disc', length=len(name), seed=seed)
'''


def test_entry_point_suite_loads_lazily_in_a_fresh_process(tmp_path):
  (tmp_path / 'ver_plugin.py').write_text(PLUGIN)
  info = tmp_path / 'ver_plugin-0.1.dist-info'
  info.mkdir()
  (info / 'METADATA').write_text(
      'Metadata-Version: 2.1\nName: ver-plugin\nVersion: 0.1\n')
  (info / 'entry_points.txt').write_text(
      '[dreamer_ver.envs]\nplugged = ver_plugin:make\n')
  code = textwrap.dedent('''
      import sys
      from dreamer_ver import envs
      envs.make_env('dummy_disc')
      assert 'ver_plugin' not in sys.modules  # Known suites load nothing.
      env = envs.make_env('plugged_abcde')
      print(env.obs_space['count'].high, 'ver_plugin' in sys.modules)
      try:
        envs.make_env('missing_x')
      except ValueError as e:
        print(e)
  ''')
  result = subprocess.run(
      [sys.executable, '-c', code], capture_output=True, text=True,
      env={**os.environ, 'PYTHONPATH': os.pathsep.join([str(tmp_path), str(ROOT)])},
      timeout=60)
  assert result.returncode == 0, result.stderr
  first, error = result.stdout.splitlines()
  assert first == '5 True'
  assert "'missing_x'" in error and 'plugged' in error


# Gymnasium make kwargs.


def test_gym_max_episode_steps_from_the_command_line():
  config = configlib.load_config([
      '--task', 'gym_CartPole-v1', '--env.gym.max_episode_steps', '10'])
  env = envs.make_run_env(config, 0)
  # Pushing towards the side the pole leans to keeps it up for far longer.
  episode = run_episode(env, lambda o: act(int(o['vector'][2] > 0)))
  assert len(episode) == 11
  assert episode[-1]['is_last'] and not episode[-1]['is_terminal']
  assert not any(o['is_last'] for o in episode[:-1])
  unlimited = envs.make_env('gym_CartPole-v1', seed=config.seed * 100_000)
  assert len(run_episode(
      unlimited, lambda o: act(int(o['vector'][2] > 0)))) > 11


def test_gym_make_kwargs_from_the_config():
  config = configlib.load_config([
      '--task', 'gym_Pendulum-v1', '--env.gym.make_kwargs', '{g: 2.5}'])
  env = envs.make_run_env(config, 0)
  assert env._env.unwrapped.g == 2.5  # The gymnasium env, via the wrappers.
  assert env._env.spec.max_episode_steps == 200  # Its registered limit.
  # JSON is YAML too, and the time limit combines with other kwargs.
  config = configlib.load_config([
      '--task', 'gym_CartPole-v1', '--env.gym.max_episode_steps', '5',
      '--env.gym.make_kwargs', '{"sutton_barto_reward": true}'])
  env = envs.make_run_env(config, 0)
  episode = run_episode(env, lambda o: act(int(o['vector'][2] > 0)))
  assert len(episode) == 6 and episode[-1]['is_last']
  assert all(o['reward'] == 0 for o in episode)  # Not CartPole's usual 1.


@pytest.mark.parametrize('text, expected', [
    ('{g: 2.5', r"is not a YAML flow mapping: expected ',' or '}'"),
    ('[1, 2]', r'must be a mapping of names to values'),
    ('{max_episode_steps: 5}', r'use env.gym.max_episode_steps instead'),
    ('{render_mode: human}', r'use env.gym.pixels instead'),
])
def test_gym_rejects_malformed_or_conflicting_make_kwargs(text, expected):
  with pytest.raises(ValueError, match=expected):
    envs.make_env('gym_Pendulum-v1', {'gym': {'make_kwargs': text}})


def test_gym_max_episode_steps_must_not_be_negative():
  with pytest.raises(ValueError, match='max_episode_steps must be >= 0'):
    envs.make_env('gym_CartPole-v1', {'gym': {'max_episode_steps': -1}})
