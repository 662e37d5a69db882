"""What a policy server accepts, and how rows become one padded batch.

Shared by the DreamerV3 actor (`actor.py`) and the generic batched policy
(`batched_policy.py`). A request is a dict of arrays: one observation per
key of the spec, an integer `envid` scalar when the server keeps per-env
carries, any of the `meta` keys (checked like observations: a value the
server reads must not fail the batch it is in), and any number of `log/...`
keys. Everything else is refused with a `RequestError` naming the key, so
the one caller that sent it learns what is wrong.
"""

import collections
import itertools
import operator
from typing import NamedTuple

import numpy as np

from dreamer_ver.actor.carries import CarryFull
from dreamer_ver.core.transitions import LOG_PREFIX

MAX_ENVID = 2 ** 31 - 1


class RequestError(ValueError):
  """A request that does not match the observation space."""


def check_request(data, spec, envid=True, meta=None):
  """Raises RequestError unless `data` fits `spec` (key -> an object with
  `.shape` and `.dtype`): those keys, `envid` if asked for, any keys of
  `meta` (the same kind of mapping) and `log/` keys. (Whether floats are
  finite, `admit` checks for the whole batch at once.)"""
  meta = meta or {}
  if not isinstance(data, dict):
    raise RequestError(
        f'request must be a dict of arrays, got {type(data).__name__}')
  for key in data:
    if not isinstance(key, str):
      raise RequestError(f'keys must be strings, got {key!r}')
  # The common case in few set operations: every row of every batch pays.
  keys = data.keys() - {k for k in data if k.startswith(LOG_PREFIX)}
  expected = spec.keys() | ({'envid'} if envid else set())
  if keys != expected and (expected - keys or keys - expected - meta.keys()):
    missing = sorted(expected - keys)
    if missing:
      raise RequestError(
          f'missing key {missing[0]!r} (expected keys: {sorted(expected)})')
    extra = sorted(keys - expected - meta.keys())
    raise RequestError(
        f'unexpected key {extra[0]!r} (expected keys: {sorted(expected)})')
  if envid:
    value = np.asarray(data['envid'])
    if value.shape != () or value.dtype.kind not in 'iu':
      raise RequestError(
          'envid must be an integer scalar, got '
          f'{value.dtype}{list(value.shape)}')
    if not 0 <= int(value) <= MAX_ENVID:
      raise RequestError(
          f'envid must be in [0, {MAX_ENVID}], got {int(value)}')
  for key, space in itertools.chain(
      spec.items(), ((k, s) for k, s in meta.items() if k in data)):
    value = np.asarray(data[key])
    if value.shape != tuple(space.shape) or value.dtype != space.dtype:
      raise RequestError(
          f'key {key!r}: expected {np.dtype(space.dtype)}'
          f'{list(space.shape)}, got {value.dtype}{list(value.shape)}')


class Batch(NamedTuple):
  """What `admit` makes of a batch's requests."""
  errors: list  # one RequestError or None per request, in order
  valid: list  # the indices of the requests without one
  obs: dict  # key of the spec -> the valid rows, zero padded to a bucket
  slots: np.ndarray  # their carry slots, padded with the lane's spare row
  envids: list  # their env ids as ints (empty without a carry lane)
  meta: dict  # meta key -> the valid rows' values (zeros where absent)


def admit(datas, spec, buckets, lane=None, meta=None):
  """Checks a batch's request dicts against `spec`, floats finite, and
  copies the valid rows into one batch padded to the smallest of the
  sorted `buckets` that holds them. With a carry `lane`, every valid
  request needs an env id of its own in the batch and a carry slot of that
  lane (given out here). Returns a Batch; its `obs` and `slots` are None
  when no row is valid."""
  meta = meta or {}
  n = len(datas)
  errors = [None] * n
  # (A batch larger than every bucket may still hold few enough valid rows.)
  staged = n <= buckets[-1] and _stage(
      datas, spec, lane is not None, meta, bucket_of(buckets, n))
  if not staged:  # Find the rows at fault, each on its own.
    for i, data in enumerate(datas):
      try:
        check_request(data, spec, lane is not None, meta)
      except RequestError as e:
        errors[i] = e
    _check_finite(datas, errors, {**spec, **meta})
  rows = [i for i, e in enumerate(errors) if e is None]
  envids, slots = [], []
  if lane is not None:
    envids, slots = _give_slots(lane, rows, staged[1] if staged else [
        int(datas[i]['envid']) for i in rows], errors)
    rows = [i for i, e in enumerate(errors) if e is None]
  if not rows:
    return Batch(errors, rows, None, None, envids, {})
  size = bucket_of(buckets, len(rows))
  if staged and len(rows) == n:
    columns = staged[0]
  else:  # The rows that passed, stacked anew.
    datas = [datas[i] for i in rows]
    columns = {key: _column(_rows(datas, key, space), space,
                            size if key in spec else len(datas))
               for key, space in itertools.chain(spec.items(), meta.items())}
  padded = np.full((size,), 0 if lane is None else lane.padding, np.int32)
  padded[:len(slots)] = slots
  return Batch(errors, rows, {k: columns[k] for k in spec}, padded, envids,
               {k: v for k, v in columns.items() if k in meta})


def _stage(datas, spec, envid, meta, size):
  """Whether every row passes `check_request` with finite floats, decided a
  key at a time over the batch as its rows are stacked: (key -> the rows
  stacked, the spec's keys zero padded to `size`; the env ids as ints), or
  None when some row may not pass. Row by row, the checks were most of a
  large batch's host time on a CPU (3-4 us a row against 1-2)."""
  expected = spec.keys() | ({'envid'} if envid else set())
  if set(map(type, datas)) != {dict}:
    return None
  for order in set(map(tuple, datas)):  # each distinct key order once
    extra = set(order) - expected
    if len(order) - len(extra) != len(expected) or not all(
        isinstance(k, str) and (k in meta or k.startswith(LOG_PREFIX))
        for k in extra):
      return None
  columns = {}
  try:
    for key, space in itertools.chain(spec.items(), meta.items()):
      values = [d[key] for d in datas] if key in spec else _rows(
          datas, key, space)
      if set(map(_DTYPE, values)) - {space.dtype}:
        return None
      column = columns[key] = _column(
          values, space, size if key in spec else len(values))
      if column.shape[1:] != tuple(space.shape) or (
          column.dtype.kind == 'f' and not np.isfinite(column).all()):
        return None
    if not envid:
      return columns, []
    values = [d['envid'] for d in datas]
    ids = np.array(values)
    if ids.shape != (len(datas),) or any(  # (bools would pass as ints)
        dtype.kind not in 'iu' for dtype in {ids.dtype, *map(_DTYPE, values)}):
      return None
    envids = ids.tolist()  # ints: numpy scalars compare 4x slower
  except (AttributeError, TypeError, ValueError):  # not arrays, or ragged
    return None
  if 0 <= min(envids) and max(envids) <= MAX_ENVID:
    return columns, envids
  return None


def _give_slots(lane, rows, envids, errors):
  """The env ids and carry slots of those of `rows` (with env ids
  `envids`) that get one; the others get an error: their env id sent
  several requests in the batch, or no slot is free for it."""
  with lane.lock:
    slots = list(map(lane.slot_of.get, envids))  # The common case.
    if None not in slots and len(set(envids)) == len(envids):
      return envids, slots
    counts = collections.Counter(envids)
    kept, slots = [], []
    for i, envid in zip(rows, envids):
      if counts[envid] > 1:
        errors[i] = RequestError(
            f'env id {envid} sent several requests in one batch; each '
            'env may only have one request in flight')
        continue
      try:
        slots.append(lane.slot(envid))
        kept.append(envid)
      except CarryFull as e:
        errors[i] = RequestError(str(e))
  return kept, slots


_DTYPE = operator.attrgetter('dtype')


def _rows(datas, key, space):
  """Each row's value of `key`; zeros of `space` where a row has none."""
  zero = np.zeros(space.shape, space.dtype)
  return [d.get(key, zero) for d in datas]


def _column(values, space, size):
  """`values` (rows of `space`), then zero rows up to `size`, as one
  array: the one copy of a batch's rows."""
  padding = [np.zeros(space.shape, space.dtype)] * (size - len(values))
  return np.array(values + padding, space.dtype)


def _check_finite(datas, errors, spaces):
  """Sets a RequestError for each request still without one whose float
  values are not all finite."""
  keys = [k for k, s in spaces.items() if np.issubdtype(s.dtype, np.floating)]
  for i, data in enumerate(datas):
    if errors[i] is not None:
      continue
    for key in keys:
      value = data.get(key)
      if value is not None and not np.isfinite(value).all():
        errors[i] = RequestError(f'key {key!r}: values must be finite')
        break


def bucket_of(buckets, count):
  """The smallest of the sorted `buckets` that holds `count` rows."""
  for size in buckets:
    if size >= count:
      return size
  raise RequestError(
      f'batch of {count} exceeds the largest bucket {buckets[-1]}')
