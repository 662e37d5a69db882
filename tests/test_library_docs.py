"""docs/library.md's examples run as written: each ```python block in a
process of its own, each line it prints equal to the `# ...` comment of
the print call that printed it."""

import os
import re
import subprocess
import sys

from helpers import ROOT


# A user's environment, but for the tests' XLA flags and compile cache
# (tests/conftest.py): the examples compile small agents.
ENV = {'JAX_PLATFORMS': 'cpu', 'PATH': '/usr/bin', **{
    key: os.environ[key] for key in ('XLA_FLAGS', 'JAX_COMPILATION_CACHE_DIR')
    if key in os.environ}}


def examples():
  text = (ROOT / 'docs' / 'library.md').read_text()
  return re.findall(r'```python\n(.*?)```', text, re.S)


def test_every_example_of_the_library_guide_prints_what_it_says():
  blocks = examples()
  assert blocks
  for code in blocks:
    expected = [line.rsplit('#', 1)[1].strip() for line in code.splitlines()
                if 'print(' in line and '#' in line]
    proc = subprocess.run([sys.executable, '-c', code], capture_output=True,
                          text=True, timeout=180, cwd=ROOT, env=ENV)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split('\n')[:-1] == expected, (proc.stdout, code)
