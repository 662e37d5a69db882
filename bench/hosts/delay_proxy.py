"""A TCP proxy that holds every byte for half a round trip each way: the
latency between two hosts, for kernels without netem (`tc qdisc ... netem`),
which this project's test machines lack.

  proxy = DelayProxy(listen_port, ('127.0.0.1', server_port), rtt_ms=20)
  ...                      # clients connect to listen_port
  proxy.close()

It runs in a process of its own (its threads never hold the benchmark's
GIL). Per connection and direction one thread reads and one writes, so the
delay is added once per byte however the stream is cut, bandwidth is not
limited, and order is kept. A close on either side closes both, after the
bytes already read were delivered.
"""

import collections
import multiprocessing
import socket
import threading
import time


class DelayProxy:

  def __init__(self, port, target, rtt_ms):
    """Listens on 127.0.0.1:`port` and forwards to `target` (host, port)
    with `rtt_ms` / 2 added each way. Returns once it listens."""
    self.rtt_ms = rtt_ms
    context = multiprocessing.get_context('spawn')
    ready = context.Event()
    self.proc = context.Process(
        target=_serve, args=(port, tuple(target), rtt_ms / 2000, ready),
        name=f'DelayProxy{rtt_ms:g}ms', daemon=True)
    self.proc.start()
    if not ready.wait(30):
      self.close()
      raise RuntimeError(f'the delay proxy did not listen on {port} in 30 s')

  def close(self):
    """Stops it; its connections close, and their clients reconnect."""
    self.proc.kill()
    self.proc.join(10)


def _serve(port, target, delay, ready):
  listener = socket.socket()
  listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
  listener.bind(('127.0.0.1', port))
  listener.listen(1024)
  ready.set()
  while True:
    client, _ = listener.accept()
    try:
      server = socket.create_connection(target, timeout=5)
    except OSError:
      client.close()  # Nobody there yet: the client retries, as with a server.
      continue
    server.settimeout(None)
    for sock in client, server:
      sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    closed = threading.Event()
    for source, sink in (client, server), (server, client):
      _Direction(source, sink, delay, closed, (client, server))


class _Direction:
  """Bytes from `source` reach `sink` `delay` seconds after they arrived."""

  def __init__(self, source, sink, delay, closed, both):
    self.source, self.sink, self.delay = source, sink, delay
    self.closed, self.both = closed, both
    self.queue = collections.deque()  # (due time, bytes); b'' = closed
    self.ready = threading.Condition()
    threading.Thread(target=self._read, daemon=True).start()
    threading.Thread(target=self._write, daemon=True).start()

  def _read(self):
    data = b''
    while True:
      try:
        data = self.source.recv(1 << 16)
      except OSError:
        data = b''
      with self.ready:
        self.queue.append((time.monotonic() + self.delay, data))
        self.ready.notify()
      if not data:
        return

  def _write(self):
    while True:
      with self.ready:
        while not self.queue:
          self.ready.wait()
        due, data = self.queue.popleft()
      wait = due - time.monotonic()
      if wait > 0:
        time.sleep(wait)
      try:
        if not data:
          raise OSError('closed')
        self.sink.sendall(data)
      except OSError:
        self._close()
        return

  def _close(self):
    if self.closed.is_set():
      return
    self.closed.set()
    for sock in self.both:
      try:
        sock.shutdown(socket.SHUT_RDWR)
      except OSError:
        pass
      sock.close()
