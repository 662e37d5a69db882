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

import numpy as np

from dreamer_ver.actor.carries import CarryFull
from dreamer_ver.transitions import LOG_PREFIX

MAX_ENVID = 2 ** 31 - 1
BATCH_CHECK = 4  # rows from which checking a key at a time is cheaper


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


def admit(requests, spec, lane=None, meta=None):
  """Checks a batch's requests (`.data` dicts) against `spec`, floats
  finite: returns one RequestError or None per request, and the indices of
  the valid ones. With a carry `lane`, every valid request needs an env id
  of its own in the batch and a carry slot of that lane (given out here)."""
  datas = [request.data for request in requests]
  errors = [None] * len(datas)
  if len(datas) < BATCH_CHECK or not _all_fit(
      datas, spec, lane is not None, meta or {}):
    for i, data in enumerate(datas):  # Find the rows at fault.
      try:
        check_request(data, spec, lane is not None, meta)
      except RequestError as e:
        errors[i] = e
  _check_finite(datas, errors, {**spec, **(meta or {})})
  if lane is not None:
    rows = collections.defaultdict(list)
    for i, data in enumerate(datas):
      if errors[i] is None:
        rows[int(data['envid'])].append(i)
    with lane.lock:
      for envid, indices in rows.items():
        if len(indices) > 1:
          for i in indices:
            errors[i] = RequestError(
                f'env id {envid} sent several requests in one batch; each '
                'env may only have one request in flight')
          continue
        try:
          lane.slot(envid)
        except CarryFull as e:
          errors[indices[0]] = RequestError(str(e))
  return errors, [i for i, e in enumerate(errors) if e is None]


def _all_fit(datas, spec, envid, meta):
  """Whether every row passes `check_request`, decided a key at a time over
  the batch (the set of shapes and of dtypes per key; each distinct key
  order checked once): a row at a time, the checks were most of a large
  batch's host time (on a CPU, 3-4 us a row against 1-2). False means some
  row may not: then each row is checked on its own, for its own error."""
  expected = spec.keys() | ({'envid'} if envid else set())
  known = set()  # key orders that passed
  for data in datas:
    if type(data) is not dict:
      return False
    order = tuple(data)
    if order not in known:
      extra = data.keys() - expected
      if len(data) - len(extra) != len(expected) or not all(
          isinstance(k, str) and (k in meta or k.startswith(LOG_PREFIX))
          for k in extra):
        return False
      known.add(order)
  try:
    for key, space in itertools.chain(spec.items(), meta.items()):
      values = [d[key] for d in datas if key in d]
      if (set(map(_SHAPE, values)) - {tuple(space.shape)}
          or set(map(_DTYPE, values)) - {space.dtype}):
        return False
    if envid:
      values = [d['envid'] for d in datas]
      if set(map(_SHAPE, values)) - {()} or {
          dtype.kind for dtype in map(_DTYPE, values)} - {'i', 'u'}:
        return False
      ids = list(map(int, values))  # numpy scalars compare 4x slower
      return 0 <= min(ids) and max(ids) <= MAX_ENVID
  except AttributeError:  # Values that are not numpy arrays or scalars.
    return False
  return True


_SHAPE, _DTYPE = operator.attrgetter('shape'), operator.attrgetter('dtype')


def _check_finite(datas, errors, spaces):
  """Sets a RequestError for each request still without one whose float
  values are not all finite: one check per key over the batch's rows, then,
  only if it fails, one per row to find the rows at fault."""
  keys = [k for k, s in spaces.items() if np.issubdtype(s.dtype, np.floating)]
  rows = [i for i, e in enumerate(errors) if e is None]
  if all(np.isfinite(np.array([datas[i][key] for i in rows
                               if key in datas[i]])).all() for key in keys):
    return
  for i in rows:
    for key in keys:
      value = datas[i].get(key)
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


def stack_rows(datas, spec, size):
  """One array per key of `spec` with the rows of `datas` first and zero
  padding up to `size` rows: the one copy into the batch."""
  batch = {}
  for key, space in spec.items():
    buf = np.zeros((size, *space.shape), space.dtype)
    buf[:len(datas)] = [d[key] for d in datas]
    batch[key] = buf
  return batch
