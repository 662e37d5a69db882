"""free_port: ports handed to servers that bind later."""

import contextlib
import pathlib
import socket

import pytest

from dreamer_ver.rpc import addresses
from dreamer_ver.rpc.addresses import fill_auto_ports, free_port, split_addr

RANGE = pathlib.Path('/proc/sys/net/ipv4/ip_local_port_range')


def test_a_free_port_is_none_an_outgoing_connection_can_take():
  """A run picks its servers' ports, then starts them: a port from the
  kernel's ephemeral range could meanwhile become the local port of any
  outgoing connection (one of the run's own clients), and the server could
  not bind it for as long as that connection lasts."""
  if not RANGE.exists():
    pytest.skip('no Linux ephemeral port range to check against')
  low, high = map(int, RANGE.read_text().split())
  ports = [free_port() for _ in range(50)]
  assert not [p for p in ports if low <= p <= high], (low, high, ports)
  assert len(set(ports)) > 40, ports  # Drawn, not one port for everyone.
  for port in ports[:5]:
    with socket.socket() as sock:
      sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
      sock.bind(('127.0.0.1', port))


def test_a_port_something_listens_on_is_passed_over(monkeypatch):
  with socket.socket() as taken:
    taken.bind(('127.0.0.1', free_port()))
    taken.listen()
    port, other = taken.getsockname()[1], free_port()
    monkeypatch.setattr(
        addresses, '_candidates', lambda: iter([port, port, other]))
    assert free_port() == other
    monkeypatch.setattr(addresses, '_candidates', lambda: iter([port]))
    with pytest.raises(OSError, match='no free port'):
      free_port()


def test_an_auto_port_is_held_for_its_server_until_released():
  """What a run publishes is reserved before any server binds it: an
  outgoing connection, another bind or another run's pick cannot take it
  meanwhile (or while its server restarts); its server binds it as portal's
  servers do (SO_REUSEADDR)."""
  held = contextlib.ExitStack()
  with held:
    addr = fill_auto_ports('localhost:{auto}', held)
    host, port = split_addr(addr)
    assert host == 'localhost'
    with socket.socket() as other, pytest.raises(OSError):
      other.bind(('127.0.0.1', port))
    for _ in range(2):  # A server, then its restart.
      with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(('127.0.0.1', port))
        server.listen()
  with socket.socket() as other:  # Released with the run.
    other.bind(('127.0.0.1', port))
  assert fill_auto_ports('10.0.0.5:7001', held) == '10.0.0.5:7001'


def test_an_ipv6_auto_port_is_held_on_ipv6():
  try:
    with socket.socket(socket.AF_INET6) as probe:
      probe.bind(('::1', 0))
  except OSError as e:
    pytest.skip(f'no IPv6 loopback here: {e}')
  with contextlib.ExitStack() as held:
    addr = fill_auto_ports('[::1]:{auto}', held)
    _, port = split_addr(addr)
    with socket.socket(socket.AF_INET6) as other, pytest.raises(OSError):
      other.bind(('::1', port))
