"""Training with and without the eval worker, side by side: learner
updates/s and env steps/s of `--script parallel` while an EvalWorker
(`run.eval_every`) evaluates the newest params, against the same run
without one.

Each round starts two fresh runs one after the other (the order alternates
between rounds), each for `--seconds` after its learner's first update.
The bench reads the run's metrics.jsonl as the logger writes it
(`run.log_every` 5 s) and stamps each row with the time it saw it: rates
are (last - first) / elapsed of `train/updates` (learner updates) and
`step` (train env steps) over the measured window, so start-up and compile
time are excluded. With the worker, the evaluations that finished in that
window are counted from `eval/version` rows.

    python -m bench.system.eval_bench [--configs cartpole] [--rounds 2]
        [--seconds 120] [--eval_every 10] [--out FILE]

The worker shares the machine's cores with the run: on a small CPU its
cost is the CPU its episodes take, which the ratio shows.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import stamp

ROOT = Path(__file__).resolve().parents[2]


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--configs', nargs='+', default=['cartpole'])
  parser.add_argument('--rounds', type=int, default=2)
  parser.add_argument('--seconds', type=float, default=120.0)
  parser.add_argument('--eval_every', type=float, default=10.0)
  parser.add_argument('--eval_envs', type=int, default=1)
  parser.add_argument('--out', default='')
  args = parser.parse_args()
  runs = []
  for r in range(args.rounds):
    order = ('off', 'on') if r % 2 == 0 else ('on', 'off')
    for mode in order:
      result = measure(args, mode)
      result['round'] = r
      runs.append(result)
      print(json.dumps(result), flush=True)
  report = summarize(runs, args)
  print(format_report(report), flush=True)
  if args.out:
    Path(args.out).write_text(json.dumps(report, indent=2) + '\n')
  return 0


def measure(args, mode):
  """One run: rates over `args.seconds` after the first learner update."""
  logdir = Path(tempfile.mkdtemp(prefix=f'eval_bench_{mode}_'))
  flags = ['--configs', *args.configs, '--logdir', str(logdir),
           '--run.log_every', '5', '--run.steps', '1e9',
           '--run.eval_worker_envs', str(args.eval_envs),
           '--run.eval_every', str(args.eval_every if mode == 'on' else 0)]
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu', 'PYTHONUNBUFFERED': '1'}
  proc = subprocess.Popen(
      [sys.executable, '-m', 'dreamer_ver.main', '--script', 'parallel',
       *flags], cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
      stderr=subprocess.DEVNULL)
  rows = []  # (time seen, row)
  read = 0
  start = None
  try:
    while proc.poll() is None:
      time.sleep(0.5)
      read, new = _new_rows(logdir / 'metrics.jsonl', read)
      now = time.monotonic()
      rows += [(now, row) for row in new]
      if start is None and any('train/updates' in r for _, r in rows):
        start = now
      if start is not None and now - start >= args.seconds:
        break
  finally:
    proc.terminate()
    proc.wait(120)
    shutil.rmtree(logdir, ignore_errors=True)
  if start is None:
    raise RuntimeError(f'{mode}: the learner never updated (exit {proc.returncode})')
  updates = [(t, r['train/updates']) for t, r in rows
             if t >= start and 'train/updates' in r]
  steps = [(t, r['step']) for t, r in rows if t >= start and 'step' in r]
  evals = sorted({r['eval/version'] for t, r in rows
                  if t >= start and 'eval/version' in r})
  return {'mode': mode, 'updates_per_s': _rate(updates),
          'env_steps_per_s': _rate(steps), 'evaluations': len(evals)}


def _new_rows(path, offset):
  """Complete JSON lines of `path` after byte `offset`."""
  try:
    with path.open('rb') as f:
      f.seek(offset)
      data = f.read()
  except FileNotFoundError:
    return offset, []
  end = data.rfind(b'\n') + 1
  rows = [json.loads(line) for line in data[:end].splitlines() if line]
  return offset + end, rows


def _rate(points):
  (t0, v0), (t1, v1) = points[0], points[-1]
  return (v1 - v0) / (t1 - t0) if t1 > t0 else float('nan')


def summarize(runs, args):
  def median(mode, key):
    return statistics.median(r[key] for r in runs if r['mode'] == mode)
  return {
      **stamp.stamp(), 'configs': args.configs, 'seconds': args.seconds,
      'eval_every': args.eval_every, 'eval_envs': args.eval_envs,
      'runs': runs,
      'updates_ratio': median('on', 'updates_per_s') / median(
          'off', 'updates_per_s'),
      'env_steps_ratio': median('on', 'env_steps_per_s') / median(
          'off', 'env_steps_per_s')}


def format_report(report):
  lines = [f"{'round':>5} {'worker':>6} {'updates/s':>10} {'env steps/s':>12}"
           f" {'evals':>6}"]
  for r in report['runs']:
    lines.append(f"{r['round']:>5} {r['mode']:>6} {r['updates_per_s']:>10.2f}"
                 f" {r['env_steps_per_s']:>12.1f} {r['evaluations']:>6}")
  lines.append(f"with / without the worker (medians): updates/s "
               f"{report['updates_ratio']:.3f}, env steps/s "
               f"{report['env_steps_ratio']:.3f}")
  return '\n'.join(lines)


if __name__ == '__main__':
  sys.exit(main())
