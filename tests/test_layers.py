"""The package's folders and who may import whom (docs/architecture.md).

Every import in a module counts, also one inside a function: a lazy import
still ties the layers together. Relative imports are resolved first.
"""

import ast
import importlib.util
import shutil
from pathlib import Path

import dreamer_ver

PACKAGE = Path(dreamer_ver.__file__).parent

# folder ('' = the top-level modules but main.py) -> (forbidden modules,
# why). A module name covers everything below it.
COMPONENTS = ('dreamer_ver.replay', 'dreamer_ver.logger', 'dreamer_ver.learner',
              'dreamer_ver.evaluation', 'dreamer_ver.actor')
ENTRY = ('dreamer_ver.runtime', 'dreamer_ver.scripts')
RULES = {
    'rpc': (('dreamer_ver.',), 'a transport library like portal: it imports '
            'nothing from dreamer_ver outside rpc/'),
    'cluster': (('dreamer_ver.agent', 'dreamer_ver.envs') + COMPONENTS + ENTRY,
                'process mechanics: nothing here knows what a component '
                'does'),
    'actor': (('dreamer_ver.rpc', 'dreamer_ver.cluster') + COMPONENTS[:-1]
              + ENTRY,
              'the actor is called by the batch server, it knows no sockets '
              'or processes'),
    'envs': (('jax', 'flax', 'optax', 'dreamer_ver.agent', 'dreamer_ver.cluster')
             + COMPONENTS + ENTRY,
             'env processes stay light and start fast'),
    'replay': (('jax', 'flax', 'optax', 'dreamer_ver.agent', 'dreamer_ver.rpc',
                'dreamer_ver.cluster') + COMPONENTS[1:] + ENTRY,
               'replay is plain numpy and knows no other component; its '
               'process main (runtime/) serves it'),
    'logger': (('jax', 'flax', 'optax', 'dreamer_ver.agent', 'dreamer_ver.rpc',
                'dreamer_ver.cluster', 'dreamer_ver.replay',
                'dreamer_ver.learner', 'dreamer_ver.evaluation',
                'dreamer_ver.actor') + ENTRY,
               'the logger only receives rows and metrics; its process main '
               '(runtime/) serves it'),
    'learner': (('dreamer_ver.rpc', 'dreamer_ver.cluster', 'dreamer_ver.replay',
                 'dreamer_ver.logger', 'dreamer_ver.evaluation',
                 'dreamer_ver.actor') + ENTRY,
                'the learner gets its links handed in: it trains and '
                'publishes, it connects nothing'),
    'evaluation': (('dreamer_ver.replay', 'dreamer_ver.logger',
                    'dreamer_ver.learner', 'dreamer_ver.actor') + ENTRY,
                   'evaluation scores params; it needs no other component'),
    'agent': (('dreamer_ver.rpc', 'dreamer_ver.cluster', 'dreamer_ver.envs')
              + COMPONENTS + ENTRY,
              'the agent is a library of pure functions'),
    'runtime': (('dreamer_ver.scripts',), 'only main.py imports scripts/'),
    'config': (('jax', 'flax', 'optax', 'dreamer_ver.rpc', 'dreamer_ver.cluster',
                'dreamer_ver.agent', 'dreamer_ver.replay', 'dreamer_ver.learner',
                'dreamer_ver.evaluation', 'dreamer_ver.inference') + ENTRY,
               'the configuration is read and checked before anything starts: '
               'it knows no process, transport or model'),
    'core': (('jax', 'flax', 'optax', 'dreamer_ver.agent', 'dreamer_ver.rpc',
              'dreamer_ver.cluster', 'dreamer_ver.envs',
              'dreamer_ver.inference') + COMPONENTS + ENTRY,
             'the contracts every layer shares import no layer that uses '
             'them'),
    'inference': (('dreamer_ver.cluster', 'dreamer_ver.envs', 'dreamer_ver.agent',
                   'dreamer_ver.replay', 'dreamer_ver.logger',
                   'dreamer_ver.learner', 'dreamer_ver.evaluation') + ENTRY,
                  'the library serves any policy to any caller: it needs no '
                  "run's processes, model or components"),
    '': (('dreamer_ver.scripts',), 'only main.py imports scripts/'),
}
ALLOWED_OWN = {'rpc': 'dreamer_ver.rpc'}  # rpc/ may import itself
# Ray is an optional extra: only the ray script, the Ray host and the Ray
# transport import it.
RAY_IMPORTERS = {'cluster/ray_host.py', 'scripts/ray_cluster.py',
                 'rpc/ray_transport.py'}  # the transport of Ray users


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


def test_only_the_ray_modules_import_ray(tmp_path):
  assert ray_importers(PACKAGE) == RAY_IMPORTERS
  root = tmp_path / 'dreamer_ver'
  shutil.copytree(PACKAGE, root, ignore=shutil.ignore_patterns('__pycache__'))
  with (root / 'cluster' / 'supervisor.py').open('a') as f:
    f.write('\n\ndef _offence():\n  from ray import util\n')
  assert ray_importers(root) == RAY_IMPORTERS | {'cluster/supervisor.py'}


def test_every_folder_of_the_package_has_a_rule():
  folders = {p.name for p in PACKAGE.iterdir()
             if p.is_dir() and (p / '__init__.py').exists()}
  assert folders - set(RULES) == {'scripts'}  # only main.py imports it


def test_the_check_catches_a_broken_rule(tmp_path):
  """Each rule fails when broken: one offending import per folder."""
  root = tmp_path / 'dreamer_ver'
  shutil.copytree(PACKAGE, root, ignore=shutil.ignore_patterns('__pycache__'))
  offences = {
      'rpc/wire.py': 'from dreamer_ver.cluster import links\n',
      'cluster/links.py': 'from dreamer_ver.replay import service\n',
      'actor/actor.py': 'from dreamer_ver.rpc import client\n',
      'envs/base.py': 'import jax\n',
      'replay/chunk.py': 'from jax import numpy\n',
      'logger/outputs.py': 'from dreamer_ver.agent import nets\n',
      'learner/learner.py': 'from dreamer_ver.rpc.client import Client\n',
      'evaluation/episodes.py': 'from ..actor import actor\n',
      'agent/dists.py': 'from ..replay import build\n',
      'runtime/env_worker.py': 'from dreamer_ver.scripts import train\n',
      'transitions.py': 'from dreamer_ver.scripts import parallel\n',
  }
  for name, line in offences.items():
    with (root / name).open('a') as f:
      f.write('\n\ndef _offence():\n  ' + line)
  broken = {file for file, _, _ in violations(root)}
  assert broken == set(offences)


def import_graph(root):
  """module -> the package's modules it imports (an imported name counts as
  the longest module it names; a module's own packages, which `from . import
  x` names, do not count: Python has them loaded first)."""
  modules = {module_name(path, root): path for path in root.rglob('*.py')}
  graph = {}
  for name, path in modules.items():
    targets = set()
    for imported in imports(path, root):
      while imported and imported not in modules:
        imported = imported.rpartition('.')[0]
      if imported and not (name + '.').startswith(imported + '.'):
        targets.add(imported)
    graph[name] = targets
  return graph


def cycles(graph):
  """Every module that lies on an import circle (Tarjan's components of
  more than one module)."""
  index, low, stack, on_stack, found = {}, {}, [], set(), []

  def visit(node):
    index[node] = low[node] = len(index)
    stack.append(node)
    on_stack.add(node)
    for target in graph[node]:
      if target not in index:
        visit(target)
        low[node] = min(low[node], low[target])
      elif target in on_stack:
        low[node] = min(low[node], index[target])
    if low[node] == index[node]:
      component = []
      while True:
        top = stack.pop()
        on_stack.discard(top)
        component.append(top)
        if top == node:
          break
      if len(component) > 1:
        found.append(sorted(component))

  for node in sorted(graph):
    if node not in index:
      visit(node)
  return found


def test_no_module_imports_itself_through_others(tmp_path):
  assert cycles(import_graph(PACKAGE)) == []
  root = tmp_path / 'dreamer_ver'
  shutil.copytree(PACKAGE, root, ignore=shutil.ignore_patterns('__pycache__'))
  with (root / 'cluster' / 'signals.py').open('a') as f:
    f.write('\n\ndef _offence():\n  from dreamer_ver.cluster import links\n')
  with (root / 'cluster' / 'links.py').open('a') as f:
    f.write('\n\ndef _offence():\n  from dreamer_ver.cluster import signals\n')
  assert cycles(import_graph(root)) == [[  # links -> ray_host -> signals
      'dreamer_ver.cluster.links', 'dreamer_ver.cluster.ray_host',
      'dreamer_ver.cluster.signals']]


def test_no_module_is_longer_than_a_newcomer_reads_at_once():
  """500 lines: past that, a module holds more than one idea (split it).
  The package and bench/ alike."""
  root = PACKAGE.parent
  paths = [*PACKAGE.rglob('*.py'), *(root / 'bench').rglob('*.py')]
  lengths = {path.relative_to(root).as_posix(): len(
      path.read_text().splitlines()) for path in paths}
  assert {name: n for name, n in lengths.items() if n > 500} == {}


def test_no_bench_module_imports_itself_through_others(tmp_path):
  """bench/ is a package of its own (its modules import each other as
  `bench.<folder>.<module>`): the same check as the package's."""
  bench = PACKAGE.parent / 'bench'
  assert cycles(import_graph(bench)) == []
  copy = tmp_path / 'bench'
  shutil.copytree(bench, copy, ignore=shutil.ignore_patterns('__pycache__'))
  with (copy / 'soaks' / 'faults.py').open('a') as f:
    f.write('\n\ndef _offence():\n  from bench.soaks import chaos\n')
  # chaos -> chaos_hosts -> faults -> chaos
  assert cycles(import_graph(copy)) == [[
      'bench.soaks.chaos', 'bench.soaks.chaos_hosts', 'bench.soaks.faults']]


def test_every_bench_import_names_a_module_that_exists():
  """Lazy imports included: a module moved or renamed leaves none behind
  (`import overhead_bench` once outlived its move into bench/actor/).
  bench/upstream/ runs in upstream's environment, with its packages."""
  bench = PACKAGE.parent / 'bench'
  stems = {path.stem for path in bench.rglob('*.py')}
  missing = set()
  for path in bench.rglob('*.py'):
    if path.is_relative_to(bench / 'upstream'):
      continue
    for name in imports(path, bench):
      top = name.split('.')[0]
      moved = top in stems and importlib.util.find_spec(top) is None
      if moved or (top == 'bench' and not _bench_module(name)):
        missing.add((path.relative_to(bench).as_posix(), name))
  assert sorted(missing) == []


def _bench_module(name):
  """Whether `name`, or the module it names a member of, is in bench/."""
  root = PACKAGE.parent.joinpath(*name.split('.'))
  parent = root.parent
  return any(p.exists() for p in (
      root.with_suffix('.py'), root / '__init__.py',
      parent.with_suffix('.py'), parent / '__init__.py'))
