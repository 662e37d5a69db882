"""Soak test: a long parallel run while env processes keep getting killed.

Runs `python -m dreamer_ver.main --script parallel --configs debug --task
synthetic_bandit` (a few envs, a long `run.steps`) in a subprocess for
`--minutes` (counted from the first env step, so start-up is not included),
SIGKILLs a random env process (from `logdir/pids/env*`) every `--kill_every`
seconds, then stops the run with SIGTERM and checks:

  progressing  env steps (the logger's `step` in metrics.jsonl) grew during
               the last minute before the stop
  exit         the run exits 0 within the shutdown budget, no child left
  consistency  replay inserts + in-flight == train steps the actor served:
               served = ckpt/counters.json `steps` (train rows the actor
               answered and posted; eval rows are not counted), inserts =
               the train rows in the replay's chunk files after the final
               save (the replay is sized so that nothing is evicted; eval
               rows go to the eval replay), logger = ckpt/logger.json `step`
               (train rows the logger counted). All three are saved by the
               final, clean shutdown, so in-flight = served - inserts is what
               was still on the way when the agent stopped: add_batch calls
               sent but not finished when the agent closed its replay client,
               or rows the replay dropped because its limiter wait was
               interrupted by the stop. A killed env loses nothing here: its
               rows count as served only once posted to replay.
  memory       VmRSS of every component (the top-level `parallel` process,
               agent, replay, logger, each env process) at the start of the soak and
               at its end; a restarted env is a new process (pid shown).

Prints a short report and writes it as JSON (`--out`).

  python -m bench.soaks.soak --minutes 10 --kill_every 30 --out soak.json
"""

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import stamp
from bench.soaks import watch
from bench.soaks.faults import soak_arguments, stored_rows

ROOT = Path(__file__).resolve().parents[2]
SHUTDOWN_BUDGET = 30  # The runtime's 15 s per group plus the agent's save.


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  soak_arguments(parser)
  parser.add_argument('--kill_every', type=float, default=30.0)
  args, extra = parser.parse_known_args()
  logdir = Path(args.logdir or tempfile.mkdtemp(prefix='soak_'))
  report = soak(args, logdir, extra)
  text = format_report(report)
  print(text, flush=True)
  if args.out:
    stamp.write(args.out, report, indent=2)
  return 0 if report['ok'] else 1


def soak(args, logdir, extra=()):
  rng = random.Random(args.seed)
  command = [
      sys.executable, '-m', 'dreamer_ver.main', '--script', 'parallel',
      '--configs', 'debug', '--task', 'synthetic_bandit',
      '--logdir', str(logdir), '--run.steps', '1e9',
      '--run.envs', str(args.envs), '--run.eval_envs', '1',
      '--env.synthetic.step_time', str(args.step_time),
      '--env.synthetic.length', '100',
      '--run.log_every', '5', '--replay.size', '1e8', *extra]
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu', 'PYTHONUNBUFFERED': '1'}
  logdir.mkdir(parents=True, exist_ok=True)
  stdout = open(logdir / 'soak_stdout.log', 'w')
  launched = time.monotonic()
  proc = subprocess.Popen(command, cwd=ROOT, env=env, stdout=stdout,
                          stderr=subprocess.STDOUT)
  report = {'command': ' '.join(command), 'logdir': str(logdir),
            'minutes': args.minutes, 'kill_every': args.kill_every}
  kills, steps = [], []  # steps: (seconds since soak start, logger step)
  try:
    if not watch.wait(lambda: watch.logger_step(logdir) > 0 or proc.poll() is not None,
                 args.startup) or proc.poll() is not None:
      raise RuntimeError(f'the run never started (see {stdout.name})')
    report['startup_s'] = round(time.monotonic() - launched, 1)
    start = time.monotonic()
    rss_start = _rss_all(logdir, proc.pid)
    steps.append((0.0, watch.logger_step(logdir)))
    next_kill = start + args.kill_every
    deadline = start + args.minutes * 60
    while time.monotonic() < deadline:
      if proc.poll() is not None:
        raise RuntimeError(f'the run exited early with {proc.returncode}')
      time.sleep(min(5.0, max(0.0, deadline - time.monotonic())))
      now = time.monotonic()
      steps.append((round(now - start, 1), watch.logger_step(logdir)))
      if now >= next_kill and now < deadline - 1:
        next_kill += args.kill_every
        kills.append(_kill_random_env(logdir, rng, now - start))
    rss_end = _rss_all(logdir, proc.pid)
    soak_s = time.monotonic() - start
    stop_at = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
      code = proc.wait(timeout=SHUTDOWN_BUDGET + 30)
    except subprocess.TimeoutExpired:
      code = None
    shutdown_s = time.monotonic() - stop_at
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
    stdout.close()
  output = (logdir / 'soak_stdout.log').read_text()

  # Progress during the last minute, from the logger's env step counter.
  end_t, end_step = steps[-1]
  before = [s for t, s in steps if t <= end_t - 60] or [steps[0][1]]
  grew = end_step - before[-1]
  leftover = [name for name, pid in watch.pids(logdir).items() if watch.alive(pid)]

  counters = watch.read_json(logdir / 'ckpt' / 'counters.json')
  logger = watch.read_json(logdir / 'ckpt' / 'logger.json')
  served = counters['steps']
  inserts = len(stored_rows(logdir / 'replay')['time'])
  inflight = served - inserts
  metrics = [json.loads(l) for l in (logdir / 'metrics.jsonl').open() if l]
  restarts = output.count('exited with code -9; restarting')

  rss = {}
  for name in sorted(set(rss_start) | set(rss_end), key=_order):
    a, b = rss_start.get(name), rss_end.get(name)
    rss[name] = {
        'start_mb': a and a[1], 'end_mb': b and b[1],
        'start_pid': a and a[0], 'end_pid': b and b[0],
        'restarted': bool(a and b and a[0] != b[0])}
  # Memory is stable when no process that lived through the whole soak grew
  # by more than 25% + 50 MB (JAX and the replay warm up their caches).
  grown = [name for name, r in rss.items()
           if r['start_mb'] and r['end_mb'] and not r['restarted']
           and r['end_mb'] > 1.25 * r['start_mb'] + 50]

  report.update({
      'soak_s': round(soak_s, 1),
      'kills': kills,
      'restarts_logged': restarts,
      'steps_start': steps[0][1], 'steps_end': end_step,
      'steps_last_minute': grew,
      'progressing': grew > 0,
      'exit_code': code,
      'shutdown_s': round(shutdown_s, 1),
      'children_left': leftover,
      'served': served,
      'replay_inserts': inserts,
      'logger_steps': logger['step'],
      'in_flight': inflight,
      'consistent': inserts + inflight == served and 0 <= inflight <= (
          8 * (args.envs + 1)),
      'env_steps_per_s': round((end_step - steps[0][1]) / max(soak_s, 1e-9), 1),
      'train_updates': counters['version'],
      'episodes': logger.get('episodes'),
      'abandoned_episodes': sum(m.get('parallel/ep_abandoned', 0)
                                for m in metrics),
      'rss': rss,
      'rss_grown': grown,
  })
  report['ok'] = bool(
      report['progressing'] and code == 0 and not leftover
      and report['consistent'] and not grown
      and shutdown_s < SHUTDOWN_BUDGET)
  return report


def format_report(r):
  kills = ', '.join(f'{k["env"]}@{k["t"]:.0f}s' for k in r['kills'])
  lines = [
      f'soak: {r["soak_s"] / 60:.1f} min after {r["startup_s"]} s start-up, '
      f'{len(r["kills"])} env kills ({kills}); {r["restarts_logged"]} '
      'restarts logged by the supervisor',
      f'progress: env step {r["steps_start"]} -> {r["steps_end"]} '
      f'({r["env_steps_per_s"]} env steps/s), +{r["steps_last_minute"]} in '
      f'the last minute: {"PROGRESSING" if r["progressing"] else "STALLED"}; '
      f'{r["train_updates"]} train updates, {r["episodes"]} episodes, '
      f'{r["abandoned_episodes"]} half episodes of killed envs not logged',
      f'stop: SIGTERM -> exit {r["exit_code"]} in {r["shutdown_s"]} s, '
      f'children left: {r["children_left"] or "none"}',
      f'consistency: replay inserts {r["replay_inserts"]} + in-flight '
      f'{r["in_flight"]} == actor served {r["served"]} (logger counted '
      f'{r["logger_steps"]}): {"OK" if r["consistent"] else "MISMATCH"}',
      'RSS MB (start -> end):',
  ]
  for name, x in r['rss'].items():
    note = (f' (restarted: pid {x["start_pid"]} -> {x["end_pid"]})'
            if x['restarted'] else '')
    lines.append(f'  {name:8s} {x["start_mb"]} -> {x["end_mb"]}{note}')
  lines.append(f'memory: {"stable" if not r["rss_grown"] else "GREW: " + ", ".join(r["rss_grown"])}')
  lines.append(f'result: {"OK" if r["ok"] else "FAILED"}')
  return '\n'.join(lines)


# ------------------------------------------------------------------ helpers

def _kill_random_env(logdir, rng, t):
  pids = {name: pid for name, pid in watch.pids(logdir).items()
          if name.startswith('env') and watch.alive(pid)}
  if not pids:
    return {'t': round(t, 1), 'env': None, 'pid': None}
  name = rng.choice(sorted(pids))
  try:
    os.kill(pids[name], signal.SIGKILL)
  except ProcessLookupError:
    pass
  return {'t': round(t, 1), 'env': name, 'pid': pids[name]}


def _rss_all(logdir, top_pid):
  """{component: (pid, VmRSS MB)}: the top-level (supervising) process as
  `parallel`, and every child in `logdir/pids`."""
  found = {'parallel': top_pid, **watch.pids(logdir)}
  out = {}
  for name, pid in found.items():
    mb = _rss_mb(pid)
    if mb is not None:
      out[name] = (pid, mb)
  return out


def _rss_mb(pid):
  try:
    for line in Path(f'/proc/{pid}/status').read_text().splitlines():
      if line.startswith('VmRSS:'):
        return round(int(line.split()[1]) / 1024, 1)
  except (FileNotFoundError, ProcessLookupError):
    return None
  return None


def _order(name):
  head = {'parallel': 0, 'agent': 1, 'replay': 2, 'logger': 3}
  if name in head:
    return (head[name], 0)
  digits = ''.join(c for c in name.split('-')[0] if c.isdigit())
  return (4, int(digits or 0))


if __name__ == '__main__':
  sys.exit(main())
