"""Addresses and handshakes: what a server binds to and a client presents.

A server binds to the host named in its `host:port` address, so `localhost`
listens on loopback only; other interfaces are used only when the address
names them (or the caller passes a host, e.g. `0.0.0.0`). A client opens
each connection with a handshake: servers built with a token accept only
clients that prove they know the same token (`auth.py`).

A client's address may also be a function returning 'host:port' (or None
while unknown): it is called again before every connection attempt, so a
control plane that moves a server to another host (`cluster/ray_host.py`)
can tell the clients where it went.
"""

import os
import random
import socket

from . import auth

HANDSHAKE = 'portal_handshake'  # portal's default: no token
PING = '__ping__'  # a heartbeat: servers answer None from their receive loop


def split_addr(addr):
  """'host:port' -> (host, port). A bare port means localhost."""
  addr = str(addr)
  if ':' not in addr:
    return 'localhost', int(addr)
  host, port = addr.rsplit(':', 1)
  if '{' in port:
    raise ValueError(
        f"address {addr!r} still holds a placeholder; components started "
        "one by one need explicit host:port addresses")
  return host.strip('[]') or 'localhost', int(port)


def client_addr(addr):
  """What a client keeps: (host, port), or the lookup function as it is."""
  return addr if callable(addr) else split_addr(addr)


def current(addr):
  """(host, port) of a client address from `client_addr`; None while a
  lookup does not know it."""
  if not callable(addr):
    return addr
  found = addr()
  return None if found is None else split_addr(found)


def describe(addr):
  """'host:port' of a client address from `client_addr`, for messages."""
  target = current(addr)
  return repr(addr) if target is None else f'{target[0]}:{target[1]}'


def bind_host(addr):
  """The interface a server for `addr` listens on (loopback for localhost)."""
  host, _ = split_addr(addr)
  if host in ('localhost', '127.0.0.1', ''):
    return '127.0.0.1'
  return host


def handshake(token):
  """The handshake string for a run token ('' = portal's default): clients
  and servers given it run the exchange of `auth.py`."""
  return auth.PREFIX + token if token else HANDSHAKE


def free_port(host='127.0.0.1'):
  """A port nothing on `host` holds now, for a server that binds it later
  (see `reserve_port` for one held until then)."""
  with reserve_port(host) as sock:
    return sock.getsockname()[1]


def reserve_port(host='127.0.0.1'):
  """A socket bound to a free port of `host` and not listening: while it
  is open, no outgoing connection, plain bind or other run's pick takes
  the port, and a server binds it as portal's do (SO_REUSEADDR), also
  again after a restart. Drawn below the kernel's ephemeral range, where
  outgoing connections never take ports at all."""
  family = socket.AF_INET6 if ':' in host else socket.AF_INET
  for port in _candidates():
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
      sock.bind((host, port))  # Plain: held by no one, not even TIME_WAIT.
    except OSError:
      sock.close()
      continue
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    return sock
  raise OSError(f'no free port on {host}')


def _candidates(tries=200):
  """Ports to try: drawn from [10000, start of the ephemeral range) by the
  OS's randomness (not `random`'s, which forked processes share), then port
  0 (the kernel's pick) where that range leaves no room below it."""
  low = _EPHEMERAL_DEFAULT
  if os.path.exists(_EPHEMERAL):
    with open(_EPHEMERAL) as f:
      low = int(f.read().split()[0])
  if low > 11000:
    yield from (_RANDOM.randrange(10000, low) for _ in range(tries))
  yield 0


_EPHEMERAL = '/proc/sys/net/ipv4/ip_local_port_range'
_EPHEMERAL_DEFAULT = 49152  # IANA's (macOS, Windows)
_RANDOM = random.SystemRandom()


def fill_auto_ports(addr, held):
  """'host:{auto}' -> 'host:<free port>', the port held by a socket
  entered into `held` (a contextlib.ExitStack) until it closes; other
  addresses as they are."""
  if '{auto}' not in addr:
    return addr
  host = addr.rsplit(':', 1)[0].strip('[]') or 'localhost'
  sock = held.enter_context(reserve_port(bind_host(f'{host}:0')))
  return addr.replace('{auto}', str(sock.getsockname()[1]))
