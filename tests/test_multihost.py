"""A multi-host learner on loopback, as a user launches one: `--script
parallel` as process 0 (the agent with the first learner, replay, logger,
envs) and `--script parallel_learner` as process 1, joined by
`jax.distributed` with CPU collectives over Gloo. Both learners train the
same updates, each on its own share of every batch, and stop together."""

import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from dreamer_ver.rpc.addresses import free_port

ROOT = Path(__file__).resolve().parent.parent
FLAGS = ['--configs', 'debug', '--task', 'synthetic_bandit',
         '--env.synthetic.length', '20', '--run.log_every', '1',
         '--run.report_every', '1', '--run.save_every', '5',
         '--jax.processes', '2']


def test_two_learner_processes_train_in_lockstep_and_stop_together(tmp_path):
  logdir = tmp_path / 'run'
  shared = [*FLAGS, '--logdir', str(logdir),
            '--jax.coordinator', f'127.0.0.1:{free_port()}',
            '--run.replay_addr', f'127.0.0.1:{free_port()}']
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu', 'PYTHONUNBUFFERED': '1'}
  logs = {name: tmp_path / f'{name}.log' for name in ('agent', 'learner')}
  commands = {
      'agent': ['--script', 'parallel', '--jax.process_id', '0',
                '--run.steps', '400'],
      'learner': ['--script', 'parallel_learner', '--jax.process_id', '1']}
  procs = {}
  try:
    for name, command in commands.items():
      with open(logs[name], 'w') as log:
        procs[name] = subprocess.Popen(
            [sys.executable, '-m', 'dreamer_ver.main', *command, *shared],
            cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True)
    codes = {name: procs[name].wait(timeout=300) for name in procs}
  finally:
    for proc in procs.values():  # With their supervised children.
      if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
  out = {name: path.read_text() for name, path in logs.items()}
  assert codes == {'agent': 0, 'learner': 0}, (
      out['agent'][-3000:], out['learner'][-3000:])
  for text in out.values():
    assert 'restarting in' not in text and 'Traceback' not in text, text[-3000:]
  counters = json.loads((logdir / 'ckpt' / 'counters.json').read_text())
  stopped = re.search(r'Learner process 1 stopped at params version (\d+)',
                      out['learner'])
  assert stopped, out['learner'][-3000:]
  # The same number of updates: every update was a step of both processes.
  assert int(stopped.group(1)) == counters['version'] >= 2, (
      stopped.group(1), counters)
  # Process 1 never wrote into the logdir: config.yaml is process 0's.
  assert 'process_id: 0' in (logdir / 'config.yaml').read_text()
  metrics = [json.loads(line) for line in
             (logdir / 'metrics.jsonl').read_text().splitlines()]
  keys = set().union(*metrics)
  # Reports ran (a collective of both processes) and the loss was logged.
  assert {'train/loss/dyn', 'report/loss/dyn'} <= keys, sorted(keys)
