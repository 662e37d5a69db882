"""What every result file in bench/results/ carries: the commit it measured
and the machine it ran on, so that no figure is read without them."""

import datetime
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def stamp():
  """{commit, date, machine}: the short commit (`+changes` when the tree
  differs from it), today's date, and the CPU model (with its family and
  model numbers where the kernel gives them), cores, Python and,
  where the process runs JAX, its version and device."""
  def git(*args):
    return subprocess.run(['git', *args], cwd=ROOT, capture_output=True,
                          text=True).stdout.strip()
  commit = git('rev-parse', '--short', 'HEAD')
  if commit and git('status', '--porcelain', '--untracked-files=no'):
    commit += '+changes'
  cpu = platform.processor() or platform.machine()
  if Path('/proc/cpuinfo').exists():  # the model, and its generation: a
    # virtual machine's model name may be as bare as 'AMD EPYC'
    info = {}
    for line in open('/proc/cpuinfo'):
      key, _, value = line.partition(':')
      info.setdefault(key.strip(), value.strip())
    cpu = info.get('model name', cpu)
    if 'cpu family' in info:
      cpu += f", family {info['cpu family']} model {info.get('model', '?')}"
  machine = {'cpu': cpu, 'cores': os.cpu_count(),
             'python': platform.python_version()}
  if 'jax' in sys.modules:  # never imported here: a bench without JAX
    jax = sys.modules['jax']
    machine.update(jax=jax.__version__,
                   device=jax.devices()[0].device_kind)
  return {'commit': commit, 'date': datetime.date.today().isoformat(),
          'machine': machine}


def write(path, result, indent=1):
  """Writes a bench's result as JSON, stamped: a dict gains the stamp's
  keys, a list of records becomes {stamp..., records}."""
  if isinstance(result, list):
    result = {'records': result}
  Path(path).write_text(json.dumps({**stamp(), **result}, indent=indent)
                        + '\n')
