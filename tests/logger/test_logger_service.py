"""Tests for the logger server: episodes, step counter and files, by value."""

import contextlib
import json
import threading

import numpy as np
import portal
import pytest
from PIL import Image, ImageSequence

from dreamer_ver.actor.shipping import SHIPMENT
from dreamer_ver.core.atomic import StateUnreadable
from dreamer_ver.config.loading import compose
from dreamer_ver.cluster.supervisor import USER_ERROR
from dreamer_ver.logger.service import LoggerService
from dreamer_ver.runtime import logger_process
from dreamer_ver.runtime.logger_process import serve_logger
from dreamer_ver.rpc.addresses import free_port
from dreamer_ver.cluster.signals import StopSignal
from helpers.storage import full_appends


class Clock:
  def __init__(self):
    self.now = 100.0

  def __call__(self):
    return self.now


def make_service(tmp_path, clock=None, **overrides):
  values = {'logdir': str(tmp_path), 'run.episode_timeout': 10.0,
            'run.steps': 1000}
  values.update(overrides)
  lines = []
  service = LoggerService.of(
      compose(['debug'], values), clock=clock or Clock(),
      out=lambda text, **_: lines.append(text))
  service.lines = lines
  return service


def rows(*steps):
  """steps: (envid, reward, is_first, is_last[, is_eval[, extra]]) tuples."""
  columns = {'envid': [], 'reward': [], 'is_first': [], 'is_last': [],
             'is_eval': []}
  extras = {}
  for step in steps:
    envid, reward, first, last, *rest = step
    columns['envid'].append(envid)
    columns['reward'].append(reward)
    columns['is_first'].append(first)
    columns['is_last'].append(last)
    columns['is_eval'].append(rest[0] if rest else False)
    for key, value in (rest[1] if len(rest) > 1 else {}).items():
      extras.setdefault(key, []).append(value)
  trans = {
      'envid': np.array(columns['envid'], np.int64),
      'reward': np.array(columns['reward'], np.float32),
      'is_first': np.array(columns['is_first'], bool),
      'is_last': np.array(columns['is_last'], bool),
      'is_eval': np.array(columns['is_eval'], bool),
      'is_terminal': np.zeros(len(steps), bool),
      'vector': np.zeros((len(steps), 3), np.float32),
  }
  trans.update({key: np.array(value) for key, value in extras.items()})
  return trans


def scores(tmp_path):
  path = tmp_path / 'scores.jsonl'
  if not path.exists():
    return []
  return [json.loads(line) for line in path.read_text().splitlines()]


def metrics(tmp_path):
  path = tmp_path / 'metrics.jsonl'
  return [json.loads(line) for line in path.read_text().splitlines()]


def test_interleaved_env_episodes_are_scored_separately_in_end_order(tmp_path):
  service = make_service(tmp_path)
  # Env 0: rewards 0 (reset), 1, 2, 3 -> score 6, length 3.
  # Env 1: rewards 0 (reset), 5, 5 -> score 10, length 2; ends first.
  service.transitions(rows((0, 0.0, True, False), (1, 0.0, True, False)))
  service.transitions(rows((1, 5.0, False, False), (0, 1.0, False, False)))
  service.transitions(rows((0, 2.0, False, False)))
  service.transitions(rows((1, 5.0, False, True), (0, 3.0, False, True)))
  assert service.step == 7 and service.episodes == 2
  lines = scores(tmp_path)
  assert [(s['env'], s['score'], s['length'], s['eval'], s['step'])
          for s in lines] == [(1, 10.0, 2, False, 6), (0, 6.0, 3, False, 7)]
  assert all(isinstance(s['time'], float) for s in lines)
  record = service.write()
  assert record['step'] == 7
  assert record['episode/score'] == 8.0 and record['episode/length'] == 2.5
  assert record['parallel/ep_starts'] == 2 and record['parallel/ep_ends'] == 2
  assert 'eval_episode/score' not in record
  assert metrics(tmp_path) == [record]


def test_eval_episodes_are_logged_separately(tmp_path):
  service = make_service(tmp_path)
  service.transitions(rows((5, 0.0, True, False, True), (0, 0.0, True, False)))
  service.transitions(
      rows((5, 2.5, False, False, True), (0, 1.0, False, False)))
  service.transitions(rows((5, 2.5, False, True, True)))
  assert service.step == 2  # Eval rows are not env steps.
  record = service.write()
  assert record['eval_episode/score'] == 5.0
  assert record['eval_episode/length'] == 2
  assert 'episode/score' not in record
  assert scores(tmp_path) == [{**scores(tmp_path)[0], 'step': 2, 'env': 5,
                               'score': 5.0, 'length': 2, 'eval': True}]
  assert service.episodes == 0
  assert 'eval score 5.00' in service.lines[-1]


def test_rows_the_actor_could_not_send_count_as_steps_and_holes(tmp_path):
  service = make_service(tmp_path)
  service.transitions(rows((0, 0.0, True, False), (1, 0.0, True, False),
                    (5, 0.0, True, False, True)))
  # The actor's link dropped a batch with a step of env 0 and of eval env 5:
  # the next rows say so. Env 0's steps still count; its episode and eval
  # env 5's have a hole and are not logged. Env 1 is untouched.
  service.transitions(rows((0, 1.0, False, False, False, {'missed': 1}),
                    (1, 1.0, False, False, False, {'missed': 0}),
                    (5, 1.0, False, False, True, {'missed': 1})))
  assert service.step == 2 + 2 + 1
  service.transitions(rows((0, 1.0, False, True), (1, 1.0, False, True),
                    (5, 1.0, False, True, True)))
  assert [(s['env'], s['score']) for s in scores(tmp_path)] == [(1, 2.0)]
  assert service.write()['parallel/ep_gap'] == 2
  # After the hole, the env's next episode is logged as usual.
  service.transitions(rows((0, 0.0, True, False)))
  service.transitions(rows((0, 4.0, False, True)))
  assert scores(tmp_path)[-1]['env'] == 0 and scores(tmp_path)[-1]['score'] == 4.0
  with pytest.raises(ValueError, match="'missed' must be non-negative"):
    service.transitions(rows((0, 0.0, True, False, False, {'missed': -1})))


def test_abandoned_half_episode_is_counted_not_logged(tmp_path):
  service = make_service(tmp_path)
  service.transitions(rows((0, 0.0, True, False), (0, 7.0, False, False)))
  # The env restarted without an is_last: the half episode is dropped.
  service.transitions(rows((0, 0.0, True, False), (0, 1.0, False, False)))
  service.transitions(rows((0, 1.0, False, True)))
  assert [(s['score'], s['length']) for s in scores(tmp_path)] == [(2.0, 2)]
  record = service.write()
  assert record['parallel/ep_abandoned'] == 1
  assert record['episode/score'] == 2.0
  assert service.step == 5


def test_episode_without_a_seen_start_is_not_logged(tmp_path):
  clock = Clock()
  service = make_service(tmp_path, clock)
  # Mid-episode rows (the logger restarted): ignored for episodes, counted
  # as steps.
  service.transitions(rows((3, 4.0, False, False), (3, 4.0, False, True)))
  # Env 4 goes silent longer than the timeout while env 0 steps on: its
  # episode is dropped.
  service.transitions(rows((4, 0.0, True, False), (4, 1.0, False, False)))
  clock.now += 6
  service.transitions(rows((0, 0.0, True, False)))
  clock.now += 5
  service.transitions(rows((0, 0.0, False, False)))
  clock.now += 1
  service.transitions(rows((4, 1.0, False, True)))
  assert scores(tmp_path) == []
  assert service.step == 7
  record = service.write()
  assert record['parallel/ep_timeout'] == 1
  assert 'episode/score' not in record


def test_a_pause_of_the_whole_run_drops_no_open_episode(tmp_path):
  """Nothing arrived for longer than the timeout (the run SIGSTOPped and
  continued, its machine suspended, its actor restarting): no env was
  silent while others stepped, so every open episode goes on."""
  clock = Clock()
  service = make_service(tmp_path, clock)
  service.transitions(rows((0, 0.0, True, False), (1, 0.0, True, False)))
  clock.now += 1000
  service.write()  # The logger's clock comes first after the pause.
  service.transitions(rows((0, 2.0, False, True)))
  service.transitions(rows((1, 3.0, False, True)))
  assert [(s['env'], s['score']) for s in scores(tmp_path)] == [
      (0, 2.0), (1, 3.0)]
  # Silent for 11 s while env 0 steps on: dropped.
  service.transitions(rows((1, 0.0, True, False)))
  clock.now += 6
  service.transitions(rows((0, 0.0, True, False)))
  clock.now += 5
  service.transitions(rows((0, 0.0, False, False)))
  assert service.write()['parallel/ep_timeout'] == 1


def test_log_keys_averaged_per_episode(tmp_path):
  service = make_service(tmp_path)
  service.transitions(rows(
      (0, 0.0, True, False, False, {'log/speed': 1.0, 'log/img': [1, 2]}),
      (0, 0.0, False, False, False, {'log/speed': 2.0, 'log/img': [1, 2]})))
  service.transitions(rows(
      (0, 0.0, False, True, False, {'log/speed': 6.0, 'log/img': [1, 2]})))
  service.transitions(rows(
      (1, 0.0, True, False, False, {'log/speed': 5.0, 'log/img': [1, 2]}),
      (1, 0.0, False, True, False, {'log/speed': 5.0, 'log/img': [1, 2]})))
  record = service.write()
  assert record['epstats/log/speed'] == 4.0  # Mean of 3 and 5.
  assert not any('img' in key for key in record)


def test_metrics_averaged_until_write(tmp_path):
  service = make_service(tmp_path)
  assert service.write() is None  # Nothing new, step unchanged.
  service.add({'train/loss': np.float32(2.0), 'fps/train': 50.0,
               'timer/agent': 'text summary', 'hist': np.arange(3)})
  service.add({'train/loss': 4, 'replay/items': np.array(7)})
  record = service.write()
  assert record == {'step': 0, 'train/loss': 3.0, 'fps/train': 50.0,
                    'replay/items': 7.0}
  assert service.write() is None
  service.transitions(rows((0, 0.0, True, False)))
  service.add({'fps/train': 50.0})
  assert service.write() == {'step': 1, 'parallel/ep_starts': 1,
                             'fps/train': 50.0}
  assert [line['step'] for line in metrics(tmp_path)] == [0, 1]
  assert len(service.lines) == 1  # No progress line at step 0.
  assert '50.0 replayed steps/s' in service.lines[0]
  assert 'fps/train 50' in service.lines[0]  # Matches logger.filter.


def frame(value, shape=(4, 6, 3)):
  """A frame with a pattern (to catch a transposition) that differs per
  value; few colours, so a GIF keeps it exactly."""
  pattern = np.arange(np.prod(shape)).reshape(shape) % 5 * 30
  return (pattern + value).astype(np.uint8)


def gif_frames(path):
  """The frames of a GIF file, as uint8 RGB [T, H, W, 3]."""
  with Image.open(path) as image:
    return np.stack([np.asarray(f.convert('RGB'))
                     for f in ImageSequence.Iterator(image)])


def videos(tmp_path):
  return sorted(p.name for p in (tmp_path / 'videos').glob('*.gif'))


def test_an_eval_episode_comes_back_frame_for_frame(tmp_path):
  service = make_service(tmp_path)
  image = lambda t: {'log/image': frame(t)}
  # The eval env (5) is recorded, not the train env (0) beside it.
  service.transitions(rows((0, 0.0, True, False, False, image(100)),
                    (5, 0.0, True, False, True, image(0))))
  service.transitions(rows((5, 1.0, False, False, True, image(1)),
                    (0, 1.0, False, False, False, image(101))))
  service.transitions(rows((5, 1.0, False, True, True, image(2)),
                    (0, 1.0, False, True, False, image(102))))
  assert service.write()['eval_episode/score'] == 2.0
  assert videos(tmp_path) == ['eval_episode_log_image_3.gif']
  np.testing.assert_array_equal(
      gif_frames(tmp_path / 'videos' / 'eval_episode_log_image_3.gif'),
      np.stack([frame(t) for t in range(3)]))


def test_one_episode_at_a_time_at_most_every_video_every(tmp_path):
  clock = Clock()
  service = make_service(tmp_path, clock, **{
      'logger.video_every': 60.0, 'logger.video_length': 2})
  image = lambda t: {'image': frame(t)}  # An image observation counts too.
  # No eval row has arrived: a train episode is recorded; the second env's
  # episode, which starts while it runs, is not.
  service.transitions(rows((0, 0.0, True, False, False, image(0)),
                    (1, 0.0, True, False, False, image(50))))
  service.transitions(rows((0, 0.0, False, False, False, image(1)),
                    (1, 0.0, False, True, False, image(51))))
  service.transitions(rows((0, 0.0, False, True, False, image(2))))
  service.write()
  assert videos(tmp_path) == ['episode_image_5.gif']
  # Only the first video_length frames are kept.
  np.testing.assert_array_equal(
      gif_frames(tmp_path / 'videos' / 'episode_image_5.gif'),
      np.stack([frame(0), frame(1)]))
  # From now on only eval episodes, and not before 60 s have passed.
  clock.now += 59
  service.transitions(rows((5, 0.0, True, False, True, image(10)),
                    (5, 0.0, False, True, True, image(11))))
  clock.now += 1
  service.transitions(rows((0, 0.0, True, False, False, image(20)),
                    (0, 0.0, False, True, False, image(21))))
  service.transitions(rows((5, 0.0, True, False, True, image(30))))
  # That recording is cut by a new is_first: no video, and the episode
  # that starts next is recorded at once.
  service.transitions(rows((5, 0.0, True, False, True, image(40)),
                    (5, 0.0, False, True, True, image(41))))
  service.write()
  assert videos(tmp_path) == ['episode_image_5.gif',
                              'eval_episode_image_7.gif']
  np.testing.assert_array_equal(
      gif_frames(tmp_path / 'videos' / 'eval_episode_image_7.gif'),
      np.stack([frame(40), frame(41)]))


def test_no_episode_videos_when_video_every_is_not_positive(tmp_path):
  service = make_service(tmp_path, **{'logger.video_every': 0.0})
  service.transitions(rows((0, 0.0, True, False, False, {'image': frame(0)}),
                    (0, 0.0, False, True, False, {'image': frame(1)})))
  service.write()
  assert videos(tmp_path) == []


def test_add_takes_videos_and_writes_them_as_gifs(tmp_path):
  service = make_service(tmp_path)
  video = np.stack([frame(t, (6, 8, 3)) for t in range(5)])
  # Only the newest video per key is written.
  service.add({'report/openloop/image': video[:2]})
  service.add({'report/openloop/image': video, 'report/loss': 1.0,
               'not_a_video': np.zeros((5, 6, 8, 3), np.float32),
               'not_frames': np.zeros((5, 6, 8), np.uint8)})
  assert service.write() == {'step': 0, 'report/loss': 1.0}
  assert service.write() is None
  service.add({'eval/openloop/image': video[:3]})
  assert service.write() == {'step': 0}  # A video alone is news.
  assert [line['step'] for line in metrics(tmp_path)] == [0, 0]
  assert videos(tmp_path) == ['eval_openloop_image_0.gif',
                              'report_openloop_image_0.gif']
  np.testing.assert_array_equal(
      gif_frames(tmp_path / 'videos' / 'report_openloop_image_0.gif'), video)
  np.testing.assert_array_equal(
      gif_frames(tmp_path / 'videos' / 'eval_openloop_image_0.gif'),
      video[:3])


def test_metrics_and_scores_files_are_always_written(tmp_path):
  # jsonl is implied: the files come without it being named.
  service = make_service(tmp_path, **{'logger.outputs': ['tensorboard']})
  service.transitions(rows((0, 0.0, True, False), (0, 1.0, False, True)))
  assert service.write()['episode/score'] == 1.0
  service.close()
  assert metrics(tmp_path)[0]['episode/score'] == 1.0
  assert scores(tmp_path)[0]['score'] == 1.0


def test_progress_line_has_rate_and_eta(tmp_path):
  clock = Clock()
  service = make_service(tmp_path, clock, **{'run.steps': 1000})
  service.transitions(rows(*[(i, 0.0, True, False) for i in range(10)]))
  clock.now += 2.0
  service.write()
  first = service.lines[-1].splitlines()[0]
  # 10 steps in 2 s: 5 steps/s, 990 steps left -> 198 s.
  assert 'step 10 ' in first and '5.0 env steps/s' in first
  assert 'ETA 0:03:18' in first


def test_no_progress_line_before_the_first_env_step(tmp_path):
  """While the agent compiles, metrics arrive but no env step: the files
  get them, the terminal gets no 'step 0' line."""
  service = make_service(tmp_path)
  service.add({'replay/items': 0})
  assert service.write() == {'step': 0, 'replay/items': 0}
  assert service.lines == []
  service.transitions(rows((0, 0.0, True, False), (0, 1.0, False, False)))
  service.write()
  assert len(service.lines) == 1 and 'step 2 ' in service.lines[0]
  service.close()


def test_a_run_ends_with_its_summary(tmp_path):
  from dreamer_ver.logger.summary import summary
  (tmp_path / 'ckpt').mkdir()
  (tmp_path / 'ckpt' / 'logger.json').write_text('{"step": 12345}')
  (tmp_path / 'scores.jsonl').write_text(
      '{"score": 3.5, "eval": false}\n{"score": 7.25, "eval": true}\n'
      '{"score": 4.0, "eval": false}\n{"score": 9')  # A line cut by a kill.
  text = summary(tmp_path, 3725)
  assert text.splitlines()[0] == (
      'Run ended at env step 12_345 after 1:02:05; last train score 4.00, '
      'last eval score 7.25.')
  assert f'python -m dreamer_ver.logger.plot {tmp_path}' in text
  assert 'run the same command again' in text
  assert 'no episode finished yet' in summary(tmp_path / 'empty', 1)
  # Stopped at start by a mistake (exit code 2): one line, no resume hint
  # (the same command would fail the same way until it is fixed).
  assert summary(tmp_path / 'empty', 20, code=2) == (
      'Run stopped before it started (exit code 2): fix what the error '
      'above names, then run the same command again.')
  # Stopped later (a full disk): one line naming the last save's step.
  assert summary(tmp_path, 20, code=2) == (
      'Run stopped (exit code 2); its last save was at env step 12_345: fix '
      'what the error above names, then run the same command again to '
      'resume.')
  # ... and the step the run reached, where the logger could not save it.
  assert summary(tmp_path, 20, code=2, reached=13000) == (
      'Run stopped at env step 13_000 (exit code 2); its last save was at '
      'env step 12_345: fix what the error above names, then run the same '
      'command again to resume.')
  assert summary(tmp_path / 'empty', 20, code=2, reached=600).startswith(
      'Run stopped at env step 600 (exit code 2); its last save was at env '
      'step 0: ')


def test_malformed_tran_raises_and_changes_nothing(tmp_path):
  service = make_service(tmp_path)
  service.transitions(rows((0, 0.0, True, False)))
  bad = rows((0, 1.0, False, False), (1, 0.0, True, False))
  bad['reward'] = bad['reward'][:1]
  with pytest.raises(ValueError, match=r"'reward': expected leading dim N=2"):
    service.transitions(bad)
  bad = rows((0, 1.0, False, True))
  del bad['is_last']
  with pytest.raises(ValueError, match=r"missing keys \['is_last'\]"):
    service.transitions(bad)
  assert service.step == 1
  service.transitions(rows((0, 1.0, False, True)))
  assert [s['score'] for s in scores(tmp_path)] == [1.0]


def test_step_counter_resumes_after_save_and_load(tmp_path):
  service = make_service(tmp_path)
  service.transitions(rows((0, 0.0, True, False), (0, 1.0, False, True),
                    (1, 0.0, True, False, True), (1, 0.0, False, True, True)))
  service.save()
  assert json.loads((tmp_path / 'ckpt' / 'logger.json').read_text()) == {
      'step': 2, 'episodes': 1, 'eval_episodes': 1, 'shipments': {}}
  restored = make_service(tmp_path)
  assert restored.load()
  assert restored.step == 2 and restored.episodes == 1
  restored.transitions(rows((0, 0.0, True, False)))
  assert restored.write()['step'] == 3
  assert not make_service(tmp_path / 'fresh').load()


def shipped(trans, seq, sender=7):
  """The batch as the actor's Shipper sends it: with a shipment id."""
  return {**trans, SHIPMENT: np.array([sender, seq], np.int64)}


def test_a_resent_shipment_is_counted_once(tmp_path):
  """The actor's link resends its calls in flight after a reconnect, so a
  batch the logger counted can come again, with the same shipment id."""
  service = make_service(tmp_path)
  first = shipped(rows((0, 0.0, True, False), (1, 0.0, True, False)), 0)
  second = shipped(rows((0, 2.0, False, True), (1, 1.0, False, False)), 1)
  for batch in (first, second, first, second):
    assert service.transitions(batch) == {}
  assert service.step == 4
  assert [(s['env'], s['score']) for s in scores(tmp_path)] == [(0, 2.0)]
  # Another sender numbers its shipments from 0 too.
  service.transitions(shipped(rows((1, 3.0, False, True)), 0, sender=8))
  assert service.step == 5 and service.episodes == 2
  with pytest.raises(ValueError, match="'shipment' must be an int array"):
    service.transitions({**rows((2, 0.0, True, False)),
                  SHIPMENT: np.zeros(3, np.int64)})
  assert service.step == 5

  service.save()
  assert json.loads((tmp_path / 'ckpt' / 'logger.json').read_text())[
      'shipments'] == {'7': 1, '8': 0}
  restored = make_service(tmp_path)
  assert restored.load()
  assert restored.transitions(second) == {}  # Counted before the save.
  assert restored.step == 5
  restored.transitions(shipped(
      rows((0, 0.0, True, False), (0, 4.0, False, True)), 2))
  assert restored.step == 7 and restored.episodes == 3
  assert [(s['env'], s['score']) for s in scores(tmp_path)] == [
      (0, 2.0), (1, 4.0), (0, 4.0)]


@contextlib.contextmanager
def serving(tmp_path, every):
  """`serve_logger` in a thread, writing and saving `every` seconds: yields
  a connected client and the exit codes (one once it stopped), stopped
  at the end."""
  port = free_port()
  config = compose(['debug'], {
      'logdir': str(tmp_path), 'run.logger_addr': f'127.0.0.1:{port}',
      'run.log_every': every, 'run.save_every': every})
  stop = StopSignal(install=False)
  result = []
  thread = threading.Thread(
      target=lambda: result.append(serve_logger(config, stop)), daemon=True)
  thread.start()
  client = portal.Client(f'127.0.0.1:{port}', 'TestLogger')
  try:
    assert client.connect(timeout=15)
    yield client, result
  finally:
    client.close(timeout=2)
    stop.set()
    thread.join(timeout=15)


@pytest.mark.filterwarnings('ignore:Using Portal from plain Python threads')
def test_server_round_trip_and_stop(tmp_path):
  with serving(tmp_path, 0.5) as (client, result):
    assert client.transitions(rows((0, 0.0, True, False), (0, 2.0, False, True))
                       ).result(10) == {}
    assert client.add({'fps/train': 3.0}).result(10) == {}
    with pytest.raises(RuntimeError, match='missing keys'):
      client.transitions({'envid': np.zeros(1, np.int64)}).result(10)
    assert client.transitions(rows((1, 0.0, True, False))).result(10) == {}
    # Upstream DreamerV3's actor: `tran`, with its obs, acts and log/ keys.
    upstream = rows((1, 5.0, False, True, False, {
        'log/speed': np.float32(2.0), 'action': np.zeros(2, np.float32)}))
    assert client.tran(upstream).result(10) == {}
  assert result == [0]
  lines = metrics(tmp_path)
  assert lines[-1]['step'] == 4
  assert any(line.get('episode/score') for line in lines)
  assert any(line.get('fps/train') == 3.0 for line in lines)
  assert json.loads((tmp_path / 'ckpt' / 'logger.json').read_text())[
      'step'] == 4
  assert [s['score'] for s in scores(tmp_path)] == [2.0, 5.0]


@pytest.mark.filterwarnings('ignore:Using Portal from plain Python threads')
def test_a_full_disk_met_by_a_scored_episode_is_said_once_and_stops_the_run(
    tmp_path, monkeypatch, capfd):
  """An episode's score line that the disk refuses, inside a `transitions`
  call: each caller gets a StorageFault, and the run's stop is asked once
  (its supervisor stops the run in order, so batches keep coming until
  then), not a line per refused batch; the logger exits with code 2."""
  full_appends(monkeypatch)
  asked = []  # The supervisor's part: it stops the logger last, later.
  monkeypatch.setattr(logger_process, 'stop_for_storage',
                      lambda role, fault, stop, step: asked.append(
                          (role, str(fault), step)))
  # No periodic write before the batches.
  with serving(tmp_path, 600) as (client, result):
    for envid in range(3):
      with pytest.raises(RuntimeError, match='StorageFault: no space left'):
        client.transitions(rows(
            (envid, 0.0, True, False), (envid, 1.0, False, True))).result(10)
  assert result == [USER_ERROR]
  assert len(asked) == 1 and asked[0][0] == 'logger', asked
  assert asked[0][1].startswith(
      f'no space left on device writing {tmp_path / "scores.jsonl"} ('), asked
  assert asked[0][2] == 2  # The first batch's two steps; not saved.
  out, err = capfd.readouterr()
  assert 'no space left' not in (out + err).lower(), out + err
  assert not (tmp_path / 'ckpt' / 'logger.json').exists()


def test_a_damaged_logger_json_at_start_is_one_line_naming_it(tmp_path):
  service = make_service(tmp_path)
  service.transitions(rows((0, 0.0, True, False)))
  service.save()
  path = tmp_path / 'ckpt' / 'logger.json'
  path.write_text(path.read_text()[:5])  # a partial copy
  with pytest.raises(StateUnreadable, match=(
      rf"^{path} cannot be read \(JSONDecodeError: .*move it away to start "
      r"the logger's step and episode counts afresh\.$")):
    make_service(tmp_path).load()
