"""The report of a GPU window (bench/gpu/gpu.py): what ran where, then one
markdown section per stage, from the records in its gpu.json."""

import json


def report(records):
  """Markdown: what ran where, then one section per stage."""
  lines = []
  stack = next((r['results'] for r in records if r['stage'] == 'stack'), {})
  if stack:
    lines += [f"GPU: {stack.get('nvidia_smi') or stack.get('device_kind')}; "
              f"{stack.get('cpus')} CPU cores; Python {stack.get('python')}, "
              f"jax {stack.get('jax')}, jaxlib {stack.get('jaxlib')}, flax "
              f"{stack.get('flax')}, optax {stack.get('optax')}, numpy "
              f"{stack.get('numpy')}; backend {stack.get('backend')}, "
              f"devices {', '.join(stack.get('devices', []))}.", '']
  for r in records:
    lines += [f"### {r['stage']} ({'ok' if r['ok'] else 'FAILED'}, "
              f"{r['seconds']} s; commit {r['commit']}, {r['date']})", '']
    for c in r['commands']:
      if c['exit'] != 0:
        lines.append(f"- `{c['command'][:120]}...` exit {c['exit']}")
    lines += section(r['stage'], r['results']) + ['']
  return '\n'.join(lines)


def section(stage, res):
  if not res:
    return ['(no results)']
  if stage == 'tests':
    return [f"{res['files']} files finished: {res['tests']} tests, "
            f"{res['failures']} failures, {res['errors']} errors, "
            f"{res['skipped']} skipped (failures: gpu.log)"] + [
                f"- {test}: " + ', '.join(f'{k} {v}' for k, v in props.items())
                for test, props in res.get('properties', {}).items()]
  if stage == 'overhead':
    rows = ['| size | bucket | actor.step ms | jitted step ms | host ms |',
            '| --- | ---: | ---: | ---: | ---: |']
    rows += [f"| {r['size']} | {r['bucket']} | {r['step_ms']:.3f} | "
             f"{r['forward_ms']:.3f} | {r['host_ms']:.3f} |"
             for r in res['host']]
    from bench.actor import overhead_bench  # lazily: it loads JAX
    for key, label in (('stages', ''), ('stages_cmdbuf', ', cmdbuf_while')):
      for size in sorted({r['size'] for r in res.get(key, [])}):
        rows += ['', f'Actor.handle by stage, microseconds ({size}{label}):',
                 '', overhead_bench.stages_table(
                     [r for r in res[key] if r['size'] == size])]
    return rows
  if stage == 'actor':
    rows = ['| envs | transport | mode | env steps/s | x baseline | p50 ms | '
            'p99 ms | batch | policy ms |',
            '| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |']
    for r in res:
      ratio = r['ratio_baseline']
      rows.append(
          f"| {r['envs']} | {r['transport']} | {r['mode']} | {r['sps']:.0f} | "
          f"{'' if ratio is None else f'{ratio:.2f}'} | "
          f"{_num(r['p50_ms'])} | {_num(r['p99_ms'])} | "
          f"{_num(r['batch_mean'])} | {_num(r['policy_ms_mean'])} |")
    return rows
  if stage == 'shared':
    rows = ['| envs | env steps/s | learner updates/s | alone | kept |',
            '| ---: | ---: | ---: | ---: | ---: |']
    rows += [f"| {r['envs']} | {r['sps']:.0f} | {_num(r['learner_ups'])} | "
             f"{_num(r['learner_alone_ups'])} | "
             f"{r['learner_ups'] / r['learner_alone_ups']:.2f} |"
             for r in res if r.get('learner_alone_ups')]
    return rows
  if stage == 'learner':
    return learner_section(res)
  if stage == 'e2e':
    rows = ['| task | system | env steps/s | updates/s | first action s | '
            'first update s | CPU s | peak GB |',
            '| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |']
    for task, entry in res.get('tasks', {}).items():
      for system in ('ours', 'upstream'):
        if system in entry:
          r = entry[system]
          rows.append(
              f"| {task} | {system} | {r['env_steps_per_s']} | "
              f"{r['updates_per_s']} | {r['first_action_s']} | "
              f"{r['first_update_s']} | {r['cpu_s']} | {r['peak_rss_gb']} |")
      if 'ratios' in entry:
        rows.append(f"ours / upstream: {json.dumps(entry['ratios'])}")
    if 'upstream_skipped' in res:
      rows.append(f"upstream skipped: {res['upstream_skipped']}")
    return rows
  if stage == 'learning':
    return [f"{res['episodes']} episodes, last at step {res['last_step']}", '',
            res['table']]
  return ['```', json.dumps(res, indent=1), '```']


def learner_section(runs):
  """One table of every learner_bench command's rows, then each traced
  update's top ops."""
  rows = ['| run | size | dtype | variant | ms/update | updates/s | x base | '
          'TFLOP/s | of peak | x upstream |',
          '| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |']
  profiles = []
  for run, res in runs.items():
    for r in res.get('rows', []):
      rows.append(
          f"| {run} | {r['size']} | {r['dtype']} | {r['variant']} | "
          f"{'-'.join(str(t) for t in r['ms_per_update'])} | "
          f"{r['updates_per_s']} | {r['x_base']} | "
          f"{r['gflop_per_s'] / 1e3:.2f} | {r['fraction_of_matmul_peak']} | "
          f"{r.get('speedup_vs_upstream', '')} |")
      if 'profile' in r:
        p = r['profile']
        profiles += ['', f"{r['size']} {r['dtype']}: {p['where']} ops, "
                     f"{p['traced_ms_per_update']} ms traced per update; top:"]
        profiles += [f'- {ms} ms, {calls} calls: `{name[:80]}`'
                     for name, ms, calls in p['ops']]
  first = next(iter(runs.values()), {})
  peaks = first.get('matmul_peak_gflop_per_s', {})
  machine = first.get('machine', {})
  head = [f"device {machine.get('device')}, jax {machine.get('jax')}; matmul "
          f"peak ({first.get('matmul_peak_n')}^2 dots) "
          + ', '.join(f'{d} {p / 1e3:.1f} TFLOP/s' for d, p in peaks.items()),
          '']
  return head + rows + profiles


def _num(value):
  return '' if value is None else f'{value:.1f}'
