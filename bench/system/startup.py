"""Agent start-up, cold against warm: how long a restarted agent takes from
its process start to its first action served, without and with JAX's
persistent compilation cache (`jax.compile_cache`), side by side.

Starts one run as separate processes, as launch/local.sh does (logger,
replay and env fleet each with its own `--script`), then starts and stops
the agent (`--script parallel_agent`, SIGTERM: it saves and exits)
repeatedly, alternating the cache off and on. Each start is timed from the
bench's Popen to the agent's 'First action served' line in its output, so it
counts the interpreter, the imports, the checkpoint restore, every compile
(policy buckets, train, report) and the first env request. A first start
with the cache on fills the cache and writes the first checkpoint; it is not
counted, so every counted start restores the same kind of checkpoint.

    python -m bench.system.startup [--configs cartpole] [--rounds 3] [--out FILE]
"""

import argparse
import os
import platform
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench import stamp

ROOT = Path(__file__).resolve().parents[2]
READY = re.compile(r'First action served ([0-9.]+) s after the agent started')


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--configs', nargs='+', default=['cartpole'])
  parser.add_argument('--rounds', type=int, default=3)
  parser.add_argument('--logdir', default='')
  parser.add_argument('--timeout', type=float, default=600.0,
                      help='seconds to wait for one start')
  parser.add_argument('--out', default='')
  args = parser.parse_args()
  logdir = Path(args.logdir or tempfile.mkdtemp(prefix='startup_'))
  report = measure(logdir, args.configs, args.rounds, args.timeout)
  print(format_report(report), flush=True)
  if args.out:
    stamp.write(args.out, report, indent=2)
  return 0


def measure(logdir, configs, rounds, timeout):
  """Times agent starts: one priming start, then `rounds` x (off, on)."""
  from dreamer_ver.rpc.addresses import free_port
  flags = ['--configs', *configs, '--logdir', str(logdir),
           '--jax.platform', 'cpu', '--run.steps', '1e9']
  for key in ('actor_addr', 'replay_addr', 'logger_addr'):
    flags += [f'--run.{key}', f'localhost:{free_port()}']
  # Each run's own cache in its logdir (what a restart finds), not a shared one.
  env = {k: v for k, v in os.environ.items() if k != 'JAX_COMPILATION_CACHE_DIR'}
  env.update(JAX_PLATFORMS='cpu', PYTHONUNBUFFERED='1')
  logdir.mkdir(parents=True, exist_ok=True)
  services = [_start(script, flags, env, logdir / f'{script}.log')
              for script in ('parallel_logger', 'parallel_replay',
                             'parallel_envs')]
  agent_flags = [*flags, '--run.remote_envs', 'True',
                 '--run.remote_replay', 'True']
  starts = []
  try:
    plan = [('on', True)] + [(mode, False) for _ in range(rounds)
                             for mode in ('off', 'on')]
    for index, (mode, priming) in enumerate(plan):
      cache = 'jax_cache' if mode == 'on' else ''
      total, inside = _time_start(
          [*agent_flags, '--jax.compile_cache', cache], env,
          logdir / f'agent_{index}_{mode}.log', timeout)
      starts.append({'cache': mode, 'priming': priming,
                     'process_start_to_first_action_s': round(total, 2),
                     'agent_reported_s': inside})
      print(f'start {index}: cache {mode}{" (priming)" if priming else ""}: '
            f'{total:.1f} s', flush=True)
  finally:
    for proc in services:
      _stop(proc)
  counted = [s for s in starts if not s['priming']]
  median = {mode: statistics.median(
      s['process_start_to_first_action_s'] for s in counted
      if s['cache'] == mode) for mode in ('off', 'on')}
  return {
      'configs': configs, 'rounds': rounds, 'starts': starts,
      'median_cold_s': median['off'], 'median_warm_s': median['on'],
      'cold_over_warm': round(median['off'] / median['on'], 2),
      'commit': _commit(), 'machine': f'{platform.processor() or platform.machine()}, '
                                      f'{os.cpu_count()} cores'}


def _start(script, flags, env, log_path):
  log = open(log_path, 'w')
  return subprocess.Popen(
      [sys.executable, '-m', 'dreamer_ver.main', '--script', script, *flags],
      cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)


def _time_start(flags, env, log_path, timeout):
  """(seconds from Popen to the first action, the agent's own count)."""
  began = time.monotonic()
  proc = _start('parallel_agent', flags, env, log_path)
  try:
    while time.monotonic() - began < timeout:
      match = READY.search(log_path.read_text())
      if match:
        return time.monotonic() - began, float(match[1])
      if proc.poll() is not None:
        raise RuntimeError(f'the agent exited with {proc.returncode}, '
                           f'see {log_path}')
      time.sleep(0.05)
    raise RuntimeError(f'no first action within {timeout} s, see {log_path}')
  finally:
    _stop(proc)


def _stop(proc, timeout=60):
  if proc.poll() is None:
    proc.send_signal(signal.SIGTERM)
    try:
      proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
      proc.kill()
      proc.wait()


def _commit():
  try:
    return subprocess.run(['git', 'rev-parse', '--short', 'HEAD'], cwd=ROOT,
                          capture_output=True, text=True).stdout.strip()
  except OSError:
    return ''


def format_report(report):
  lines = [f"Agent start-up, process start to first action served "
           f"({' '.join(report['configs'])}, commit {report['commit']}, "
           f"{report['machine']}):"]
  for start in report['starts']:
    if not start['priming']:
      lines.append(f"  cache {start['cache']:3s}  "
                   f"{start['process_start_to_first_action_s']:6.1f} s")
  lines.append(f"median cold {report['median_cold_s']:.1f} s, warm "
               f"{report['median_warm_s']:.1f} s: cold / warm = "
               f"{report['cold_over_warm']:.2f}")
  return '\n'.join(lines)


if __name__ == '__main__':
  sys.exit(main())
