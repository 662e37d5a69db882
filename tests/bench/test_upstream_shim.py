"""bench/upstream/upstream_shim: upstream's logged-only frames where MuJoCo cannot
render, and nothing imported where they are not asked for."""

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
             if k != 'UPSTREAM_BLANK_RENDER'}
  environ.update(PYTHONPATH=str(SHIM), MUJOCO_GL='disable', **env)
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
