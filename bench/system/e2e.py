"""The whole system against upstream DreamerV3's own runtime: both
`--script parallel`s on the same machine, JAX, task, model size, batch,
train ratio, env count and seed, each for the same wall-clock budget, in
alternating order (A B B A, so that drift in the machine's load hits both).

  python -m bench.system.e2e --upstream SRC --setup --site /tmp/upsite   # once
  python -m bench.system.e2e --upstream SRC --site /tmp/upsite --tasks dummy_disc \\
      dmc_cartpole_balance --minutes 15 --rounds 2 --out bench/results/e2e_cpu.json
  python -m bench.system.e2e --smoke [--upstream SRC --site DIR]  # 1.5 min each

SRC is a danijar/dreamerv3 checkout (fetched beforehand, never committed);
`--setup` installs the packages its parallel script needs beyond ours into
`--site` (`bench/upstream/upstream.py`), and every upstream process runs on this
interpreter with the `jax.jit` shim (`bench/upstream/upstream_shim`). Without SRC
only our half runs, and the results say why upstream's was skipped.

Each run is a process group of its own, stopped at the budget by SIGINT
to the group (Ctrl-C's signal; neither script stops by itself on time) and
killed 60 s later if still there. Meanwhile the bench stamps every line its
`metrics.jsonl` gains with the wall-clock seconds since the start (both
systems log every `--log_every` seconds, so every time below has that
resolution) and samples the CPU time and resident memory of the group's
processes every second. From those, per system and round: env steps/s
and updates/s over the run (updates: each log window's `fps/train`, the
replayed steps/s both systems report, over batch size x length), the time
to the first action (first logged step > 0) and to the first update
(first `fps/train` > 0), the updates/s once training (the log windows
after the first update's), our policy lag, the CPU seconds and peak memory
of all processes, and the score against env steps and against wall-clock.
`--learner_alone` also times our learner alone at each task's
configuration (`bench/learner/learner_bench.py --task`, 3 rounds before
the runs and 3 after) and reports the fraction of it our run keeps once
training (`kept`).
The JSON has an entry per system (`ours`, `upstream`) with the medians over
rounds (`env_steps_per_s`, `updates_per_s`, ...), the rounds themselves,
and the ratios; `--figure` draws score against wall-clock for both
(`dreamer_ver.logger.plot --runs`).

Upstream's dmc wrapper renders a frame every env step even on proprio
tasks (`log/image`), through software OpenGL where there is no GPU
(Mesa's EGL), so `--render_cost` also times that rendering alone
in this process (one env, `--render_steps` steps) and reports it per env
step on a line of its own. Where MuJoCo has no OpenGL at all
(MUJOCO_GL=disable, as on a GPU machine without EGL) upstream's frames are
black instead (`bench/upstream/upstream_shim`) and the results list those tasks
under `upstream_blank_render`: its env steps are cheaper there, not dearer.
"""

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from bench import stamp
from bench.upstream import upstream as upstreamlib

ROOT = Path(__file__).resolve().parents[2]

SYSTEMS = ('ours', 'upstream')
# What upstream's parallel script needs beyond its learner's packages.
PARALLEL_PACKAGES = ('cloudpickle',)


def settings(args, task):
  """The flags both systems take under the same names."""
  flags = {
      'task': task, 'seed': args.seed, 'batch_size': args.batch_size,
      'batch_length': args.batch_length,
      'report_length': min(32, args.batch_length), 'run.envs': args.envs,
      'run.eval_envs': 0, 'run.train_ratio': args.train_ratio,
      'run.log_every': args.log_every, 'jax.platform': args.platform,
      'jax.compute_dtype': args.dtype}
  if task.startswith('dmc_'):  # proprio: no image in the observation
    flags['env.dmc.image'] = False
  return flags


def command(system, args, task, logdir):
  """(argv, environment) of one system's parallel script."""
  flags = [f'--{key}={value}' for key, value in settings(args, task).items()]
  configs = ['--configs', args.size]
  common = ['--script', 'parallel', *configs, f'--logdir={logdir}', *flags]
  env = {**os.environ, 'PYTHONUNBUFFERED': '1'}
  env.setdefault('MUJOCO_GL', 'egl')  # Mesa's software EGL on a CPU machine
  if system == 'ours':
    return [sys.executable, '-m', 'dreamer_ver.main', *common], env
  main = Path(args.upstream) / 'dreamerv3' / 'main.py'
  if blank_render(task, env):
    env['UPSTREAM_BLANK_RENDER'] = '1'
  # Its default `jax.profiler` traces updates 100 to 120; on the CPU its
  # stop_trace never returned and the process grew until the kernel killed
  # it (docs/benchmarks.md, e2e section): off, as ours is unless asked.
  env['UPSTREAM_NO_PROFILER'] = '1'
  # Upstream's default outputs include `scope`, a viewer's format: JSONL
  # alone, as ours writes.
  return ([sys.executable, str(main), *common, '--logger.outputs=jsonl'],
          {**upstreamlib.environ(args.upstream, args.site), **{
              k: v for k, v in env.items() if k != 'PYTHONPATH'}})


def blank_render(task, env):
  """Whether upstream's logged-only frames are black (the shim's
  UPSTREAM_BLANK_RENDER): on proprio dmc tasks where MuJoCo cannot render
  at all, else its first step would fail."""
  return task.startswith('dmc_') and env.get('MUJOCO_GL') == 'disable'


class Watch:
  """Stamps the lines a metrics file gains and samples a process group's
  CPU seconds and resident memory, once a second, on a thread."""

  def __init__(self, metrics, group, start):
    self.metrics, self.group, self.start = metrics, group, start
    self.lines = []  # (seconds since start, record)
    self.cpu = {}  # pid -> CPU seconds last seen (ended pids keep theirs)
    self.peak_rss = 0
    self._pos = 0
    self._stop = threading.Event()
    self._thread = threading.Thread(target=self._run, daemon=True)
    self._thread.start()

  def close(self):
    self._stop.set()
    self._thread.join(timeout=10)
    self._read()

  def _run(self):
    while not self._stop.wait(1.0):
      self._read()
      self._sample()

  def _read(self):
    if not self.metrics.exists():
      return
    with open(self.metrics) as f:
      f.seek(self._pos)
      text = f.read()
    complete = text[:text.rfind('\n') + 1]
    self._pos += len(complete.encode())
    now = time.monotonic() - self.start
    for line in complete.splitlines():
      try:
        self.lines.append((now, json.loads(line)))
      except json.JSONDecodeError:
        pass  # a line another process wrote half of; the next is whole

  def _sample(self):
    tick = os.sysconf('SC_CLK_TCK')
    page = os.sysconf('SC_PAGE_SIZE')
    rss = 0
    for pid in os.listdir('/proc'):
      if not pid.isdigit():
        continue
      try:
        stat = Path(f'/proc/{pid}/stat').read_text()
      except OSError:
        continue
      fields = stat[stat.rfind(')') + 2:].split()
      if int(fields[3]) != self.group:  # pgrp
        continue
      self.cpu[pid] = (int(fields[11]) + int(fields[12])) / tick
      rss += int(fields[21]) * page
    self.peak_rss = max(self.peak_rss, rss)


def run_once(system, args, task, logdir, seconds):
  """Runs one system for `seconds` of wall-clock; returns its record."""
  argv, env = command(system, args, task, logdir)
  log = open(Path(logdir).parent / f'{Path(logdir).name}.log', 'w')
  start = time.monotonic()
  proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log,
                          stderr=subprocess.STDOUT, start_new_session=True)
  watch = Watch(Path(logdir) / 'metrics.jsonl', proc.pid, start)
  try:
    try:
      code = proc.wait(timeout=seconds)  # neither should end by itself
    except subprocess.TimeoutExpired:
      code = None
    cut = time.monotonic() - start
    if code is None:
      os.killpg(proc.pid, signal.SIGINT)
      try:
        proc.wait(timeout=60)
      except subprocess.TimeoutExpired:
        pass
  finally:  # also when the bench is stopped: no run outlives it
    try:
      os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
      pass
    proc.wait()
  watch.close()
  log.close()
  if code:  # it ended by itself, and failed: its last lines, not silence
    tail = Path(log.name).read_text().splitlines()[-30:]
    print(f'{system} exited with {code}:', *tail, sep='\n  ',
          file=sys.stderr)
  record = summarize([(t, r) for t, r in watch.lines if t <= cut],
                     args.batch_size * args.batch_length, cut,
                     args.log_every)
  record.update(system=system, task=task, seconds=round(cut, 1),
                exit=code, cpu_s=round(sum(watch.cpu.values()), 1),
                peak_rss_gb=round(watch.peak_rss / 2**30, 2),
                logdir=str(logdir))
  return record


def summarize(lines, batch_steps, seconds, window):
  """Rates, first times and curves from stamped metrics lines, written every
  `window` seconds."""
  steps = [(t, int(r['step'])) for t, r in lines if 'step' in r]
  last_step = max([s for _, s in steps], default=0)
  first_action = next((t for t, s in steps if s > 0), None)
  first_update = next((t for t, r in lines if r.get('fps/train', 0) > 0),
                      None)
  # Replayed steps over each log window: a line's fps/train is the rate
  # over the window it closes, since the line before that carried it (the
  # first: one `window` of time, or less where the run is younger).
  replayed, previous, since_first = 0.0, None, 0.0
  for t, r in lines:
    if 'fps/train' in r:
      replayed += r['fps/train'] * (
          t - previous if previous is not None else min(t, window))
      if previous is not None:
        since_first += r['fps/train'] * (t - previous)
      previous = t
  # Once training: the windows after the first update's, whole ones only.
  training = (first_update is not None and previous is not None
              and previous > first_update)
  lags = [r['train/policy_lag/mean'] for _, r in lines
          if 'train/policy_lag/mean' in r]
  scores = [(t, int(r['step']), r['episode/score']) for t, r in lines
            if 'episode/score' in r]
  usage = {}  # where the time goes: each `usage/*` metric's last value
  for _, r in lines:
    usage.update({k: v for k, v in r.items() if k.startswith('usage/')})
  return {
      'env_steps': last_step,
      'env_steps_per_s': round(last_step / seconds, 3),
      'updates': round(replayed / batch_steps, 1),
      'updates_per_s': round(replayed / batch_steps / seconds, 4),
      'training_updates_per_s': round(
          since_first / batch_steps / (previous - first_update), 4)
      if training else None,
      'first_action_s': first_action and round(first_action, 1),
      'first_update_s': first_update and round(first_update, 1),
      'policy_lag_mean': round(float(np.mean(lags)), 2) if lags else None,
      'score_last': scores[-1][2] if scores else None,
      'scores': [[round(t, 1), s, round(float(v), 3)] for t, s, v in scores],
      'usage': usage,
  }


def render_cost(steps):
  """Seconds per env step of upstream's extra frame: dm_control's render of
  a 64 x 64 frame, as its dmc wrapper does each step."""
  os.environ.setdefault('MUJOCO_GL', 'egl')  # as the runs have it
  from dm_control import suite
  env = suite.load('cartpole', 'balance', task_kwargs={'random': 0})
  env.reset()
  env.physics.render(64, 64, camera_id=0)  # the context's first frame
  start = time.perf_counter()
  for _ in range(steps):
    env.step(np.zeros(env.action_spec().shape))
    env.physics.render(64, 64, camera_id=0)
  rendered = time.perf_counter() - start
  start = time.perf_counter()
  for _ in range(steps):
    env.step(np.zeros(env.action_spec().shape))
  return (rendered - (time.perf_counter() - start)) / steps


def median(records, key):
  values = [r[key] for r in records if r.get(key) is not None]
  return float(np.median(values)) if values else None


def report(args, records, skipped, render_ms=None, alone=None):
  """The results: per task and system the medians over rounds and the
  rounds; per task the ratios of ours over upstream, and with `alone`
  ({task: {'before': [updates/s of our learner alone per round],
  'after': [...]}}) their median and the fraction of it ours keeps once
  training (`kept`)."""
  import jax  # noqa: F401  (the stamp names the runs' JAX and device)
  result = {**stamp.stamp(), 'settings': {
      k: v for k, v in settings(args, '').items() if k != 'task'},
      'size': args.size, 'minutes': args.minutes, 'tasks': {}}
  if skipped:
    result['upstream_skipped'] = skipped
  keys = ('env_steps_per_s', 'updates_per_s', 'training_updates_per_s',
          'first_action_s', 'first_update_s', 'policy_lag_mean', 'cpu_s',
          'peak_rss_gb')
  for task in args.tasks:
    entry = {}
    for system in SYSTEMS:
      rounds = [r for r in records if r['task'] == task and
                r['system'] == system]
      if rounds:
        entry[system] = {k: median(rounds, k) for k in keys}
        entry[system]['rounds'] = rounds
    if alone and task in alone and 'ours' in entry:
      ours = entry['ours']
      rate = float(np.median(alone[task]['before'] + alone[task]['after']))
      ours['learner_alone'] = {k: [round(r, 3) for r in v]
                               for k, v in alone[task].items()}
      ours['learner_alone_updates_per_s'] = round(rate, 3)
      if ours['training_updates_per_s']:
        ours['kept'] = round(ours['training_updates_per_s'] / rate, 3)
    if 'ours' in entry and 'upstream' in entry:
      entry['ratios'] = {
          k: round(entry['ours'][k] / entry['upstream'][k], 2)
          for k in ('env_steps_per_s', 'updates_per_s')
          if entry['upstream'][k]}
    result['tasks'][task] = entry
  if render_ms is not None:
    result['upstream_render_ms_per_env_step'] = render_ms
  blank = [t for t in args.tasks if blank_render(t, os.environ)]
  if blank and not skipped:
    result['upstream_blank_render'] = blank
  return result


def figure(result, path):
  """Score against wall-clock seconds, both systems, every round that
  ended an episode; returns the systems left out for having none."""
  folder = Path(tempfile.mkdtemp())
  runs = {system: [] for system in SYSTEMS}
  ran = set()
  for task, entry in result['tasks'].items():
    for system in SYSTEMS:
      for i, r in enumerate(entry.get(system, {}).get('rounds', [])):
        ran.add(system)
        if not r['scores']:
          continue
        file = folder / f'{task}_{system}_{i}.jsonl'
        file.write_text(''.join(json.dumps({'step': t, 'score': v}) + '\n'
                                for t, _, v in r['scores']))
        runs[system].append(str(file))
  left_out = [system for system in SYSTEMS if system in ran
              and not runs[system]]
  for system in left_out:
    print(f'{system}: no episode ended; the figure leaves it out',
          flush=True)
  if runs['ours']:
    command = [
        sys.executable, '-m', 'dreamer_ver.logger.plot', *runs['ours'],
        '--label', 'dreamer_ver', '--xlabel', 'wall-clock seconds',
        '--bins', '10', '--out', str(path), '--title',
        f"score against wall-clock ({result['commit']}, "
        f"{result['machine']['cores']} cores)"]
    if runs['upstream']:
      command += ['--runs', 'upstream DreamerV3', *runs['upstream']]
    subprocess.run(command, check=True, cwd=ROOT)
  return left_out


def learner_alone(args, task, root):
  """Our learner's updates/s per round at the run's size, dtype, batch
  and the task's spaces, alone on the machine (learner_bench.py in a
  process of its own, as the run's platform)."""
  name = re.sub(r'[^\w]', '_', task)
  out = root / f'alone_{name}.json'
  subprocess.run(
      [sys.executable, '-m', 'bench.learner.learner_bench', '--task', task,
       '--sizes', args.size, '--dtypes', args.dtype, '--variants', 'base',
       '--batch', str(args.batch_size), '--length', str(args.batch_length),
       '--steps', '8', '--rounds', '3', '--no-floor', '--out', str(out)],
      cwd=ROOT, check=True,
      env={**os.environ, 'JAX_PLATFORMS': args.platform})
  (row,) = json.loads(out.read_text())['rows']
  return [1e3 / ms for ms in row['ms_per_update']]


def run_all(args, systems, root):
  """Every task's rounds, A B B A; the records in run order."""
  records = []
  for task in args.tasks:
    for round_ in range(args.rounds):
      order = systems if round_ % 2 == 0 else systems[::-1]
      for system in order:
        name = re.sub(r'[^\w]', '_', task)
        logdir = root / f'{name}_{system}_{round_}'
        print(f'{task} round {round_} {system} ...', flush=True)
        record = run_once(system, args, task, logdir, args.minutes * 60)
        record['round'] = round_
        records.append(record)
        print(json.dumps({k: v for k, v in record.items()
                          if k != 'scores'}), flush=True)
  return records


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--upstream', metavar='SRC', default='',
                      help='a danijar/dreamerv3 checkout (none: ours only)')
  parser.add_argument('--site', default='',
                      help="folder of upstream's extra packages")
  parser.add_argument('--setup', action='store_true',
                      help="install upstream's extra packages into --site")
  parser.add_argument('--tasks', nargs='+', default=['dummy_disc'])
  parser.add_argument('--systems', nargs='+', choices=SYSTEMS,
                      default=list(SYSTEMS), help='which to run')
  parser.add_argument('--minutes', type=float, default=15.0)
  parser.add_argument('--rounds', type=int, default=2)
  parser.add_argument('--size', default='size1m')
  parser.add_argument('--envs', type=int, default=4)
  parser.add_argument('--batch_size', type=int, default=16)
  parser.add_argument('--batch_length', type=int, default=64)
  parser.add_argument('--train_ratio', type=float, default=32.0)
  parser.add_argument('--seed', type=int, default=0)
  parser.add_argument('--platform', default='cpu')
  parser.add_argument('--dtype', default='float32')
  parser.add_argument('--log_every', type=float, default=15.0)
  parser.add_argument('--render_cost', action='store_true')
  parser.add_argument('--learner_alone', action='store_true',
                      help="time our learner alone at each task's "
                      'configuration before the rounds and after '
                      '(bench/learner/learner_bench.py --task)')
  parser.add_argument('--render_steps', type=int, default=500)
  parser.add_argument('--smoke', action='store_true',
                      help='1.5 minutes per system, one round, dummy_disc, '
                      'the debug configs (tiny models)')
  parser.add_argument('--logdir', default='',
                      help='where the runs write (default: a temp folder, '
                      'removed at the end)')
  parser.add_argument('--out', default='')
  parser.add_argument('--figure', default='')
  args = parser.parse_args()
  # A deadline's SIGTERM ends the bench as Ctrl-C does, through run_once's
  # cleanup of the run in progress.
  signal.signal(signal.SIGTERM, signal.default_int_handler)
  if args.smoke:
    args.tasks, args.minutes, args.rounds = ['dummy_disc'], 1.5, 1
    args.size, args.batch_size, args.batch_length = 'debug', 4, 8
    args.log_every = 5.0
  if args.setup:
    if not args.site:
      parser.error('--setup needs --site')
    upstreamlib.install(Path(args.site), PARALLEL_PACKAGES)
  skipped = ''
  if not args.upstream:
    skipped = 'no upstream source given (--upstream SRC)'
  elif not (Path(args.upstream) / 'dreamerv3' / 'main.py').exists():
    skipped = f'{args.upstream} has no dreamerv3/main.py'
  systems = ['ours'] if skipped else args.systems
  if skipped:
    print(f'upstream skipped: {skipped}', flush=True)
  with tempfile.TemporaryDirectory(prefix='e2e_') as temp:
    root = Path(args.logdir or temp)
    root.mkdir(parents=True, exist_ok=True)
    alone = {task: {'before': learner_alone(args, task, root)}
             for task in args.tasks if args.learner_alone}
    records = run_all(args, systems, root)
    for task in alone:  # and after: a drift in the machine shows
      alone[task]['after'] = learner_alone(args, task, root)
  render_ms = round(render_cost(args.render_steps) * 1e3, 3) if (
      args.render_cost) else None
  result = report(args, records, skipped, render_ms, alone)
  if args.out:
    Path(args.out).write_text(json.dumps(result, indent=1) + '\n')
  if args.figure:
    figure(result, args.figure)
  for task, entry in result['tasks'].items():
    for system in SYSTEMS:
      if system in entry:
        shown = {k: v for k, v in entry[system].items() if k != 'rounds'}
        print(f'{task} {system}: {json.dumps(shown)}')
    if 'ratios' in entry:
      print(f'{task} ours / upstream: {json.dumps(entry["ratios"])}')


if __name__ == '__main__':
  main()
