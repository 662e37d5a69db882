"""Child processes of a run: start, supervise, stop.

This module imports nothing heavy: spawned children import it to start, so
env processes never load JAX or the agent.
"""

import collections
import contextlib
import fcntl
import json
import multiprocessing
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path

from dreamer_ver.cluster.targets import load
from dreamer_ver.config.validation import ConfigError

SHUTDOWN_SECONDS = 15  # a stopping child's grace before it is killed
STOP = b'stop'  # the supervisor's order to a child (`_Parent`)
END_RUN = b'end-run:'  # a child's request to stop the run (`end_run`)
# The exit code of a child that stopped on a ConfigError (a bad flag, a
# logdir whose checkpoint cannot be read), having said what to do in one
# line: restarting would not help, so it is never restarted.
USER_ERROR = 2
# Supervisor that own files in the logdir: one of each per logdir at a time.
OWNERS = ('replay', 'logger', 'agent')
_held = []  # This process's role locks, held until it exits.
_parent = None  # In a supervised child: its `_Parent`.


def _call(name, target, config, parent, orders, shutdown, *args):
  """Child process entry: stop when the supervisor says (`_Parent`),
  own the logdir's role (`lock_role`), record the pid as
  `logdir/pids/<name>` (for operators and fault tests), import
  `module:function`, exit with its code."""
  global _parent
  _parent = _Parent(parent, orders, shutdown)
  if name in OWNERS:
    _held.append(lock_role(config.logdir, name))
  pids = Path(config.logdir) / 'pids'
  pids.mkdir(parents=True, exist_ok=True)
  (pids / name).write_text(str(os.getpid()))
  try:
    code = load(target)(config, *args)
  except ConfigError as error:  # a mistake at start: one line, no restart
    print(f'error: {name}: {error}', file=sys.stderr, flush=True)
    code = USER_ERROR
  raise SystemExit(code or 0)


def end_run(code, line='', step=None):
  """Asks this process's supervisor to stop the whole run in order and end
  it with exit code `code`: for a fault that no restart cures (a full
  disk). The supervisor prints `line` if this is the run's first such
  request (processes that meet the same full disk say it once), and keeps
  the env `step` this process reached unsaved for the run's summary. This
  process serves on until its stop is ordered. False where no supervisor
  runs it (the caller says its line and stops by itself)."""
  if _parent is None:
    return False
  request = {'code': int(code), 'line': line, 'step': step}
  try:
    _parent.orders.send_bytes(END_RUN + json.dumps(request).encode())
  except OSError:  # the supervisor is gone: this process stops anyway
    return False
  return True


def exit_leaving(code):
  """Ends this supervised child with `code` now, without the interpreter's
  exit, which aborts (SIGABRT) on a daemon thread inside native code (an
  XLA compile cannot be interrupted). Returns where no supervisor runs it."""
  if _parent is not None:
    try:  # A full disk may refuse the flush: exit all the same.
      sys.stdout.flush()
      sys.stderr.flush()
    finally:
      os._exit(code)


def stop_for_storage(role, fault, stop, step=None):
  """A storage fault of process `role`: its one line, and the run stopped
  in order (`end_run` with USER_ERROR and the env `step` reached unsaved;
  without a supervisor, the line printed here and `stop` set)."""
  line = (f'error: {role}: {fault}; free space there (or make it '
          'writable), then run the same command again to resume')
  if not end_run(USER_ERROR, line, step):
    print(line, file=sys.stderr, flush=True)
    stop.set()


def when_stop_ordered(stop):
  """Calls `stop` (at a SIGINT/SIGTERM: `signals.StopSignal`) at once, or
  in a supervised child once its supervisor ordered its stop or is gone:
  a signal that reaches every process at once (Ctrl-C to the process
  group, `timeout`, Slurm's cancel) must not stop a server before the
  clients that the supervisor stops first have saved."""
  if _parent is None:
    stop()
  else:
    _parent.defer(stop)


class _Parent:
  """A supervised child's view of its supervisor (the process `parent`):
  it orders this child's stop with a message on the `orders` pipe before
  its SIGTERM, and when it is gone (EOF, or another parent: a SIGKILL, the
  OOM killer) this child stops by itself, as on SIGTERM, and is killed
  after `shutdown` seconds if it has not exited: a stuck orphan would keep
  its role's lock on the logdir for good."""

  def __init__(self, parent, orders, shutdown):
    self.parent = parent
    self.orders = orders
    self.shutdown = shutdown
    self.ordered = threading.Event()  # its order came, or it is gone
    self.signalled = threading.Event()  # a SIGINT/SIGTERM came (`defer`)
    self.stop = None
    threading.Thread(target=self._watch, name='ParentWatch',
                     daemon=True).start()
    threading.Thread(target=self._stop_when_ordered, name='StopOrder',
                     daemon=True).start()

  def defer(self, stop):
    """Has `stop` called once the order came, or after twice the stop
    grace without one (the supervisor has stopped the groups before this
    child's by then, or the signal did not reach it)."""
    self.stop = stop
    self.signalled.set()

  def _stop_when_ordered(self):
    self.signalled.wait()
    if not self.ordered.wait(2 * self.shutdown):
      print(f'No stop order from the supervisor (pid {self.parent}) in '
            f'{2 * self.shutdown:g} s after SIGINT/SIGTERM; stopping.',
            flush=True)
    self.stop()

  def _watch(self):
    if self._order():  # It may still die before it stops this child.
      self.ordered.set()
      while os.getppid() == self.parent:
        time.sleep(0.5)
    self.ordered.set()
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(self.shutdown)  # This daemon thread ends with the process.
    try:
      print(f'The supervisor (pid {self.parent}) is gone and this child '
            f'did not stop within {self.shutdown:g} s; killing it.',
            flush=True)
    finally:
      os.kill(os.getpid(), signal.SIGKILL)

  def _order(self):
    """Waits until the supervisor orders the stop (True) or is gone."""
    while os.getppid() == self.parent:
      if self.orders.poll(0.5):
        try:
          return self.orders.recv_bytes() == STOP
        except EOFError:
          return False
    return False


def lock_role(logdir, role):
  """Takes `logdir/locks/<role>.lock` for the life of this process (an
  flock: the kernel lets go when the process ends, however it ends) and
  returns its descriptor. RuntimeError naming the holder if another
  process has it: two replays (or loggers, or agents) would write the
  same files."""
  folder = Path(logdir) / 'locks'
  folder.mkdir(parents=True, exist_ok=True)
  fd = os.open(folder / f'{role}.lock', os.O_RDWR | os.O_CREAT, 0o644)
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
  except BlockingIOError:
    holder = os.read(fd, 256).decode('utf-8', 'replace').strip()
    os.close(fd)
    raise RuntimeError(
        f'{logdir} already has a {role} ({holder or "another process"}); '
        'stop it first') from None
  os.ftruncate(fd, 0)
  os.write(fd, f'pid {os.getpid()} on {socket.gethostname()}'.encode())
  return fd


class Supervisor:
  """Child processes started with 'spawn'.

  `supervise()` restarts the children started with `restart=True` that died
  with a non-zero exit code (a child exits 0 only when told to stop), waiting
  an exponential backoff per child so a process that keeps crashing does not
  spin (a child that ran for `stable` seconds before it died starts again from
  the shortest wait); `supervise_in_background()` calls it every half second
  on a daemon thread. A child that fails `crash_limit` times within
  `crash_window` seconds will fail again (a damaged file, a bad flag): it is
  not restarted, `gave_up` names it and its exit code, and `wait_for` returns
  that code, so whoever runs this process (a shell, Ray, Kubernetes) sees the
  failure. `crash_limit` 0 restarts for ever.

  A child that exits with `USER_ERROR` is not restarted either: its entry
  caught a ConfigError and printed it as one line. A child that calls
  `end_run(code, line, step)` (a full disk) ends the run as one that gave up,
  with that code, and is stopped in its group's turn like the others; the
  first such line is printed, and `reached` is the largest env step a child
  reached without saving it (None if none said one).

  A child started with a `probe` (the address its server listens on) is sent a
  heartbeat (`rpc.addresses.PING`) every tick. One that fails in its first
  life before it ever answered (a bad flag, a damaged file) is not restarted:
  the run stops with its exit code. Once it answered one (it is up), silence
  for `peer_timeout / 6` seconds is reported by name, and for `peer_timeout`
  means it hangs (stopped, deadlocked, its receive loop dead): it is killed
  and restarted like a crash. `stop_all()` ends supervision, then stops the
  children in groups of rising `stop_order` (e.g. envs before the servers they
  feed, so those save everything): the order (`_Parent`), SIGTERM (and
  SIGCONT, so a stopped child gets it), and a kill for what is still alive
  after `shutdown` seconds. A child that gets SIGINT/SIGTERM from elsewhere
  waits for that order (at most twice `shutdown`), and one whose supervisor is
  gone stops by itself (killed after `shutdown`).
  """

  def __init__(self, backoff=(1.0, 30.0), stable=60.0, clock=time.monotonic,
               crash_limit=0, crash_window=300.0, peer_timeout=0,
               handshake=None, shutdown=SHUTDOWN_SECONDS):
    self.context = multiprocessing.get_context('spawn')
    self.procs = {}
    self.orders = {}  # name -> the pipe its stop is ordered on
    self.shutdown = shutdown
    self.specs = {}  # name -> (target, config, args, restart, order, probe)
    self.backoff = backoff
    self.stable = stable
    self.clock = clock
    self.restarts = collections.Counter()
    self.crashes = collections.Counter()  # restarts since it last ran stably
    self.started = {}  # name -> clock() at its latest start
    self.due = {}  # name -> time a dead child may be restarted
    self.crash_limit = crash_limit
    self.crash_window = crash_window
    self.crash_times = collections.defaultdict(collections.deque)
    # (name, exit code) of a child in a crash loop, or of one that asked to
    # end the run (`end_run`)
    self.gave_up = None
    self.reached = None
    self.peer_timeout = peer_timeout
    self.handshake = handshake
    self.heartbeats = {}  # name -> _Heartbeat, for children with a probe
    self.lock = threading.RLock()  # supervise() vs stop_all()
    self.stopping = False
    self.halt = threading.Event()
    self.thread = None

  def start(self, name, target, config, *args, restart=True, stop_order=0,
            probe=None):
    """Starts `target` ('module:function', called as fn(config, *args)) in
    a child process named `name`; `probe`: the address it serves at."""
    proc = self._spawn(name, target, config, args)
    self.started[name] = self.clock()
    self.procs[name] = proc
    self.specs[name] = (target, config, args, restart, stop_order, probe)
    if probe is not None and self.peer_timeout:
      if name not in self.heartbeats:
        self.heartbeats[name] = _Heartbeat(name, probe, self.handshake)
      self.heartbeats[name].restarted()
    return proc

  def _spawn(self, name, target, config, args):
    self._close_orders(name)  # A restart: its previous process is dead.
    # Duplex: the stop order goes down, a child's `end_run` comes up.
    orders, self.orders[name] = self.context.Pipe(duplex=True)
    proc = self.context.Process(
        target=_call, name=name, daemon=False, args=(
            name, target, config, os.getpid(), orders, self.shutdown, *args))
    proc.start()
    orders.close()  # The child's end: EOF in the child once we are gone.
    return proc

  def _order_stop(self, name):
    """Tells child `name` that the SIGTERM it gets next is our stop. The
    pipe stays open for what it sends while it stops (`_close_orders`)."""
    orders = self.orders.get(name)
    if orders is not None:
      with contextlib.suppress(OSError):  # it is gone: a broken pipe
        orders.send_bytes(STOP)

  def _close_orders(self, name):
    """Takes what child `name` sent up its pipe until it exited, then
    closes it."""
    self._requests(name)
    orders = self.orders.pop(name, None)
    if orders is not None:
      orders.close()

  def supervise(self):
    """Restarts dead children whose backoff has passed."""
    with self.lock:
      if not self.stopping:
        self._supervise()

  def supervise_in_background(self, every=0.5):
    if self.thread is None:
      def loop():
        while not self.halt.wait(every):
          self.supervise()
      self.thread = threading.Thread(
          target=loop, name='Supervisor', daemon=True)
      self.thread.start()

  def _supervise(self):
    now = self.clock()
    for name, proc in list(self.procs.items()):
      target, config, args, restart, order, probe = self.specs[name]
      if proc.is_alive():
        self._listen(name, proc, now)
      if proc.is_alive() or not restart:
        continue
      if proc.exitcode == 0:  # Asked to stop, and saved: not a crash.
        continue
      if self.gave_up is not None and self.gave_up[0] == name:
        continue
      if name not in self.due:
        if proc.exitcode == USER_ERROR or self._failed_at_start(name, proc):
          self.gave_up = (name, proc.exitcode)
          if proc.exitcode != USER_ERROR:  # that one said what to do
            print(f'{name} failed before it ever served (exit code '
                  f'{proc.exitcode}; its error is above): a mistake at '
                  'start does not go away by restarting; stopping the run.',
                  flush=True)
          continue
        if self._crash_loop(name, now):
          self.gave_up = (name, proc.exitcode)
          print(f'{name} failed {self.crash_limit} times within '
                f'{self.crash_window:g} s (last exit code {proc.exitcode}); '
                'it will not be restarted: stopping the run.', flush=True)
          continue
        if now - self.started[name] >= self.stable:
          self.crashes[name] = 0
        delay = min(self.backoff[1],
                    self.backoff[0] * 2 ** self.crashes[name])
        self.due[name] = now + delay
        print(f'{name} exited with code {proc.exitcode}; restarting in '
              f'{delay:.0f} s.')
        continue
      if now >= self.due[name]:
        del self.due[name]
        self.restarts[name] += 1
        self.crashes[name] += 1
        self.start(name, target, config, *args, restart=restart,
                   stop_order=order, probe=probe)

  def _listen(self, name, proc, now):
    """Takes a child's request to end the run (`end_run`: `gave_up` names
    it and its code); kills a child that answered heartbeats before and has
    answered none for `peer_timeout` seconds (supervision restarts it)."""
    self._requests(name)
    heartbeat = self.heartbeats.get(name)
    silence = heartbeat and heartbeat.silence(now)
    if silence is None:
      return
    if silence >= self.peer_timeout:
      print(f'{name} (pid {proc.pid}) has answered no heartbeat for '
            f'{silence:.0f} s (run.peer_timeout): it hangs; killing it to '
            'restart it.', flush=True)
      heartbeat.restarted()
      proc.kill()
      proc.join(5)
    elif silence >= self.peer_timeout / 6 and not heartbeat.reported:
      heartbeat.reported = True
      print(f'{name} (pid {proc.pid}) has answered no heartbeat for '
            f'{silence:.0f} s; killed at {self.peer_timeout:g} s '
            '(run.peer_timeout).', flush=True)

  def _requests(self, name):
    """Takes what child `name` sent up its orders pipe: requests to end the
    run (`end_run`)."""
    orders = self.orders.get(name)
    try:
      while orders is not None and orders.poll():
        message = orders.recv_bytes()
        if not message.startswith(END_RUN):
          continue
        request = json.loads(message[len(END_RUN):])
        if request['step'] is not None:
          self.reached = max(self.reached or 0, int(request['step']))
        if self.gave_up is None:
          self.gave_up = (name, int(request['code']))
          if request['line']:
            print(request['line'], file=sys.stderr, flush=True)
    except (EOFError, OSError):
      pass  # it died: its exit code tells

  def _failed_at_start(self, name, proc):
    """Whether a child with a heartbeat failed (a non-zero exit of its own,
    not a signal) in its first life, before it ever answered one."""
    heartbeat = self.heartbeats.get(name)
    return (heartbeat is not None and heartbeat.answered is None
            and not self.restarts[name] and proc.exitcode > 0)

  def _crash_loop(self, name, now):
    """Counts a crash; True once `crash_limit` fell within the window."""
    times = self.crash_times[name]
    times.append(now)
    while times and times[0] < now - self.crash_window:
      times.popleft()
    return bool(self.crash_limit) and len(times) >= self.crash_limit

  def failure_code(self):
    """Non-zero once a child is in a crash loop (its exit code, or 1 for
    a death by signal), else 0."""
    if self.gave_up is None:
      return 0
    code = self.gave_up[1]
    return code if code and code > 0 else 1

  def wait_for(self, name, stop):
    """Waits until child `name` exits 0 or `stop` is set; returns 0 then.
    While it crashes, it is restarted if it was started with `restart=True`
    (the wait goes on); otherwise its exit code is returned. A crash loop of
    any child ends the wait with `failure_code()`."""
    while not stop:
      self.supervise()
      if self.gave_up is not None:
        return self.failure_code()
      with self.lock:
        proc = self.procs[name]
      proc.join(0.2)
      if proc.exitcode == 0:
        return 0
      if proc.exitcode is not None and not self.specs[name][3]:
        return proc.exitcode
    return 0

  def stop_all(self):
    with self.lock:  # Waits for a restart in progress; no restarts after.
      self.stopping = True
    self.halt.set()
    if self.thread is not None:
      self.thread.join()
    for heartbeat in self.heartbeats.values():
      heartbeat.client.close(timeout=1)
    orders = sorted({spec[4] for spec in self.specs.values()})
    groups = [[n for n in self.procs if self.specs[n][4] == order]
              for order in orders]
    for group in groups:
      for name in group:
        proc = self.procs[name]
        self._order_stop(name)
        if proc.is_alive():
          proc.terminate()
          # A stopped (SIGSTOP, hung) child only acts on SIGTERM once it
          # runs again; without this it would wait out the whole deadline.
          with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGCONT)
      deadline = time.monotonic() + self.shutdown
      for name in group:
        self.procs[name].join(max(0.0, deadline - time.monotonic()))
        if self.procs[name].is_alive():
          print(f'{name} did not stop within {self.shutdown:g} s; killing it.')
          self.procs[name].kill()
          self.procs[name].join()
        self._close_orders(name)  # with what it sent while it stopped


class _Heartbeat:
  """Pings a child's server, one heartbeat at a time; `silence` is how long
  since it last answered (None until it answered once: still starting)."""

  def __init__(self, name, addr, handshake):
    from dreamer_ver.rpc.addresses import HANDSHAKE, PING
    from dreamer_ver.rpc.client import Client
    self.name = name
    self.ping = PING
    self.client = Client(addr, f'{name}Heartbeat', maxinflight=1,
                         handshake=handshake or HANDSHAKE)
    self.future = None
    self.answered = None
    self.reported = False  # whether the current silence was reported

  def restarted(self):
    """A new process: not up until it answers."""
    self.answered, self.reported = None, False

  def silence(self, now):
    if self.future is not None and self.future.done():
      if self.future.exception() is None:
        if self.reported:
          print(f'{self.name} answers heartbeats again after '
                f'{now - self.answered:.0f} s.', flush=True)
        self.answered, self.reported = now, False
      self.future = None
    if self.future is None and self.client.error is None:
      self.future = self.client.call(self.ping)
    return None if self.answered is None else now - self.answered

