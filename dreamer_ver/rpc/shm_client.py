"""The shared-memory transport's client: a caller on the batch server's host
(`shm_protocol.py` has the protocol).
"""

import fcntl
import itertools
import json
import mmap
import os
import socket
import threading

import numpy as np
from portal.client_socket import Disconnected

from .addresses import HANDSHAKE
from .shm_protocol import (
    CALL, REPLY, SEALS, SLOT, Slot, array_views, endpoints, layout_of,
    nbytes, same_user)
from .wire import Refusals, RemoteError


class ShmClient:
  """A caller on the server's host, with BlockingClient's calls.

  `reply_space`: key -> (shape, dtype) of one env's reply (the actor: the
  action keys and `reset`), or a function of the request data that returns
  it; a call with a vector under `envid_key` gets one row per env. A slot
  is made for each request layout in flight (an env worker's halves: two).
  """

  def __init__(self, addr, reply_space, handshake=HANDSHAKE,
               envid_key='envid'):
    self.addr = addr
    self.handshake = handshake.encode('utf-8')
    self.reply_space = reply_space
    self.envid_key = envid_key
    self.sock = None
    self.reqnums = itertools.count()
    self._reset()

  def connect(self, stop=None, retry=0.1):
    """Retries until connected; False if `stop` (an Event) was set first.
    A refused handshake (a wrong token) counts in `wire.Refusals`."""
    # Not `stop or Event()`: a StopSignal is falsy until it is set.
    stop = threading.Event() if stop is None else stop
    self.close()
    refusals = Refusals(f'the shared-memory socket of {self.addr}', retry)
    while not stop.is_set():
      # Looked up each time: the server may pick another folder on restart.
      for path in endpoints(self.addr, self.handshake):
        answer = self._hello(path)
        if answer:
          return True
        if answer is False:
          refusals.refused()
      stop.wait(refusals.delay() or retry)
    return False

  def _hello(self, path):
    """True once connected to the server at `path`; False if it refused
    the token; None if nobody of this user serves there."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
      sock.settimeout(5.0)
      sock.connect(path)
      if not same_user(sock):  # It would get the token.
        raise PermissionError(f'{path} is served by another user')
      sock.send(b'H' + self.handshake)
      if sock.recv(16) == b'A':
        self.sock = sock
        return True
      answer = False
    except OSError:
      answer = None
    sock.close()
    return answer

  def call(self, method, data, stop=None):
    return self.recv(self.send(method, data), stop)

  def send(self, method, data):
    """Writes `data` (a dict of arrays) into a free slot and sends the call;
    returns its number for `recv`."""
    if self.sock is None:
      raise Disconnected
    data = {k: np.asarray(v) for k, v in data.items()}
    layout = (method, *((k, v.shape, v.dtype.str) for k, v in data.items()))
    free = self._free.setdefault(layout, [])
    slot = free.pop() if free else self._attach(method, data)
    for key, value in data.items():
      slot.request[key][...] = value
    reqnum = next(self.reqnums)
    self._inflight[reqnum] = (layout, slot)
    self._send(CALL.pack(b'R', slot.index, reqnum))
    return reqnum

  def recv(self, reqnum, stop=None, poll=0.5):
    """The reply to `reqnum` (copies of the slot's reply arrays). None once
    `stop` is set while waiting; Disconnected if the server goes away;
    RemoteError with the server's message for an error reply."""
    while reqnum not in self._replies:
      if not self._read(stop, poll):
        return None
    status, message = self._replies.pop(reqnum)
    layout, slot = self._inflight.pop(reqnum)
    self._free[layout].append(slot)
    if status:
      raise RemoteError(message)
    return {k: v.copy() for k, v in slot.reply.items()}

  def close(self):
    if self.sock is not None:
      self.sock.close()
      self.sock = None
    self._reset()

  def _reset(self):
    self._slots = 0
    self._free = {}  # request layout -> slots without a call in flight
    self._inflight = {}  # reqnum -> (request layout, slot)
    self._replies = {}  # reqnum -> (status, message)
    self._attached = {}  # slot index -> None, or why it was refused

  def _attach(self, method, data):
    envids = data.get(self.envid_key)
    rows = (len(envids),) if envids is not None and envids.ndim == 1 else ()
    request = [(k, list(v.shape), v.dtype.str) for k, v in data.items()]
    space = self.reply_space
    space = space(data) if callable(space) else space
    reply = [(k, [*rows, *shape], np.dtype(dtype).str)
             for k, (shape, dtype) in space.items()]
    size = max(nbytes(layout_of(request + reply)), 1)
    index, self._slots = self._slots, self._slots + 1
    fd = os.memfd_create(f'dreamer_ver-slot{index}',
                         os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
      os.ftruncate(fd, size)
      fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
      buffer = mmap.mmap(fd, size)
      spec = json.dumps({'method': method, 'request': request, 'reply': reply})
      try:
        socket.send_fds(self.sock, [
            b'S' + SLOT.pack(index) + spec.encode('utf-8')], [fd])
      except OSError as e:
        self.close()
        raise Disconnected from e
    finally:
      os.close(fd)
    while index not in self._attached:
      self._read(None, 0.5)
    why = self._attached.pop(index)
    if why is not None:
      raise RuntimeError(why)
    views, end = array_views(buffer, layout_of(request), 0)
    return Slot(views, array_views(buffer, layout_of(reply), end)[0], index)

  def _send(self, msg):
    try:
      self.sock.send(msg)
    except OSError as e:
      self.close()
      raise Disconnected from e

  def _read(self, stop, poll):
    """Reads one message from the server; False once `stop` is set."""
    while True:
      if self.sock is None:
        raise Disconnected
      if stop is not None and stop.is_set():
        return False
      self.sock.settimeout(poll)
      try:
        msg = self.sock.recv(65536)
        break
      except TimeoutError:
        continue
      except OSError as e:
        self.close()
        raise Disconnected from e
    if not msg:
      self.close()
      raise Disconnected
    if msg[:1] == b'P':
      _, reqnum, status = REPLY.unpack(msg[:REPLY.size])
      self._replies[reqnum] = (status, msg[REPLY.size:].decode('utf-8'))
    elif msg[:1] in (b'A', b'E'):
      index, = SLOT.unpack(msg[1:1 + SLOT.size])
      self._attached[index] = (
          None if msg[:1] == b'A' else msg[1 + SLOT.size:].decode('utf-8'))
    return True
