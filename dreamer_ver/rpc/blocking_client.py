"""A blocking client for portal's wire protocol, for env processes.

An env worker has at most two requests in flight (one per half of its envs),
so it needs no background thread: it sends frames and reads the replies on
the same socket when it needs them. This keeps an idle env process at zero
CPU and saves a thread hop per step (`client.py` says why portal's
own client is not used).

A connection that closes before its first reply counts as refused
(`wire.Refusals`): the next `connect` waits longer.
"""

import itertools

from portal.client_socket import Disconnected

from . import wire
from .addresses import HANDSHAKE, client_addr


class BlockingClient:

  def __init__(self, addr, handshake=HANDSHAKE, max_msg_size=2 ** 30):
    self.addr = client_addr(addr)
    self.handshake = handshake
    self.max_msg_size = max_msg_size
    self.sock = None
    self.reqnums = itertools.count()
    self.early = {}  # replies that arrived before they were asked for
    self.refusals = wire.Refusals(getattr(addr, 'name', addr))

  def connect(self, stop, retry=0.1):
    """Retries until connected; returns False if `stop` (a threading.Event) was
    set first."""
    self.close()
    delay = self.refusals.delay()
    if delay:
      stop.wait(delay)
    self.sock = wire.connect(self.addr, self.handshake, stop, retry)
    self.refusals.opened()
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
    waiting; raises Disconnected if the server goes away and RemoteError
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
      self.refusals.answered()
    return wire.reply(self.early.pop(reqnum))[1]

  def close(self):
    self.early.clear()
    if self.sock is not None:
      self.refusals.closed()
      self.sock.close()
      self.sock = None
