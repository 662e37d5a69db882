"""The token handshake: both ends prove they know the run token, which
itself never travels.

A client opens the connection with HELLO (a protocol tag and a fresh
nonce). The server answers its own nonce and HMAC-SHA256(token, SERVER_TAG
| client nonce | server nonce). The client checks that before it sends
anything else -- so a process that took a stopped server's port learns
nothing it could use -- then proves itself with the HMAC over CLIENT_TAG,
which the server checks before it reads a call. Fresh nonces on both sides
make a recorded exchange worthless on another connection.

Handshake strings (`addresses.handshake`) name the token: PREFIX + token.
Any other string (portal's default) is a plain handshake, sent as it is;
a server with a token takes the plain `PREFIX + token` from unmodified
portal clients only when told to (`plain_handshake`).
"""

import hashlib
import hmac
import secrets

PREFIX = 'dreamer_ver:'
HELLO_TAG = b'dreamer_ver/hmac-sha256/1\n'
SERVER_TAG = b'dreamer_ver/server'
CLIENT_TAG = b'dreamer_ver/client'
NONCE = 32
DIGEST = 32  # bytes of an HMAC-SHA256
HELLO = len(HELLO_TAG) + NONCE  # client: tag, nonce
ANSWER = NONCE + DIGEST  # server: its nonce, its proof
PROOF = DIGEST  # client: its proof
# Bytes that tell a hello from a plain `PREFIX + token` handshake.
PEEK = len(PREFIX)
ANSWER_SECONDS = 5.0  # how long a client waits for the server's answer


class Refused(Exception):
  """The peer failed the exchange: it did not prove it knows the token."""


def token_of(handshake):
  """The token a handshake string names, or None for a plain one."""
  if handshake.startswith(PREFIX) and len(handshake) > len(PREFIX):
    return handshake[len(PREFIX):]
  return None


def is_hello(start):
  """Whether the first PEEK bytes a client sent begin a hello."""
  return start[:PEEK] == HELLO_TAG[:PEEK]


def answer(token, hello):
  """The server's side: (its nonce, the answer to send) for a client's
  HELLO bytes; Refused for another protocol's tag."""
  if hello[:len(HELLO_TAG)] != HELLO_TAG:
    raise Refused('another handshake protocol')
  nonce = secrets.token_bytes(NONCE)
  return nonce, nonce + _mac(token, SERVER_TAG, hello[len(HELLO_TAG):], nonce)


def proven(token, hello, nonce, proof):
  """Whether a client's PROOF bytes show it knows the token."""
  expected = _mac(token, CLIENT_TAG, hello[len(HELLO_TAG):], nonce)
  return hmac.compare_digest(bytes(proof), expected)


def introduce(sock, handshake):
  """Opens a connected blocking socket with `handshake`: a plain one is
  sent; for a token, the exchange above. Raises Refused (the token not
  sent) if the server does not answer with the proof in ANSWER_SECONDS, or
  closes the connection first; OSError if the connection fails."""
  token = token_of(handshake)
  if token is None:
    sock.sendall(handshake.encode('utf-8'))
    return
  nonce = secrets.token_bytes(NONCE)
  sock.sendall(HELLO_TAG + nonce)
  reply = _read(sock, ANSWER)
  theirs, proof = reply[:NONCE], reply[NONCE:]
  if not hmac.compare_digest(proof, _mac(token, SERVER_TAG, nonce, theirs)):
    raise Refused('the server did not prove it knows the run token (a '
                  'server of another run, or another program on its port)')
  sock.sendall(_mac(token, CLIENT_TAG, nonce, theirs))


def _read(sock, size):
  sock.settimeout(ANSWER_SECONDS)
  data = b''
  try:
    while len(data) < size:
      got = sock.recv(size - len(data))
      if not got:
        raise Refused('the server closed the connection during the token '
                      'handshake (it has no token, or another one)')
      data += got
  except TimeoutError:
    raise Refused(f'the server did not answer the token handshake within '
                  f'{ANSWER_SECONDS:g} s') from None
  return data


def _mac(token, tag, client_nonce, server_nonce):
  message = tag + bytes(client_nonce) + bytes(server_nonce)
  return hmac.new(token.encode('utf-8'), message, hashlib.sha256).digest()
