"""How the run config travels: from `main.py` through a script into every
component it launches, counted statically at two commits side by side.

An edge is a call that hands the config, or a part of it (`config.run`,
`config.run.envs`, a name bound to one, `self.config`), to a function of
the package; a launch
by name (`AGENT`, `REPLAY`, ... with the config) is an edge into that
target. The walk expands each function once. It reports the modules the
config passes and its *returns*: entries into a module it had already
entered and left (what the code would avoid by handing each component only
what it uses).

  python -m bench.tools.config_flow --base 784517f --head . --script parallel
"""

import argparse
import ast
import json
import subprocess
from pathlib import Path

from bench import stamp


def sources(rev):
  """{module name: source} of the package at git revision `rev` ('.': the
  working tree)."""
  if rev == '.':
    return {str(f.with_suffix('')).replace('/', '.').removesuffix(
        '.__init__'): f.read_text() for f in Path('dreamer_ver').rglob('*.py')}
  files = subprocess.run(
      ['git', 'ls-tree', '-r', '--name-only', rev, 'dreamer_ver'],
      capture_output=True, text=True, check=True).stdout.split()
  return {f[:-3].replace('/', '.').removesuffix('.__init__'): subprocess.run(
      ['git', 'show', f'{rev}:{f}'], capture_output=True, text=True,
      check=True).stdout for f in files if f.endswith('.py')}


class Module:

  def __init__(self, name, source, package):
    self.name = name
    self.tree = ast.parse(source)
    self.imports = {}  # local name -> module, or (module, attribute)
    self.functions = {}  # qualname -> FunctionDef
    self.classes = set()
    self.strings = {}  # constant name -> 'module:function' string
    self.mappings = {}  # constant name -> {key: 'module:function'}
    for node in ast.walk(self.tree):
      if isinstance(node, ast.ImportFrom):
        base = self._absolute(node, package)
        for alias in node.names:
          full = f'{base}.{alias.name}'
          self.imports[alias.asname or alias.name] = (
              full if full in package else (base, alias.name))
      elif isinstance(node, ast.Import):
        for alias in node.names:
          self.imports[alias.asname or alias.name.split('.')[0]] = (
              alias.name if alias.asname else alias.name.split('.')[0])
    for node in self.tree.body:
      if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
        self.functions[node.name] = node
      elif isinstance(node, ast.ClassDef):
        self.classes.add(node.name)
        for item in node.body:
          if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            self.functions[f'{node.name}.{item.name}'] = item
      elif isinstance(node, ast.Assign) and len(node.targets) == 1 and \
          isinstance(node.targets[0], ast.Name):
        name, value = node.targets[0].id, node.value
        if isinstance(value, ast.Constant) and isinstance(value.value, str) \
            and ':' in value.value:
          self.strings[name] = value.value
        elif isinstance(value, ast.Dict):
          self.mappings[name] = {
              k.value: v.value for k, v in zip(value.keys, value.values)
              if isinstance(k, ast.Constant) and isinstance(v, ast.Constant)}

  def _absolute(self, node, package):
    if not node.level:
      return node.module
    parts = self.name.split('.')
    is_package = f'{self.name}.__init__' in package or any(
        m.startswith(self.name + '.') for m in package)
    base = parts if is_package else parts[:-1]
    base = base[:len(base) - node.level + 1]
    return '.'.join(base + ([node.module] if node.module else []))


class Walk:

  def __init__(self, modules, script):
    self.modules = modules
    self.script = script
    self.expanded = set()
    self.entered = []  # module of each entry, in walk order
    self.returns = []  # (module, launched target under which it happened)
    self.trace = []  # a line per call, indented by depth

  def run(self, start):
    self.visit(start, None, 'main', 0)

  def visit(self, function, caller_module, root, depth):
    module = function[0]
    mark = ''
    if module != caller_module:
      if module in self.entered:
        self.returns.append((module, root))
        mark = '  <- return'
      self.entered.append(module)
    self.trace.append(f'{"  " * depth}{module}:{function[1]}{mark}')
    if function in self.expanded:
      return
    self.expanded.add(function)
    node = self.modules[module].functions[function[1]]
    for callee, launched in self.calls(module, function[1], node):
      if callee[0] in self.modules and \
          callee[1] in self.modules[callee[0]].functions:
        self.visit(callee, module, launched or root, depth + 1)

  def calls(self, module, qualname, node):
    """(callee, launched target name or None) of each call in `node` that
    hands on the config."""
    mod = self.modules[module]
    tainted = {'config'}  # A parameter or a local of that name.
    for sub in ast.walk(node):  # Names bound from the config, in order.
      if isinstance(sub, ast.Assign) and self.carries(sub.value, tainted):
        for target in sub.targets:
          for name in ast.walk(target):
            if isinstance(name, ast.Name):
              tainted.add(name.id)
    cls = qualname.split('.')[0] if '.' in qualname else None
    local = {name.id for sub in ast.walk(node) if isinstance(sub, ast.Assign)
             for target in sub.targets for name in ast.walk(target)
             if isinstance(name, ast.Name)}
    for sub in ast.walk(node):
      if not isinstance(sub, ast.Call):
        continue
      args = list(sub.args) + [k.value for k in sub.keywords]
      if not any(self.carries(a, tainted) for a in args):
        continue
      for arg in args:  # A launch by name: the target gets the config.
        spec = self.target(mod, arg)
        if spec:
          target_module, _, function = spec.partition(':')
          yield (target_module, function), function
      callee = self.resolve(mod, cls, sub.func)
      if callee is None and (module, qualname) == ('dreamer_ver.main', 'main') \
          and isinstance(sub.func, ast.Name) and sub.func.id in local:
        spec = next(iter(m.get(self.script) for m in mod.mappings.values()
                         if self.script in m), None)
        if spec:  # main calls the script the flags name.
          callee = tuple(spec.partition(':')[::2])
      if callee:
        yield callee, None

  def carries(self, expr, tainted):
    """Whether `expr` is the config or a part of it: a name bound to one,
    `self.config`, an attribute or item of one, or `<one>.update(...)`."""
    if isinstance(expr, ast.keyword):
      expr = expr.value
    if isinstance(expr, ast.Starred):
      expr = expr.value
    if isinstance(expr, ast.Call) and isinstance(expr.func, ast.Attribute) \
        and expr.func.attr == 'update':
      expr = expr.func.value
    while isinstance(expr, (ast.Attribute, ast.Subscript)):
      if isinstance(expr, ast.Attribute) and expr.attr == 'config' and \
          isinstance(expr.value, ast.Name) and expr.value.id == 'self':
        return True
      expr = expr.value
    return isinstance(expr, ast.Name) and expr.id in tainted

  def target(self, mod, arg):
    if isinstance(arg, ast.Name):
      if arg.id in mod.strings:
        return mod.strings[arg.id]
      imported = mod.imports.get(arg.id)
      if isinstance(imported, tuple) and imported[0] in self.modules:
        return self.modules[imported[0]].strings.get(imported[1])
    return None

  def resolve(self, mod, cls, func):
    """(module, qualname) a call's function names, if in the package."""
    if isinstance(func, ast.Name):
      return self.named(mod, func.id)
    if isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name):
      owner = func.value.id
      if owner == 'self' and cls:
        return (mod.name, f'{cls}.{func.attr}')
      if owner in mod.classes:
        return (mod.name, f'{owner}.{func.attr}')
      imported = mod.imports.get(owner)
      if isinstance(imported, str) and imported in self.modules:
        return self.named(self.modules[imported], func.attr)
      if isinstance(imported, tuple) and imported[0] in self.modules:
        return (imported[0], f'{imported[1]}.{func.attr}')
    return None

  def named(self, mod, name):
    if name in mod.classes:
      return (mod.name, f'{name}.__init__')
    if name in mod.functions:
      return (mod.name, name)
    imported = mod.imports.get(name)
    if isinstance(imported, tuple) and imported[0] in self.modules:
      return self.named(self.modules[imported[0]], imported[1])
    return None


def measure(rev, script):
  package = sources(rev)
  modules = {name: Module(name, source, package)
             for name, source in package.items()}
  walk = Walk(modules, script)
  walk.run(('dreamer_ver.main', 'main'))
  by_target = {}
  for _, root in walk.returns:
    by_target[root] = by_target.get(root, 0) + 1
  if rev != '.':
    rev = subprocess.run(['git', 'rev-parse', '--short', rev], text=True,
                         capture_output=True, check=True).stdout.strip()
  return {'rev': rev, 'modules': len(set(walk.entered)),
          'entries': len(walk.entered), 'returns': len(walk.returns),
          'returns_by_launched_target': by_target,
          'functions': len(walk.expanded), 'trace': walk.trace}


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--base', default='784517f')
  parser.add_argument('--head', default='.')
  parser.add_argument('--script', default='parallel')
  parser.add_argument('--out', default='')
  parser.add_argument('--trace', action='store_true',
                      help='print each walk, a line per call')
  args = parser.parse_args()
  rows = [measure(rev, args.script) for rev in (args.base, args.head)]
  for row in rows:
    if args.trace:
      print('\n'.join(row['trace']))
    print(json.dumps({k: v for k, v in row.items() if k != 'trace'}))
  if args.out:
    stamp.write(args.out, rows)


if __name__ == '__main__':
  main()
