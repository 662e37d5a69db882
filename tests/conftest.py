import os

import numpy as np
import pytest

# Tests run on the CPU only, whatever the machine has.
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
# Ray nodes started by tests (and their workers) use 127.0.0.1, so our
# sockets on them listen on loopback only. Ray reads this when it is
# imported, so it is set here, before any test module imports Ray.
os.environ.setdefault('RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER', '0')


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
