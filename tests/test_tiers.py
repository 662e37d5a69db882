"""The test tiers' own machinery: tests marked with one `xdist_group` run
in one worker under `--dist loadgroup`, as the system tier's Ray tests
(one Ray instance at a time) and shared fixtures rely on."""

import os
import subprocess
import sys
import textwrap


def test_a_group_runs_in_one_worker(tmp_path):
  (tmp_path / 'test_grouped.py').write_text(textwrap.dedent('''
      import os
      import pytest

      pytestmark = pytest.mark.xdist_group('one')

      @pytest.mark.parametrize('i', range(6))
      def test_record_worker(i):
        with open(os.environ['WORKERS_FILE'], 'a') as f:
          f.write(os.environ['PYTEST_XDIST_WORKER'] + '\\n')
  '''))
  workers = tmp_path / 'workers.txt'
  proc = subprocess.run(
      [sys.executable, '-m', 'pytest', '-q', '-n', '2', '--dist', 'loadgroup',
       '-p', 'no:cacheprovider', '-c', '/dev/null', '--rootdir', str(tmp_path),
       str(tmp_path / 'test_grouped.py')],
      cwd=tmp_path, env={**os.environ,
                         'WORKERS_FILE': str(workers)},
      capture_output=True, text=True, timeout=120)
  assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
  ran = workers.read_text().split()
  assert len(ran) == 6 and len(set(ran)) == 1, ran
