"""What the learner bench counts in a compiled update (bench/learner/learner_bench.py):
its matrix products and their FLOPs, the ops a GPU launches per scan step,
each product timed alone (the matmul floor) and the device's matmul peak."""

import math
import re
import time

import jax
import jax.numpy as jnp
import numpy as np


def matmul_ops(jaxpr):
  """The matrix products (`dot_general`s and convolutions) of a jaxpr as
  {signature: [equation, count]}, each scan body counted times its length
  (of a cond's branches, the costliest)."""
  ops = {}
  for eqn in jaxpr.eqns:
    if eqn.primitive.name in ('dot_general', 'conv_general_dilated'):
      signature = (eqn.primitive.name, repr(sorted(eqn.params.items())),
                   tuple((v.aval.shape, str(v.aval.dtype)) for v in eqn.invars))
      ops.setdefault(signature, [eqn, 0])[1] += 1
    for value in eqn.params.values():
      for sig, (sub, count) in _ops_of(value).items():
        ops.setdefault(sig, [sub, 0])[1] += count * eqn.params.get('length', 1)
  return ops


def _ops_of(value):
  """The products of a param that holds jaxprs (one, or branches)."""
  if isinstance(value, (tuple, list)):
    return max((_ops_of(v) for v in value), key=total_flops, default={})
  inner = getattr(value, 'jaxpr', value)  # ClosedJaxpr -> Jaxpr
  return matmul_ops(inner) if hasattr(inner, 'eqns') else {}


def flops(eqn):
  """2 per multiply-add of one matrix product."""
  out = eqn.outvars[0].aval.shape
  if eqn.primitive.name == 'dot_general':
    (contract, _), _ = eqn.params['dimension_numbers']
    lhs = eqn.invars[0].aval.shape
    return 2 * math.prod(out) * math.prod(lhs[d] for d in contract)
  rhs = eqn.invars[1].aval.shape
  spec = eqn.params['dimension_numbers'].rhs_spec  # (out, in, *spatial)
  return 2 * math.prod(out) * math.prod(rhs[d] for d in spec[1:])


def total_flops(ops):
  return sum(count * flops(eqn) for eqn, count in ops.values())


# HLO instructions that launch nothing: they name or regroup buffers.
NO_LAUNCH = ('parameter', 'get-tuple-element', 'tuple', 'constant', 'bitcast')


def computations(hlo):
  """{name: [its instruction lines]} of optimized HLO text."""
  found, name = {}, None
  for line in hlo.splitlines():
    head = re.match(r'(?:ENTRY )?%?([\w.\-]+) .*\{$', line)
    if head and not line.startswith(' '):
      name = head[1]
      found[name] = []
    elif name:
      found[name].append(line)
  return found


def loops(hlo):
  """[(trip count or None, body computation's name)] of each while loop of
  optimized HLO text, in the order they appear."""
  found = []
  for line in hlo.splitlines():
    if ' while(' in line:
      trip = re.search(r'"known_trip_count":\{"n":"(\d+)"', line)
      found.append((int(trip[1]) if trip else None,
                    re.search(r'body=%?([\w.\-]+)', line)[1]))
  return found


def scan_body_ops(hlo):
  """The ops in each while loop's body of optimized HLO text, what a GPU
  launches per trip (a fusion is one op; a nested loop counts as one, its
  body apart): [[trip count, ops]] in the order the loops appear."""
  bodies = computations(hlo)
  counts = []
  for trip, body in loops(hlo):
    ops = [op[1] for op in (
        re.match(r'\s+(?:ROOT )?%?[\w.\-]+ = (?:\(.*?\)|\S+) ([\w\-]+)\(',
                 line) for line in bodies[body]) if op]
    counts.append([trip, len([op for op in ops if op not in NO_LAUNCH])])
  return counts


def product_seconds(eqn, copies=8, calls=3):
  """Seconds of one matrix product alone, at its shapes, dtypes and
  dimension numbers, on `copies` sets of random operands: the faster of
  one compiled scan over the copies (no dispatch per product, but the scan
  slices its inputs and stacks its outputs) and one jitted call per copy
  (no copies, but a dispatch each); best of `calls`."""
  rng = np.random.default_rng(0)
  operands = [jnp.asarray(rng.standard_normal((copies, *v.aval.shape))
                          .astype(v.aval.dtype)) for v in eqn.invars]
  one = jax.jit(lambda *xs: eqn.primitive.bind(*xs, **eqn.params))
  scan = jax.jit(lambda xs: jax.lax.scan(lambda _, x: (None, one(*x)),
                                         None, xs)[1])
  apart = [[x[i] for x in operands] for i in range(copies)]
  ways = [lambda: scan(operands), lambda: [one(*xs) for xs in apart]]
  best = math.inf
  for way in ways:
    jax.block_until_ready(way())
    for _ in range(calls):
      start = time.perf_counter()
      jax.block_until_ready(way())
      best = min(best, time.perf_counter() - start)
  return best / copies


def matmul_floor(ops):
  """Seconds the update's matrix products take, each timed alone: what an
  update would take if everything else it does were free."""
  return sum(count * product_seconds(eqn) for eqn, count in ops.values())


def matmul_peak(dtype, n, repeats=20):
  """Sustained FLOP/s of back-to-back n x n matrix products in `dtype`."""
  x = jax.random.normal(jax.random.PRNGKey(0), (n, n), dtype)
  dot = jax.jit(jnp.dot)
  dot(x, x).block_until_ready()
  start = time.perf_counter()
  for _ in range(repeats):
    y = dot(x, x)
  y.block_until_ready()
  return repeats * 2 * n ** 3 / (time.perf_counter() - start)
