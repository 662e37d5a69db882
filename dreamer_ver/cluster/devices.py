"""The `jax` config block applied to this process, and the devices the actor
and the learner run on.

Call `setup(config)` before JAX touches a device: the platform and GPU
memory preallocation are fixed once JAX has started its backend (later
changes are ignored by JAX).

JAX's persistent compilation cache (`jax.compile_cache`, a folder in the
logdir by default) keeps every compiled program on disk, so a restarted
agent loads its policy buckets, train and report steps instead of
compiling them again (measured in bench/system/startup.py). JAX keys each entry by
the program, the devices and the compiler flags, so a stale entry is never
used. JAX's own `JAX_COMPILATION_CACHE_DIR`, when set, names the folder
instead: one cache shared by many runs (a sweep, a test session).

`jax.malloc` picks the host allocator of a process whose JAX runs on the
CPU (`runs_on_cpu`). XLA:CPU allocates each call's buffers anew and frees
them after it, about 370 MB per size1m learner update, from its worker
threads. glibc's malloc (`glibc`) serves a thread's block over 64 MiB from
a mapping of its own and unmaps it on free, so each update touched its
buffers as fresh pages again (94,700 page faults); with one arena kept
(`one_arena`: no unmapping, no trimming) the faults are gone, but every
thread allocates from one heap, whose searches cost more than the faults
on some CPUs. `mimalloc` (the default) keeps per-thread heaps and, with
purging off, every page it has had: neither faults nor one shared heap
(docs/benchmarks.md, learner section, has the figures of all three). Each is
a setting a process must start with (a preloaded library, glibc's
tunables), so the command line's `main` starts again with it
(`malloc_restart_env`); the library comes with the `cmeel-mimalloc` wheel,
a dependency on Linux.
"""

import importlib.metadata
import os
import re
import socket
import sys
import warnings
from pathlib import Path

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


# What `malloc_env` may set.
MALLOC_VARS = ('LD_PRELOAD', 'MIMALLOC_PURGE_DELAY', 'GLIBC_TUNABLES')
# glibc's tunables for `one_arena`: one arena, no blocks mapped on their
# own, no trimming of the heap.
ONE_ARENA = ('glibc.malloc.arena_max=1:glibc.malloc.mmap_max=0:'
             'glibc.malloc.trim_threshold=2147483647')


def mimalloc_library():
  """The path of the mimalloc library the cmeel-mimalloc wheel installed,
  or None where it is not installed."""
  try:
    files = importlib.metadata.files('cmeel-mimalloc') or ()
  except importlib.metadata.PackageNotFoundError:
    return None
  for file in files:
    if file.name == 'libmimalloc.so':
      return str(file.locate())
  return None


def malloc_env(malloc):
  """The environment variables a process starts with for allocator
  `malloc` ({} for glibc as it is, or mimalloc where it is missing)."""
  if malloc == 'mimalloc':
    library = mimalloc_library()
    # Purging off: never give pages back.
    return {'LD_PRELOAD': library, 'MIMALLOC_PURGE_DELAY': '-1'} if (
        library) else {}
  if malloc == 'one_arena':
    return {'GLIBC_TUNABLES': ONE_ARENA}
  assert malloc == 'glibc', malloc
  return {}


def malloc_restart_env(malloc, platform, environ):
  """The environment this process must start again with for allocator
  `malloc` (`jax.malloc`) to apply: `environ` and `malloc_env`; None where
  nothing is to be done: JAX does not run on the CPU (`platform`:
  `jax.platform`), the allocator needs nothing, or its variables are set
  already (by the restart, or by the user, whose choice stays)."""
  wanted = malloc_env(malloc)
  if (not wanted or not runs_on_cpu(platform)
      or any(environ.get(key) for key in wanted)):
    return None
  return {**environ, **wanted}


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
  if not isinstance(warnings.showwarning, _DamagedEntries):
    warnings.showwarning = _DamagedEntries(warnings.showwarning)


class _DamagedEntries:
  """`warnings.showwarning` that removes a compile cache entry JAX could not
  read (a cut or flipped file): JAX warns in two lines and compiles the
  program again, but keeps the entry, so every later start of every
  process would warn again. The entry's files (all of its name) go, with
  one line; the program's next compile writes it anew."""

  PATTERN = re.compile(
      r"Error reading persistent compilation cache entry for '([\w.-]+)'")

  def __init__(self, show):
    self.show = show

  def __call__(self, message, category, filename, lineno, file=None,
               line=None):
    import jax
    found = self.PATTERN.match(str(message))
    folder = jax.config.jax_compilation_cache_dir
    files = sorted(Path(folder).glob(f'{found.group(1)}-*-cache')) if (
        found and folder) else []
    if not files:
      return self.show(message, category, filename, lineno, file, line)
    for path in files:
      path.unlink(missing_ok=True)
    print(f'Removed the unreadable compile cache entry {found.group(1)} '
          f'from {folder} ({str(message).split(": ", 1)[-1]}); it is '
          'compiled again.', file=sys.stderr, flush=True)
