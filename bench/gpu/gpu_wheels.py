"""Downloads the wheels a bare GPU machine lacks into `.whl/` and checks
that they travel with the repository under the size limit.

  python3 -m bench.gpu.gpu_wheels [--dir .whl] [--limit_mib 64]

The GPU machine has Python 3.12 with jax, flax, optax, numpy and their
dependencies, but no network and none of elements, portal, gymnasium or
dm_control. This fetches those (at the versions `constraints.txt` pins)
for CPython 3.12 on manylinux x86-64, with their dependencies that the
machine also lacks, then slims the two big ones: dm_control loses the
locomotion walkers' and soccer's assets, the dog's and test files, mujoco
its `experimental` viewer (the suite's walker, cartpole and the like need
none of them; upstream's dmc wrapper imports locomotion's code). pip has no
way to leave files of a wheel out, hence the repacking here.
On the GPU machine, `bench/gpu/gpu.sh` installs them with
`pip install --no-index --no-deps --target`.

`--upstream SRC` also carries upstream DreamerV3 for the learner bench's
side-by-side: the `dreamerv3/` and `embodied/` folders of SRC's HEAD (a
danijar/dreamerv3 checkout) into `.upstream/`, and the wheels of its
dependencies that the GPU image lacks (ninjax, granular; newest).
"""

import argparse
import base64
import hashlib
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# What the GPU image lacks of our dependencies and theirs.
PACKAGES = ('elements', 'portal', 'ruamel.yaml', 'gymnasium',
            'Farama-Notifications', 'dm_control', 'mujoco', 'dm-env',
            'dm-tree', 'glfw', 'labmaze', 'PyOpenGL')
# Folders of a wheel that the suite tasks never read.
DROP = {
    'dm_control': ('dm_control/locomotion/walkers/assets/',
                   'dm_control/locomotion/soccer/assets/',
                   'dm_control/suite/dog_assets/',
                   'dm_control/mujoco/testing/', 'dm_control/blender/',
                   'dm_control/mjcf/test_assets/', 'dm_control/third_party/',
                   'dm_control/suite/all_domains.png'),
    'mujoco': ('mujoco/experimental/',),
}
UPSTREAM_PACKAGES = ('ninjax', 'granular')
PLATFORMS = ('manylinux_2_28_x86_64', 'manylinux_2_27_x86_64',
             'manylinux_2_24_x86_64', 'manylinux_2_17_x86_64',
             'manylinux2014_x86_64', 'manylinux1_x86_64')


def pinned(name):
  """`name==version` as constraints.txt pins it."""
  key = name.lower().replace('_', '-')
  for line in (ROOT / 'constraints.txt').read_text().splitlines():
    left = line.split('==')[0].strip().lower().replace('_', '-')
    if left == key:
      return line.strip()
  sys.exit(f'gpu_wheels: {name} is not pinned in constraints.txt')


def download(folder, names):
  command = [sys.executable, '-m', 'pip', 'download', '-q', '--no-deps',
             '--only-binary=:all:', '--python-version', '3.12',
             '--implementation', 'cp', '-d', str(folder)]
  for platform in PLATFORMS:
    command += ['--platform', platform]
  subprocess.run(command + list(names), check=True)


def export_upstream(src, target):
  """SRC's committed dreamerv3/ and embodied/ folders into `target`."""
  shutil.rmtree(target, ignore_errors=True)
  target.mkdir()
  archive = subprocess.run(
      ['git', '--git-dir', str(src), 'archive', 'HEAD', 'dreamerv3',
       'embodied'], capture_output=True, check=True).stdout
  subprocess.run(['tar', '-x', '-C', str(target)], input=archive, check=True)


def digest(data):
  raw = hashlib.sha256(data).digest()
  return 'sha256=' + base64.urlsafe_b64encode(raw).rstrip(b'=').decode()


def slim(wheel, prefixes):
  """Rewrites `wheel` without the files under `prefixes` (RECORD too)."""
  kept = {}
  with zipfile.ZipFile(wheel) as source:
    for info in source.infolist():
      if not info.filename.startswith(prefixes):
        kept[info.filename] = source.read(info)
  record = next(name for name in kept if name.endswith('.dist-info/RECORD'))
  lines = [f'{name},{digest(data)},{len(data)}'
           for name, data in kept.items() if name != record]
  kept[record] = ('\n'.join(lines + [f'{record},,']) + '\n').encode()
  with zipfile.ZipFile(wheel, 'w', zipfile.ZIP_DEFLATED) as target:
    for name, data in kept.items():
      target.writestr(name, data)


def travelling_bytes(*folders):
  """Bytes of the tracked and untracked-not-ignored files, and of the
  files in `folders`."""
  names = subprocess.run(
      ['git', 'ls-files', '-z', '--cached', '--others', '--exclude-standard'],
      cwd=ROOT, capture_output=True, check=True).stdout.split(b'\0')
  tree = sum((ROOT / n.decode()).stat().st_size for n in names
             if n and (ROOT / n.decode()).is_file())
  carried = sum(p.stat().st_size for f in folders for p in f.rglob('*')
                if p.is_file())
  return tree, carried


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--dir', default=str(ROOT / '.whl'))
  parser.add_argument('--limit_mib', type=float, default=64)
  parser.add_argument('--upstream', metavar='SRC',
                      help='git dir of a danijar/dreamerv3 checkout')
  args = parser.parse_args()
  folder = Path(args.dir)
  folder.mkdir(exist_ok=True)
  for old in folder.glob('*.whl'):
    old.unlink()
  names = [pinned(p) for p in PACKAGES]
  folders = [folder]
  if args.upstream:
    names += UPSTREAM_PACKAGES
    folders.append(ROOT / '.upstream')
    export_upstream(Path(args.upstream), folders[-1])
  download(folder, names)
  for wheel in folder.glob('*.whl'):
    name = wheel.name.split('-')[0].lower()
    if name in DROP:
      slim(wheel, DROP[name])
  tree, carried = travelling_bytes(*folders)
  total = (tree + carried) / 2 ** 20
  print(f'repository {tree / 2 ** 20:.1f} MiB + carried '
        f'{carried / 2 ** 20:.1f} MiB = {total:.1f} MiB (limit '
        f'{args.limit_mib:g} MiB)')
  if total > args.limit_mib:
    sys.exit('gpu_wheels: over the limit')


if __name__ == '__main__':
  main()
