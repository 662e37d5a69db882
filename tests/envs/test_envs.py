"""Tests for dreamer_ver.envs: spaces, episode bookkeeping, and wrappers."""

import importlib
import inspect
import subprocess
import sys

import elements
import gymnasium
import numpy as np
import pytest
from portal import packlib

from dreamer_ver.config import loading as configlib
from dreamer_ver import envs
from dreamer_ver.envs import base
from dreamer_ver.envs import gym as gym_env
from dreamer_ver.envs import resize
from dreamer_ver.envs import wrappers
from dreamer_ver.runtime import env_worker
from helpers.envs import rendered_dmc


def assert_space(space, dtype, shape, low=None, high=None):
  # elements.Space.__eq__ returns a (truthy) tuple, so compare fields.
  assert space.dtype == np.dtype(dtype), space
  assert space.shape == shape, space
  if low is not None:
    np.testing.assert_array_equal(space.low, np.broadcast_to(low, shape))
  if high is not None:
    np.testing.assert_array_equal(space.high, np.broadcast_to(high, shape))


def zero_action(env, reset=False):
  action = {k: np.zeros(v.shape, v.dtype) for k, v in env.act_space.items()}
  action['reset'] = reset
  return action


def run_episode(env, action_fn, max_steps=10000):
  obs = [env.step(zero_action(env, reset=True))]
  while not obs[-1]['is_last'] and len(obs) < max_steps:
    obs.append(env.step(action_fn(obs[-1])))
  return obs


class Recorder(base.Env):
  """Passes through to ``env`` and remembers the last action it received."""

  def __init__(self, env):
    self.env = env
    self.actions = []

  obs_space = property(lambda self: self.env.obs_space)
  act_space = property(lambda self: self.env.act_space)

  def step(self, action):
    self.actions.append(dict(action))
    return self.env.step(action)


class FakeEnv(base.Env):
  """Returns fixed observations, to feed the wrappers odd inputs, and
  remembers its actions and its ``render_frames`` calls."""

  def __init__(self, obs_space, act_space, obs):
    self._obs_space = {**obs_space, **base.basic_obs_space()}
    self._act_space = {'reset': elements.Space(bool), **act_space}
    self._obs = obs
    self.actions = []
    self.frames_on = []

  obs_space = property(lambda self: self._obs_space)
  act_space = property(lambda self: self._act_space)

  def step(self, action):
    self.actions.append(dict(action))
    return {**self._obs, **base.basic_obs(is_first=action['reset'])}

  def render_frames(self, on):
    self.frames_on.append(on)


# Dummy.


def test_dummy_disc_spaces_match_upstream():
  env = envs.make_env('dummy_disc')
  obs, act = env.obs_space, env.act_space
  assert list(obs) == [
      'image', 'vector', 'token', 'count', 'float2d', 'int2d',
      'reward', 'is_first', 'is_last', 'is_terminal']
  assert_space(obs['image'], np.uint8, (64, 64, 3))
  assert_space(obs['vector'], np.float32, (7,))
  assert_space(obs['token'], np.int32, (), 0, 256)
  assert_space(obs['count'], np.float32, (), 0, 100)
  assert_space(obs['float2d'], np.float32, (4, 5))
  assert_space(obs['int2d'], np.int32, (2, 3), 0, 4)
  assert_space(obs['reward'], np.float32, ())
  for key in ('is_first', 'is_last', 'is_terminal'):
    assert_space(obs[key], bool, ())
  assert sorted(act) == ['act_cont', 'act_disc', 'reset']
  assert_space(act['reset'], bool, ())
  assert_space(act['act_disc'], np.int32, (), 0, 5)
  assert act['act_disc'].classes == 5
  assert_space(act['act_cont'], np.float32, (6,), -1, 1)
  assert not act['act_cont'].discrete


def test_dummy_episode_flags_and_count():
  env = envs.make_env('dummy_disc', {'dummy': {'length': 7}})
  episode = run_episode(env, lambda obs: zero_action(env))
  assert len(episode) == 8
  assert [bool(o['is_first']) for o in episode] == [True] + [False] * 7
  assert [bool(o['is_last']) for o in episode] == [False] * 7 + [True]
  assert [bool(o['is_terminal']) for o in episode] == [False] * 7 + [True]
  assert [float(o['count']) for o in episode] == list(range(8))
  assert episode[0]['reward'] == 0
  for obs in episode:
    assert obs['reward'].dtype == np.float32 and obs['reward'].shape == ()
    assert obs['is_first'].dtype == bool
  # The step after is_last starts a new episode even without reset=True.
  after = env.step(zero_action(env))
  assert after['is_first'] and after['count'] == 0 and after['reward'] == 0


def test_dummy_restarts_the_episode_on_a_reset_action():
  env = envs.make_env('dummy_cont')
  env.step(zero_action(env, reset=True))
  for _ in range(5):
    obs = env.step(zero_action(env))
  assert obs['count'] == 5 and not obs['is_first']
  obs = env.step(zero_action(env, reset=True))
  assert obs['is_first'] and not obs['is_last'] and obs['count'] == 0
  assert obs['reward'] == 0
  assert env.step(zero_action(env))['count'] == 1


def test_dummy_rewards_follow_the_cue_and_goal():
  disc = envs.make_env('dummy_disc', seed=3)
  obs = disc.step(zero_action(disc, reset=True))
  rewards = []
  for i in range(20):
    action = zero_action(disc)
    right = i % 2 == 0
    action['act_disc'] = np.int32(obs['token'] if right else
                                  (obs['token'] + 1) % 5)
    obs = disc.step(action)
    rewards.append(float(obs['reward']))
  assert rewards == [1.0, 0.0] * 10

  cont = envs.make_env('dummy_cont', seed=3)
  obs = cont.step(zero_action(cont, reset=True))
  action = zero_action(cont)
  action['act_cont'] = obs['vector'][:6]
  assert cont.step(action)['reward'] == pytest.approx(1.0)
  assert -1 <= obs['vector'][:6].min() and obs['vector'][:6].max() <= 1


def test_dummy_is_deterministic_given_seed():
  def tokens(seed):
    env = envs.make_env('dummy_disc', seed=seed)
    return [int(o['token']) for o in run_episode(env, lambda o: zero_action(env))]
  assert tokens(1) == tokens(1)
  assert tokens(1) != tokens(2)


# make_env.


def test_unknown_suite_names_task_and_suites():
  with pytest.raises(ValueError) as info:
    envs.make_env('nosuchsuite_reward')
  message = str(info.value)
  assert 'nosuchsuite_reward' in message
  for suite in ('dummy', 'gym', 'dmc', 'atari', 'atari100k', 'crafter'):
    assert suite in message


def test_make_env_accepts_config_or_dict_and_defaults_when_empty():
  config = elements.Config({'dummy': {'length': 3}, 'gym': {}})
  for env_config in (config, {'dummy': {'length': 3}}):
    env = envs.make_env('dummy_disc', env_config)
    assert len(run_episode(env, lambda o: zero_action(env))) == 4
    assert env.obs_space['count'].high == 3
  for env_config in (None, {}, {'dummy': None}):
    env = envs.make_env('dummy_disc', env_config)
    assert env.obs_space['count'].high == 100


def test_make_env_fills_missing_keys_from_the_config_defaults():
  env = envs.make_env('synthetic_a', {'synthetic': {'length': 5}})
  assert env.obs_space['vector'].shape == (
      configlib.compose().env.synthetic.vector_size,)
  episode = run_episode(env, lambda o: zero_action(env))
  assert len(episode) == 6
  # The bandit's last round ends the game: terminal, not a time limit.
  assert [bool(o['is_terminal']) for o in episode] == [False] * 5 + [True]


def test_config_env_defaults_fit_the_constructors():
  defaults = configlib.compose().env
  assert set(defaults) == set(envs._SUITES)
  for suite, path in envs._SUITES.items():
    module, cls = path.split(':')
    ctor = getattr(importlib.import_module(module), cls)
    params = inspect.signature(ctor).parameters
    assert set(defaults[suite]) <= set(params), suite


def test_envs_package_stays_light():
  code = (
      'import sys; from dreamer_ver.envs import make_env; '
      'env = make_env("dummy_disc"); '
      'heavy = [m for m in ("jax", "flax", "dreamer_ver.agent", '
      '"dreamer_ver.runtime", "dm_control", "ale_py", "crafter", '
      '"gymnasium") if m in sys.modules]; '
      'print(heavy); sys.exit(bool(heavy))')
  result = subprocess.run(
      [sys.executable, '-c', code], capture_output=True, text=True)
  assert result.returncode == 0, result.stdout + result.stderr


# Gym.


def test_gym_cartpole_spaces_and_termination():
  env = envs.make_env('gym_CartPole-v1', seed=0)
  assert sorted(env.obs_space) == [
      'is_first', 'is_last', 'is_terminal', 'reward', 'vector']
  assert_space(env.obs_space['vector'], np.float32, (4,))
  assert_space(env.act_space['action'], np.int32, (), 0, 2)
  assert env.act_space['action'].classes == 2
  # Always pushing left topples the pole within a few dozen steps.
  episode = run_episode(env, lambda o: zero_action(env))
  assert 5 < len(episode) < 100
  last = episode[-1]
  assert last['is_last'] and last['is_terminal']
  assert [float(o['reward']) for o in episode] == [0.0] + [1.0] * (
      len(episode) - 1)
  assert not any(o['is_last'] for o in episode[:-1])
  assert all(o['vector'].dtype == np.float32 for o in episode)


def test_gym_time_limit_is_last_but_not_terminal():
  env = envs.make_env('gym_CartPole-v1', {'gym': {'max_episode_steps': 3}})
  episode = [env.step(zero_action(env, reset=True))]
  for i in range(3):
    episode.append(env.step({**zero_action(env), 'action': np.int32(i % 2)}))
  assert [bool(o['is_last']) for o in episode] == [False] * 3 + [True]
  assert not episode[-1]['is_terminal']


def test_normalize_and_clip_action_pendulum():
  recorder = Recorder(gym_env.FromGym('Pendulum-v1'))
  env = envs.wrap_env(recorder)
  # Pendulum's torque is in [-2, 2]; the agent sees [-1, 1].
  assert_space(recorder.act_space['action'], np.float32, (1,), -2, 2)
  assert_space(env.act_space['action'], np.float32, (1,), -1, 1)
  env.step(zero_action(env, reset=True))
  sent = []
  for value in (1.0, -1.0, 0.0, 0.5, 5.0, -7.0):
    env.step({'reset': False, 'action': np.array([value], np.float32)})
    sent.append(float(recorder.actions[-1]['action'][0]))
  assert sent == [2.0, -2.0, 0.0, 1.0, 2.0, -2.0]


def test_normalize_action_keeps_unbounded_dims():
  fake = FakeEnv(
      {}, {'action': elements.Space(np.float32, (2,), [0, -np.inf],
                                    [10, np.inf])}, {})
  env = wrappers.NormalizeAction(fake, 'action')
  assert_space(env.act_space['action'], np.float32, (2,), [-1, -np.inf],
               [1, np.inf])
  env.step({'reset': False, 'action': np.array([0.0, 3.5], np.float32)})
  np.testing.assert_allclose(fake.actions[-1]['action'], [5.0, 3.5])


class DictEnv(gymnasium.Env):
  """Nested Dict spaces and a fixed rendered frame, for the adapter."""

  metadata = {'render_modes': ['rgb_array'], 'render_fps': 10}

  def __init__(self, render_mode=None):
    spaces = gymnasium.spaces
    self.observation_space = spaces.Dict({
        'pos': spaces.Box(-1, 1, (2,), np.float64),
        'inner': spaces.Dict({'mode': spaces.Discrete(3, start=1)}),
        'reward': spaces.Box(0, 1, (), np.float32),
    })
    self.action_space = spaces.Dict({
        'move': spaces.Box(-3, 3, (2,), np.float32),
        'pick': spaces.Discrete(4),
    })
    self.render_mode = render_mode
    self.received = []

  def reset(self, seed=None, options=None):
    super().reset(seed=seed)
    return self._obs(), {}

  def step(self, action):
    self.received.append(action)
    return self._obs(), 0.5, False, False, {}

  def render(self):
    frame = np.zeros((40, 30, 3), np.uint8)
    frame[:, :, 0] = 200
    return frame

  def _obs(self):
    return {'pos': np.array([0.25, -0.5]), 'inner': {'mode': 3},
            'reward': np.array(0.75, np.float32)}


gymnasium.register('DreamerVerDictTest-v0', entry_point=DictEnv)


def test_gym_dict_spaces_are_flattened():
  inner = gym_env.FromGym('DreamerVerDictTest-v0')
  env = envs.wrap_env(inner)
  assert sorted(env.obs_space) == [
      'gym_reward', 'inner/mode', 'is_first', 'is_last', 'is_terminal',
      'pos', 'reward']
  assert_space(env.obs_space['pos'], np.float32, (2,), -1, 1)
  assert_space(env.obs_space['inner/mode'], np.int32, (), 0, 3)
  assert sorted(env.act_space) == ['move', 'pick', 'reset']
  assert_space(env.act_space['move'], np.float32, (2,), -1, 1)
  assert_space(env.act_space['pick'], np.int32, (), 0, 4)
  obs = env.step(zero_action(env, reset=True))
  np.testing.assert_array_equal(obs['pos'], np.float32([0.25, -0.5]))
  assert obs['pos'].dtype == np.float32
  assert obs['inner/mode'] == 2  # Shifted by Discrete.start.
  assert obs['gym_reward'] == np.float32(0.75) and obs['reward'] == 0
  obs = env.step({'reset': False, 'move': np.float32([1, -0.5]),
                  'pick': np.int32(3)})
  assert obs['reward'] == np.float32(0.5)
  received = inner._env.unwrapped.received[-1]
  assert sorted(received) == ['move', 'pick']
  np.testing.assert_allclose(received['move'], [3.0, -1.5])
  assert received['pick'] == 3


def test_gym_pixels_render_and_resize():
  env = envs.make_env(
      'gym_DreamerVerDictTest-v0', {'gym': {'pixels': True, 'size': [16, 8]}})
  assert sorted(env.obs_space) == [
      'image', 'is_first', 'is_last', 'is_terminal', 'reward']
  assert_space(env.obs_space['image'], np.uint8, (16, 8, 3))
  obs = env.step(zero_action(env, reset=True))
  assert obs['image'].shape == (16, 8, 3) and obs['image'].dtype == np.uint8
  np.testing.assert_array_equal(obs['image'][..., 0], 200)
  np.testing.assert_array_equal(obs['image'][..., 1:], 0)


# Wrappers.


def test_unify_dtypes_casts_both_ways():
  fake = FakeEnv(
      {'x': elements.Space(np.float64, (2,)),
       'n': elements.Space(np.int64, (), 0, 10),
       'img': elements.Space(np.uint8, (2, 2, 1))},
      {'action': elements.Space(np.float64, (1,), -1, 1)},
      {'x': np.array([1.5, 2.5]), 'n': np.int64(4),
       'img': np.zeros((2, 2, 1), np.uint8)})
  env = wrappers.UnifyDtypes(fake)
  assert env.obs_space['x'].dtype == np.float32
  assert_space(env.obs_space['n'], np.int32, (), 0, 10)
  assert env.obs_space['img'].dtype == np.uint8
  assert env.obs_space['is_first'].dtype == bool
  assert env.act_space['action'].dtype == np.float32
  obs = env.step({'reset': True, 'action': np.float32([0.5])})
  assert obs['x'].dtype == np.float32 and obs['n'].dtype == np.int32
  assert obs['img'].dtype == np.uint8 and obs['is_first'].dtype == bool
  assert fake.actions[-1]['action'].dtype == np.float64


def test_check_spaces_names_key_on_wrong_shape():
  fake = FakeEnv(
      {'vector': elements.Space(np.float32, (4,))}, {},
      {'vector': np.arange(3, dtype=np.float32)})
  env = wrappers.CheckSpaces(fake)
  with pytest.raises(ValueError) as info:
    env.step({'reset': True})
  message = str(info.value)
  assert "'vector'" in message
  assert 'shape (3,) != (4,)' in message
  assert 'Expected dtype float32, shape (4,)' in message
  assert '[0. 1. 2.]' in message


def test_check_spaces_rejects_bad_actions_and_keys():
  env = envs.make_env('dummy_disc')
  env.step(zero_action(env, reset=True))
  bad = {**zero_action(env), 'act_disc': np.int32(5)}
  with pytest.raises(ValueError, match=r"'act_disc'.*high=5 \(exclusive\)"):
    env.step(bad)
  bad = {**zero_action(env), 'act_disc': np.float32(1)}
  with pytest.raises(ValueError, match=r"'act_disc'.*dtype float32 != int32"):
    env.step(bad)
  bad = zero_action(env)
  del bad['act_cont']
  with pytest.raises(ValueError, match=r"missing \['act_cont'\]"):
    env.step(bad)
  nan = {**zero_action(env), 'act_cont': np.full(6, np.nan, np.float32)}
  with pytest.raises(ValueError, match="'act_cont'.*non-finite"):
    env.step(nan)
  # Python scalars are accepted when their kind matches.
  env.step({**zero_action(env), 'reset': False, 'act_disc': 4})


def test_wrappers_forward_render_frames_and_allow_absent_log_keys():
  frame = elements.Space(np.uint8, (2, 2, 3))
  vector = np.zeros(2, np.float32)
  fake = FakeEnv(
      {'vector': elements.Space(np.float32, (2,)), 'log/frame': frame},
      {'action': elements.Space(np.float32, (1,), -1, 1)},
      {'vector': vector})
  env = envs.wrap_env(fake)  # Four wrappers deep.
  env.render_frames(True)
  env.render_frames(False)
  assert fake.frames_on == [True, False]
  action = {'reset': True, 'action': np.float32([0])}
  assert 'log/frame' not in env.step(action)  # Absent while frames are off.
  fake._obs = {'vector': vector, 'log/frame': np.zeros((2, 2, 3), np.uint8)}
  assert env.step(action)['log/frame'].shape == (2, 2, 3)
  fake._obs = {'vector': vector, 'log/frame': np.zeros((2, 3), np.uint8)}
  with pytest.raises(ValueError, match=r"'log/frame'.*shape"):
    env.step(action)  # A present log/ key is still checked.
  fake._obs = {}
  with pytest.raises(ValueError, match=r"missing \['vector'\]"):
    env.step(action)
  fake._obs = {'vector': vector, 'log/other': np.float32(1)}
  with pytest.raises(ValueError, match=r"unexpected \['log/other'\]"):
    env.step(action)


def test_space_violation_flags_values_below_low_and_allows_uint8_255():
  assert wrappers.space_violation(np.int32(4), elements.Space(
      np.int32, (), 0, 5)) is None
  assert wrappers.space_violation(np.int32(-1), elements.Space(
      np.int32, (), 0, 5)) == 'values below low=0'
  # Default uint8 bounds are inclusive of 255.
  image = np.full((2, 2, 3), 255, np.uint8)
  assert wrappers.space_violation(
      image, elements.Space(np.uint8, (2, 2, 3))) is None


# Resize.


def test_resize_numpy_preserves_constants_and_shape():
  image = np.full((210, 160, 3), 77, np.uint8)
  out = resize.resize(image, (64, 48), 'numpy')
  assert out.shape == (64, 48, 3) and out.dtype == np.uint8
  assert (out == 77).all()
  gray = np.tile(np.arange(100, dtype=np.uint8)[:, None, None], (1, 20, 1))
  out = resize.resize(gray, (10, 5), 'numpy')
  assert out.shape == (10, 5, 1)
  np.testing.assert_allclose(out[:, 0, 0], np.arange(10) * 10 + 4.5, atol=1)


def test_resize_numpy_matches_pillow():
  pytest.importorskip('PIL')
  rng = np.random.default_rng(0)
  image = rng.integers(0, 256, (210, 160, 3)).astype(np.uint8)
  ours = resize.resize(image, (64, 64), 'numpy')
  theirs = resize.resize(image, (64, 64), 'pillow')
  assert np.abs(ours.astype(int) - theirs).max() <= 1


# DMC.


def test_dmc_proprio_cartpole_has_float_obs_and_repeat_sums_rewards():
  pytest.importorskip('dm_control')
  config = {'dmc': {'image': False, 'log_image': False}}
  env = envs.make_env('dmc_cartpole_balance', config, seed=0)
  assert sorted(env.obs_space) == [
      'is_first', 'is_last', 'is_terminal', 'position', 'reward', 'velocity']
  assert_space(env.obs_space['position'], np.float32, (3,))
  assert_space(env.obs_space['velocity'], np.float32, (2,))
  assert_space(env.act_space['action'], np.float32, (1,), -1, 1)
  obs = env.step(zero_action(env, reset=True))
  assert obs['is_first'] and obs['reward'] == 0
  rewards = []
  for _ in range(4):
    obs = env.step({'reset': False, 'action': np.float32([0.3])})
    for key in ('position', 'velocity', 'reward'):
      assert obs[key].dtype == np.float32, key
    assert not obs['is_first'] and not obs['is_last']
    rewards.append(float(obs['reward']))
  assert all(0 < r <= 1 for r in rewards)

  # Action repeat 2 sums the rewards of two underlying steps.
  config = {'dmc': {'image': False, 'log_image': False, 'repeat': 2}}
  repeated = envs.make_env('dmc_cartpole_balance', config, seed=0)
  repeated.step(zero_action(repeated, reset=True))
  totals = [
      float(repeated.step({'reset': False, 'action': np.float32([0.3])})[
          'reward']) for _ in range(2)]
  np.testing.assert_allclose(
      totals, [rewards[0] + rewards[1], rewards[2] + rewards[3]], rtol=1e-6)


def test_dmc_image_has_the_configured_size_and_keeps_proprio():
  env, obs = rendered_dmc({'dmc': {'size': [32, 48]}})
  assert_space(env.obs_space['image'], np.uint8, (32, 48, 3))
  assert obs['image'].shape == (32, 48, 3) and obs['image'].dtype == np.uint8
  assert obs['image'].std() > 0
  assert 'position' in obs  # proprio stays on by default.


def proprio_dmc(size=16):
  """A dmc cartpole env from state, with `log/image` in its space, as the
  proprio preset has it; skips the test where MuJoCo cannot render."""
  probe, _ = rendered_dmc({'dmc': {'size': [size, size]}})  # Renders.
  probe.close()
  return envs.make_env(
      'dmc_cartpole_balance', {'dmc': {'image': False, 'size': [size, size]}})


def test_dmc_renders_log_image_only_while_frames_are_on(monkeypatch):
  env = proprio_dmc()
  assert_space(env.obs_space['log/image'], np.uint8, (16, 16, 3))
  physics = env._env.physics  # dm_control's, through the wrappers.
  render = physics.render
  renders = []

  def counted_render(*args, **kwargs):
    renders.append(args)
    return render(*args, **kwargs)

  monkeypatch.setattr(physics, 'render', counted_render)

  def steps(count):
    return [env.step({'reset': False, 'action': np.float32([0.3])})
            for _ in range(count)]

  assert all('log/image' not in obs for obs in steps(5))  # Off at first.
  assert len(renders) == 0
  env.render_frames(True)  # Through all the wrappers to the dmc env.
  for obs in steps(4):
    assert obs['log/image'].shape == (16, 16, 3)
    assert obs['log/image'].dtype == np.uint8 and obs['log/image'].std() > 0
  assert len(renders) == 4
  env.render_frames(False)
  assert all('log/image' not in obs for obs in steps(3))
  assert len(renders) == 4


def test_dmc_log_image_goes_over_the_wire():
  # MuJoCo's frames are flipped views, which the env worker must send as
  # contiguous arrays.
  env = proprio_dmc()
  env.render_frames(True)
  obs = env.step(zero_action(env, reset=True))
  assert 'image' not in obs and obs['log/image'].shape == (16, 16, 3)
  data = env_worker.request([obs], [7], False, single=True)
  back = packlib.unpack(b''.join(packlib.pack(data)))
  assert int(back['envid']) == 7
  np.testing.assert_array_equal(back['log/image'], obs['log/image'])


def test_dmc_splits_task_names_resolves_aliases_and_rejects_unknown():
  pytest.importorskip('dm_control')
  from dreamer_ver.envs import dmc
  tasks = [('point_mass', 'easy'), ('ball_in_cup', 'catch'),
           ('walker', 'walk')]
  assert dmc._split('point_mass_easy', tasks, dmc.DMC.ALIASES) == (
      'point_mass', 'easy')
  assert dmc._split('cup_catch', tasks, dmc.DMC.ALIASES) == (
      'ball_in_cup', 'catch')
  with pytest.raises(ValueError, match='walker_walk'):
    dmc._split('walker_fly', tasks, dmc.DMC.ALIASES)


# Atari.


def test_atari100k_pong_has_64px_images_minimal_actions_and_is_reproducible():
  pytest.importorskip('ale_py')
  def play(seed):
    env = envs.make_env('atari100k_pong', seed=seed)
    obs = [env.step(zero_action(env, reset=True))]
    for i in range(40):
      obs.append(env.step({'reset': False, 'action': np.int32(i % 6)}))
    return env, obs
  env, first = play(0)
  assert sorted(env.obs_space) == [
      'image', 'is_first', 'is_last', 'is_terminal', 'reward']
  assert_space(env.obs_space['image'], np.uint8, (64, 64, 3))
  assert_space(env.act_space['action'], np.int32, (), 0, 6)  # Minimal set.
  assert first[0]['is_first'] and not any(o['is_first'] for o in first[1:])
  assert first[-1]['image'].std() > 0
  assert {o['reward'].dtype for o in first} == {np.dtype(np.float32)}
  _, second = play(0)
  for a, b in zip(first, second):
    np.testing.assert_array_equal(a['image'], b['image'])
