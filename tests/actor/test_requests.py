"""Admission by value: whatever mix of good and bad rows a batch holds,
`admit` gives each row the error (or none) that checking it alone gives,
however it checks the batch to be fast."""

import jax
import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from dreamer_ver.actor.carries import CarryLane
from dreamer_ver.actor.requests import RequestError, admit, check_request

S = jax.ShapeDtypeStruct
SPEC = {'x': S((3,), np.float32), 'r': S((), np.float32), 'first': S((), bool)}
META = {'is_eval': S((), bool), 'w': S((2,), np.float64)}
BUCKETS = (1, 2, 4, 8, 16)


def good(envid):
  return {'x': np.arange(3, dtype=np.float32), 'r': np.float32(1),
          'first': np.bool_(False), 'envid': np.int64(envid)}


FAULTS = {  # how a row goes wrong (or stays right), by name
    'none': lambda d: d,
    'log key': lambda d: {**d, 'log/score': np.float32(3)},
    'meta key': lambda d: {**d, 'is_eval': np.bool_(True)},
    'float meta': lambda d: {**d, 'w': np.ones(2)},
    'nan meta': lambda d: {**d, 'w': np.array([0, np.nan])},
    'missing key': lambda d: {k: v for k, v in d.items() if k != 'r'},
    'extra key': lambda d: {**d, 'bogus': np.zeros(1)},
    'wrong shape': lambda d: {**d, 'x': np.zeros(4, np.float32)},
    'wrong dtype': lambda d: {**d, 'x': np.zeros(3, np.float64)},
    'meta dtype': lambda d: {**d, 'is_eval': np.int32(1)},
    'python bool': lambda d: {**d, 'first': True},
    'nan': lambda d: {**d, 'x': np.array([0, np.nan, 1], np.float32)},
    'inf': lambda d: {**d, 'r': np.float32(np.inf)},
    'float envid': lambda d: {**d, 'envid': np.float64(1)},
    'negative envid': lambda d: {**d, 'envid': np.int64(-1)},
    'huge envid': lambda d: {**d, 'envid': np.int64(2 ** 40)},
    'not a dict': lambda d: [d],
    'bytes key': lambda d: {**d, b'bogus': np.zeros(1)},  # msgpack's bin
    'int key': lambda d: {**d, 7: np.zeros(1)},  # an in-process caller's
    # Rows that a stacked batch would take in silently, by promotion,
    # broadcasting or byte order:
    'half floats': lambda d: {**d, 'x': np.zeros(3, np.float16)},
    'swapped bytes': lambda d: {**d, 'x': np.zeros(3, '>f4')},
    'column': lambda d: {**d, 'x': np.zeros((3, 1), np.float32)},
    'one float': lambda d: {**d, 'x': np.zeros(1, np.float32)},
    'list': lambda d: {**d, 'x': [0.0, 1.0, 2.0]},
    'bool envid': lambda d: {**d, 'envid': np.bool_(True)},
    'vector envid': lambda d: {**d, 'envid': np.array([d['envid']])},
    'int32 envid': lambda d: {**d, 'envid': np.int32(d['envid'])},  # fine
}


def reference(datas, slots):
  """Each row checked alone, then finiteness, then one row per env id:
  each row's error message, or a part of it, or None."""
  errors = []
  for data in datas:
    try:
      check_request(data, SPEC, True, META)
      for key in ('x', 'r', 'w'):
        if key in data and not np.isfinite(data[key]).all():
          raise RequestError(f'key {key!r}: values must be finite')
      errors.append(None)
    except RequestError as e:
      errors.append(str(e))
  envids = [int(d['envid']) for d, e in zip(datas, errors) if e is None]
  taken = set()
  for i, (data, error) in enumerate(zip(datas, errors)):
    if error is None:
      envid = int(data['envid'])
      if envids.count(envid) > 1:
        errors[i] = f'env id {envid} sent several requests'
      elif envid not in taken and len(taken) >= slots:
        errors[i] = f'env id {envid} needs a carry slot'
      else:
        taken.add(envid)
  return errors


# Mostly good rows, so that many batches hold one fault or none: those
# are the batches a fast path could let through.
ROW = st.tuples(st.integers(0, 6), st.sampled_from(
    ['none'] * len(FAULTS) + sorted(FAULTS)))


@settings(max_examples=200, deadline=None)
@given(st.lists(ROW, min_size=1, max_size=12))
def test_each_row_gets_the_error_it_gets_alone(rows):
  datas = [FAULTS[fault](good(envid)) for envid, fault in rows]
  slots = 5
  lane = CarryLane(0, (), slots)
  batch = admit(datas, SPEC, BUCKETS, lane, META)
  expected = reference(datas, slots)
  assert batch.valid == [i for i, e in enumerate(expected) if e is None]
  for got, want in zip(batch.errors, expected):
    assert (got is None) == (want is None), (rows, got, want)
    assert want is None or str(got).startswith(want), (rows, got, want)
  if batch.valid:  # The valid rows, stacked and padded, by value.
    valid = [datas[i] for i in batch.valid]
    size = min(b for b in BUCKETS if b >= len(valid))
    for key, space in SPEC.items():
      assert batch.obs[key].dtype == space.dtype
      np.testing.assert_array_equal(batch.obs[key], np.array(
          [d[key] for d in valid] + [np.zeros(space.shape)] * (
              size - len(valid)), space.dtype))
    assert batch.envids == [int(d['envid']) for d in valid]
    assert batch.slots.tolist() == [lane.slot_of[e] for e in batch.envids] + [
        lane.padding] * (size - len(valid))
    np.testing.assert_array_equal(
        batch.meta['is_eval'], [d.get('is_eval', False) for d in valid])
  else:
    assert batch.obs is None and batch.slots is None


def test_a_full_batch_of_one_wrong_shape_is_refused_row_by_row():
  # Alike rows fill a bucket without padding: nothing ragged to give them
  # away, so only the batch's shape does.
  for key, value in (('x', np.zeros(4, np.float32)), ('w', np.zeros(3))):
    datas = [{**good(envid), key: value} for envid in range(4)]
    batch = admit(datas, SPEC, BUCKETS, CarryLane(0, (), 5), META)
    assert batch.valid == [] and batch.obs is None
    assert all(f'key {key!r}: expected' in str(e) for e in batch.errors)


def test_a_batch_larger_than_every_bucket_serves_the_valid_rows_that_fit():
  datas = [good(envid) for envid in range(4)] + [
      {**good(4), 'r': np.float32(np.nan)}]
  batch = admit(datas, SPEC, (1, 2, 4), CarryLane(0, (), 5), META)
  assert batch.valid == [0, 1, 2, 3] and batch.obs['x'].shape == (4, 3)
  assert 'finite' in str(batch.errors[4])


def test_a_value_with_an_unhashable_dtype_fails_its_row_alone():
  class Odd:  # An in-process caller's object that only looks like an array.
    dtype, shape = [], ()
  datas = [good(envid) for envid in range(3)] + [{**good(3), 'r': Odd()}]
  batch = admit(datas, SPEC, BUCKETS, CarryLane(0, (), 5), META)
  assert batch.valid == [0, 1, 2]
  assert "key 'r': expected float32[]" in str(batch.errors[3])
