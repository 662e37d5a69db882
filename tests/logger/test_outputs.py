"""Tests for the logger's outputs and the videos they get, read back by value:
TensorBoard's event file, the offline W&B run's transaction log, the GIFs,
and the open-loop video of the learner's report."""

import concurrent.futures
import io
import json
import sys

import elements
import jax
import numpy as np
import pytest
from PIL import Image, ImageSequence

from dreamer_ver.agent import agent as agentlib
from dreamer_ver.config.loading import compose
from dreamer_ver.learner import learner as learnerlib
from dreamer_ver.logger.service import LoggerService
from dreamer_ver.config.validation import ConfigError, validate
from helpers.wandb_log import wandb_history, wandb_run


def make_service(logdir, **overrides):
  config = compose(['debug'], {'logdir': str(logdir), **overrides})
  return LoggerService.of(config, out=lambda text, **_: None)


def rows(envids, first=False, last=False):
  """Train rows of the given envs, reward 1."""
  count = len(envids)
  return {'envid': np.array(envids, np.int64),
          'reward': np.ones(count, np.float32),
          'is_first': np.full(count, first), 'is_last': np.full(count, last),
          'is_eval': np.zeros(count, bool)}


def known_video():
  """Five distinct uint8 frames [5, 6, 8, 3] of few colours (a GIF keeps
  them exactly)."""
  pattern = np.arange(6 * 8 * 3).reshape((6, 8, 3)) % 5 * 30
  return np.stack([pattern + 20 * t for t in range(5)]).astype(np.uint8)


def gif_frames(data):
  with Image.open(io.BytesIO(data)) as image:
    return np.stack([np.asarray(f.convert('RGB'))
                     for f in ImageSequence.Iterator(image)])


# -------------------------------------------------------------------- tests

def test_every_output_reads_back_by_value(tmp_path, monkeypatch):
  for name in ('DIR', 'CONFIG_DIR', 'CACHE_DIR', 'DATA_DIR'):
    monkeypatch.setenv(f'WANDB_{name}', str(tmp_path / 'wandb_home'))
  monkeypatch.setenv('WANDB_SILENT', 'true')
  monkeypatch.setenv('WANDB_CONSOLE', 'off')  # Leave pytest's stdout alone.
  logdir = tmp_path / 'run7'
  overrides = {'logger.outputs': ['jsonl', 'tensorboard', 'wandb'],
               'logger.wandb_mode': 'offline',
               'logger.wandb_project': 'tests', 'logger.fps': 10,
               'run.token': 'sekrit-run-token'}
  service = make_service(logdir, **overrides)
  video = known_video()
  service.transitions(rows([0, 1], first=True))
  service.add({'train/loss': 1.5})
  assert service.write() == {'step': 2, 'train/loss': 1.5,
                             'parallel/ep_starts': 2}
  service.transitions(rows([0], last=True))
  service.add({'train/loss': 3.0, 'report/openloop/image': video})
  service.write()
  service.save()
  service.close()

  # metrics.jsonl and the GIF.
  lines = [json.loads(x) for x in (logdir / 'metrics.jsonl').open()]
  assert [(x['step'], x['train/loss']) for x in lines] == [(2, 1.5), (3, 3.0)]
  gif = (logdir / 'videos' / 'report_openloop_image_3.gif').read_bytes()
  np.testing.assert_array_equal(gif_frames(gif), video)
  assert Image.open(io.BytesIO(gif)).info['duration'] == 100  # 10 fps

  # TensorBoard: scalars as simple values, the video as its GIF.
  from tensorboard.backend.event_processing import event_accumulator
  events = event_accumulator.EventAccumulator(str(logdir))
  events.Reload()
  assert [(e.step, e.value) for e in events.Scalars('train/loss')] == [
      (2, 1.5), (3, 3.0)]
  assert [(e.step, e.value) for e in events.Scalars('episode/score')] == [
      (3, 2.0)]
  (image,) = events.Images('report/openloop/image')
  assert (image.step, image.width, image.height) == (3, 8, 6)
  assert image.encoded_image_string == gif
  with Image.open(io.BytesIO(image.encoded_image_string)) as decoded:
    assert (decoded.format, decoded.n_frames, decoded.size) == ('GIF', 5,
                                                                (8, 6))

  # W&B: the offline run's transaction log.
  run_id = json.loads((logdir / 'wandb' / 'run.json').read_text())['id']
  (path,) = (logdir / 'wandb').glob(f'offline-run-*/run-{run_id}.wandb')
  run = wandb_run(path)
  assert (run.run_id, run.display_name, run.project) == (
      run_id, 'run7', 'tests')
  config = {item.key: json.loads(item.value_json)
            for item in run.config.update}
  assert config['batch_size'] == 8 and config['logger.fps'] == 10
  # The run's token is never uploaded (nor written anywhere in the logdir).
  assert config['run.token'] == ''
  for file in logdir.rglob('*'):
    assert not file.is_file() or b'sekrit' not in file.read_bytes(), file
  history = wandb_history(path)
  assert sorted(history) == [2, 3]
  assert history[2]['train/loss'] == 1.5
  assert history[3]['train/loss'] == 3.0
  assert history[3]['episode/score'] == 2.0
  logged = history[3]['report/openloop/image.path']
  assert history[3]['report/openloop/image._type'] == 'video-file'
  media = path.parent / 'files' / logged
  np.testing.assert_array_equal(gif_frames(media.read_bytes()), video)

  # A restarted logger resumes the same W&B run.
  service = make_service(logdir, **overrides)
  service.load()
  service.add({'train/loss': 4.0})
  service.transitions(rows([1]))
  service.write()
  service.close()
  paths = sorted((logdir / 'wandb').glob(f'offline-run-*/run-{run_id}.wandb'))
  assert len(paths) == 2 and paths[0] == path
  assert wandb_run(paths[1]).run_id == run_id
  assert wandb_history(paths[1])[4]['train/loss'] == 4.0


def test_a_video_is_written_whole_or_not_at_all(tmp_path, monkeypatch):
  """A full disk (or a kill) midway through a GIF leaves no cut file
  for a viewer, and the error names the file."""
  import errno
  from dreamer_ver.logger.outputs import write_gif
  video = np.random.default_rng(0).integers(0, 255, (4, 8, 8, 3), np.uint8)
  path = tmp_path / 'videos' / 'policy_image_5.gif'
  write_gif(path, video, 10)
  kept = path.read_bytes()
  real_save = Image.Image.save
  def full_midway(image, file, **kwargs):
    real_save(image, io.BytesIO(), **kwargs)
    file.write(b'GIF89a')  # a first part reaches the disk
    raise OSError(errno.ENOSPC, 'No space left on device')
  monkeypatch.setattr(Image.Image, 'save', full_midway)
  with pytest.raises(OSError, match='policy_image_5.gif') as failed:
    write_gif(path, video[::-1], 10)
  assert failed.value.errno == errno.ENOSPC
  assert path.read_bytes() == kept  # the earlier file, whole
  assert sorted(p.name for p in path.parent.iterdir()) == [path.name]
  np.testing.assert_array_equal(gif_frames(kept), video)


@pytest.mark.parametrize('output', ['tensorboard', 'wandb'])
def test_a_missing_package_names_the_extra_to_install(
    tmp_path, monkeypatch, capsys, output):
  # None in sys.modules makes every import of the package fail.
  for name in [output] + [n for n in sys.modules
                          if n.startswith(output + '.')]:
    monkeypatch.setitem(sys.modules, name, None)
  with pytest.raises(ImportError) as error:
    make_service(tmp_path, **{'logger.outputs': ['jsonl', output]})
  message = str(error.value)
  assert message.startswith(
      f"logger.outputs has '{output}', but it cannot be imported (")
  assert message.endswith(f"): pip install 'dreamer_ver[{output}]'")
  assert '\n' not in message
  # The scripts that start a logger refuse to start, instead of leaving the
  # logger to crash in a restart loop.
  from dreamer_ver import main as mainlib
  capsys.readouterr()
  ports = ['--run.actor_addr', 'localhost:1', '--run.logger_addr',
           'localhost:2', '--run.replay_addr', 'localhost:3']
  for script in ('parallel', 'parallel_logger'):
    assert mainlib.main([
        '--configs', 'debug', '--script', script, '--logdir',
        str(tmp_path / 'run'), '--logger.outputs', 'jsonl', output,
        *(ports if script == 'parallel_logger' else [])]) == 2
  err = capsys.readouterr().err.splitlines()
  assert err == [f"error: logger.outputs has '{output}', but {output} is not "
                 f"installed: pip install 'dreamer_ver[{output}]'"] * 2
  assert not (tmp_path / 'run').exists()  # nothing was started


def test_unknown_outputs_and_modes_are_config_errors():
  config = compose(['debug'], {'logger.outputs': ['jsonl', 'tensorbord']})
  with pytest.raises(ConfigError, match=(
      r"logger.outputs has unknown names \['tensorbord'\] \(known: jsonl, "
      r"tensorboard, wandb\)")):
    validate(config)
  config = compose(['debug'], {'logger.wandb_mode': 'disabled'})
  with pytest.raises(ConfigError, match="logger.wandb_mode must be one of"):
    validate(config)
  config = compose(['debug'], {'logger.fps': 0})
  with pytest.raises(ConfigError, match=r'logger.fps must be >= 1 \(got 0\)'):
    validate(config)
  validate(compose(['debug'], {
      'logger.outputs': ['tensorboard', 'wandb', 'jsonl']}))


# ------------------------------------------------------------ report video

H, W = 12, 16  # Small images, for a one-stage CNN (fast to compile).


def tiny_agent(image=True):
  obs = {
      'vector': elements.Space(np.float32, (3,)),
      'reward': elements.Space(np.float32, ()),
      'is_first': elements.Space(bool, ()),
      'is_last': elements.Space(bool, ()),
      'is_terminal': elements.Space(bool, ()),
  }
  if image:
    obs['image'] = elements.Space(np.uint8, (H, W, 3))
  act = {'action': elements.Space(np.int32, (), 0, 3),
         'reset': elements.Space(bool, ())}
  config = compose(['debug'], {'agent.enc.mults': [4], 'agent.dec.mults': [4]})
  return agentlib.Agent(obs, act, config)


def report_batch(agent, seed=0):
  """A report batch [B, report_length + replay_context] as the replay's
  (an image too, which a vector agent ignores)."""
  config = agent.config
  B, T = config.batch_size, config.report_length + config.replay_context
  rng = np.random.default_rng(seed)
  rssm = config.agent.rssm
  batch = {
      'image': rng.integers(0, 256, (B, T, H, W, 3)).astype(np.uint8),
      'vector': rng.normal(size=(B, T, 3)).astype(np.float32),
      'reward': rng.normal(size=(B, T)).astype(np.float32),
      'is_first': np.zeros((B, T), bool), 'is_last': np.zeros((B, T), bool),
      'is_terminal': np.zeros((B, T), bool),
      'action': rng.integers(0, 3, (B, T)).astype(np.int32),
      'stepid': np.zeros((B, T, 20), np.uint8),
      'consec': np.zeros((B, T), np.int32),
      'dyn/deter': np.zeros((B, T, rssm.deter), np.float32),
      'dyn/stoch': np.zeros((B, T, rssm.stoch, rssm.classes), np.float32),
  }
  batch['is_first'][:, 0] = True
  return batch


@pytest.fixture(scope='module')
def reported():
  """(agent, state, batch, report) of a tiny untrained image agent."""
  agent = tiny_agent()
  state = agent.init_state(agent.init_params(0))
  batch = report_batch(agent)
  return agent, state, batch, jax.device_get(agent.report(state, batch))


def test_report_video_shows_truth_model_and_error(reported):
  agent, _, batch, report = reported
  C = agent.config.replay_context
  T = agent.config.report_length
  rows = agentlib.VIDEO_ROWS
  video = report['openloop/image']
  assert video.dtype == np.uint8 and video.shape == (T, 3 * H, rows * W, 3)
  panels = video.reshape((T, 3, H, rows, W, 3))
  # The truth panel of each row is the batch's images, after the context.
  np.testing.assert_array_equal(
      panels[:, 0].transpose((2, 0, 1, 3, 4)), batch['image'][:rows, C:])
  # The error panel is grey where truth and model agree.
  truth = panels[:, 0].astype(np.float32) / 255
  model = panels[:, 1].astype(np.float32) / 255
  error = panels[:, 2].astype(np.float32) / 255
  np.testing.assert_allclose(error, (model - truth + 1) / 2, atol=1.5 / 255)
  # Everything else in the report is a scalar.
  assert all(np.ndim(v) == 0 for k, v in report.items()
             if k != 'openloop/image')


def test_learner_sends_report_videos_to_the_logger(reported, tmp_path):
  """The learner's report reaches the logger as float64 scalars and the
  uint8 video, which the logger writes as a GIF."""
  agent, state, batch, report = reported

  class Replay:  # The replay client's futures, answered at once.
    def sample_batch_report(self, rows):
      assert rows == agent.config.batch_size  # One process: every row.
      return self._answer()

    def sample_batch_eval(self, rows):
      assert rows == agent.config.batch_size
      return self._answer()

    def _answer(self):
      future = concurrent.futures.Future()
      future.set_result(batch)
      return future

  logger = make_service(tmp_path)  # Its add is the client's add.
  learner = learnerlib.Learner(
      agent, state, params_store=None,
      options=learnerlib.Options.of(agent.config), replay=Replay(),
      logger=logger, ckpt=None, counters={'version': 0})
  learner.send(learner.report(stop=lambda: False))
  record = logger.write()
  assert record['report/openloop/image_mse'] == pytest.approx(
      float(report['openloop/image_mse']))
  assert 'eval/openloop/image_mse' in record
  for prefix in ('report', 'eval'):
    gif = tmp_path / 'videos' / f'{prefix}_openloop_image_0.gif'
    # Random images have too many colours for a GIF to keep them exactly.
    assert gif_frames(gif.read_bytes()).shape == report['openloop/image'].shape
  sent = learnerlib.loggable({'a': np.float32(2), 'hist': np.arange(3),
                              'video': report['openloop/image']})
  assert sent.keys() == {'a', 'video'} and type(sent['a']) is np.float64


def test_vector_agents_report_no_video():
  agent = tiny_agent(image=False)
  state = agent.init_state(agent.init_params(0))
  report = agent.report(state, report_batch(agent))
  assert 'openloop/vector_mse' in report
  assert all(np.ndim(v) == 0 for v in report.values())
