"""A blocking client for portal's wire protocol, for env processes.

An env worker has at most two requests in flight (one per half of its envs),
so it needs no background thread: it sends frames and reads the replies on
the same socket when it needs them. This keeps an idle env process at zero
CPU and saves a thread hop per step (`client.py` says why portal's
own client is not used).

portal's protocol has no handshake reply: a server that refuses the
client's token (another run's server) just closes the connection. So a
connection that closes before its first reply makes the next `connect`
wait, twice as long after each such connection in a row (up to 5 s), and
the client says so once, rather than reconnecting in a tight loop.
"""

import itertools

from portal.client_socket import Disconnected

from . import wire
from .addresses import HANDSHAKE, client_addr, current


class BlockingClient:

  def __init__(self, addr, handshake=HANDSHAKE, max_msg_size=2 ** 30):
    self.addr = client_addr(addr)
    self.handshake = handshake
    self.max_msg_size = max_msg_size
    self.sock = None
    self.reqnums = itertools.count()
    self.early = {}  # replies that arrived before they were asked for
    self.answered = False  # whether this connection got a reply yet
    self.unanswered = 0  # connections in a row closed before their reply

  def connect(self, stop, retry=0.1, longest=5.0):
    """Retries until connected; returns False if `stop` (a threading.Event) was
    set first."""
    self.close()
    if self.unanswered:
      if self.unanswered == 3:
        print(f'The server at {current(self.addr)} closed '
              f'{self.unanswered} connections in a row before replying (a '
              'server of another run, or a wrong token?); retrying less '
              'often.', flush=True)
      stop.wait(min(retry * 2 ** self.unanswered, longest))
    self.sock = wire.connect(self.addr, self.handshake, stop, retry)
    self.answered = False
    return self.sock is not None

  def call(self, method, *args, stop=None):
    """Sends one request and waits for its reply (see `send` and `recv`)."""
    return self.recv(self.send(method, *args), stop)

  def send(self, method, *args):
    """Sends a request; returns its number for `recv`."""
    if self.sock is None:
      raise Disconnected
    reqnum = next(self.reqnums)
    try:
      wire.send(self.sock, wire.request(reqnum, method, args))
    except OSError as e:
      self.close()
      raise Disconnected from e
    return reqnum

  def recv(self, reqnum, stop=None, poll=0.5):
    """Waits for the reply to `reqnum`. Returns None once `stop` is set while
    waiting; raises Disconnected if the server goes away and RuntimeError
    with the server's message for an error reply."""
    while reqnum not in self.early:
      if self.sock is None:
        raise Disconnected
      try:
        frame = wire.recv(self.sock, stop, self.max_msg_size, poll)
      except (OSError, EOFError) as e:
        self.close()
        raise Disconnected from e
      if frame is None:
        return None
      self.early[wire.reqnum_of(frame)] = frame
      self.answered = True
    return wire.reply(self.early.pop(reqnum))[1]

  def close(self):
    self.early.clear()
    if self.sock is not None:
      self.unanswered = 0 if self.answered else self.unanswered + 1
      self.sock.close()
      self.sock = None
