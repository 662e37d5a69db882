"""The plotting tool: loading, binning and reference numbers by value."""

import json

import numpy as np
import pytest

from dreamer_ver.logger import plot

REFERENCE = plot.REFERENCE_DIR / 'dmc_proprio-dreamerv3.json.gz'


def write_scores(logdir, records, task='gym_CartPole-v1'):
  logdir.mkdir(parents=True, exist_ok=True)
  with (logdir / 'scores.jsonl').open('w') as f:
    for r in records:
      f.write(json.dumps({'env': 0, 'length': 1, 'time': 0.0, **r}) + '\n')
  (logdir / 'config.yaml').write_text(f'task: {task}\nseed: 0\n')
  return logdir


def test_load_scores_sorts_filters_eval_and_skips_bad_lines(tmp_path):
  logdir = write_scores(tmp_path / 'a', [
      {'step': 30, 'score': 3.0, 'eval': False},
      {'step': 10, 'score': 1.0},  # --script train writes no `eval` key
      {'step': 20, 'score': 7.0, 'eval': True},
  ])
  with (logdir / 'scores.jsonl').open('ab') as f:
    f.write(b'{"step": 50, "score": 5\xff}\n')  # a flipped byte
    f.write(b'{"step": 40, "sco')  # A line cut short by a crash.
  steps, scores = plot.load_scores(logdir)
  np.testing.assert_array_equal(steps, [10, 30])
  np.testing.assert_array_equal(scores, [1, 3])
  steps, scores = plot.load_scores(logdir / 'scores.jsonl', eval=True)
  np.testing.assert_array_equal(steps, [20])
  np.testing.assert_array_equal(scores, [7])
  assert plot.config_task(logdir) == 'gym_CartPole-v1'


def test_bin_scores_means_per_bin_and_nan_for_empty_bins():
  edges = plot.bin_edges(40, 4)  # [0, 10), [10, 20), [20, 30), [30, 40]
  np.testing.assert_array_equal(edges, [0, 10, 20, 30, 40])
  np.testing.assert_array_equal(plot.centres(edges), [5, 15, 25, 35])
  steps = [0, 9, 10, 19, 35, 40, 41]
  scores = [1, 3, 10, 20, 7, 9, 1000]  # 41 is past the last edge
  binned = plot.bin_scores(steps, scores, edges)
  np.testing.assert_allclose(binned[[0, 1, 3]], [2, 15, 8])
  assert np.isnan(binned[2])


def test_seeds_aggregate_to_mean_and_spread(tmp_path):
  a = write_scores(tmp_path / 's0', [
      {'step': s, 'score': v} for s, v in [(5, 10), (15, 20), (25, 30)]])
  b = write_scores(tmp_path / 's1', [
      {'step': s, 'score': v} for s, v in [(5, 30), (6, 50), (25, 10)]])
  edges = plot.bin_edges(30, 3)
  curves = [plot.bin_scores(*plot.load_scores(d), edges) for d in (a, b)]
  np.testing.assert_allclose(curves[1], [40, np.nan, 10])
  mean, lo, hi, count = plot.aggregate(curves, 'minmax')
  np.testing.assert_allclose(mean, [25, 20, 20])
  np.testing.assert_allclose(lo, [10, 20, 10])
  np.testing.assert_allclose(hi, [40, 20, 30])
  np.testing.assert_array_equal(count, [2, 1, 2])
  mean, lo, hi, _ = plot.aggregate(curves, 'sd')
  np.testing.assert_allclose(lo, [10, 20, 10])  # population sd: 15, 0, 10
  np.testing.assert_allclose(hi, [40, 20, 30])


def test_run_value_averages_the_window_else_interpolates():
  xs, ys = np.array([0.0, 10, 20, 100]), np.array([0.0, 10, 50, 90])
  values = plot.run_value(xs, ys, [10, 60, 200], window=10)
  np.testing.assert_allclose(values[:2], [20, 70])  # mean(0,10,50); interp
  assert np.isnan(values[2])  # past the run's last point + window


def test_table_uses_last_episodes_before_each_step(tmp_path):
  seeds = [(np.arange(1.0, 101), np.arange(1.0, 101)),  # score = step
           (np.arange(1.0, 51), np.full(50, 7.0))]      # stops at step 50
  ref = [(np.array([0.0, 100]), np.array([0.0, 100]))]
  rows = plot.table_rows(seeds, ref, [50, 100], 'T', last=10, window=0)
  mean, sd, n = rows[0]['ours']
  assert n == 2 and mean == pytest.approx((45.5 + 7) / 2)
  assert sd == pytest.approx(abs(45.5 - 7) / 2)
  assert rows[0]['ref'] == (50.0, 0.0, 1)
  assert rows[1]['ours'] == (95.5, 0.0, 1)  # seed 1 never got to step 100
  text = plot.format_table(rows, last=10, window=0)
  assert '| T | 100 | 95.5 ± 0.0 (n=1) | 100.0 ± 0.0 (n=1) |' in text


def test_reference_task_names_and_atari_frames():
  runs = [{'task': 'atari_pong', 'method': 'dreamerv3', 'seed': 0,
           'xs': [400, 800], 'ys': [-21, -20]},
          {'task': 'dmc_walker_walk', 'method': 'dreamerv3', 'seed': 0,
           'xs': [10, 20], 'ys': [1, 2]}]
  (xs, ys), = plot.reference_runs(runs, 'atari100k_pong')
  np.testing.assert_array_equal(xs, [100, 200])  # frames -> agent steps
  (xs, _), = plot.reference_runs(runs, 'dmc_walker_walk')
  np.testing.assert_array_equal(xs, [10, 20])
  assert plot.reference_runs(runs, 'dmc_cheetah_run') == []
  with pytest.raises(FileNotFoundError, match='no reference'):
    plot.reference_path('no_such_benchmark')


def test_the_atari57_reference_covers_the_57_games_in_agent_steps():
  runs = plot.load_reference('atari57')
  games = plot.reference_tasks(runs)
  assert len(games) == 57 and 'atari_pong' in games
  pong = plot.reference_runs(runs, 'atari_pong')
  assert len(pong) >= 1
  # 200M frames are 50M agent steps; Pong goes from -21 towards +21. The
  # points before a run's first episode (null in the file) are left out.
  assert max(xs[-1] for xs, _ in pong) == 50e6
  assert all(np.isfinite(ys).all() and xs[0] > 0 for xs, ys in pong)
  assert all(ys[0] < -15 and ys[-1] > 15 for _, ys in pong)


def test_dmc_proprio_reference_at_100k_steps(capsys):
  runs = plot.load_reference('dmc_proprio')
  assert plot.reference_path('dmc_proprio') == REFERENCE
  walker = plot.reference_runs(runs, 'dmc_walker_walk')
  cartpole = plot.reference_runs(runs, 'dmc_cartpole_balance')
  assert len(walker) == 5 and len(cartpole) == 5
  rows = plot.table_rows([], walker + [], [1e5], 'dmc_walker_walk')
  mean, sd, n = rows[0]['ref']
  assert 400 < mean < 650 and n == 5
  assert mean == pytest.approx(518.4, abs=0.1)  # reference/dreamerv3.md
  mean, _, _ = plot.table_rows([], cartpole, [1e5], 'c')[0]['ref']
  assert mean == pytest.approx(821.1, abs=0.1)
  # The curve rises: 10k is far below 100k, and never above 1000.
  curve, lo, hi, count = plot.reference_curve(
      cartpole, [1e4, 5e4, 1e5], window=5000)
  assert curve[0] < curve[1] < curve[2] and (hi <= 1000).all()
  assert (count == 5).all()
  # The same number from the command line, with no logdir.
  assert plot.main(['--reference', 'dmc_proprio', '--task',
                    'dmc_walker_walk', '--table', '100000']) == 0
  assert '| dmc_walker_walk | 100,000 | — | 518.4 ± 153.9 (n=5) |' in (
      capsys.readouterr().out)


def test_cli_writes_png_and_prints_table(tmp_path, capsys):
  pytest.importorskip('matplotlib')
  dirs = []
  for seed in range(3):
    rng = np.random.default_rng(seed)
    dirs.append(str(write_scores(tmp_path / f'seed{seed}', [
        {'step': int(s), 'score': float(s / 100 + rng.normal())}
        for s in range(100, 20001, 250)], task='dmc_cartpole_balance')))
  out = tmp_path / 'plot.png'
  args = [*dirs, '--bins', '8', '--out', str(out), '--table', '10000',
          '--last', '5', '--reference', 'dmc_proprio']
  assert plot.main(args) == 0
  assert out.read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
  table = capsys.readouterr().out
  assert '| dmc_cartpole_balance | 10,000 | ' in table and '(n=3)' in table
  # Default output next to the first logdir; a missing logdir is an error.
  assert plot.main([dirs[0]]) == 0
  assert (tmp_path / 'seed0' / 'scores.png').is_file()
  assert plot.main([str(tmp_path / 'missing')]) == 2
  assert plot.main([dirs[0], '--reference', str(tmp_path / 'x.json.gz')]) == 2


def test_a_short_run_shows_the_reference_over_its_first_points():
  ref = [(np.array([1e4, 2e4, 3e4, 4e4]), np.zeros(4))] * 3
  ours = [(np.array([100.0, 5000.0]), np.zeros(2))]
  assert plot.default_xmax(ours, ref) == 3e4  # its third point
  assert plot.default_xmax([(np.array([9e4]), np.zeros(1))], ref) == 9e4
  assert plot.default_xmax([], ref) == 4e4  # the reference alone: all of it


def test_several_runs_metrics_keys_and_svg_in_one_figure(tmp_path):
  pytest.importorskip('matplotlib')
  runs = {}
  for name, slope in (('a', 1.0), ('b', 2.0)):
    for seed in range(2):
      logdir = write_scores(tmp_path / f'{name}{seed}', [
          {'step': s, 'score': slope * s} for s in range(0, 1001, 100)],
          task='dmc_walker_walk')
      with (logdir / 'metrics.jsonl').open('w') as f:
        for s in range(0, 1001, 100):
          f.write(json.dumps({'step': s, 'train/loss/dyn': slope * s}) + '\n')
        f.write(json.dumps({'step': 1100, 'fps/policy': 3.0}) + '\n')
      runs.setdefault(name, []).append(str(logdir))
  drawn = []
  real = plot.draw
  plot.draw = lambda *a, **k: drawn.append(real(*a, **k)) or drawn[-1]
  try:
    out = tmp_path / 'dyn.svg'
    assert plot.main([*runs['a'], '--label', 'A', '--runs', 'B', *runs['b'],
                      '--key', 'train/loss/dyn', '--bins', '5',
                      '--out', str(out)]) == 0
  finally:
    plot.draw = real
  assert out.read_text().lstrip().startswith('<?xml')
  assert '<svg' in out.read_text()
  (fig,) = drawn
  assert fig['labels'] == ['A', 'B'] and fig['title'] == 'dmc_walker_walk'
  assert fig['xlim'] == (0.0, 1000.0)  # the key's rows only, not step 1100
  # The values by bin, per run: the mean of the two seeds.
  edges = plot.bin_edges(1000, 5)
  for logdir, slope in ((runs['a'][0], 1.0), (runs['b'][1], 2.0)):
    steps, values = plot.load_metric(logdir, 'train/loss/dyn')
    np.testing.assert_array_equal(values, slope * steps)
    binned = plot.bin_scores(steps, values, edges)
    np.testing.assert_allclose(binned, slope * np.array(
        [50, 250, 450, 650, 900]))
  # A file's title is the task beside it; mistakes are one-line errors.
  assert plot.config_task(tmp_path / 'a0' / 'scores.jsonl') == (
      'dmc_walker_walk')
  assert plot.main([runs['a'][0], '--key', 'no/such']) == 2
  assert plot.main([runs['a'][0], '--key', 'x', '--reference', 'atari57']) == 2
  assert plot.main(['--runs', 'lonely']) == 2
