"""`--script eval_only` on a freshly saved checkpoint of the debug agent."""

import json

import pytest

from dreamer_ver.config import loading as configlib
from dreamer_ver import main as mainlib
from dreamer_ver.agent.agent import Agent
from dreamer_ver.envs import make_env
from dreamer_ver.agent.checkpoint import Checkpoint
from dreamer_ver.scripts import eval_only

LENGTH = 10
FLAGS = ['--configs', 'debug', '--task', 'synthetic_bandit',
         '--env.synthetic.length', str(LENGTH)]


@pytest.fixture(scope='module')
def run_dir(tmp_path_factory):
  """A logdir whose checkpoint is a freshly initialised agent state."""
  logdir = tmp_path_factory.mktemp('run')
  config = configlib.load_config(FLAGS)
  env = make_env(config.task, config.env, 0)
  agent = Agent(env.obs_space, env.act_space, config)
  state = agent.init_state(agent.init_params(config.seed), config.seed)
  Checkpoint(logdir).save(state, {'steps': 0, 'version': 0})
  env.close()
  return logdir


def read(path):
  return [json.loads(line) for line in path.open()]


def test_episode_shares_split_episodes_evenly_with_extras_first():
  assert eval_only.episode_shares(5, 2) == [3, 2]
  assert eval_only.episode_shares(4, 4) == [1, 1, 1, 1]
  assert sum(eval_only.episode_shares(7, 3)) == 7


def test_eval_only_from_the_command_line(run_dir, tmp_path, capsys):
  out = tmp_path / 'eval'
  code = mainlib.main([
      '--script', 'eval_only', *FLAGS, '--logdir', str(out),
      '--run.from_checkpoint', str(run_dir), '--run.steps', '5',
      '--run.eval_worker_envs', '2'])
  assert code == 0
  records = read(out / 'eval_scores.jsonl')
  assert len(records) == 5
  assert all(r['length'] == LENGTH for r in records)
  assert all(0 <= r['score'] <= LENGTH for r in records)
  assert all(r['eval'] and r['mode'] == 'greedy' and r['step'] == 0
             for r in records)
  assert sorted(r['env'] for r in records) == [0, 0, 0, 1, 1]
  text = capsys.readouterr().out
  assert 'Eval score over 5 episodes (greedy' in text


def test_eval_max_steps_cuts_every_episode_as_truncated(run_dir, tmp_path):
  out = tmp_path / 'eval'
  config = configlib.load_config([
      *FLAGS, '--logdir', str(out), '--run.from_checkpoint', str(run_dir),
      '--run.steps', '3', '--run.eval_worker_envs', '2',
      '--run.eval_max_steps', '4'])
  assert eval_only.eval_only(config) == 0
  records = read(out / 'eval_scores.jsonl')
  assert [(r['length'], r['truncated']) for r in records] == [(4, True)] * 3


def test_eval_only_from_the_ckpt_folder_sampled_and_random(run_dir, tmp_path):
  out = tmp_path / 'eval'
  config = configlib.load_config([
      *FLAGS, '--logdir', str(out), '--run.from_checkpoint',
      str(run_dir / 'ckpt'), '--run.steps', '3', '--run.eval_worker_envs', '4',
      '--run.eval_mode', 'sample'])
  assert eval_only.eval_only(config) == 0
  records = read(out / 'eval_scores.jsonl')
  assert len(records) == 3 and {r['env'] for r in records} == {0, 1, 2}
  assert all(r['length'] == LENGTH and r['mode'] == 'sample'
             for r in records)
  random = configlib.override(config, {'random_agent': True})
  assert eval_only.eval_only(random) == 0  # Appends.
  records = read(out / 'eval_scores.jsonl')
  assert len(records) == 6 and records[-1]['mode'] == 'random'


def test_eval_only_without_a_checkpoint_fails_cleanly(tmp_path, capsys):
  config = configlib.load_config([
      *FLAGS, '--logdir', str(tmp_path / 'empty'), '--run.steps', '2'])
  assert eval_only.eval_only(config) == 2
  assert 'no checkpoint' in capsys.readouterr().err
  assert not (tmp_path / 'empty' / 'eval_scores.jsonl').exists()


def test_eval_video_writes_the_first_episode_of_an_image_env(tmp_path):
  """`run.eval_video`: env 0's first episode, frame for frame, as a GIF."""
  import numpy as np
  from PIL import Image, ImageSequence
  from dreamer_ver.envs import make_run_env
  flags = ['--configs', 'debug', '--script', 'eval_only', '--task',
           'dummy_disc', '--env.dummy.length', '6', '--logdir',
           str(tmp_path / 'eval')]
  config = configlib.load_config(flags)
  env = make_run_env(config, config.run.envs)
  agent = Agent(env.obs_space, env.act_space, config)
  Checkpoint(tmp_path / 'run').save(
      agent.init_state(agent.init_params(0), 0), {'steps': 17, 'version': 0})
  config = configlib.load_config([
      *flags, '--run.from_checkpoint', str(tmp_path / 'run'),
      '--run.steps', '2', '--run.eval_video', 'True', '--random_agent', 'True'])
  assert eval_only.eval_only(config) == 0
  gif = Image.open(tmp_path / 'eval' / 'videos' / 'eval_17.gif')
  frames = [np.asarray(f.convert('RGB')) for f in ImageSequence.Iterator(gif)]
  assert len(frames) == 7  # The reset frame and 6 steps.
  assert frames[0].shape == tuple(env.obs_space['image'].shape)
  env.close()
