"""The package's folders and who may import whom (docs/architecture.md).

Every import in a module counts, also one inside a function: a lazy import
still ties the layers together. Relative imports are resolved first.
"""

import ast
import shutil
from pathlib import Path

import dreamer_ver

PACKAGE = Path(dreamer_ver.__file__).parent

# folder ('' = the top-level modules but main.py) -> (forbidden modules,
# why). A module name covers everything below it.
RULES = {
    'rpc': (('dreamer_ver.',), 'a transport library like portal: it imports '
            'nothing from dreamer_ver outside rpc/'),
    'actor': (('dreamer_ver.rpc', 'dreamer_ver.runtime',
               'dreamer_ver.scripts'),
              'the actor is called by the batch server, it knows no sockets '
              'or processes'),
    'envs': (('jax', 'flax', 'optax', 'dreamer_ver.agent',
              'dreamer_ver.actor', 'dreamer_ver.runtime',
              'dreamer_ver.scripts'),
             'env processes stay light and start fast'),
    'replay': (('jax', 'flax', 'optax', 'dreamer_ver.agent',
                'dreamer_ver.actor', 'dreamer_ver.runtime',
                'dreamer_ver.scripts'),
               'replay is plain numpy'),
    'agent': (('dreamer_ver.runtime', 'dreamer_ver.replay',
               'dreamer_ver.actor', 'dreamer_ver.rpc',
               'dreamer_ver.scripts'),
              'the agent is a library of pure functions'),
    'runtime': (('dreamer_ver.scripts',), 'only main.py imports scripts/'),
    '': (('dreamer_ver.scripts',), 'only main.py imports scripts/'),
}
ALLOWED_OWN = {'rpc': 'dreamer_ver.rpc'}  # rpc/ may import itself
# Ray is an optional extra: only the ray script and the Ray host import it.
RAY_IMPORTERS = {'runtime/ray_host.py', 'scripts/ray_cluster.py'}


def module_name(path, root):
  parts = list(path.relative_to(root.parent).with_suffix('').parts)
  if parts[-1] == '__init__':
    parts.pop()
  return '.'.join(parts)


def imports(path, root):
  """The absolute names of every module `path` imports."""
  tree = ast.parse(path.read_text(), str(path))
  package = module_name(path, root)
  if path.name != '__init__.py':
    package = package.rpartition('.')[0]
  names = []
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      names += [alias.name for alias in node.names]
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ''
      if node.level:
        anchor = package.split('.')
        anchor = anchor[:len(anchor) - (node.level - 1)]
        base = '.'.join(anchor + ([base] if base else []))
      names += [base] + [f'{base}.{alias.name}' for alias in node.names]
  return names


def violations(root):
  """(file, imported module, rule) for every import that breaks a rule."""
  found = []
  for path in sorted(root.rglob('*.py')):
    rel = path.relative_to(root)
    folder = rel.parts[0] if len(rel.parts) > 1 else ''
    if rel.as_posix() == 'main.py' or folder not in RULES:
      continue
    forbidden, why = RULES[folder]
    own = ALLOWED_OWN.get(folder)
    for name in imports(path, root):
      if own and (name == own or name.startswith(own + '.')):
        continue
      if any(_under(name, prefix) for prefix in forbidden):
        found.append((rel.as_posix(), name, why))
  return found


def ray_importers(root):
  """The modules that import Ray."""
  return {path.relative_to(root).as_posix() for path in root.rglob('*.py')
          if any(_under(name, 'ray') for name in imports(path, root))}


def _under(name, prefix):
  """'jax' covers jax and jax.numpy; 'dreamer_ver.' every submodule."""
  if prefix.endswith('.'):
    return name.startswith(prefix)
  return name == prefix or name.startswith(prefix + '.')


def test_every_folder_keeps_its_import_rules():
  assert violations(PACKAGE) == []


def test_only_the_ray_script_and_host_import_ray(tmp_path):
  assert ray_importers(PACKAGE) == RAY_IMPORTERS
  root = tmp_path / 'dreamer_ver'
  shutil.copytree(PACKAGE, root, ignore=shutil.ignore_patterns('__pycache__'))
  with (root / 'runtime' / 'supervisor.py').open('a') as f:
    f.write('\n\ndef _offence():\n  from ray import util\n')
  assert ray_importers(root) == RAY_IMPORTERS | {'runtime/supervisor.py'}


def test_every_folder_of_the_package_has_a_rule():
  folders = {p.name for p in PACKAGE.iterdir()
             if p.is_dir() and (p / '__init__.py').exists()}
  assert folders - set(RULES) == {'scripts'}  # only main.py imports it


def test_the_check_catches_a_broken_rule(tmp_path):
  """Each rule fails when broken: one offending import per folder."""
  root = tmp_path / 'dreamer_ver'
  shutil.copytree(PACKAGE, root, ignore=shutil.ignore_patterns('__pycache__'))
  offences = {
      'rpc/wire.py': 'from dreamer_ver.runtime import process\n',
      'actor/actor.py': 'from dreamer_ver.rpc import client\n',
      'envs/base.py': 'import jax\n',
      'replay/chunk.py': 'from jax import numpy\n',
      'agent/dists.py': 'from ..replay import build\n',
      'runtime/devices.py': 'from dreamer_ver.scripts import train\n',
  }
  for name, line in offences.items():
    with (root / name).open('a') as f:
      f.write('\n\ndef _offence():\n  ' + line)
  broken = {file for file, _, _ in violations(root)}
  assert broken == set(offences)
