"""The supervisor of child processes (cluster/supervisor.py) and how the
agent process names its first failure (runtime/agent_process.py)."""

import os
import signal
import sys
import time
from pathlib import Path

import pytest

from bench.soaks.watch import wait as _wait_for
from helpers import ROOT
from helpers.processes import process_state, running


def _wait_for_stop(config, ready):
  """A child that runs until SIGTERM/SIGINT, then exits 0."""
  from dreamer_ver.cluster.signals import StopSignal
  stop = StopSignal()
  Path(ready).write_text('ready')
  while not stop.wait(0.1):
    pass
  return 0


def test_stop_all_stops_a_sigstopped_child_gracefully(tmp_path):
  from types import SimpleNamespace
  from dreamer_ver.cluster.supervisor import Supervisor
  children = Supervisor()
  ready = tmp_path / 'ready'
  proc = children.start('env0', f'{__name__}:_wait_for_stop',
                        SimpleNamespace(logdir=str(tmp_path)), str(ready))
  try:
    assert _wait_for(ready.exists, 60, poll=0.1)
    os.kill(proc.pid, signal.SIGSTOP)
    assert _wait_for(lambda: process_state(proc.pid) == 'T', 10, poll=0.1)
    start = time.monotonic()
    children.stop_all()
    elapsed = time.monotonic() - start
  finally:
    if proc.is_alive():
      proc.kill()
  # SIGTERM alone stays pending while a process is stopped: stop_all would
  # wait out its 15 s and SIGKILL it (exit code -9), losing its save.
  assert proc.exitcode == 0 and elapsed < 5, (proc.exitcode, elapsed)


def test_a_child_that_exits_cleanly_is_not_restarted(tmp_path):
  from types import SimpleNamespace
  from dreamer_ver.cluster.supervisor import Supervisor
  children = Supervisor(backoff=(0.0, 0.0), shutdown=1.0)
  ready = tmp_path / 'ready'
  proc = children.start('env0', f'{__name__}:_wait_for_stop',
                        SimpleNamespace(logdir=str(tmp_path)), str(ready))
  try:
    assert _wait_for(ready.exists, 60, poll=0.1)
    # A SIGINT its supervisor did not send (an operator's): the child waits
    # for the supervisor's order (twice its stop grace), gets none, then
    # saves and exits 0: not a crash.
    os.kill(proc.pid, signal.SIGINT)
    proc.join(10)
    assert proc.exitcode == 0
    for _ in range(3):
      children.supervise()
    assert children.procs['env0'] is proc and not children.restarts
  finally:
    children.stop_all()


def _crash(config):
  """A child that fails at once."""
  del config
  return 3


def test_restart_policy_is_a_parameter_of_start(tmp_path):
  from types import SimpleNamespace
  from dreamer_ver.cluster.supervisor import Supervisor
  children = Supervisor(backoff=(0.0, 0.0))
  config = SimpleNamespace(logdir=str(tmp_path))
  kept = children.start('kept', f'{__name__}:_crash', config)
  left = children.start('left', f'{__name__}:_crash', config, restart=False)
  try:
    kept.join(60)
    left.join(60)
    assert kept.exitcode == left.exitcode == 3
    assert _wait_for(lambda: children.supervise() or children.restarts[
        'kept'] >= 2, 60, poll=0.1)
    assert children.restarts['left'] == 0 and children.procs['left'] is left
  finally:
    children.stop_all()


def test_failure_names_the_first_dead_part_of_the_agent():
  from types import SimpleNamespace as Fake
  from dreamer_ver.runtime.agent_process import failure
  server = Fake(error=None)
  links = {'actor to replay': Fake(error=None),
           'learner to logger': Fake(error=None)}
  assert failure([], server, links) is None
  links['learner to logger'].error = OSError('bad fd')
  assert failure([], server, links) == (
      "the learner to logger link failed: OSError('bad fd')")
  server.error = ValueError('loop died')
  assert failure([], server, links) == (
      "the batch server failed: ValueError('loop died')")
  assert failure([KeyError('x')], server, links) == (
      "the learner raised KeyError('x')")


class _FakeProc:
  """A child process stand-in: alive until `die(code)`."""

  def __init__(self):
    self.exitcode = None

  def is_alive(self):
    return self.exitcode is None

  def die(self, code):
    self.exitcode = code


def test_backoff_doubles_while_a_child_crashes_and_resets_once_it_ran_stably():
  from dreamer_ver.cluster.supervisor import Supervisor
  now = [0.0]

  class FakeSupervisor(Supervisor):
    def _spawn(self, name, target, config, args):
      return _FakeProc()

  children = FakeSupervisor(backoff=(1.0, 30.0), stable=60.0,
                          clock=lambda: now[0])
  children.start('agent', 'unused:target', None)
  waits = []

  def crash_at(t):
    """Kills the child at t; returns the wait before its restart."""
    now[0] = t
    proc = children.procs['agent']
    proc.die(1)
    children.supervise()
    wait = children.due['agent'] - t
    now[0] = children.due['agent']
    children.supervise()
    assert children.procs['agent'] is not proc, 'not restarted'
    return wait

  for ran in (0.5, 2.0, 1.0, 100.0, 3.0):  # Seconds each start lives.
    waits.append(crash_at(now[0] + ran))
  # Three quick crashes: 1, 2, 4 s; a start that lived 100 s: back to 1 s.
  assert waits == [1.0, 2.0, 4.0, 1.0, 2.0]
  assert children.restarts['agent'] == 5


def test_a_crash_loop_stops_the_run_with_a_failure_instead_of_restarting_forever():
  """A child failing `crash_limit` times within `crash_window` seconds (a
  damaged checkpoint, a bad flag: it will always fail) is not restarted
  again; waiting on the run returns non-zero at once. Crashes spread wider
  than the window are restarted, however many."""
  from dreamer_ver.cluster.supervisor import Supervisor
  now = [0.0]

  class FakeSupervisor(Supervisor):
    def _spawn(self, name, target, config, args):
      return _FakeProc()

  def crash(children, name, code=1):
    children.procs[name].die(code)
    children.supervise()  # Seen: a restart is due (or not).
    if name in children.due:
      now[0] = children.due[name]
      children.supervise()

  spread = FakeSupervisor(backoff=(1.0, 1.0), clock=lambda: now[0],
                        crash_limit=3, crash_window=60.0)
  spread.start('replay', 'unused:target', None)
  for _ in range(6):
    now[0] += 40.0  # Two crashes per window at most.
    crash(spread, 'replay')
  assert spread.restarts['replay'] == 6 and spread.gave_up is None

  loop = FakeSupervisor(backoff=(1.0, 1.0), clock=lambda: now[0],
                      crash_limit=3, crash_window=60.0)
  loop.start('replay', 'unused:target', None)
  loop.start('agent', 'unused:target', None)
  for _ in range(3):
    now[0] += 5.0
    crash(loop, 'replay', code=3)
  assert loop.restarts['replay'] == 2  # The third crash is not restarted.
  assert loop.gave_up == ('replay', 3)
  assert not loop.procs['replay'].is_alive()
  # Whatever the run waits for, it ends now, with the failure's exit code.
  loop.procs['agent'].join = lambda timeout: None
  assert loop.wait_for('agent', stop=False) == 3


SUPERVISOR = '''
import sys
from types import SimpleNamespace
sys.path[:0] = sys.argv[4:]
from dreamer_ver.cluster.signals import StopSignal
from dreamer_ver.cluster.supervisor import Supervisor
stop = StopSignal()
children = Supervisor(shutdown=float(sys.argv[2]))
for order, child in enumerate(sys.argv[3].split(',')):
  name, target = child.split('=')
  children.start(name, f'test_supervisor:{target}',
                 SimpleNamespace(logdir=sys.argv[1]), stop_order=order)
stop.wait(120)
children.stop_all()
'''


def _supervise(logdir, children, shutdown=15):
  """A supervisor process (a process group of its own, like a terminal's
  job) of `children`, 'name=function' of this module, stopped in that
  order; returns it once each child is ready and with each child's pid."""
  import subprocess
  here = str(Path(__file__).parent)
  supervisor = subprocess.Popen(
      [sys.executable, '-c', SUPERVISOR, str(logdir), str(shutdown),
       ','.join(children), here, str(ROOT / 'tests')],
      start_new_session=True)
  names = [child.split('=')[0] for child in children]
  ready = lambda: all((logdir / f'{n}.ready').exists() for n in names)
  if not _wait_for(ready, 60, poll=0.1):
    supervisor.kill()
    raise AssertionError('the children never got ready')
  return supervisor, {
      name: int((logdir / 'pids' / name).read_text()) for name in names}


def _ready(config, name):
  """Marks child `name` ready (its stop handlers are installed)."""
  (Path(config.logdir) / f'{name}.ready').write_text('ready')


def _ignore_sigterm(config):
  """A child stuck in a way SIGTERM does not end."""
  signal.signal(signal.SIGTERM, signal.SIG_IGN)
  _ready(config, 'replay')
  time.sleep(120)
  return 0


def _log_stop(config, name, seconds):
  """Waits for SIGTERM/SIGINT, takes `seconds` to save, then appends
  `name` to `logdir/stops`. It polls, as the components do: a signal that
  the kernel hands to another thread runs its handler only once the main
  thread runs Python again."""
  from dreamer_ver.cluster.signals import StopSignal
  stop = StopSignal()
  _ready(config, name)
  _wait_for(stop.is_set, 120, poll=0.1)
  time.sleep(seconds)
  with open(Path(config.logdir) / 'stops', 'a') as stops:
    stops.write(f'{name}\n')
  return 0


def _client(config):
  return _log_stop(config, 'client', 1.0)


def _server(config):
  return _log_stop(config, 'server', 0.0)


def _replay(config):
  return _log_stop(config, 'replay', 0.0)


@pytest.mark.parametrize('target,seconds', [
    ('_replay', 10), ('_ignore_sigterm', 1)])
def test_children_of_a_killed_supervisor_stop_and_free_the_logdir(
    tmp_path, target, seconds):
  """SIGKILL of a supervisor leaves no orphan: its child stops (gracefully,
  as on SIGTERM) within seconds, or is killed after the supervisor's stop
  grace (`seconds`) if it does not, and its role's lock on the logdir is
  free for the next owner."""
  from dreamer_ver.cluster.supervisor import lock_role
  supervisor, pids = _supervise(tmp_path, [f'replay={target}'], seconds)
  child = pids['replay']
  try:
    with pytest.raises(RuntimeError, match=f'replay.*pid {child}'):
      lock_role(tmp_path, 'replay')  # The live child holds it.
    supervisor.kill()
    supervisor.wait()
    assert _wait_for(lambda: not running(child), 10, poll=0.1), 'orphaned'
    os.close(lock_role(tmp_path, 'replay'))
    if target == '_replay':  # It saved.
      assert (tmp_path / 'stops').read_text() == 'replay\n'
  finally:
    supervisor.kill()
    if running(child):
      os.kill(child, signal.SIGKILL)


def test_a_child_told_to_stop_is_not_orphaned_when_its_supervisor_dies(
    tmp_path):
  """The supervisor orders the stop, then dies (SIGKILL) in its grace: the
  child that ignores SIGTERM is still killed after that grace."""
  supervisor, pids = _supervise(tmp_path, ['replay=_ignore_sigterm'], 3)
  child = pids['replay']
  try:
    supervisor.send_signal(signal.SIGTERM)  # stop_all: the order, SIGTERM,
    time.sleep(1.0)  # then its 3 s grace, in which it dies.
    supervisor.kill()
    supervisor.wait()
    assert _wait_for(lambda: not running(child), 15, poll=0.1), 'orphaned'
  finally:
    supervisor.kill()
    if running(child):
      os.kill(child, signal.SIGKILL)


@pytest.mark.parametrize('how', ['group', 'each'])
@pytest.mark.parametrize(
    'sig', [signal.SIGTERM, signal.SIGINT], ids=['SIGTERM', 'SIGINT'])
def test_a_signal_to_every_process_stops_the_children_in_order(
    tmp_path, sig, how):
  """A signal that reaches every process of a run at once (Ctrl-C or
  `timeout` to the process group; Slurm signals each process) stops the
  children as the supervisor orders: the client saves while its server
  still serves, then the server stops."""
  supervisor, pids = _supervise(
      tmp_path, ['client=_client', 'server=_server'])
  try:
    if how == 'group':
      os.killpg(supervisor.pid, sig)
    else:
      for pid in (supervisor.pid, *pids.values()):
        os.kill(pid, sig)
    assert supervisor.wait(timeout=30) == 0
  finally:
    try:
      os.killpg(supervisor.pid, signal.SIGKILL)  # What is left of the run.
    except ProcessLookupError:
      pass
  assert (tmp_path / 'stops').read_text().split() == ['client', 'server']


def _serve_until_stopped(config, port):
  """A child that serves heartbeats at `port` until SIGTERM/SIGINT."""
  from dreamer_ver.rpc.server import Server
  from dreamer_ver.cluster.signals import StopSignal
  stop = StopSignal()
  server = Server(port, 'Child', host='127.0.0.1').start()
  while not stop.wait(0.1):
    pass
  server.close()
  return 0


def test_a_hung_child_is_killed_named_and_restarted(tmp_path, capfd):
  """A child that answered heartbeats and then answers none for
  peer_timeout (SIGSTOP: the kernel still holds its socket, so only a
  heartbeat tells) is killed and restarted."""
  from types import SimpleNamespace
  from dreamer_ver.rpc.addresses import free_port
  from dreamer_ver.cluster.supervisor import Supervisor
  port = free_port()
  children = Supervisor(backoff=(0.0, 0.0), peer_timeout=2.0)
  proc = children.start('replay', f'{__name__}:_serve_until_stopped',
                        SimpleNamespace(logdir=str(tmp_path)), port,
                        probe=f'127.0.0.1:{port}')
  heartbeat = children.heartbeats['replay']
  try:
    def up():
      children.supervise()
      return heartbeat.answered is not None
    assert _wait_for(up, 60, poll=0.2), 'never answered a heartbeat'
    time.sleep(3)  # Alive and answering: longer than peer_timeout.
    children.supervise()
    assert children.procs['replay'] is proc and proc.is_alive()
    os.kill(proc.pid, signal.SIGSTOP)

    def restarted():
      children.supervise()
      return children.restarts['replay'] == 1
    assert _wait_for(restarted, 30, poll=0.2)
    assert proc.exitcode == -signal.SIGKILL
    out = capfd.readouterr().out
    assert f'replay (pid {proc.pid}) has answered no heartbeat' in out
    assert 'killed at 2 s' in out  # Reported before it was killed.
    assert _wait_for(up, 60, poll=0.2), 'the restarted child never answered'
  finally:
    children.stop_all()
    if proc.is_alive():
      proc.kill()
  assert children.procs['replay'].exitcode == 0


def _fail_at_start(config):
  """A child that fails before it serves (a mistake at start)."""
  del config
  print('ValueError: a mistake at start', flush=True)
  return 3


def test_a_child_that_fails_before_it_ever_served_stops_the_run(
    tmp_path, capfd):
  from types import SimpleNamespace
  from dreamer_ver.rpc.addresses import free_port
  from dreamer_ver.cluster.supervisor import Supervisor
  children = Supervisor(backoff=(0.0, 0.0), peer_timeout=30.0)
  children.start('replay', f'{__name__}:_fail_at_start',
                 SimpleNamespace(logdir=str(tmp_path)),
                 probe=f'127.0.0.1:{free_port()}')
  try:
    def stopped():
      children.supervise()
      return children.gave_up is not None
    assert _wait_for(stopped, 60, poll=0.2)
  finally:
    children.stop_all()
  assert children.gave_up == ('replay', 3) and children.failure_code() == 3
  assert children.restarts['replay'] == 0
  assert 'replay failed before it ever served (exit code 3' in (
      capfd.readouterr().out)


def _config_error_after_serving(config, marker):
  """Fails with a ConfigError in its second life (the first crashes)."""
  from dreamer_ver.config.validation import ConfigError
  marker = Path(marker)
  if not marker.exists():
    marker.write_text('crashed once')
    return 1
  raise ConfigError('the checkpoint in /x/ckpt cannot be read: '
                    'move it away')


def test_a_config_error_is_one_line_and_is_never_restarted(tmp_path, capfd):
  # Even after a restart (so not at its first start): exit code 2 means
  # the child said what the user must do, and restarting changes nothing.
  from types import SimpleNamespace
  from dreamer_ver.cluster.supervisor import USER_ERROR, Supervisor
  children = Supervisor(backoff=(0.0, 0.0))
  children.start('agent', f'{__name__}:_config_error_after_serving',
                 SimpleNamespace(logdir=str(tmp_path)),
                 str(tmp_path / 'marker'))
  try:
    def stopped():
      children.supervise()
      return children.gave_up is not None
    assert _wait_for(stopped, 60, poll=0.2)
    time.sleep(1)
    children.supervise()
  finally:
    children.stop_all()
  assert children.gave_up == ('agent', USER_ERROR) == ('agent', 2)
  assert children.restarts['agent'] == 1 and children.failure_code() == 2
  out, err = capfd.readouterr()
  assert err.splitlines()[-1] == (
      'error: agent: the checkpoint in /x/ckpt cannot be read: move it away')
  assert 'Traceback' not in err and 'failed before it ever served' not in out


def _ends_the_run_then_serves(config, ready):
  """Asks to end the run with code 2, then serves until its stop is
  ordered and exits 2 (what a server does after a full disk)."""
  from dreamer_ver.cluster.signals import StopSignal
  from dreamer_ver.cluster.supervisor import USER_ERROR, end_run
  stop = StopSignal()
  Path(ready).write_text('asked')
  assert end_run(USER_ERROR, 'error: replay: no space left on device')
  while not stop.wait(0.1):
    pass
  Path(ready).write_text('stopped when ordered')
  return USER_ERROR


def _meets_the_full_disk_as_it_stops(config):
  """At its stop, fails to save the env step it reached (a logger)."""
  from dreamer_ver.cluster.signals import StopSignal
  from dreamer_ver.cluster.supervisor import stop_for_storage
  stop = StopSignal()
  while not stop.wait(0.1):
    pass
  stop_for_storage('logger', 'no space left on device; env step 597 was '
                   'not saved', stop, step=597)
  return 2


def test_a_child_that_asks_to_end_the_run_ends_it_in_order(
    tmp_path, capfd):
  from types import SimpleNamespace
  from dreamer_ver.cluster.signals import StopSignal
  from dreamer_ver.cluster.supervisor import Supervisor
  config = SimpleNamespace(logdir=str(tmp_path))
  children = Supervisor(backoff=(0.0, 0.0))
  ready, other = tmp_path / 'replay_ready', tmp_path / 'agent_ready'
  children.start('replay', f'{__name__}:_ends_the_run_then_serves', config,
                 str(ready), stop_order=1)
  children.start('logger', f'{__name__}:_meets_the_full_disk_as_it_stops',
                 config, stop_order=1)
  children.start('agent', f'{__name__}:_wait_for_stop', config, str(other))
  try:
    # The run's wait ends with the code the child asked for, while both
    # children still run: nothing was restarted or killed.
    assert children.wait_for('agent', StopSignal(install=False)) == 2
    assert children.gave_up == ('replay', 2)
    assert ready.read_text() == 'asked'
    assert _wait_for(other.exists, 30, poll=0.1)
    assert all(p.is_alive() for p in children.procs.values())
  finally:
    children.stop_all()
  assert ready.read_text() == 'stopped when ordered'
  assert children.procs['replay'].exitcode == 2
  assert children.procs['agent'].exitcode == 0
  assert not children.restarts
  # The first request's line is said once, by the supervisor; the logger's
  # (sent as it stopped) adds only the step it reached unsaved.
  assert capfd.readouterr().err.splitlines() == [
      'error: replay: no space left on device']
  assert children.reached == 597


def test_end_run_without_a_supervisor_says_so():
  from dreamer_ver.cluster.supervisor import end_run
  assert end_run(2) is False


def _leave_a_compile(config):
  """A child that returns while a daemon thread is inside an XLA compile,
  as the agent does when a stop lands during its learner's compile."""
  import threading
  import jax
  import jax.numpy as jnp
  from dreamer_ver.cluster.supervisor import exit_leaving
  jax.config.update('jax_enable_compilation_cache', False)  # a real compile
  def chain(x):
    # About 2 s of XLA compile under the tests' XLA flags on a 2-core
    # AMD EPYC (Zen 5), ten times the wait below: 300 links took 0.18 s
    # there, and the compile ended before the child did.
    for i in range(1500):
      x = jnp.sin(x @ x) + i
    return x
  compiling = threading.Event()
  def compile_it():
    lowered = jax.jit(chain).lower(jnp.ones((8, 8)))
    compiling.set()
    lowered.compile()  # seconds, in native code
    Path(config.logdir, 'compiled').write_text('compiled')
  threading.Thread(target=compile_it, daemon=True).start()
  assert compiling.wait(60)
  time.sleep(0.2)
  exit_leaving(0)
  return 0


def test_a_child_leaving_a_compile_behind_exits_with_its_own_code(tmp_path):
  """The interpreter's exit ends a daemon thread inside native code with
  an unwind that aborts the process (SIGABRT, exit code -6 here) after
  its work was done and saved: `exit_leaving` exits without it."""
  from types import SimpleNamespace
  from dreamer_ver.cluster.supervisor import Supervisor
  children = Supervisor(backoff=(0.0, 0.0))
  config = SimpleNamespace(logdir=str(tmp_path))
  proc = children.start('agent', f'{__name__}:_leave_a_compile', config,
                        restart=False)
  try:
    proc.join(60)
    assert proc.exitcode == 0
    assert not (tmp_path / 'compiled').exists()  # It did not wait for it.
  finally:
    children.stop_all()
