"""The `jax` config block applied to this process, and the devices the actor
and the learner run on.

Call `setup(config)` before JAX touches a device: the platform and GPU
memory preallocation are fixed once JAX has started its backend (later
changes are ignored by JAX).

JAX's persistent compilation cache (`jax.compile_cache`, a folder in the
logdir by default) keeps every compiled program on disk, so a restarted
agent loads its policy buckets, train and report steps instead of
compiling them again (measured in bench/startup.py). JAX keys each entry by
the program, the devices and the compiler flags, so a stale entry is never
used. JAX's own `JAX_COMPILATION_CACHE_DIR`, when set, names the folder
instead: one cache shared by many runs (a sweep, a test session).

`jax.keep_freed_memory` keeps the host memory the process frees for its
own reuse (`keep_freed_memory`): XLA on the CPU allocates each call's
temporary buffers anew and frees them after it, and glibc's malloc gives
large blocks (and the heaps of its per-thread arenas) back to the kernel
on free, so every learner update touched its hundreds of megabytes as new
pages again (bench/README.md, learner section: 94,700 page faults per
size1m update on a 2-core CPU, which ran 1.26-1.54x faster without them).
It applies only where JAX runs on the CPU (`runs_on_cpu`): a GPU's buffers
are not glibc's, and one arena for the GPU compiler's many threads is a
cost nobody has measured.
"""

import ctypes
import importlib.metadata
import os
import socket
import sys

JOIN_TIMEOUT = 60  # seconds a learner process > 0 tries to join process 0
# Distributions that give JAX a default backend other than the CPU.
ACCELERATOR_PLUGINS = ('jax-cuda', 'jax-rocm', 'libtpu')


def coordinator_bind_address(config):
  """Where process 0 serves JAX's coordinator: `run.bind_host` when set,
  else the address of `jax.coordinator`'s own host, as the run's servers
  bind (JAX alone would listen on every interface)."""
  host, _, port = config.jax.coordinator.rpartition(':')
  host = config.run.bind_host or socket.gethostbyname(host)
  return f'{host}:{port}'


def setup(config):
  """Applies `jax.platform`, `jax.prealloc` and `jax.jit`, joins the
  multi-host learner when `jax.processes` > 1; returns the policy devices
  (a list of this process's devices: the actor runs one lane per entry of
  `jax.policy_devices`) and the train devices (a list: the learner trains
  data-parallel over them; with several processes, every process's
  `jax.train_devices`, process by process, so that each process's rows are
  one contiguous block of the batch)."""
  cfg = config.jax
  if cfg.keep_freed_memory and runs_on_cpu(cfg.platform):
    keep_freed_memory()
  import jax
  os.environ['XLA_PYTHON_CLIENT_PREALLOCATE'] = str(bool(cfg.prealloc)).lower()
  if cfg.platform:
    jax.config.update(
        'jax_platforms', 'cuda' if cfg.platform == 'gpu' else cfg.platform)
  jax.config.update('jax_disable_jit', not cfg.jit)
  _compile_cache(config)
  if cfg.processes > 1:
    # CPU devices of different processes talk over Gloo; GPUs use NCCL.
    # The learners' small agreements (multihost_utils) span every device of
    # every process, so each host should have the same device count.
    jax.config.update('jax_cpu_collectives_implementation', 'gloo')
    # JAX's preemption service would take SIGTERM for itself; our processes
    # stop (and save) on it through cluster/signals.StopSignal.
    jax.config.update('jax_enable_preemption_service', False)
    # Process 0 waits JAX's default 300 s for the others to join. Another
    # process gives up sooner and fails, to be restarted and look the
    # coordinator up again: under Ray, a restarted learner may have found
    # the address of an agent that was about to fail (and restart on a new
    # port), which JAX would otherwise retry for the whole 300 s.
    jax.distributed.initialize(
        cfg.coordinator, num_processes=cfg.processes,
        process_id=cfg.process_id,
        initialization_timeout=300 if cfg.process_id == 0 else JOIN_TIMEOUT,
        coordinator_bind_address=coordinator_bind_address(config))

  def pick(key, index, process):
    devices = jax.local_devices(process_index=process)
    if index >= len(devices):
      which = ('this process' if process == jax.process_index()
               else f'learner process {process}')
      raise ValueError(
          f'jax.{key} names device {index}, but {which} has '
          f'{len(devices)} {devices[0].platform} device(s)')
    return devices[index]

  here = jax.process_index()
  policy = [pick('policy_devices', i, here) for i in cfg.policy_devices]
  train = [pick('train_devices', i, process)
           for process in range(jax.process_count())
           for i in cfg.train_devices]
  return policy, train


def runs_on_cpu(platform):
  """Whether JAX will run this process on the CPU, answered without starting
  its backend: `platform` (`jax.platform`, else `$JAX_PLATFORMS`'s first)
  says cpu, or it is left to JAX and no accelerator plugin is installed."""
  platform = platform or os.environ.get('JAX_PLATFORMS', '').split(',')[0]
  if platform:
    return platform == 'cpu'
  names = {(dist.metadata['Name'] or '').lower().replace('_', '-')
           for dist in importlib.metadata.distributions()}
  return not any(name.startswith(ACCELERATOR_PLUGINS) for name in names)


def keep_freed_memory():
  """Makes glibc's malloc keep what this process frees: one arena, no
  blocks mapped on their own, no trimming of the heap. Call it before
  JAX's backend starts its threads. Returns whether it applied (False off
  glibc, which has no `mallopt`)."""
  if not sys.platform.startswith('linux'):
    return False
  mallopt = getattr(ctypes.CDLL(None), 'mallopt', None)  # the process's libc
  if mallopt is None:
    return False
  m_trim_threshold, m_mmap_max, m_arena_max = -1, -4, -8  # glibc's malloc.h
  settings = ((m_arena_max, 1), (m_mmap_max, 0), (m_trim_threshold, 2**31 - 1))
  return all([mallopt(option, value) == 1 for option, value in settings])


def _compile_cache(config):
  """Points JAX's persistent compilation cache at `jax.compile_cache`, or at
  `$JAX_COMPILATION_CACHE_DIR` where that is set ('' stays off)."""
  import jax
  from jax.experimental.compilation_cache import compilation_cache
  folder = os.path.expanduser(config.jax.compile_cache)
  if folder and os.environ.get('JAX_COMPILATION_CACHE_DIR'):
    folder = os.path.expanduser(os.environ['JAX_COMPILATION_CACHE_DIR'])
  if folder and not os.path.isabs(folder):
    # Inside the logdir; a config without one (library use) caches nothing
    # rather than write into the working directory.
    folder = os.path.join(config.logdir, folder) if config.logdir else ''
  if folder != jax.config.jax_compilation_cache_dir:
    # JAX opens its cache once per process; a second run in one process
    # (tests, notebooks) must not keep writing to the first run's folder.
    compilation_cache.reset_cache()
    jax.config.update('jax_compilation_cache_dir', folder or None)
  # Cache every program: the policy buckets compile in well under JAX's
  # default threshold of 1 s each, but there are many of them.
  jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.0)
