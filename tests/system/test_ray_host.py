"""A component hosted by `cluster/ray_host.Host` on a local Ray instance:
one that fails restarts, even when it set its own stop event first (as the
agent does to stop its threads); one removed has freed its name."""

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

ray = pytest.importorskip('ray')
# One Ray instance at a time where tests run side by side (.ci/run: -n 2
# --dist loadgroup).
pytestmark = pytest.mark.xdist_group('ray')
from dreamer_ver.cluster import ray_host  # noqa: E402

TESTS = Path(__file__).resolve().parent


def fails_once(config, marker, stop):
  """Counts its runs in the file `marker`; the first one sets `stop` and
  returns 1 (a failure), the next returns 0."""
  del config
  path = Path(marker)
  runs = int(path.read_text()) if path.exists() else 0
  path.write_text(str(runs + 1))
  if runs == 0:
    stop.set()
    return 1
  return 0


def waits(config, pidfile, stop):
  """Writes its process id to `pidfile`, then runs until asked to stop."""
  del config
  Path(pidfile).write_text(str(os.getpid()))
  while not stop.wait(1.0):
    pass
  return 0


@pytest.fixture
def local_ray():
  """Ray on this machine, whose workers import this module and the
  tests' helpers."""
  path = os.pathsep.join(p for p in (
      str(TESTS), str(TESTS.parent), os.environ.get('PYTHONPATH', '')) if p)
  ray.init(address='local', num_cpus=1, namespace='ray-host',
           include_dashboard=False,
           runtime_env={'env_vars': {'PYTHONPATH': path}})
  yield
  ray.shutdown()


def test_a_component_that_fails_after_setting_its_stop_restarts(
    local_ray, tmp_path):
  marker = tmp_path / 'runs'
  host = ray_host.start({}, 'flaky', 'test_ray_host:fails_once', str(marker),
                        num_cpus=1)
  try:
    # Ray retries the join across the restart; the second run finishes.
    assert ray.get(host.join.remote(None), timeout=120) == 0
  finally:
    ray.kill(host, no_restart=True)
  assert marker.read_text() == '2'


def test_a_removed_component_frees_its_name_before_remove_returns(
    local_ray, tmp_path):
  # `ray.kill` only asks: a component started again under the same name
  # right after (an eval worker of the same name) must not find it taken.
  # As an eval worker's: detached, and restarted once by Ray.
  pidfile = tmp_path / 'pid'
  for _ in range(3):
    pidfile.unlink(missing_ok=True)
    host = ray_host.start({}, 'again', 'test_ray_host:waits', str(pidfile),
                          num_cpus=0.25, lifetime='detached')
    pid = int(wait_for(pidfile))
    os.kill(pid, signal.SIGKILL)
    assert int(wait_for(pidfile, other_than=str(pid))) != pid
    ray_host.remove(host, 'again', 30)
    with pytest.raises(ValueError):
      ray.get_actor('again')


def wait_for(path, other_than=None, seconds=120):
  """The text of `path` once it exists (and differs from `other_than`)."""
  deadline = time.monotonic() + seconds
  while time.monotonic() < deadline:
    text = path.read_text() if path.exists() else ''
    if text and text != other_than:
      return text
    time.sleep(0.05)
  raise TimeoutError(f'{path} after {seconds} s')


def test_a_detached_ray_worker_with_a_custom_policy_is_found_by_name(
    local_ray, tmp_path):
  """A named eval worker on Ray is detached (it outlives its handle), with
  a custom policy (`policy_maker`), and `from_name` finds it through Ray's
  named actors."""
  from dreamer_ver.config import loading as configlib
  from dreamer_ver.evaluation.worker import EvalWorker
  from helpers.evaluation import FLAGS, LENGTH
  config = configlib.load_config([*FLAGS, '--logdir', str(tmp_path)])
  owner = EvalWorker(policy_maker='helpers.evaluation:cue_policy',
                     config=config, name='custom', host='ray', num_cpus=0.5)
  try:
    owner.close()  # The handle goes; the detached worker stays.
    token = (tmp_path / 'token').read_text().strip()
    found = EvalWorker.from_name('custom', token=token, timeout=60)
    found.submit({'flip': np.int32(0)}, 7, episodes=2)
    result = found.poll(timeout=120)
    assert result['version'] == 7 and result['scores'] == [LENGTH] * 2
    found.close()
  finally:
    owner.shutdown(timeout=10)
