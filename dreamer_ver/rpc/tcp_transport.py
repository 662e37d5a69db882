"""The batch server's TCP transport: calls of one method in portal's protocol.

Any host can reach it, and an unmodified `portal.Client` talks to it. Calls
that cannot be served (a frame that does not decode, another method, an
argument that is not one dict of numpy arrays) are answered with an error
here and never reach the batch server. Connection ids are the peers'
(host, port) tuples.
"""

import threading

from .addresses import PING
from .server_socket import BadCall, ServerSocket, check_args, parse_call
from .transport import Transport


class TcpTransport(Transport):

  kind = 'tcp'

  def __init__(self, addr, method, name, nodelay=True, **socket_kwargs):
    self.method = method
    self.socket = ServerSocket(addr, name, nodelay=nodelay, **socket_kwargs)
    self.refused = 0  # calls answered with an error before queueing
    self._closed = False
    self._close_lock = threading.Lock()

  @property
  def conns(self):
    return self.socket.conns

  @property
  def disconnects(self):
    return self.socket.disconnects

  @property
  def error(self):
    return self.socket.error

  def receive(self, timeout):
    """The calls received within `timeout` seconds: (conn, reqnum, data)."""
    try:
      messages = self.socket.receive(timeout=timeout)
    except TimeoutError:
      return []
    calls = [self._decode(addr, msg) for addr, msg in messages]
    return [call for call in calls if call is not None]

  def reply(self, conn, reqnum, value):
    return self.socket.send_reply(conn, reqnum, value)

  def error_reply(self, conn, reqnum, status, message):
    return self.socket.send_error(conn, reqnum, status, message)

  def shutdown(self):
    self.socket.shutdown()

  def close(self, timeout):
    """Closes the socket; a second call does nothing."""
    with self._close_lock:
      closed, self._closed = self._closed, True
    if not closed:
      self.socket.close(timeout)

  def _decode(self, addr, msg):
    try:
      reqnum, name, args = parse_call(msg)
    except BadCall as e:
      return self._refuse(addr, e.reqnum, e.status, str(e))
    if name == PING:  # A client's heartbeat: alive, whatever the batch does.
      self.socket.send_reply(addr, reqnum, None)
      return None
    if name != self.method:
      return self._refuse(addr, reqnum, 3, f'Unknown method {name}')
    problem = check_args(args)
    if problem:
      return self._refuse(addr, reqnum, 4, (
          f'{self.method}() expects one argument, a dict of numpy arrays; '
          f'got {problem}'))
    return addr, reqnum, args[0]

  def _refuse(self, addr, reqnum, status, message):
    self.refused += 1
    self.socket.send_error(addr, reqnum, status, message)
    return None

