"""What every runtime process shares: addresses and a graceful stop.

Servers bind to the host named in their `host:port` address, so a
single-machine run (`localhost:...`) listens on loopback only; binding to all
interfaces happens only for an explicit non-local host such as `0.0.0.0`.
"""

import signal
import socket
import threading


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


def server_kwargs(addr):
  """Keyword arguments for portal.Server / portal.ServerSocket."""
  return dict(host=bind_host(addr), ipv6=':' in bind_host(addr))


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
