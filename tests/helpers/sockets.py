"""Raw sockets as a misbehaving peer sees them."""


def closed_by_peer(sock, timeout=5.0):
  """Whether the other end closed `sock` (an end of file or a reset)
  within `timeout` seconds; what it sent before is read and dropped."""
  sock.settimeout(timeout)
  try:
    while sock.recv(1 << 16):
      pass
  except ConnectionResetError:
    pass
  except TimeoutError:
    return False
  return True
