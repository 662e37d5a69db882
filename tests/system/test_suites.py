"""The suites without a system test of their own, end to end: a debug
`--script train` run of each trains on its frames and logs its episodes."""

import json

import pytest

from dreamer_ver import main as mainlib

SUITES = {
    'pinpad_three': ['--env.pinpad.length', '20'],
    'memmaze_9x9': [],
    'loconav_ant_maze_s': ['--env.loconav.length', '30'],
}


@pytest.mark.parametrize('task', list(SUITES))
def test_a_debug_run_trains_on_the_suite(task, tmp_path):
  if task.startswith('memmaze'):
    pytest.importorskip('memory_maze')
  if task.startswith('loconav'):
    pytest.importorskip('dm_control')
  logdir = tmp_path / task
  assert mainlib.main([
      '--script', 'train', '--configs', 'debug', '--task', task,
      '--logdir', str(logdir), '--run.steps', '120', '--run.envs', '2',
      '--run.train_ratio', '16', *SUITES[task]]) in (0, None)
  counters = json.loads((logdir / 'ckpt' / 'counters.json').read_text())
  assert counters['steps'] == 120 and counters['version'] > 0, counters
  rows = [json.loads(line) for line in (logdir / 'metrics.jsonl').open()]
  assert any('train/loss/image' in row for row in rows)  # a decoder of frames
  if task.startswith(('pinpad', 'loconav')):  # Short episodes: several end.
    scores = [json.loads(line) for line in (logdir / 'scores.jsonl').open()]
    length = {'pinpad': 20, 'loconav': 30}[task.split('_')[0]]
    assert len(scores) >= 2 and all(s['length'] == length for s in scores)
  if task.startswith('pinpad'):
    assert len(scores) >= 4
  if task.startswith('loconav'):  # Its coverage reaches scores.jsonl.
    assert all(s['log/coverage'] >= 1 for s in scores), scores
