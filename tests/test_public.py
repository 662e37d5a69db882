"""The package's public surface (`dreamer_ver/__init__.py`): every name
resolves to its class, and only the names that need JAX load it."""

import subprocess
import sys

import pytest

import dreamer_ver

CHECK = '''
import sys
import dreamer_ver
from dreamer_ver import (Collector, EvalWorker, InferenceClient, MPTransport,
                         Transport, WeightSender)
light = 'jax' not in sys.modules
from dreamer_ver import InferenceServer
print(light, 'jax' in sys.modules)
'''


def test_the_public_names_are_the_library_classes():
  from dreamer_ver.inference.collector import Collector
  from dreamer_ver.evaluation.worker import EvalWorker
  from dreamer_ver.inference.server import InferenceServer
  from dreamer_ver.inference.client import InferenceClient, WeightSender
  from dreamer_ver.rpc.mp_transport import MPTransport
  from dreamer_ver.rpc.transport import Transport
  assert [getattr(dreamer_ver, name) for name in (
      'Collector', 'EvalWorker', 'InferenceClient', 'InferenceServer',
      'MPTransport', 'Transport', 'WeightSender')] == [
          Collector, EvalWorker, InferenceClient, InferenceServer,
          MPTransport, Transport, WeightSender]
  assert set(dreamer_ver.__all__) <= set(dir(dreamer_ver))
  with pytest.raises(AttributeError, match='no attribute'):
    dreamer_ver.InferenceSever  # noqa: B018  (a typo)


def test_the_names_without_jax_do_not_load_it():
  done = subprocess.run([sys.executable, '-c', CHECK], capture_output=True,
                        text=True, timeout=120, check=False)
  assert done.stdout.split() == ['True', 'True'], done.stdout + done.stderr
