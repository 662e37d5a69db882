"""What every runtime process shares: the run token, the server and client
settings it implies, and a graceful stop.

Servers bind to the host named in their `host:port` address
(`rpc/addresses.py`), or to `run.bind_host` when set (e.g. `0.0.0.0` on a
multi-host run). Clients connect to `peer(addr)`: on a Ray cluster the
addresses are names that Ray resolves.

Every server of a run only accepts clients that present the run's token in
the connection handshake. The token comes from `run.token`, else the
DREAMER_VER_TOKEN environment variable, else `logdir/token` (created with
owner-only permissions by the first component that needs it).
"""

import os
import secrets
import signal
import sys
import threading
import time
from pathlib import Path

import elements

from dreamer_ver.rpc import addresses
from dreamer_ver.validation import ConfigError

TOKEN_ENV = 'DREAMER_VER_TOKEN'
RAY_PREFIX = 'ray:'


def server_kwargs(config):
  """Keyword arguments for our servers (and portal's) in a run: the bind
  interface when `run.bind_host` sets one, and the token handshake."""
  kwargs = dict(handshake=addresses.handshake(config.run.token))
  if config.run.bind_host:
    kwargs['host'] = config.run.bind_host
  return kwargs


def client_kwargs(config):
  """Keyword arguments for our futures clients (`rpc/client.py`) in a run:
  the token handshake and the deadline on a peer that stopped answering."""
  return dict(handshake=addresses.handshake(config.run.token),
              peer_timeout=config.run.peer_timeout or None)


def peer(addr):
  """The address a client of a run connects to: `addr` as it is, or for
  'ray:<name>' (or 'ray:<name>/<config key>') a lookup of where the run's
  Ray-hosted component <name> serves now, asked again at every reconnect
  (`runtime/ray_host.py`)."""
  if str(addr).startswith(RAY_PREFIX):
    from dreamer_ver.runtime.ray_host import Lookup
    name, _, key = addr[len(RAY_PREFIX):].partition('/')
    return Lookup(name, key or None)
  return addr


def resolve(addr, stop, poll=1.0):
  """`addr` as a 'host:port' string, for the callers that need one now
  (JAX's coordinator): a 'ray:' address is looked up until Ray says where
  it serves. None if `stop` is set first."""
  where = peer(addr)
  while callable(where):
    found = where()
    if found:
      return found
    if stop.wait(poll):
      return None
  return where


def with_token(config):
  """The config with `run.token` filled in (see the module docstring).
  Raises ConfigError for an empty or blank token: portal's handshake
  without one is public, so it would let anyone in."""
  if config.run.token:
    token, where = config.run.token, 'run.token'
  elif os.environ.get(TOKEN_ENV):
    token, where = os.environ[TOKEN_ENV], TOKEN_ENV
  else:
    path = Path(config.logdir) / 'token'
    token, where = _logdir_token(Path(config.logdir)), str(path)
  if not token.strip():
    raise ConfigError(
        f'{where} is empty: the run token must be a secret, not blank '
        '(remove an empty token file and one is made)')
  return config.update({'run.token': token})


def _logdir_token(logdir):
  path = logdir / 'token'
  if not path.exists():
    logdir.mkdir(parents=True, exist_ok=True)
    tmp = logdir / f'.token.{os.getpid()}'
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, 'w') as f:
      f.write(secrets.token_hex(16))
    try:
      os.link(tmp, path)  # Atomic: if another component won, keep theirs.
    except FileExistsError:
      pass
    finally:
      tmp.unlink()
  if path.stat().st_mode & 0o077:
    print(f'warning: other users can read the run token in {path}; '
          f'chmod 600 {path}', file=sys.stderr)
  return path.read_text().strip()


class StopSignal:
  """An event set by SIGINT/SIGTERM (or by hand), so loops can save and exit.

  Installing handlers only works in the main thread; elsewhere the event is
  still usable and set by whoever owns the process.
  """

  def __init__(self, install=True):
    self.event = threading.Event()
    self.previous = {}  # signal -> the handler it replaced
    if install and threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGINT, signal.SIGTERM):
        self.previous[sig] = signal.signal(sig, self._handle)

  def restore(self):
    """Puts back the handlers it replaced (a loop run inside a longer-lived
    process: a notebook, a test session)."""
    for sig, handler in self.previous.items():
      signal.signal(sig, handler)
    self.previous = {}

  def _handle(self, signum, frame):
    del frame
    self.event.set()

  def __bool__(self):
    return self.event.is_set()

  def is_set(self):
    return self.event.is_set()

  def set(self):
    self.event.set()

  def wait(self, timeout):
    return self.event.wait(timeout)


def every(seconds):
  """A clock (`elements.when.Clock`) that fires every `seconds`, and never
  when `seconds` <= 0: Clock(0) would fire on every call, and the config's
  `<= 0` means off everywhere, as in `run_periodically`."""
  return elements.when.Clock(seconds if seconds > 0 else -1)


def run_periodically(stop, tasks, poll=0.5, servers=()):
  """A server process's main loop: calls each `fn` of `tasks`, a list of
  (seconds, fn), every that many seconds (never when <= 0) until `stop` is
  set, checking twice a second. Raises RuntimeError once one of `servers`
  (rpc Servers) stopped serving, so that the process ends non-zero and its
  supervisor restarts it, instead of living on and serving no one."""
  last = [time.monotonic()] * len(tasks)
  while not stop.wait(poll):
    for server in servers:
      if server.error is not None:
        raise RuntimeError(
            f'{server.name} stopped serving: {server.error!r}')
    now = time.monotonic()
    for i, (seconds, fn) in enumerate(tasks):
      if seconds > 0 and now - last[i] >= seconds:
        last[i] = now
        fn()
