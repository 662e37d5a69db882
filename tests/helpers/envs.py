"""Envs that tests in several folders share."""

import numpy as np
import pytest


def rendered_dmc(config):
  """A dmc cartpole env (`config` as for make_env) and its first
  observation; skips the test where MuJoCo cannot render."""
  pytest.importorskip('dm_control')
  from dreamer_ver.envs import make_env
  try:
    env = make_env('dmc_cartpole_balance', config)
    reset = {k: np.zeros(s.shape, s.dtype) for k, s in env.act_space.items()}
    reset['reset'] = np.bool_(True)
    return env, env.step(reset)
  except Exception as e:  # No usable OpenGL backend (EGL/OSMesa) here.
    pytest.skip(f'MuJoCo rendering unavailable: {type(e).__name__}: {e}')
