"""Faults a long run must survive, on the real parallel runtime."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from bench.soaks.watch import wait as _wait_for
from helpers import ROOT
from helpers.processes import process_state
FLAGS = ['--configs', 'debug', '--task', 'synthetic_bandit',
         '--env.synthetic.length', '20', '--env.synthetic.step_time', '0.005',
         '--run.log_every', '2', '--run.save_every', '3']


def _start(logdir, steps, output=None, hook=None):
  """The run, a process group of its own (as a shell's job); `output`: a
  file for its output, to read while it runs (else a pipe, read at its
  end); `hook`: a change to the learner in each of its processes
  (LEARNER_HOOK: 'fault' or 'hold'), which leaves the marker file
  `hook_happened` beside the logdir."""
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu', 'PYTHONUNBUFFERED': '1'}
  if hook is not None:
    folder = Path(logdir).parent / 'hook'
    folder.mkdir(exist_ok=True)
    (folder / 'sitecustomize.py').write_text(LEARNER_HOOK)
    env.update(LEARNER_HOOK=hook, LEARNER_HOOK_MARKER=str(
        Path(logdir).parent / 'hook_happened'), PYTHONPATH=os.pathsep.join(
            [str(folder), os.environ.get('PYTHONPATH', '')]))
  stdout = subprocess.PIPE if output is None else open(output, 'w')
  try:
    return subprocess.Popen(
        [sys.executable, '-m', 'dreamer_ver.main', '--script', 'parallel',
         '--logdir', str(logdir), '--run.steps', str(steps), *FLAGS],
        cwd=ROOT, env=env, stdout=stdout, stderr=subprocess.STDOUT,
        text=True, start_new_session=True)
  finally:
    if output is not None:
      stdout.close()  # The run has its own copy.


def _sigterm(proc, group=False):
  """Ends a run the way a user does (`group`: `timeout`, a scheduler or
  `kill -- -PGID`, which signal every process at once); returns its
  output (None where it went to a file)."""
  if group:
    os.killpg(proc.pid, signal.SIGTERM)
  else:
    proc.send_signal(signal.SIGTERM)
  return proc.communicate(timeout=60)[0]


def _kill(proc):
  """Cleans up after a failed check: the run must not outlive the test."""
  if proc.poll() is None:
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _pid(logdir, name):
  path = Path(logdir) / 'pids' / name
  return int(path.read_text()) if path.exists() else None


def _alive(pid):
  try:
    os.kill(pid, 0)
    return True
  except ProcessLookupError:
    return False


def _served(logdir):
  path = Path(logdir) / 'ckpt' / 'logger.json'
  return json.loads(path.read_text())['step'] if path.exists() else 0


def _chunk_rows(logdir):
  """Train steps in the saved replay chunk files (the length is the last
  field of the name)."""
  rows = {}  # A kill mid-rewrite can leave two files of one chunk.
  for path in (Path(logdir) / 'replay').glob('*.npz'):
    _, uuid, _, length = path.stem.split('-')
    rows[uuid] = max(rows.get(uuid, 0), int(length))
  return sum(rows.values())


def test_killed_env_and_replay_are_restarted_and_the_run_goes_on(tmp_path):
  logdir = tmp_path / 'run'
  proc = _start(logdir, 10 ** 6)  # Ends by SIGTERM (see the logger test).
  try:
    assert _wait_for(lambda: _served(logdir) > 150, 240), 'run never started'
    env_pid, replay_pid = _pid(logdir, 'env0'), _pid(logdir, 'replay')
    os.kill(env_pid, signal.SIGKILL)
    assert _wait_for(lambda: _pid(logdir, 'env0') not in (None, env_pid), 60)
    os.kill(replay_pid, signal.SIGKILL)
    killed_at = time.time()
    # What the dead replay left behind (its restart is >= 1 s away).
    saved = json.loads((logdir / 'ckpt' / 'replay.json').read_text())
    saved_rows = _chunk_rows(logdir)
    assert _wait_for(lambda: _pid(logdir, 'replay') not in (None, replay_pid), 60)
    served = _served(logdir)
    assert _wait_for(lambda: _served(logdir) > served + 300, 120), (
        'the run did not go on after the restarts')
    out = _sigterm(proc)
  finally:
    _kill(proc)
  assert proc.returncode == 0, out[-3000:]
  assert 'env0 exited with code -9; restarting' in out
  assert 'replay exited with code -9; restarting' in out
  # The agent rides out the replay's death on its own links (a client whose
  # resend failed once died instead: test_client's resending test); a
  # restart of it would also void the count below.
  assert 'agent exited with code' not in out, _agent_lines(out)
  counters = json.loads((logdir / 'ckpt' / 'counters.json').read_text())
  assert counters['steps'] > served
  # Transitions lost with the replay: none. Every row the replay
  # acknowledged is in its write-ahead log, and resent batches are stored
  # once, so the only shortfall at the end is what was still in flight when
  # the agent stopped (its replay link holds at most 8 calls of at most
  # run.envs + run.eval_envs = 5 rows).
  final = json.loads((logdir / 'ckpt' / 'replay.json').read_text())
  rows = _chunk_rows(logdir)
  lost = counters['steps'] - rows
  since_save = killed_at - saved['time']
  fps = max(m.get('fps/policy', 0) for m in _metrics(logdir))
  loaded = [l for l in out.splitlines() if l.startswith('[replay] loaded')]
  print(f'\n[replay kill] last save {since_save:.3f} s before the kill: '
        f'{saved["limiter"]["size"]} inserts counted, {saved_rows} rows in '
        f'chunk files; restart: {loaded[-1].split(" from ")[0]!r}; run end: '
        f'actor served {counters["steps"]}, replay rows {rows}, replay '
        f'inserts counted {final["limiter"]["size"]}; LOST {lost} '
        f'transitions (arrivals since the last save: <= {fps:.0f} '
        f'steps/s x {since_save:.2f} s = {fps * since_save:.0f})')
  assert 0 <= lost <= 8 * 5, (lost, since_save, fps)
  # The saved count never runs ahead of the saved rows.
  assert saved_rows >= saved['limiter']['size']
  assert rows >= final['limiter']['size']
  # Every component is gone after the run.
  for name in ('env0', 'env1', 'replay', 'logger'):
    assert not _alive(_pid(logdir, name)), name
  # The restarted env's half episode was not logged as finished.
  scores = [json.loads(l) for l in (logdir / 'scores.jsonl').open()]
  assert scores and all(s['length'] == 20 for s in scores)


def _agent_lines(out):
  """The lines of a run's output that say why the agent stopped."""
  keys = ('Agent failed', 'agent exited', 'Traceback', 'Error', 'raise')
  return '\n'.join(line for line in out.splitlines()
                   if any(key in line for key in keys))[-4000:]


@pytest.mark.parametrize('group', [False, True], ids=['run', 'group'])
def test_sigterm_stops_everything_quickly_and_the_rerun_resumes(
    tmp_path, group):
  """SIGTERM to the run, or to every process of it at once: the children
  stop in the supervisor's order (envs and agent, then the servers that
  save what they sent), none is killed, and a rerun resumes. The signal to
  the run lands while it trains; the signal to every process while the
  learner compiles (`hold`: a compile that never ends, as XLA's cannot be
  interrupted): the agent saves without waiting for it."""
  logdir, log = tmp_path / 'run', tmp_path / 'output.log'
  proc = _start(logdir, 100_000, output=log, hook='hold' if group else None)
  started = (lambda: 'First action served' in log.read_text()) if group else (
      lambda: 'Learner compiled' in log.read_text() and _served(logdir) > 100)
  try:
    assert _wait_for(started, 240), 'run never started'
    children = [_pid(logdir, n) for n in ('env0', 'replay', 'logger')]
    start = time.monotonic()
    _sigterm(proc, group)
    elapsed = time.monotonic() - start
  finally:
    _kill(proc)
  out = log.read_text()
  assert proc.returncode == 0, out[-3000:]
  assert elapsed < 20, elapsed  # 15 s budget plus interpreter exit.
  assert 'did not stop within' not in out and 'Traceback' not in out, (
      out[-3000:])
  if group:
    assert 'Compiling the learner' in out, out[-3000:]
    assert (tmp_path / 'hook_happened').exists(), 'no compile was held'
  assert not any(_alive(pid) for pid in children)
  saved = json.loads((logdir / 'ckpt' / 'counters.json').read_text())
  assert saved['steps'] > 0
  proc = _start(logdir, saved['steps'] + 100)
  out, _ = proc.communicate(timeout=300)
  assert proc.returncode == 0, out[-3000:]
  assert f'Agent resumed at step {saved["steps"]}' in out


def _metrics(logdir):
  path = Path(logdir) / 'metrics.jsonl'
  if not path.exists():
    return []
  return [json.loads(line) for line in path.read_text().splitlines() if line]


def _counters(logdir):
  path = Path(logdir) / 'ckpt' / 'counters.json'
  return json.loads(path.read_text()) if path.exists() else {
      'steps': 0, 'version': 0}


def test_killed_logger_is_restarted_and_metrics_resume(tmp_path):
  logdir = tmp_path / 'run'
  # More steps than it can serve in the test: it ends by SIGTERM, so how
  # fast the machine is cannot end the run before the checks.
  proc = _start(logdir, 10 ** 6)
  try:
    assert _wait_for(lambda: _served(logdir) > 150 and _metrics(logdir), 240), (
        'run never started')
    pid = _pid(logdir, 'logger')
    before = _metrics(logdir)
    last_step = max(m['step'] for m in before)
    os.kill(pid, signal.SIGKILL)
    killed = _counters(logdir)
    assert _wait_for(lambda: _pid(logdir, 'logger') not in (None, pid), 60)
    # Training goes on: the learner publishes and saves newer params.
    assert _wait_for(
        lambda: _counters(logdir)['version'] > killed['version'], 60)
    # Metrics resume: the restarted logger writes lines past the old step,
    # the learner's among them.
    assert _wait_for(lambda: any(
        m['step'] > last_step for m in _metrics(logdir)[len(before):]), 60)
    assert _wait_for(lambda: any(
        'train/loss/dyn' in m for m in _metrics(logdir)[len(before):]), 60), (
            'no train metrics resumed')
    out = _sigterm(proc)
  finally:
    _kill(proc)
  assert proc.returncode == 0, out[-3000:]
  assert 'logger exited with code -9; restarting' in out
  assert '[logger] resumed at step' in out
  assert _counters(logdir)['steps'] > killed['steps']
  for name in ('env0', 'replay', 'logger'):
    assert not _alive(_pid(logdir, name)), name


def test_hung_env_never_blocks_the_others_and_is_stopped_at_the_end(tmp_path):
  logdir = tmp_path / 'run'
  proc = _start(logdir, 10 ** 6)  # Ends by SIGTERM (see the logger test).
  pid = None
  try:
    assert _wait_for(lambda: _served(logdir) > 150, 240), 'run never started'
    pid = _pid(logdir, 'env0')
    # Hung: it stops responding but its socket stays open.
    os.kill(pid, signal.SIGSTOP)
    assert _wait_for(lambda: process_state(pid) == 'T', 10)
    served = _served(logdir)
    assert _wait_for(lambda: _served(logdir) > served + 300, 120), (
        'env steps stalled behind the hung env')
    assert process_state(pid) == 'T'  # Still hung, never restarted or resumed.
    assert _pid(logdir, 'env0') == pid
    out = _sigterm(proc)
  finally:
    _kill(proc)
    if pid is not None and process_state(pid) is not None:
      os.kill(pid, signal.SIGKILL)
  assert proc.returncode == 0, out[-3000:]
  assert _counters(logdir)['steps'] > served
  # The stopped child got SIGCONT with its SIGTERM: it stopped by itself
  # instead of being killed after the 15 s deadline.
  assert 'did not stop within' not in out, out[-3000:]
  assert process_state(pid) is None
  for name in ('env1', 'replay', 'logger'):
    assert not _alive(_pid(logdir, name)), name


def _component(logdir, script, flags, log):
  """One component of a split launch (launch/local.sh), output to `log`."""
  env = {**os.environ, 'JAX_PLATFORMS': 'cpu', 'PYTHONUNBUFFERED': '1'}
  with open(log, 'w') as file:
    return subprocess.Popen(
        [sys.executable, '-m', 'dreamer_ver.main', '--script', script,
         '--logdir', str(logdir), *flags],
        cwd=ROOT, env=env, stdout=file, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)


def test_killed_agent_restarts_from_its_checkpoint_and_envs_reconnect(
    tmp_path):
  """A split launch (launch/local.sh): SIGKILL the agent process; its
  `parallel_agent` supervisor restarts it, it resumes from its checkpoint,
  and the env processes reconnect without being restarted."""
  from dreamer_ver.rpc.addresses import free_port
  logdir = tmp_path / 'run'
  # Ends by SIGTERM, not by its step count (see the logger test).
  flags = [*FLAGS, '--run.steps', str(10 ** 6),
           '--run.actor_addr', f'127.0.0.1:{free_port()}',
           '--run.replay_addr', f'127.0.0.1:{free_port()}',
           '--run.logger_addr', f'127.0.0.1:{free_port()}']
  agent_flags = [*flags, '--run.remote_envs', 'True',
                 '--run.remote_replay', 'True']
  procs, envs = {}, {}
  try:
    for name in ('parallel_logger', 'parallel_replay', 'parallel_envs',
                 'parallel_agent'):
      procs[name] = _component(
          logdir, name, agent_flags if name == 'parallel_agent' else flags,
          tmp_path / f'{name}.log')
    stored = lambda: max(
        (m.get('replay/items', 0) for m in _metrics(logdir)), default=0)
    assert _wait_for(
        lambda: _counters(logdir)['steps'] > 150 and stored() > 0, 240), (
            'agent never saved, or replay never logged its items')
    envs = {name: _pid(logdir, name) for name in ('env0', 'env1', 'env4')}
    items = stored()
    first = _pid(logdir, 'agent')
    os.kill(first, signal.SIGKILL)
    saved = _counters(logdir)
    lines = len(_metrics(logdir))
    # It is restarted, resumes and makes progress: a later save has more
    # steps and newer params than the one it started from.
    assert _wait_for(lambda: _pid(logdir, 'agent') not in (None, first), 60)
    assert _wait_for(lambda: (
        _counters(logdir)['steps'] > saved['steps'] + 100 and
        _counters(logdir)['version'] > saved['version']), 240), (
            (tmp_path / 'parallel_agent.log').read_text()[-3000:])
    agent = procs['parallel_agent']
    agent.send_signal(signal.SIGTERM)
    assert agent.wait(timeout=60) == 0, (
        tmp_path / 'parallel_agent.log').read_text()[-3000:]
    out = (tmp_path / 'parallel_agent.log').read_text()
    assert 'agent exited with code -9; restarting' in out, out[-3000:]
    assert f'Agent resumed at step {saved["steps"]} ' in out, out[-3000:]
    assert not _alive(_pid(logdir, 'agent'))
    # The env processes were never restarted: the same ones reconnected.
    assert envs == {name: _pid(logdir, name) for name in envs}
    assert all(_alive(pid) for pid in envs.values())
    # The replay server kept its data throughout.
    for name in ('parallel_logger', 'parallel_replay', 'parallel_envs'):
      assert procs[name].poll() is None, name
    after = [m['replay/items'] for m in _metrics(logdir)[lines:]
             if 'replay/items' in m]
    assert after and min(after) >= items > 0, (items, after)
    for name in ('parallel_envs', 'parallel_replay', 'parallel_logger'):
      procs[name].send_signal(signal.SIGTERM)
      assert procs[name].wait(timeout=30) == 0, name
  finally:
    for proc in procs.values():
      _kill(proc)
    for path in (logdir / 'pids').glob('*'):
      pid = int(path.read_text())
      if _alive(pid):
        os.kill(pid, signal.SIGKILL)
  assert not any(_alive(pid) for pid in envs.values())


# Every Python process's sitecustomize (through PYTHONPATH): as the agent
# imports the learner, `$LEARNER_HOOK` changes its Learner: 'fault' raises
# at the third update of the run (once: the marker file says it happened),
# 'hold' makes each compile wait forever once done (the marker says one
# began).
LEARNER_HOOK = """
import importlib.abc, importlib.util, os, sys, threading

class _Hook(importlib.abc.MetaPathFinder):
  def find_spec(self, name, path, target=None):
    if name != 'dreamer_ver.learner.learner':
      return None
    sys.meta_path.remove(self)
    spec = importlib.util.find_spec(name)
    run_module = spec.loader.exec_module
    marker = os.environ['LEARNER_HOOK_MARKER']
    def exec_module(module):
      run_module(module)
      Learner = module.Learner
      if os.environ['LEARNER_HOOK'] == 'hold':
        compile = Learner.compile
        def held_compile(self):
          open(marker, 'w').close()
          compile(self)
          threading.Event().wait()
        Learner.compile = held_compile
        return
      train_step = Learner.train_step
      calls = []
      def failing_train_step(self, batch):
        calls.append(1)
        if len(calls) == 3 and not os.path.exists(marker):
          open(marker, 'w').close()
          raise RuntimeError('injected learner fault')
        return train_step(self, batch)
      Learner.train_step = failing_train_step
    spec.loader.exec_module = exec_module
    return spec

sys.meta_path.insert(0, _Hook())
"""


def test_a_failed_learner_restarts_the_agent_and_the_run_completes(tmp_path):
  logdir = tmp_path / 'run'
  proc = _start(logdir, 400, hook='fault')
  try:
    out = proc.communicate(timeout=420)[0]
  finally:
    _kill(proc)
  assert proc.returncode == 0, out[-3000:]
  assert (tmp_path / 'hook_happened').exists(), 'the fault was never injected'
  assert 'RuntimeError: injected learner fault' in out, out[-3000:]
  assert out.count("Agent failed: the learner raised RuntimeError("
                   "'injected learner fault')") == 1, out[-3000:]
  assert 'agent exited with code 1; restarting' in out, out[-3000:]
  assert 'Agent resumed at step' in out, out[-3000:]
  # The restarted agent trained on (its params moved past the first
  # agent's) and the run reached its step count.
  counters = _counters(logdir)
  assert counters['steps'] >= 400, counters
  assert counters['version'] > 2, counters


def test_a_component_that_fails_before_it_ever_served_stops_its_run(
    tmp_path):
  """A replay server that crashes at start (a folder where its checkpoint
  file belongs; a damaged file is a one-line ConfigError instead, tested
  in tests/replay) never served, so a restart would fail the same way;
  the split launch stops at once, exits non-zero and says why (it used to
  restart for ever). Crash loops of a child that had served are tested
  with a fake clock in tests/cluster/test_supervisor.py."""
  from dreamer_ver.rpc.addresses import free_port
  logdir = tmp_path / 'run'
  (logdir / 'ckpt' / 'replay.json').mkdir(parents=True)
  start = time.monotonic()
  proc = subprocess.run(
      [sys.executable, '-m', 'dreamer_ver.main', '--script',
       'parallel_replay', '--configs', 'debug', '--logdir', str(logdir),
       '--run.replay_addr', f'127.0.0.1:{free_port()}',
       '--run.actor_addr', f'127.0.0.1:{free_port()}',
       '--run.logger_addr', f'127.0.0.1:{free_port()}', '--run.crash_limit', '3',
       '--run.crash_window', '120'],
      cwd=ROOT, capture_output=True, text=True, timeout=180)
  out = proc.stdout + proc.stderr
  assert proc.returncode not in (0, None), out[-2000:]
  assert 'replay failed before it ever served (exit code 1' in out, out[-2000:]
  assert out.count('IsADirectoryError:') == 1  # One start, its own error.
  assert time.monotonic() - start < 60
