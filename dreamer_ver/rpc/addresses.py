"""Addresses and handshakes: what a server binds to and a client presents.

A server binds to the host named in its `host:port` address, so `localhost`
listens on loopback only; other interfaces are used only when the address
names them (or the caller passes a host, e.g. `0.0.0.0`). A client opens
each connection with a handshake string; servers built with a token accept
only clients presenting the same token.
"""

import socket

HANDSHAKE = 'portal_handshake'  # portal's default: no token


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


def bind_host(addr):
  """The interface a server for `addr` listens on (loopback for localhost)."""
  host, _ = split_addr(addr)
  if host in ('localhost', '127.0.0.1', ''):
    return '127.0.0.1'
  return host


def handshake(token):
  """The handshake string for a run token ('' = portal's default)."""
  return f'dreamer_ver:{token}' if token else HANDSHAKE


def free_port():
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
    sock.bind(('127.0.0.1', 0))
    return sock.getsockname()[1]


def fill_auto_ports(addr):
  """'localhost:{auto}' -> 'localhost:<free port>'."""
  return addr.replace('{auto}', str(free_port())) if '{auto}' in addr else addr
