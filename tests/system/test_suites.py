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
  scores = [json.loads(line) for line in (logdir / 'scores.jsonl').open()]
  if task.startswith('pinpad'):  # 20-step episodes: 2 envs finish several
    assert len(scores) >= 4 and all(s['length'] == 20 for s in scores)
  if task.startswith('loconav'):  # 30-step episodes, their coverage logged
    assert len(scores) >= 2 and all(s['length'] == 30 for s in scores)
    assert all(s['log/coverage'] >= 1 for s in scores), scores
