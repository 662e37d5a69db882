"""Settings for every test process, and the two tiers.

The fast tier is every folder but `system/`: `pytest` runs it. The system
tier (whole runs of the real processes) runs only when named: `pytest
tests/system`. Where a new test goes: tests/README.md.
"""

import atexit
import os
import shutil
import tempfile
from pathlib import Path

# Tests run on the CPU only, whatever the machine has.
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
# Ray nodes started by tests (and their workers) use 127.0.0.1, so our
# sockets on them listen on loopback only. Ray reads this when it is
# imported, so it is set here, before any test module imports Ray.
os.environ.setdefault('RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER', '0')
# One JAX persistent compilation cache for the whole session, in this
# process and in every process a test starts (they inherit the variable,
# which cluster/devices.py prefers to the logdir's cache): the same debug
# agent compiles once per session, not once per test. Set it yourself to
# keep the cache between sessions.
if not os.environ.get('JAX_COMPILATION_CACHE_DIR'):
  _cache = tempfile.mkdtemp(prefix='dreamer_ver_test_jax_cache_')
  os.environ['JAX_COMPILATION_CACHE_DIR'] = _cache
  atexit.register(shutil.rmtree, _cache, ignore_errors=True)

SYSTEM = Path(__file__).resolve().parent / 'system'
# The tests' tiny agents spend their time compiling, not running: LLVM does
# not optimise the machine code XLA generates for them (XLA's own passes
# still run), and XLA:CPU's loop emitters replace its MLIR fusion emitters.
# On a 2-core AMD EPYC the debug agent's update compiles in 6.9 s instead
# of 10.7 (its ~180 small eager ops in 3.0 s instead of 7.2), and a debug
# `--script train` run of a suite takes half the time. Only the machine
# code changes, not the program: the system tier's checks of processes,
# faults and rows hold as they do under the default. The learning test
# and the runs that set their own XLA_FLAGS use the default. At size1m the
# loop emitters run the update 1.21x slower, so they are no default.
FAST_XLA_FLAGS = ('--xla_backend_optimization_level=0 '
                  '--xla_cpu_use_fusion_emitters=false')


def pytest_configure(config):
  """Before any test runs JAX (its backend reads XLA_FLAGS once). The
  flags are XLA:CPU's: where the tests run on a GPU, XLA keeps its own."""
  if not os.environ.get('XLA_FLAGS') and os.environ['JAX_PLATFORMS'] == 'cpu':
    os.environ['XLA_FLAGS'] = FAST_XLA_FLAGS


def pytest_xdist_auto_num_workers(config):
  """`-n auto`: one and a half workers per core. A fast-tier worker waits
  for a fifth of its time (helper processes starting, servers' timeouts),
  so one per core leaves the cores idle: on a 2-core AMD EPYC the tier
  took 196-211 s on 2 workers, 167 s on 3 and 168 s on 4."""
  return max(2, (os.cpu_count() or 1) * 3 // 2)


def pytest_ignore_collect(collection_path, config):
  """Leaves out tests/system unless a command-line path lies inside it."""
  if collection_path.resolve() != SYSTEM:
    return None
  return not names_system(config)


def names_system(config):
  """Whether a command-line path lies inside tests/system."""
  here = config.invocation_params.dir
  named = [(here / arg.split('::')[0]).resolve() for arg in config.args]
  return any(path.is_relative_to(SYSTEM) for path in named)
