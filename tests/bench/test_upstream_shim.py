"""bench/upstream/upstream_shim: upstream's logged-only frames where MuJoCo cannot
render, its profiler off, and nothing imported where they are not asked for."""

import os
import subprocess
import sys

import pytest

from helpers import ROOT

SHIM = ROOT / 'bench' / 'upstream' / 'upstream_shim'
RENDER = """
from dm_control import suite
env = suite.load('cartpole', 'balance')
env.reset()
frame = env.physics.render(24, 32, camera_id=0)
print(frame.shape, frame.dtype, int(frame.max()))
"""


def _python(code, **env):
  environ = {k: v for k, v in os.environ.items()
             if k not in ('UPSTREAM_BLANK_RENDER', 'UPSTREAM_NO_PROFILER')}
  environ.update({'PYTHONPATH': str(SHIM), 'MUJOCO_GL': 'disable', **env})
  return subprocess.run([sys.executable, '-c', code], env=environ,
                        capture_output=True, text=True, timeout=120)


def test_blank_frames_where_mujoco_cannot_render():
  pytest.importorskip('dm_control')
  blank = _python(RENDER, UPSTREAM_BLANK_RENDER='1')
  assert blank.returncode == 0, blank.stderr
  assert blank.stdout.split() == ['(24,', '32,', '3)', 'uint8', '0']
  plain = _python(RENDER)  # what upstream's first env step meets there
  assert plain.returncode != 0
  assert 'No OpenGL rendering backend' in plain.stderr


def test_the_shim_alone_imports_no_dm_control():
  code = "import sys; print('dm_control' in sys.modules)"
  assert _python(code, UPSTREAM_BLANK_RENDER='1').stdout.strip() == 'False'


def test_upstreams_profiler_defaults_to_off_only_when_asked(tmp_path):
  """A stand-in for upstream's embodied/jax/agent.py: its `Options` keep
  every other field and default, and the one the agent reads is patched."""
  package = tmp_path / 'embodied' / 'jax'
  package.mkdir(parents=True)
  (tmp_path / 'embodied' / '__init__.py').write_text('')
  (package / '__init__.py').write_text('')
  (package / 'agent.py').write_text(
      'import dataclasses\n'
      '@dataclasses.dataclass\n'
      'class Options:\n'
      '  precompile: bool = True\n'
      '  profiler: bool = True\n')
  code = ('from embodied.jax import agent; o = agent.Options(); '
          "print(o.profiler, o.precompile, sorted(agent.Options.__dataclass_fields__))")
  path = f'{SHIM}{os.pathsep}{tmp_path}'
  off = _python(code, PYTHONPATH=path, UPSTREAM_NO_PROFILER='1')
  assert off.stdout.split() == [
      'False', 'True', "['precompile',", "'profiler']"], off.stderr
  shipped = _python(code, PYTHONPATH=path)
  assert shipped.stdout.split()[:2] == ['True', 'True'], shipped.stderr
