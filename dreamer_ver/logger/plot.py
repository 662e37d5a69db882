"""Score curves: ours (mean and spread across seeds) next to DreamerV3's.

    python -m dreamer_ver.logger.plot LOGDIR [LOGDIR ...] [--reference dmc_proprio]
        [--runs LABEL LOGDIR [LOGDIR ...]] [--key METRIC]
        [--task T] [--out FILE.png|.svg] [--bins N] [--eval] [--spread minmax|sd]
        [--xmax STEPS] [--target SCORE] [--table STEPS ...] [--last N]
        [--window STEPS] [--ref_xscale F] [--title T] [--label L] [--xlabel X]
    python -m dreamer_ver.logger.plot --reference dmc_proprio --task dmc_walker_walk
        --table 100000 [--out FILE.png]      (the reference alone)

Each LOGDIR is one seed of the same run (a logdir holding `scores.jsonl`, or a
`scores.jsonl`-style file itself). Only finished episodes are read: train
episodes by default, eval episodes with `--eval` (records without an `eval`
key, as `--script train` writes them, count as train episodes). `--key K`
reads the values of K in each logdir's `metrics.jsonl` instead (any scalar
the run logs, e.g. `train/loss/dyn`). `--runs LABEL LOGDIR ...` adds
another run or method (its own seeds) to the same figure, in its own colour.

The curve: env steps from 0 to `--xmax` (default: the largest step of any
seed, and with a reference at least its third point) are cut into `--bins` equal bins; each seed's value in a bin is the
mean score of the episodes that ended in it (empty bins are left out, not
drawn as zero); the line is the mean over the seeds that have a value, the
band their min..max (`--spread minmax`, default) or mean ± sd (`--spread sd`,
population sd over seeds).

The reference (`--reference NAME` reads DreamerV3's published
`NAME-dreamerv3.json.gz`, package data in `dreamer_ver/reference/`; a path
works too) is a gzip JSON list of runs {task, method, seed, xs, ys}. The
runs whose `task` equals `--task` (default: `task` in the first logdir's
`config.yaml`; `atari100k_<game>` matches the reference's `atari_<game>`)
are put on the same bin centres, each run's value at a centre being the
mean of its points within the bin (the linear interpolation of its points
where a bin has none), then averaged over seeds with the same spread rule.
Atari reference x values are frames (4 per agent step); they are divided by
4 so that both curves count agent steps (`--ref_xscale` overrides this).
`--target SCORE` draws a dotted line.

`--table S1 S2 ...` prints one markdown table row per step S: our score is,
per seed, the mean of the last `--last` (default 20) episodes that ended at
or before S (seeds whose scores stop before S are left out, as they never got
there), then mean ± sd over seeds; the reference is, per reference run, the
mean of its points with S - window <= x <= S + window (`--window`, default
10000, which reproduces the @100k numbers in `reference/dreamerv3.md`;
interpolated where a run has no point there), then mean ± sd over runs.
All sds are population sds (ddof 0), as in those notes.

Only `draw` needs matplotlib (the `plot` extra); the rest is pure.
"""

import argparse
import importlib.resources
import json
import sys
from pathlib import Path

import elements
import numpy as np

# DreamerV3's published scores (MIT, from danijar/dreamerv3's scores/),
# shipped as package data.
REFERENCE_DIR = importlib.resources.files('dreamer_ver') / 'reference'
# Reference x units per agent step, by the reference task's suite.
REF_XUNITS = {'atari': 4.0}


# ---------------------------------------------------------------- loading

def series_path(path, key=None):
  """The file a logdir's curve comes from (`scores.jsonl`, or with a
  metrics `key` `metrics.jsonl`); a file is itself."""
  path = Path(path)
  if not path.is_dir():
    return path
  return path / ('metrics.jsonl' if key else 'scores.jsonl')


def load_scores(path, eval=False):
  """(steps, scores) as float arrays, sorted by step, of the finished
  episodes in a logdir's `scores.jsonl` (or that file): train episodes, or
  eval episodes with `eval=True`. Blank or truncated lines are skipped."""
  steps, scores = [], []
  with series_path(path).open(errors='replace') as f:  # a flipped byte
    for line in f:
      line = line.strip()
      if not line:
        continue
      try:
        record = json.loads(line)
      except json.JSONDecodeError:
        continue  # A line cut short by a crash mid-write.
      if bool(record.get('eval', False)) != bool(eval):
        continue
      steps.append(float(record['step']))
      scores.append(float(record['score']))
  order = np.argsort(steps, kind='stable')
  return np.asarray(steps)[order], np.asarray(scores)[order]


def load_metric(path, key):
  """(steps, values) of `key` in a logdir's `metrics.jsonl` (or that
  file), sorted by step; rows without the key are skipped."""
  steps, values = [], []
  with series_path(path, key).open(errors='replace') as f:
    for line in f:
      try:
        record = json.loads(line)
      except json.JSONDecodeError:
        continue  # Blank, or cut short by a crash mid-write.
      if isinstance(record.get(key), (int, float)) and 'step' in record:
        steps.append(float(record['step']))
        values.append(float(record[key]))
  order = np.argsort(steps, kind='stable')
  return np.asarray(steps)[order], np.asarray(values)[order]


def config_task(logdir):
  """The `task` in `logdir/config.yaml` (for a file: beside it), or None."""
  logdir = Path(logdir)
  path = (logdir if logdir.is_dir() else logdir.parent) / 'config.yaml'
  if not path.is_file():
    return None
  from ruamel.yaml import YAML
  config = YAML(typ='safe').load(path.read_text())
  return (config or {}).get('task')


def reference_path(name):
  """The reference file for `name`: an existing path, else the packaged
  `reference/<name>-dreamerv3.json.gz` or `reference/<name>`."""
  candidates = [Path(name), REFERENCE_DIR / f'{name}-dreamerv3.json.gz',
                REFERENCE_DIR / name]
  for path in candidates:
    if path.is_file():
      return path
  known = sorted(p.name.split('-dreamerv3')[0] for p in REFERENCE_DIR.iterdir()
                 if p.name.endswith('-dreamerv3.json.gz'))
  raise FileNotFoundError(
      f"no reference '{name}' (looked for {candidates[1]}); known: "
      f"{', '.join(known) or 'none'}")


def load_reference(name):
  """The list of reference runs {task, method, seed, xs, ys}."""
  return elements.plotting.load(reference_path(name))


def reference_task(task):
  """The reference's name for our task: atari100k_<game> -> atari_<game>."""
  suite, _, rest = task.partition('_')
  return f'atari_{rest}' if suite == 'atari100k' else task


def reference_runs(runs, task, xscale=None):
  """[(xs, ys)] of the runs for `task`, xs divided by the reference's x units
  per agent step (4 frames for Atari) unless `xscale` (a factor applied to
  xs) is given."""
  name = reference_task(task)
  if xscale is None:
    xscale = 1.0 / REF_XUNITS.get(name.partition('_')[0], 1.0)
  picked = []
  for run in runs:
    if run['task'] == name:
      xs = np.asarray(run['xs'], float) * xscale
      ys = np.asarray(run['ys'], float)  # null (no episode yet) -> nan
      xs, ys = xs[np.isfinite(ys)], ys[np.isfinite(ys)]
      order = np.argsort(xs, kind='stable')
      picked.append((xs[order], ys[order]))
  return picked


def reference_tasks(runs):
  return sorted({run['task'] for run in runs})


# ---------------------------------------------------------------- binning

def default_xmax(seeds, ref_runs):
  """The last step shown: the largest of any seed, and with a reference at
  least its runs' third point, so that a short run still shows the
  reference as a line."""
  xmax = max((s[-1] for s, _ in seeds if len(s)), default=0.0)
  if ref_runs and not seeds:
    return max(xs[-1] for xs, _ in ref_runs)
  if ref_runs:
    third = [xs[min(2, len(xs) - 1)] for xs, _ in ref_runs if len(xs)]
    xmax = max(xmax, float(np.median(third)))
  return xmax


def bin_edges(xmax, bins):
  """`bins` equal bins covering [0, xmax]."""
  xmax = float(xmax)
  if not xmax > 0:
    raise ValueError(f'xmax must be > 0, got {xmax}')
  return np.linspace(0.0, xmax, int(bins) + 1)


def bin_scores(steps, scores, edges):
  """Mean score per bin, NaN for bins without episodes. Bin k holds the
  episodes with edges[k] <= step < edges[k+1] (the last bin includes its
  right edge); episodes outside the edges are ignored. (Not
  `elements.plotting.binning`: it counts an episode on an edge in both
  bins.)"""
  steps, scores = np.asarray(steps, float), np.asarray(scores, float)
  nbins = len(edges) - 1
  index = np.searchsorted(edges, steps, side='right') - 1
  index[steps == edges[-1]] = nbins - 1
  inside = (index >= 0) & (index < nbins)
  sums = np.bincount(index[inside], scores[inside], minlength=nbins)
  counts = np.bincount(index[inside], minlength=nbins)
  with np.errstate(invalid='ignore', divide='ignore'):
    return np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)


def centres(edges):
  edges = np.asarray(edges, float)
  return (edges[:-1] + edges[1:]) / 2


def aggregate(curves, spread='minmax'):
  """(mean, lo, hi, count) over seeds (rows of `curves`), ignoring NaNs;
  lo..hi is min..max or mean -/+ population sd. NaN where no seed has a
  value."""
  curves = np.atleast_2d(np.asarray(curves, float))
  count = np.sum(~np.isnan(curves), axis=0)
  mean = np.full(curves.shape[1], np.nan)
  lo, hi = mean.copy(), mean.copy()
  has = count > 0
  if has.any():
    part = curves[:, has]
    mean[has] = np.nanmean(part, axis=0)
    if spread == 'minmax':
      lo[has], hi[has] = np.nanmin(part, axis=0), np.nanmax(part, axis=0)
    elif spread == 'sd':
      sd = np.nanstd(part, axis=0)
      lo[has], hi[has] = mean[has] - sd, mean[has] + sd
    else:
      raise ValueError(f"spread must be 'minmax' or 'sd', got '{spread}'")
  return mean, lo, hi, count


def run_value(xs, ys, at, window):
  """One run's values at the steps `at`: the mean of its points with
  at - window <= x <= at + window, or the linear interpolation of its points
  where there is none; NaN outside [xs[0] - window, xs[-1] + window]."""
  xs, ys = np.asarray(xs, float), np.asarray(ys, float)
  at = np.atleast_1d(np.asarray(at, float))
  out = np.full(at.shape, np.nan)
  if not len(xs):
    return out
  lo = np.searchsorted(xs, at - window, side='left')
  hi = np.searchsorted(xs, at + window, side='right')
  cumsum = np.concatenate([[0.0], np.cumsum(ys)])
  counts = hi - lo
  with np.errstate(invalid='ignore', divide='ignore'):
    means = (cumsum[hi] - cumsum[lo]) / counts
  interp = np.interp(at, xs, ys)
  out = np.where(counts > 0, means, interp)
  outside = (at < xs[0] - window) | (at > xs[-1] + window)
  out[outside] = np.nan
  return out


def reference_curve(runs, at, window, spread='minmax'):
  """(mean, lo, hi, count) of the reference runs [(xs, ys)] at `at`."""
  if not runs:
    nan = np.full(len(np.atleast_1d(at)), np.nan)
    return nan, nan, nan, np.zeros(len(nan), int)
  return aggregate([run_value(xs, ys, at, window) for xs, ys in runs], spread)


def last_mean(steps, scores, step, last=20):
  """Mean of the last `last` episodes that ended at or before `step`; NaN if
  the scores stop before `step` (the run never got there) or none ended."""
  steps, scores = np.asarray(steps, float), np.asarray(scores, float)
  if not len(steps) or steps[-1] < step:
    return np.nan
  upto = scores[steps <= step]
  return float(np.mean(upto[-last:])) if len(upto) else np.nan


def mean_sd(values):
  """(mean, population sd, count) over the non-NaN values."""
  values = np.asarray(values, float)
  values = values[~np.isnan(values)]
  if not len(values):
    return np.nan, np.nan, 0
  return float(values.mean()), float(values.std()), len(values)


def table_rows(seeds, ref_runs, steps, task, last=20, window=10000):
  """One dict per step: ours (mean, sd, n) and the reference's."""
  rows = []
  for step in steps:
    ours = mean_sd([last_mean(s, y, step, last) for s, y in seeds])
    ref = mean_sd([run_value(xs, ys, step, window)[0] for xs, ys in ref_runs])
    rows.append({'task': task, 'step': int(step), 'ours': ours, 'ref': ref})
  return rows


def format_table(rows, last=20, window=10000):
  def cell(mean, sd, n):
    return '—' if n == 0 else f'{mean:.1f} ± {sd:.1f} (n={n})'
  lines = [
      f'| task | env steps | ours: mean ± sd over seeds (last {last} '
      f'episodes) | reference: mean ± sd over runs (±{window:g} steps) |',
      '| --- | ---: | ---: | ---: |']
  for row in rows:
    lines.append(f"| {row['task']} | {row['step']:,} | {cell(*row['ours'])} "
                 f"| {cell(*row['ref'])} |")
  return '\n'.join(lines)


# ---------------------------------------------------------------- drawing

COLORS = ('tab:blue', 'tab:orange', 'tab:green', 'tab:red', 'tab:purple',
          'tab:brown', 'tab:pink', 'tab:olive')


def draw(path, x, groups, ref=None, title='', ref_label='DreamerV3',
         xmax=None, target=None, ylabel='episode return', xlabel='env steps'):
  """Writes the figure (PNG, SVG or PDF by `path`'s suffix). `groups` is
  [(label, seeds, (mean, lo, hi, count))], one colour each: its per-seed
  curves drawn thin, its mean thick with the band; `ref` the reference's
  (mean, lo, hi, count) on `x`; `target` a score drawn as a dotted line.
  Returns what it drew: {'xlim', 'title', 'labels'}."""
  import matplotlib
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(6.4, 4.0), dpi=120)
  if ref is not None:
    mean, lo, hi, _ = ref
    ax.plot(x, mean, color='tab:gray', ls='--', lw=1.5, label=ref_label)
    ax.fill_between(x, lo, hi, color='tab:gray', alpha=0.2, lw=0)
  for (label, seeds, (mean, lo, hi, _)), color in zip(
      groups, COLORS * (1 + len(groups) // len(COLORS))):
    if len(seeds) > 1:
      for curve in seeds:
        keep = ~np.isnan(curve)
        ax.plot(x[keep], curve[keep], color=color, lw=0.6, alpha=0.35)
    keep = ~np.isnan(mean)
    ax.plot(x[keep], mean[keep], color=color, lw=2, label=label,
            marker='.' if keep.sum() < 3 else None)
    ax.fill_between(x[keep], lo[keep], hi[keep], color=color, alpha=0.2,
                    lw=0)
  if target is not None:
    ax.axhline(target, color='tab:red', ls=':', lw=1,
               label=f'target {target:g}')
  ax.set_xlim(0, xmax or x[-1])
  ax.set_xlabel(xlabel)
  ax.set_ylabel(ylabel)
  ax.set_title(title)
  ax.grid(alpha=0.3)
  ax.legend(loc='best', fontsize='small')
  fig.tight_layout()
  fig.savefig(path)
  drawn = {'xlim': ax.get_xlim(), 'title': ax.get_title(),
           'labels': [t.get_text() for t in ax.get_legend().get_texts()]}
  plt.close(fig)
  return drawn


# ---------------------------------------------------------------- CLI

def parse_args(argv):
  parser = argparse.ArgumentParser(
      prog='python -m dreamer_ver.logger.plot',
      description='Score (or any metric) vs env steps across seeds, next to '
                  'DreamerV3 and other runs.')
  add = parser.add_argument
  add('logdirs', nargs='*',
      help='one logdir (or scores.jsonl / metrics.jsonl file) per seed; '
           'none: the reference alone (needs --reference and --task)')
  add('--runs', nargs='+', action='append', default=[],
      metavar=('LABEL', 'LOGDIR'),
      help='another run or method in the same figure: its label, then one '
           'logdir per seed (repeatable)')
  add('--key', default='',
      help="plot this metrics.jsonl key (e.g. train/loss/dyn) instead of "
           "the episode scores")
  add('--reference', default='',
      help='dmc_proprio, dmc_vision, atari100k, atari57 or a .json.gz path')
  add('--task', default='',
      help="reference task (default: task in the first logdir's config.yaml)")
  add('--out', default='',
      help='figure path; .png, .svg or .pdf (default: <first logdir>/'
           'scores.png, or <key>.png with --key)')
  add('--bins', type=int, default=30,
      help='equal bins over [0, xmax] (default 30)')
  add('--eval', action='store_true',
      help='eval episodes instead of train episodes')
  add('--spread', choices=('minmax', 'sd'), default='minmax',
      help='band across seeds: min..max (default) or mean ± sd')
  add('--xmax', type=float, default=0.0,
      help="last env step shown (default: the runs' largest step, and at "
           "least the reference's third point)")
  add('--table', type=float, nargs='+', default=None, metavar='STEPS',
      help='print a markdown table row per step')
  add('--last', type=int, default=20,
      help='episodes per seed averaged for --table (default 20)')
  add('--window', type=float, default=10000.0,
      help='reference half-window in steps for --table (default 10000)')
  add('--ref_xscale', type=float, default=None,
      help='factor on reference xs (default 1; 0.25 for Atari frames)')
  add('--target', type=float, default=None,
      help='draw this score as a dotted line')
  add('--title', default='', help='(default: the task)')
  add('--label', default='', help='legend label of the logdirs\' curve')
  add('--xlabel', default='env steps',
      help="the x axis' label (files whose `step` counts something else)")
  return parser.parse_args(argv)


def main(argv=None):
  args = parse_args(sys.argv[1:] if argv is None else argv)
  if args.bins < 1:
    return _fail('--bins must be >= 1')
  if not args.logdirs and not args.runs and not (args.reference and args.task):
    return _fail('give logdirs, or --reference and --task for the '
                 'reference alone')
  if args.key and (args.reference or args.table):
    return _fail('--key plots a metric: no --reference or --table with it')
  if any(len(run) < 2 for run in args.runs):
    return _fail('--runs needs a label and at least one logdir')
  kind = 'eval' if args.eval else 'train'
  runs = ([(args.label, args.logdirs)] if args.logdirs else []) + [
      (run[0], run[1:]) for run in args.runs]
  loaded = []  # (label, [(steps, values)] per seed)
  for label, logdirs in runs:
    seeds = []
    for logdir in logdirs:
      path = series_path(logdir, args.key)
      if not path.is_file():
        return _fail(f'no {"metrics" if args.key else "scores"} at {path}')
      seeds.append(load_metric(path, args.key) if args.key else
                   load_scores(path, eval=args.eval))
    if not any(len(s) for s, _ in seeds):
      what = f'{args.key!r} values' if args.key else f'{kind} episodes'
      hint = '' if args.eval or args.key else ' (eval episodes need --eval)'
      return _fail(f'no {what} in {", ".join(logdirs)}{hint}')
    loaded.append((label, seeds))
  first = Path(runs[0][1][0]) if runs else None
  task = args.task or (config_task(first) if first else None) or ''

  ref_runs = []
  if args.reference:
    if not task:
      return _fail('--reference needs --task (no config.yaml with a task)')
    try:
      ref_file = load_reference(args.reference)
    except FileNotFoundError as e:
      return _fail(str(e))
    ref_runs = reference_runs(ref_file, task, args.ref_xscale)
    if not ref_runs:
      return _fail(
          f"reference '{args.reference}' has no runs for task "
          f"'{reference_task(task)}'; it has: "
          f"{', '.join(reference_tasks(ref_file))}")

  seeds = [seed for _, group in loaded for seed in group]
  if args.table:
    rows = table_rows(loaded[0][1] if loaded else [], ref_runs, args.table,
                      task or '?', args.last, args.window)
    print(format_table(rows, args.last, args.window))
  if not seeds and not args.out:
    return 0  # The reference alone: a figure only when --out asks for one.

  xmax = args.xmax or default_xmax(seeds, ref_runs)
  edges = bin_edges(xmax, args.bins)
  x = centres(edges)
  groups = []
  for label, group in loaded:
    curves = np.array([bin_scores(s, y, edges) for s, y in group])
    n = len(group)
    label = label or f"ours, {kind} ({n} seed{'s' if n > 1 else ''})"
    groups.append((label, curves, aggregate(curves, args.spread)))
  ref = None
  if ref_runs:
    ref = reference_curve(ref_runs, x, (edges[1] - edges[0]) / 2, args.spread)
  name = args.key.replace('/', '_') if args.key else 'scores'
  out = Path(args.out) if args.out else (
      (first if first.is_dir() else first.parent) / f'{name}.png')
  draw(out, x, groups, ref, args.title or task or str(first),
       f'DreamerV3 {args.reference} ({len(ref_runs)} runs)', xmax,
       args.target, args.key or 'episode return', args.xlabel)
  print(f'Wrote {out}', file=sys.stderr if args.table else sys.stdout)
  return 0


def _fail(message):
  print(f'error: {message}', file=sys.stderr)
  return 2


if __name__ == '__main__':
  sys.exit(main())
