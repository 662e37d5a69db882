"""`jax.malloc`: a block a worker thread frees is reused by its next
allocation instead of coming back from the kernel as new pages (the page
faults that cost a CPU learner update 10-40 % of its time), with mimalloc
preloaded (the default) or glibc kept to one arena; glibc as it starts
maps such a block anew each time."""

import os
import subprocess
import sys

import pytest

from dreamer_ver.cluster import devices

CHILD = r'''
import ctypes, resource, threading
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
size = 96 << 20  # over glibc's largest heap of a thread's arena (64 MiB)
faults = []

def rounds():  # in a thread, as XLA's workers allocate
  for _ in range(3):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    block = libc.malloc(size)
    ctypes.memset(block, 1, size)
    libc.free(ctypes.c_void_p(block))
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)

thread = threading.Thread(target=rounds)
thread.start()
thread.join()
mapped = 'libmimalloc' in open('/proc/self/maps').read()
print(mapped, *faults)
'''


def without_preload():
  """This process's environment without another allocator's settings."""
  return {k: v for k, v in os.environ.items()
          if k not in devices.MALLOC_VARS}


def page_faults(malloc):
  """(mimalloc mapped, page faults of 3 rounds of malloc, touch, free of
  96 MiB in a thread) of a process started with `malloc_env(malloc)`."""
  env = {**without_preload(), **devices.malloc_env(malloc)}
  out = subprocess.run([sys.executable, '-c', CHILD], check=True,
                       env=env, capture_output=True, text=True,
                       timeout=60).stdout
  mapped, *faults = out.split()
  return mapped == 'True', [int(f) for f in faults]


def assert_kept(faults):
  # The first round maps its pages (4 KiB or huge ones); later rounds reuse
  # them.
  assert faults[0] >= 24, faults
  assert faults[1] + faults[2] <= max(4, faults[0] // 100), faults


@pytest.mark.skipif(not devices.mimalloc_library(),
                    reason='cmeel-mimalloc has no build for this platform')
def test_the_default_preloads_mimalloc_which_keeps_a_threads_freed_block():
  assert os.path.isfile(devices.malloc_env('mimalloc')['LD_PRELOAD'])
  mapped, faults = page_faults('mimalloc')
  assert mapped
  assert_kept(faults)
  # Left to glibc, a thread's block this large is a mapping of its own,
  # made and unmapped each round: every round faults its pages again.
  mapped, default = page_faults('glibc')
  assert not mapped
  assert min(default) >= faults[0] // 2, (default, faults)


def test_one_arena_keeps_a_threads_freed_block():
  mapped, faults = page_faults('one_arena')
  assert not mapped
  assert_kept(faults)


def test_the_restart_is_only_for_mimalloc_on_the_cpu_and_never_twice(
    monkeypatch):
  monkeypatch.setattr(devices, 'mimalloc_library', lambda: '/lib/mi.so')
  monkeypatch.delenv('JAX_PLATFORMS', raising=False)
  environ = {'PATH': '/bin'}
  env = devices.malloc_restart_env('mimalloc', 'cpu', environ)
  assert env == {'PATH': '/bin', 'LD_PRELOAD': '/lib/mi.so',
                 'MIMALLOC_PURGE_DELAY': '-1'}
  assert environ == {'PATH': '/bin'}  # the caller's stays as it was
  assert devices.malloc_restart_env('mimalloc', 'cpu', env) is None
  assert devices.malloc_restart_env(  # the user's own preload stays
      'mimalloc', 'cpu', {'LD_PRELOAD': '/lib/other.so'}) is None
  env = devices.malloc_restart_env('one_arena', 'cpu', environ)
  assert env == {'PATH': '/bin', 'GLIBC_TUNABLES': devices.ONE_ARENA}
  assert devices.malloc_restart_env('one_arena', 'cpu', env) is None
  assert devices.malloc_restart_env('glibc', 'cpu', environ) is None
  assert devices.malloc_restart_env('mimalloc', 'cuda', environ) is None
  monkeypatch.setattr(devices, 'mimalloc_library', lambda: None)
  assert devices.malloc_restart_env('mimalloc', 'cpu', environ) is None


def test_it_applies_only_where_jax_runs_on_the_cpu(monkeypatch):

  class Dist:
    def __init__(self, name):
      self.metadata = {'Name': name}

  installed = [Dist('jax'), Dist('jaxlib'), Dist('numpy')]
  monkeypatch.setattr(devices.importlib.metadata, 'distributions',
                      lambda: list(installed))
  monkeypatch.delenv('JAX_PLATFORMS', raising=False)
  assert devices.runs_on_cpu('cpu') and devices.runs_on_cpu('')
  assert not devices.runs_on_cpu('cuda') and not devices.runs_on_cpu('tpu')
  installed.append(Dist('jax_cuda13_plugin'))  # JAX's default: the GPU
  assert not devices.runs_on_cpu('')
  assert devices.runs_on_cpu('cpu')
  monkeypatch.setenv('JAX_PLATFORMS', 'cpu,cuda')
  assert devices.runs_on_cpu('')
  assert not devices.runs_on_cpu('gpu')
