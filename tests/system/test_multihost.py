"""A multi-host learner on loopback, as a user launches one: `--script
parallel` as process 0 (the agent with the first learner, replay, logger,
envs) and `--script parallel_learner` as process 1, joined by
`jax.distributed` with CPU collectives over Gloo. Both learners train the
same updates, each on its own share of every batch, and stop together
(SIGTERM to process 1 stops the agent too, which saves); a learner process
that dies takes the agent's learner down with it, and both come back and
finish the run."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from dreamer_ver.rpc.addresses import free_port

from helpers import ROOT
FLAGS = ['--configs', 'debug', '--task', 'synthetic_bandit',
         '--env.synthetic.length', '20', '--run.log_every', '1',
         '--run.report_every', '1', '--run.save_every', '5',
         '--jax.processes', '2']
STOPPED = re.compile(r'Learner process 1 stopped at params version (\d+) '
                     r'\(params checksum ([0-9.e+-]+)\)')


def _launch(tmp_path, steps):
  """Starts process 0 and process 1 (each its own session, so a cleanup
  can kill them with their supervised children); returns (procs, logs)."""
  shared = [*FLAGS, '--logdir', str(tmp_path / 'run'),
            '--jax.coordinator', f'127.0.0.1:{free_port()}',
            '--run.replay_addr', f'127.0.0.1:{free_port()}']
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu', 'PYTHONUNBUFFERED': '1'}
  commands = {
      'agent': ['--script', 'parallel', '--jax.process_id', '0',
                '--run.steps', str(steps)],
      'learner': ['--script', 'parallel_learner', '--jax.process_id', '1']}
  procs, logs = {}, {}
  for name, command in commands.items():
    logs[name] = tmp_path / f'{name}.log'
    with open(logs[name], 'w') as log:
      procs[name] = subprocess.Popen(
          [sys.executable, '-m', 'dreamer_ver.main', *command, *shared],
          cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
          start_new_session=True)
  return procs, logs


def _finish(procs, logs, timeout=300):
  """Both exit codes and logs; kills whatever is left after `timeout`."""
  try:
    codes = {name: proc.wait(timeout=timeout) for name, proc in procs.items()}
  finally:
    for proc in procs.values():
      if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
  return codes, {name: path.read_text() for name, path in logs.items()}


def check_lockstep(logdir, learner_output):
  """Both processes stopped after the same update with the same params:
  process 1's last report (in its output) against the checkpoint process 0
  saved."""
  counters = json.loads((logdir / 'ckpt' / 'counters.json').read_text())
  stopped = STOPPED.findall(learner_output)
  assert stopped, learner_output[-3000:]
  version, checksum = stopped[-1]
  assert int(version) == counters['version'] >= 2, (stopped, counters)
  with np.load(logdir / 'ckpt' / 'agent.npz') as saved:
    saved = sum(float(np.abs(saved[key].astype(np.float64)).sum())
                for key in saved.files if key.startswith("['params']"))
  assert saved > 0 and float(checksum) == pytest.approx(saved, rel=1e-9)


def wait_for_updates(logdir, updates, timeout=240):
  """Until the logged `train/updates` reaches `updates`."""
  deadline = time.monotonic() + timeout
  path = logdir / 'metrics.jsonl'
  while time.monotonic() < deadline:
    if path.exists():
      logged = [json.loads(line).get('train/updates', 0)
                for line in path.read_text().splitlines()]
      if max(logged, default=0) >= updates:
        return
    time.sleep(0.5)
  raise AssertionError(f'fewer than {updates} updates logged')


def test_two_learner_processes_train_in_lockstep_and_stop_together(tmp_path):
  """SIGTERM to process 1's launcher (as a user stops one host) stops both
  learners after the same update; the agent saves and exits 0."""
  procs, logs = _launch(tmp_path, steps=10 ** 6)
  try:
    wait_for_updates(tmp_path / 'run', 4)
    procs['learner'].send_signal(signal.SIGTERM)
  finally:
    codes, out = _finish(procs, logs)
  assert codes == {'agent': 0, 'learner': 0}, (
      out['agent'][-3000:], out['learner'][-3000:])
  for text in out.values():
    assert 'restarting in' not in text and 'Traceback' not in text, text[-3000:]
  logdir = tmp_path / 'run'
  check_lockstep(logdir, out['learner'])
  # Process 1 never wrote into the logdir: config.yaml is process 0's.
  assert 'process_id: 0' in (logdir / 'config.yaml').read_text()
  metrics = [json.loads(line) for line in
             (logdir / 'metrics.jsonl').read_text().splitlines()]
  keys = set().union(*metrics)
  # Reports ran (a collective of both processes) and the loss was logged.
  assert {'train/loss/dyn', 'report/loss/dyn'} <= keys, sorted(keys)


def test_a_killed_learner_process_restarts_with_the_agent(tmp_path):
  procs, logs = _launch(tmp_path, steps=1500)
  try:
    wait_for_updates(tmp_path / 'run', 2)
    supervisor = procs['learner'].pid
    child = subprocess.run(
        ['pgrep', '-P', str(supervisor), '-f', 'spawn_main'],
        capture_output=True, text=True).stdout.split()
    assert child, 'no supervised learner process'
    os.kill(int(child[0]), signal.SIGKILL)
  finally:
    codes, out = _finish(procs, logs)
  assert codes == {'agent': 0, 'learner': 0}, (
      out['agent'][-3000:], out['learner'][-3000:])
  # The learner was restarted, and the agent, whose collectives failed,
  # exited and was restarted too; both then trained the run to its end.
  assert 'learner exited with code -9; restarting' in out['learner']
  assert re.search(r'agent exited with code -?\d+; restarting',
                   out['agent']), out['agent'][-3000:]
  assert out['learner'].count('training from') >= 2
  check_lockstep(tmp_path / 'run', out['learner'])
