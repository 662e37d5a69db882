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

import numpy as np

from dreamer_ver.actor.carries import CarryFull
from dreamer_ver.transitions import LOG_PREFIX

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
  errors = [None] * len(requests)
  for i, request in enumerate(requests):
    try:
      check_request(request.data, spec, lane is not None, meta)
    except RequestError as e:
      errors[i] = e
  _check_finite(requests, errors, {**spec, **(meta or {})})
  if lane is not None:
    rows = collections.defaultdict(list)
    for i, request in enumerate(requests):
      if errors[i] is None:
        rows[int(request.data['envid'])].append(i)
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


def _check_finite(requests, errors, spaces):
  """Sets a RequestError for each request still without one whose float
  values are not all finite: one check of every float of the batch at
  once, then, only if it fails, one per row to find the rows at fault (on
  a CPU, checks per row and key were most of a large batch's host time)."""
  keys = [k for k, s in spaces.items() if np.issubdtype(s.dtype, np.floating)]
  rows = [i for i, e in enumerate(errors) if e is None]
  parts = [np.ravel(requests[i].data[k]) for i in rows for k in keys
           if k in requests[i].data]
  if not parts or np.isfinite(np.concatenate(parts)).all():
    return
  for i in rows:
    for key in keys:
      value = requests[i].data.get(key)
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
