"""bench/hosts/delay_proxy.py: the latency between hosts in the latency table."""

import socket
import threading
import time

from bench.hosts.delay_proxy import DelayProxy
from dreamer_ver.rpc.addresses import free_port


def _echo_server(once=False):
  """Echoes what it receives; with `once`, the first chunk only, then it
  closes the connection."""
  listener = socket.socket()
  listener.bind(('127.0.0.1', 0))
  listener.listen()

  def serve():
    conn, _ = listener.accept()
    with conn:
      while data := conn.recv(4096):
        conn.sendall(data)
        if once:
          break
    listener.close()

  thread = threading.Thread(target=serve, daemon=True)
  thread.start()
  return listener.getsockname(), thread


def _receive(sock, size):
  data = b''
  while len(data) < size:
    chunk = sock.recv(size - len(data))
    assert chunk, 'closed early'
    data += chunk
  return data


def test_every_round_trip_takes_the_delay_and_the_bytes_arrive_in_order():
  target, _ = _echo_server()
  port = free_port()
  proxy = DelayProxy(port, target, rtt_ms=40)
  try:
    with socket.create_connection(('127.0.0.1', port), timeout=10) as sock:
      sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
      for size in (1, 1000, 300_000):
        payload = bytes(i % 251 for i in range(size))
        start = time.monotonic()
        sock.sendall(payload)
        assert _receive(sock, size) == payload
        assert time.monotonic() - start >= 0.040
  finally:
    proxy.close()


def test_a_closing_server_closes_its_clients_connection():
  target, served = _echo_server(once=True)
  port = free_port()
  proxy = DelayProxy(port, target, rtt_ms=2)
  try:
    with socket.create_connection(('127.0.0.1', port), timeout=10) as sock:
      sock.sendall(b'x')
      assert _receive(sock, 1) == b'x'
      served.join(10)
      assert not served.is_alive()
      assert sock.recv(1) == b''  # Passed on to the client, not held open.
  finally:
    proxy.close()
