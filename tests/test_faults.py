"""Faults a long run must survive, on the real parallel runtime."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FLAGS = ['--configs', 'debug', '--task', 'synthetic_bandit',
         '--env.synthetic.length', '20', '--env.synthetic.step_time', '0.005',
         '--run.log_every', '2', '--run.save_every', '3']


def _start(logdir, steps):
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu', 'PYTHONUNBUFFERED': '1'}
  return subprocess.Popen(
      [sys.executable, '-m', 'dreamer_ver.main', '--script', 'parallel',
       '--logdir', str(logdir), '--run.steps', str(steps), *FLAGS],
      cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
      text=True)


def _pid(logdir, name):
  path = Path(logdir) / 'pids' / name
  return int(path.read_text()) if path.exists() else None


def _alive(pid):
  try:
    os.kill(pid, 0)
    return True
  except ProcessLookupError:
    return False


def _wait_for(predicate, timeout, poll=0.5):
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    if predicate():
      return True
    time.sleep(poll)
  return False


def _served(logdir):
  path = Path(logdir) / 'ckpt' / 'logger.json'
  return json.loads(path.read_text())['step'] if path.exists() else 0


def test_killed_env_and_replay_are_restarted_and_the_run_finishes(tmp_path):
  logdir = tmp_path / 'run'
  proc = _start(logdir, 1500)
  try:
    assert _wait_for(lambda: _served(logdir) > 150, 240), 'run never started'
    env_pid, replay_pid = _pid(logdir, 'env0'), _pid(logdir, 'replay')
    os.kill(env_pid, signal.SIGKILL)
    assert _wait_for(lambda: _pid(logdir, 'env0') not in (None, env_pid), 60)
    os.kill(replay_pid, signal.SIGKILL)
    assert _wait_for(lambda: _pid(logdir, 'replay') not in (None, replay_pid), 60)
    out, _ = proc.communicate(timeout=300)
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  assert proc.returncode == 0, out[-3000:]
  assert 'env0 exited with code -9; restarting' in out
  assert 'replay exited with code -9; restarting' in out
  counters = json.loads((logdir / 'ckpt' / 'counters.json').read_text())
  assert counters['steps'] >= 1500
  # Every component is gone after the run.
  for name in ('env0', 'env1', 'replay', 'logger'):
    assert not _alive(_pid(logdir, name)), name
  # The restarted env's half episode was not logged as finished.
  scores = [json.loads(l) for l in (logdir / 'scores.jsonl').open()]
  assert scores and all(s['length'] == 20 for s in scores)


def test_sigterm_stops_everything_quickly_and_the_rerun_resumes(tmp_path):
  logdir = tmp_path / 'run'
  proc = _start(logdir, 100_000)
  try:
    assert _wait_for(lambda: _served(logdir) > 100, 240), 'run never started'
    children = [_pid(logdir, n) for n in ('env0', 'replay', 'logger')]
    proc.send_signal(signal.SIGTERM)
    start = time.monotonic()
    out, _ = proc.communicate(timeout=60)
    elapsed = time.monotonic() - start
  finally:
    if proc.poll() is None:
      proc.kill()
      proc.wait()
  assert proc.returncode == 0, out[-3000:]
  assert elapsed < 20, elapsed  # 15 s budget plus interpreter exit.
  assert not any(_alive(pid) for pid in children)
  saved = json.loads((logdir / 'ckpt' / 'counters.json').read_text())
  assert saved['steps'] > 0
  proc = _start(logdir, saved['steps'] + 100)
  out, _ = proc.communicate(timeout=300)
  assert proc.returncode == 0, out[-3000:]
  assert f'Agent resumed at step {saved["steps"]}' in out
