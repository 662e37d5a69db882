"""Fuzzing every server's input path with hypothesis: random and mutated
frames on the TCP wire, random slot layouts on the shm transport.

Property: a bad input gets an error reply or a closed connection, never a
dead server loop, and a well-behaved client is served all along. The
examples are derived from the test's name (`derandomize`), so every run
tries the same ones, and their number is bounded to keep the fast tier
fast.
"""

import contextlib
import socket
import time

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from portal import packlib

from dreamer_ver.rpc import wire
from dreamer_ver.rpc.addresses import free_port
from dreamer_ver.rpc.client import Client
from dreamer_ver.rpc.server import Server
from dreamer_ver.rpc.server_socket import BadCall, parse_call
from test_shm import (
    LAYOUT, Recorder, attach, nested, raw, serves_tcp_and_shm_callers,
    serving)

FUZZ = settings(derandomize=True, deadline=None, database=None,
                suppress_health_check=[HealthCheck.too_slow])


def packed(value):
  return b''.join(bytes(memoryview(b).cast('B')) for b in packlib.pack(value))


def call_frame(reqnum, method, payload):
  name = method.encode()
  return (reqnum.to_bytes(8, 'little') + len(name).to_bytes(8, 'little')
          + name + payload)


GOOD = call_frame(1, 'echo', packed([{'x': np.arange(4, dtype=np.int64)}]))


@st.composite
def mutated(draw, frame=GOOD):
  """`frame` with some bytes replaced, cut short or extended."""
  data = bytearray(frame)
  for _ in range(draw(st.integers(1, 8))):
    index = draw(st.integers(0, len(data) - 1))
    data[index] = draw(st.integers(0, 255))
  cut = draw(st.integers(0, len(data)))
  return bytes(data[:cut]) + draw(st.binary(max_size=16))


@FUZZ
@given(st.one_of(st.binary(max_size=256), mutated()))
def test_any_bytes_are_a_call_or_a_bad_call(msg):
  try:
    reqnum, method, args = parse_call(msg)
  except BadCall as e:
    assert e.status in (1, 2) and len(e.reqnum) == 8
  else:
    assert isinstance(method, str) and isinstance(args, (list, dict))


@FUZZ
@given(st.one_of(st.binary(max_size=256), mutated(packed({'y': np.ones(3)}))))
def test_a_client_unpacks_a_reply_or_raises_a_plain_error(payload):
  reply = (5).to_bytes(8, 'little') + (0).to_bytes(8, 'little') + payload
  try:
    wire.reply(reply)
  except Exception as e:  # Any error of the call's future, not a crash.
    assert not isinstance(e, (SystemExit, KeyboardInterrupt))


LEAVES = st.one_of(
    st.none(), st.text(max_size=4), st.binary(max_size=4),
    st.sampled_from([np.float32, np.int64, np.uint8, np.bool_, np.float16,
                     '>i4']).flatmap(lambda dtype: st.lists(
                         st.integers(0, 3), max_size=3).map(
                             lambda shape: np.arange(
                                 int(np.prod(shape))).astype(dtype).reshape(
                                     shape))))
TREES = st.recursive(LEAVES, lambda children: st.one_of(
    st.lists(children, max_size=3),
    st.dictionaries(st.text(max_size=3), children, max_size=3)),
    max_leaves=8)


def _same(ours, theirs):
  if isinstance(theirs, np.ndarray):
    return (isinstance(ours, np.ndarray) and ours.dtype == theirs.dtype
            and ours.shape == theirs.shape and (ours == theirs).all())
  if isinstance(theirs, (list, dict)):
    keys = range(len(theirs)) if isinstance(theirs, list) else theirs
    return (type(ours) is type(theirs) and len(ours) == len(theirs)
            and all(_same(ours[k], theirs[k]) for k in keys))
  if isinstance(theirs, memoryview):
    return bytes(ours) == bytes(theirs)
  return ours == theirs


@FUZZ
@given(TREES)
def test_unpack_reads_what_portal_packs_as_portal_does(tree):
  payload = memoryview(packed(tree))
  assert _same(wire.unpack(payload), packlib.unpack(payload))


# What replies and requests hold besides: numpy and Python scalars (bools
# among the ints), tuples, numpy strings, strided views, other buffers.
PACK_LEAVES = st.one_of(
    LEAVES, st.integers(-2 ** 63, 2 ** 63 - 1), st.floats(), st.booleans(),
    st.sampled_from([np.float32(1.5), np.bool_(True), np.int64(-3),
                     np.str_('s'), np.bytes_(b'b'), bytearray(b'ba'),
                     memoryview(b'mv'), np.arange(12.0).reshape(3, 4)[:, 1],
                     np.zeros((2, 3), np.float32).T]))
PACK_TREES = st.recursive(PACK_LEAVES, lambda children: st.one_of(
    st.lists(children, max_size=3), st.tuples(children, children),
    st.dictionaries(st.text(max_size=3), children, max_size=3)),
    max_leaves=8)


def _contiguous(value):
  return value.copy(order='C') if isinstance(value, np.ndarray) else value


@FUZZ
@given(PACK_TREES)
def test_pack_writes_what_portal_packs_byte_for_byte(tree):
  ours = b''.join(bytes(memoryview(b).cast('B')) for b in wire.pack(tree))
  assert ours == packed(packlib.tree_map(_contiguous, tree))


def test_unpack_refuses_a_tree_that_does_not_match_its_leaves():
  import msgpack
  specs = msgpack.packb([['array', [2], '<f8'], ['none']])
  leaves = [np.ones(2).tobytes(), b'\x00']
  for tree, problem in (({'a': None}, 'more leaves'),
                        ({'a': None, 'b': None, 'c': None}, 'fewer leaves'),
                        ({'a': None, 'b': 3}, 'tree node')):
    parts = [msgpack.packb(tree), specs, *leaves]
    payload = b''.join([len(parts).to_bytes(8, 'little'), *(
        len(part).to_bytes(8, 'little') for part in parts), *parts])
    with pytest.raises(ValueError, match=problem):
      wire.unpack(memoryview(payload))


def test_unpack_refuses_a_shape_it_would_have_to_multiply_out():
  # A product of a peer's list ([10**12, 'x']) would be a string of a
  # terabyte: a MemoryError at best, an allocation of any size below that.
  import msgpack
  for shape in ([10**12, 'x'], ['x', 3], [2**63], 5):
    parts = [msgpack.packb([None]),
             msgpack.packb([['array', shape, '<f4']]), b'\x00' * 8]
    payload = b''.join([len(parts).to_bytes(8, 'little'), *(
        len(part).to_bytes(8, 'little') for part in parts), *parts])
    with pytest.raises((ValueError, TypeError, OverflowError)):
      wire.unpack(memoryview(payload))


@contextlib.contextmanager
def echo_server():
  addr = f'127.0.0.1:{free_port()}'
  server = Server(addr, 'Fuzzed', logging=False)
  server.bind('echo', lambda data: {'x': data['x'] + 1})
  server.start()
  client = Client(addr, 'Honest')
  try:
    yield server, addr, client
  finally:
    client.close(timeout=1)
    server.close(timeout=1)


def served(client):
  x = np.arange(3, dtype=np.int64)
  return (client.echo({'x': x}).result(timeout=10)['x'] == x + 1).all()


@settings(FUZZ, max_examples=40)
@given(frames=st.lists(st.one_of(
    mutated().map(lambda m: len(m).to_bytes(8, 'little') + m),  # framed
    st.binary(min_size=1, max_size=64)), min_size=1, max_size=4))
def test_a_tcp_server_survives_any_frames_and_serves_the_others(frames):
  with echo_server() as (server, addr, client):
    host, port = addr.split(':')
    with socket.create_connection((host, int(port)), timeout=5) as sock:
      sock.sendall(b'portal_handshake')
      for frame in frames:
        try:
          sock.sendall(frame)
        except OSError:
          break  # The server closed this connection: its only loss.
      assert served(client)
    assert server.error is None
    # Memory stays bounded: the closed connection is let go.
    deadline = time.monotonic() + 10
    while len(server.socket.conns) > 1 and time.monotonic() < deadline:
      time.sleep(0.01)
    assert len(server.socket.conns) <= 1


# Shapes: small, huge (their element count overflows int64), non-finite
# or not integers at all; a JSON float such as 1e400 parses as Infinity.
DIM = st.one_of(st.integers(-2, 1 << 20), st.sampled_from(
    [2 ** 31, 2 ** 31 + 1, 2 ** 63, 2 ** 64, float('inf'), float('-inf'),
     float('nan'), 1e300, 2.5, '3', None, [2]]))
LEAF = st.tuples(st.sampled_from(['x', 'envid', 'y', '']),
                 st.one_of(st.lists(DIM, max_size=9), DIM),
                 st.sampled_from(['<i8', '<f4', '|O', 'xx', '<u1', 3]))


@settings(FUZZ, max_examples=60)
@given(request=st.lists(LEAF, max_size=3), reply=st.lists(LEAF, max_size=2),
       raw_spec=st.one_of(
           st.none(),
           st.binary(max_size=32),  # Not even JSON.
           st.integers(500, 20000).map(nested)),
       size=st.sampled_from([1 << 16, 0]))  # 0: an empty memfd
def test_an_shm_server_answers_any_slot_layout_and_serves_the_others(
    request, reply, raw_spec, size):
  with serving(Recorder(), transports=('tcp', 'shm')) as (server, addr):
    with contextlib.closing(raw(addr)) as sock:
      layout = {'request': [list(leaf) for leaf in request],
                'reply': [list(leaf) for leaf in reply]}
      got, _ = attach(sock, layout, size=size, spec=raw_spec)
      assert got[:1] in (b'A', b'E'), got
      got, _ = attach(sock, LAYOUT, index=1)  # Still usable.
      assert got[:1] == b'A', got
    serves_tcp_and_shm_callers(server, addr)
