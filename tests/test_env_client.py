"""The env processes' blocking client speaks portal's wire protocol."""

import numpy as np
import portal
import pytest
from portal.client_socket import Disconnected

from dreamer_ver.runtime.env_client import EnvClient
from dreamer_ver.runtime.process import StopSignal, free_port


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
  client = EnvClient(f'127.0.0.1:{port}')
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
  client = EnvClient(f'127.0.0.1:{port}')
  assert client.connect(stop) is False  # Nobody listens; stop ends the retry.
