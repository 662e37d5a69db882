"""`jax.keep_freed_memory`: a block the process frees is reused by its
next allocation instead of coming back from the kernel as new pages (the
page faults that cost a CPU learner update about 40 % of its time)."""

import subprocess
import sys

CHILD = r'''
import ctypes, resource, sys
from dreamer_ver.cluster.devices import keep_freed_memory
applied = keep_freed_memory() if sys.argv[1] == 'keep' else None
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
size = 64 << 20  # over glibc's largest threshold for mapping a block alone
faults = []
for _ in range(3):
  before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  block = libc.malloc(size)
  ctypes.memset(block, 1, size)
  libc.free(ctypes.c_void_p(block))
  faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(applied, *faults)
'''


def page_faults(mode):
  """(applied, page faults of 3 rounds of malloc, touch, free of 64 MiB)."""
  out = subprocess.run([sys.executable, '-c', CHILD, mode], check=True,
                       capture_output=True, text=True, timeout=60).stdout
  applied, *faults = out.split()
  return applied, [int(f) for f in faults]


def test_a_freed_block_is_reused_without_new_page_faults():
  applied, kept = page_faults('keep')
  assert applied == 'True'
  # The first round maps its pages (4 KiB or huge ones); later rounds reuse
  # them. Left to glibc's defaults, every round maps the block anew.
  assert kept[0] >= 16
  assert kept[1] + kept[2] <= max(4, kept[0] // 100), kept
  _, default = page_faults('default')
  assert min(default) >= kept[0] // 2, (default, kept)


def test_it_applies_only_where_jax_runs_on_the_cpu(monkeypatch):
  from dreamer_ver.cluster import devices

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
