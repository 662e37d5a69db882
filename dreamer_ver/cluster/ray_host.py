"""Components of a run as Ray actors: Ray places, watches and restarts them;
their per-step traffic stays on our portal-protocol sockets.

  Host       a Ray actor running one component ('module:function', the same
             entry points the supervised processes call) in a thread of its
             worker process
  Lookup     a client address: where the run's component <name> serves now
  start(config, name, target, *args, serves=(), **options) -> actor handle
  remove(actor, name, timeout)  stops a Host and removes it (no restart)
  available_gpus(wanted)   `wanted`, or 0 where the cluster has fewer GPUs

Why a thread in the Ray worker and not a child process: when a node dies,
Ray's workers on it die with it, and so must the env processes they host,
or an orphaned fleet would keep acting with env ids that its restarted
copy now uses.

Restarts. A Host is created with unlimited restarts and task retries, so
Ray starts it again (on another node when its node is gone) with the same
arguments: the same env ids for a fleet, the same logdir for replay, logger
and agent, which resume from their checkpoints there. A component that
returns non-zero (the agent after a broken link, as in `run_agent`) ends
the worker process (after RESTART_DELAY when it failed within STABLE
seconds of its start, so a component that cannot start does not spin), so
Ray restarts it the same way.

Addresses. A Host that serves (`serves` names its config key, e.g.
'run.replay_addr', or a tuple of keys) picks a free port on its node's
address for each key and reports it with `address(key)` (by default the
first key's); everyone else holds 'ray:<name>' (or 'ray:<name>/<key>') in
that key, which `cluster.links.client_address` turns into a `Lookup`,
asked again at every reconnect. A server that moved to another node is
found there.
"""

import os
import threading
import time
import traceback
import warnings

import ray

from dreamer_ver.cluster.signals import StopSignal
from dreamer_ver.cluster.targets import load
from dreamer_ver.rpc.addresses import free_port

LOOKUP_TIMEOUT = 5.0
RESTART_DELAY = 5.0  # before a restart of a component that failed early
STABLE = 60.0  # seconds a component ran for its failure to restart at once


class Host:
  """One component of a run. Ray calls its methods from a few threads
  (`max_concurrency`), so `join` may wait while `address` answers."""

  def __init__(self, name, target, config, args, serves=()):
    self.name = name
    self.addrs = {}  # config key -> 'ip:port', the first key's first
    if serves:
      ip = ray.util.get_node_ip_address()
      keys = (serves,) if isinstance(serves, str) else serves
      self.addrs = {key: f'{ip}:{free_port(ip)}' for key in keys}
      config = config.update(self.addrs)
    self.code = None
    self.stopping = StopSignal(install=False)  # the component may set it too
    self.asked_to_stop = False  # by `stop`: only then is non-zero final
    self.finished = threading.Event()
    context = ray.get_runtime_context()
    with warnings.catch_warnings():  # Ray warns about its own internals.
      warnings.simplefilter('ignore', DeprecationWarning)
      again = ' again' if context.was_current_actor_reconstructed else ''
    served = ', '.join(self.addrs.values())
    print(f'[ray] {name} started{again} on node {context.get_node_id()[:8]}'
          + (f', serving at {served}' if served else ''), flush=True)
    self.thread = threading.Thread(
        target=self._run, args=(target, config, args), name=name, daemon=True)
    self.thread.start()

  def _run(self, target, config, args):
    # The component's servers start portal threads from this thread, not
    # the main one; they are closed by the component itself when it stops.
    warnings.filterwarnings('ignore', 'Using Portal from plain Python threads')
    began = time.monotonic()
    try:
      code = load(target)(config, *args, stop=self.stopping) or 0
    except BaseException:
      traceback.print_exc()
      code = 1
    if code != 0 and not self.asked_to_stop:
      # Exits before `join` can answer: the driver must see a restart, not
      # a finished component. A component that keeps failing at once is
      # restarted every few seconds, not in a tight loop.
      delay = RESTART_DELAY if time.monotonic() - began < STABLE else 0
      print(f'[ray] {self.name} exited with code {code}; Ray restarts it'
            f' in {delay:.0f} s.', flush=True)
      time.sleep(delay)
      os._exit(1)
    self.code = code
    self.finished.set()

  def address(self, key=None):
    """Where the component serves `key` (by default its first key), or
    None when it serves nothing."""
    if key is None:
      return next(iter(self.addrs.values()), None)
    return self.addrs[key]

  def node(self):
    return ray.get_runtime_context().get_node_id()

  def join(self, timeout):
    """The component's exit code once it finished, else None after
    `timeout` seconds."""
    self.finished.wait(timeout)
    return self.code

  def stop(self, timeout):
    """Tells the component to save and stop; its exit code, or None if it
    is still running after `timeout` seconds."""
    self.asked_to_stop = True
    self.stopping.set()
    return self.join(timeout)


class Lookup:
  """A client address: calls to it return where the run's component `name`
  serves now (its address for the config `key`, by default its first), or
  None while Ray cannot say (it is being placed or restarted; the first
  such failure is printed)."""

  def __init__(self, name, key=None):
    self.name = name
    self.key = key
    self.handle = None
    self.failed = False

  def __call__(self):
    try:
      if self.handle is None:
        self.handle = ray.get_actor(self.name)
      return ray.get(self.handle.address.remote(self.key),
                     timeout=LOOKUP_TIMEOUT)
    except Exception as error:  # Not created yet, or restarting.
      if not self.failed:
        print(f'[ray] where {self.name} serves is unknown for now: '
              f'{error!r}', flush=True)
      self.failed = True
      self.handle = None
      return None

  def __repr__(self):
    return f'ray:{self.name}' + (f'/{self.key}' if self.key else '')


def start(config, name, target, *args, serves=(), **options):
  """Creates the Host `name` (a named actor in the driver's namespace) for
  `target`; `options` are Ray's (num_cpus, num_gpus, scheduling_strategy)."""
  actor = ray.remote(Host).options(
      name=name, max_restarts=-1, max_task_retries=-1, max_concurrency=4,
      **options)
  return actor.remote(name, target, config, args, serves=serves)


def remove(actor, name, timeout):
  """Asks the Host `actor` (started as `name`) to stop (up to `timeout`
  seconds), then removes it for good (no restart) and returns once Ray no
  longer finds `name`, free for a new one (`ray.kill` only asks)."""
  try:
    ray.get(actor.stop.remote(timeout), timeout=timeout + 5)
  except Exception as error:  # Gone already, or it did not stop in time.
    print(f'[ray] stopping a component: {error!r}; removing it.', flush=True)
  ray.kill(actor, no_restart=True)
  deadline = time.monotonic() + timeout
  while time.monotonic() < deadline:
    try:
      ray.get_actor(name)
    except ValueError:
      return
    time.sleep(0.05)
  print(f'[ray] {name} was still named {timeout:g} s after its removal.',
        flush=True)


def available_gpus(wanted):
  """The GPUs to ask for: `wanted` if the cluster has that many, else 0
  (so a component that can run on CPU is placed on a CPU-only cluster)."""
  return wanted if ray.cluster_resources().get('GPU', 0) >= wanted else 0
