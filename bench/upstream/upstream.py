"""Upstream DreamerV3 on this project's own JAX, for the benches that time
it beside ours: upstream's source (a danijar/dreamerv3 checkout, fetched
beforehand and never committed) runs with this interpreter, its jax,
jaxlib, optax and numpy, plus the few packages upstream needs that we do
not, installed into a folder of their own (`--site`).

  python -m bench.upstream.upstream --site /tmp/upsite     # once: pip install there
  env = upstream.environ(src, site)                # then: run upstream with it

`bench/upstream/upstream_shim/sitecustomize.py` adapts upstream's positional
`jax.jit` options at start-up; everything else of upstream runs as written.
"""

import argparse
import os
import subprocess
import sys
from pathlib import Path

SHIM = Path(__file__).resolve().with_name('upstream_shim')
# What upstream's learner imports beyond our dependencies (its
# requirements.txt, less what dreamer_ver already has), with their own.
PACKAGES = ('ninjax', 'granular', 'chex', 'toolz', 'einops', 'jaxtyping',
            'wadler-lindig')


def install(site, more=()):
  """pip-installs PACKAGES and `more` into `site`, without touching this
  environment (no dependencies: ours, JAX included, stay the ones both
  sides use)."""
  subprocess.run([sys.executable, '-m', 'pip', 'install', '-q', '--no-deps',
                  '--target', str(site), *PACKAGES, *more], check=True)


def environ(src, site=None):
  """os.environ for a process of upstream's: the shim, `site` (None: the
  packages are importable already, as on the GPU machine) and SRC first on
  PYTHONPATH."""
  path = [str(SHIM)] + ([str(site)] if site else []) + [str(src)]
  old = os.environ.get('PYTHONPATH')
  path += [old] if old else []
  return {**os.environ, 'PYTHONPATH': os.pathsep.join(path)}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--site', required=True,
                      help='folder to install upstream-only packages into')
  install(Path(parser.parse_args().site))


if __name__ == '__main__':
  main()
