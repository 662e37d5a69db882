"""The env processes' blocking client speaks portal's wire protocol."""

import socket

import numpy as np
import portal
import pytest
from portal.client_socket import Disconnected

from dreamer_ver.rpc.blocking_client import BlockingClient
from dreamer_ver.rpc.addresses import free_port
from dreamer_ver.cluster.signals import StopSignal


def test_round_trip_errors_and_disconnect_against_portal_server():
  port = free_port()
  server = portal.Server(port, 'Echo', host='127.0.0.1', errors=False,
                         logging=False)

  def act(data):
    if 'boom' in data:
      raise ValueError('boom requested')
    return {'y': data['x'] * 2}

  server.bind('act', act)
  server.start(block=False)
  stop = StopSignal(install=False)
  client = BlockingClient(f'127.0.0.1:{port}')
  try:
    assert client.connect(stop)
    for i in range(20):
      reply = client.call('act', {'x': np.arange(3) + i}, stop=stop)
      np.testing.assert_array_equal(reply['y'], (np.arange(3) + i) * 2)
    with pytest.raises(RuntimeError, match='boom requested'):
      client.call('act', {'x': np.zeros(1), 'boom': np.zeros(1)}, stop=stop)
    # The connection survives an error reply.
    assert client.call('act', {'x': np.ones(2)}, stop=stop)['y'].tolist() == [2, 2]
  finally:
    server.close()
  with pytest.raises(Disconnected):
    client.call('act', {'x': np.ones(2)}, stop=stop)
  client.close()


def test_stop_interrupts_waiting_and_connecting():
  port = free_port()
  stop = StopSignal(install=False)
  stop.set()
  client = BlockingClient(f'127.0.0.1:{port}')
  assert client.connect(stop) is False  # Nobody listens; stop ends the retry.


def test_connect_retries_when_the_server_resets_during_the_handshake(
    monkeypatch):
  # A server that is being killed can accept a connection and reset it
  # before the handshake is written; that must mean "retry", not a crash
  # of the env worker (the CI failure that made the launcher restart env4).
  port = free_port()
  server = portal.Server(port, 'Echo', host='127.0.0.1', errors=False,
                         logging=False)
  server.bind('act', lambda data: {'y': data['x'] + 1})
  server.start(block=False)
  stop = StopSignal(install=False)
  client = BlockingClient(f'127.0.0.1:{port}')
  real = socket.create_connection
  resets = []

  class ResetOnSend:
    def __init__(self, sock):
      self.sock = sock

    def setsockopt(self, *args):
      self.sock.setsockopt(*args)

    def sendall(self, data):
      resets.append(data)
      raise ConnectionResetError(104, 'Connection reset by peer')

    def close(self):
      self.sock.close()

  def flaky(addr, timeout=None):
    sock = real(addr, timeout=timeout)
    return ResetOnSend(sock) if len(resets) < 2 else sock

  try:
    monkeypatch.setattr(socket, 'create_connection', flaky)
    assert client.connect(stop, retry=0.01)
    monkeypatch.undo()
    assert len(resets) == 2
    reply = client.call('act', {'x': np.arange(4)}, stop=stop)
    np.testing.assert_array_equal(reply['y'], np.arange(4) + 1)
  finally:
    client.close()
    server.close()
