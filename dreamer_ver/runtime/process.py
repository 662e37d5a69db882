"""What every runtime process shares: addresses, the run token, and a
graceful stop.

Servers bind to the host named in their `host:port` address, so a
single-machine run (`localhost:...`) listens on loopback only; binding to
other interfaces happens only for a non-local address or an explicit
`run.bind_host` (e.g. `0.0.0.0` on a multi-host run).

Every server of a run only accepts clients that present the run's token in
the connection handshake. The token comes from `run.token`, else the
DREAMER_VER_TOKEN environment variable, else `logdir/token` (created with
owner-only permissions by the first component that needs it).
"""

import os
import secrets
import signal
import socket
import threading
from pathlib import Path

TOKEN_ENV = 'DREAMER_VER_TOKEN'


def split_addr(addr):
  """'host:port' -> (host, port). A bare port means localhost."""
  addr = str(addr)
  if ':' not in addr:
    return 'localhost', int(addr)
  host, port = addr.rsplit(':', 1)
  if '{' in port:
    raise ValueError(
        f"address {addr!r} still holds a placeholder; parallel components "
        "started one by one need explicit host:port addresses")
  return host.strip('[]') or 'localhost', int(port)


def bind_host(addr):
  """The interface a server for `addr` listens on (loopback for localhost)."""
  host, _ = split_addr(addr)
  if host in ('localhost', '127.0.0.1', ''):
    return '127.0.0.1'
  if host in ('::1',):
    return '::1'
  return host


def server_kwargs(addr, config=None):
  """Keyword arguments for portal.Server / portal.ServerSocket: the bind
  interface and, given the run's config, the token handshake."""
  host = (config is not None and config.run.bind_host) or bind_host(addr)
  kwargs = dict(host=host, ipv6=':' in host)
  if config is not None:
    kwargs['handshake'] = handshake(config)
  return kwargs


def client_kwargs(config):
  """Keyword arguments for portal.Client (and EnvClient) of a run."""
  return dict(handshake=handshake(config))


def handshake(config):
  token = config.run.token
  return f'dreamer_ver:{token}' if token else 'portal_handshake'


def with_token(config):
  """The config with `run.token` filled in (see the module docstring)."""
  token = config.run.token or os.environ.get(TOKEN_ENV, '')
  if not token:
    token = _logdir_token(Path(config.logdir))
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
  return path.read_text().strip()


def free_port():
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
    sock.bind(('127.0.0.1', 0))
    return sock.getsockname()[1]


def fill_auto_ports(addr):
  """'localhost:{auto}' -> 'localhost:<free port>'."""
  return addr.replace('{auto}', str(free_port())) if '{auto}' in addr else addr


class StopSignal:
  """An event set by SIGINT/SIGTERM (or by hand), so loops can save and exit.

  Installing handlers only works in the main thread; elsewhere the event is
  still usable and set by whoever owns the process.
  """

  def __init__(self, install=True):
    self.event = threading.Event()
    if install and threading.current_thread() is threading.main_thread():
      for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, self._handle)

  def _handle(self, signum, frame):
    del frame
    self.event.set()

  def __bool__(self):
    return self.event.is_set()

  def set(self):
    self.event.set()

  def wait(self, timeout):
    return self.event.wait(timeout)
