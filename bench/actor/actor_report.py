"""The actor bench's tables and plot (bench/actor/actor_bench.py): its records
as markdown rows, per kind of run."""

from bench.actor.actor_load import MODES


def _fmt(value, digits=1):
  if value is None:
    return '-'
  return f'{value:.{digits}f}'


HEADER = ('| fleet | mode | env steps/s | x baseline | x limit | limit | '
          'p50 ms | p99 ms | batch | policy share | stalled |')


def _name(r):
  """The mode, its transport, and with --wal the replay's WAL mode."""
  return (r['mode'] + (f' {r["transport"]}' if r.get('transport') else '') +
          (f' wal {r["wal"]}' if r['wal'] else '') +
          (f' rtt {r["rtt_ms"]:g} ms' if r.get('rtt_ms') is not None else ''))


def row(r, partial=False):
  if partial:
    return (f'{r["fleet"]:10s} {_name(r):8s} {r["sps"]:8.1f} steps/s  '
            f'batch {r["batch_mean"]:5.2f}  policy {r["policy_ms_mean"]:5.2f} '
            f'ms  cpu server {r["cpu_server"]:.2f} envs {r["cpu_envs"]:.2f}'
            f'{"  replay %.2f" % r["cpu_replay"] if r["wal"] else ""}'
            f'{"  learner %.2f/s" % r["learner_ups"] if "learner_ups" in r else ""}'
            f'  ready {_fmt(r.get("ready_s"))} s  load {r["load"]:.1f}'
            f'{"  STALLED" if r["stalled"] else ""}'
            f'{"  env crashes %d" % r["env_crashes"] if r["env_crashes"] else ""}')
  return (f'| {r["fleet"]} | {_name(r)} | {r["sps"]:.0f} | '
          f'{_fmt(r["ratio_baseline"], 2)} | {_fmt(r["ratio_limit"], 2)} | '
          f'{r["limit_sps"]:.0f} | {_fmt(r["p50_ms"])} | {_fmt(r["p99_ms"])} '
          f'| {r["batch_mean"]:.1f} | {_fmt(r.get("policy_share"), 2)} | '
          f'{"yes" if r["stalled"] else "no"} |')


def table(records):
  lines = [HEADER, '|' + ' --- |' * 11]
  lines += [row(r) for r in records]
  notes = []
  multi = next((r for r in records if r['fleet'] == 'fast_multi'), None)
  if multi:
    notes.append(
        f'fast_multi: {multi["envs_per_process"]} envs per process; portal\'s '
        'BatchServer cannot batch multi-env calls, so its x baseline is '
        'against the fast fleet\'s baseline.')
  if notes:
    lines += [''] + notes
  return '\n'.join(lines)


def latency_table(records):
  """--rtt_ms: env steps/s against the round trip between the env processes
  and the server, per fleet (envs per process) and mode."""
  lines = ['| fleet | envs per process | mode | round trip ms | env steps/s '
           '| x no delay | p50 ms | batch |', '|' + ' --- |' * 8]
  zero = {(r['fleet'], r['mode']): r['sps'] for r in records
          if r['rtt_ms'] == 0}
  for r in records:
    base = zero.get((r['fleet'], r['mode']))
    lines.append(
        f'| {r["fleet"]} | {r["envs_per_process"]} | {r["mode"]} | '
        f'{r["rtt_ms"]:g} | {r["sps"]:.0f} | '
        f'{_fmt(r["sps"] / base if base else None, 2)} | {_fmt(r["p50_ms"])} '
        f'| {r["batch_mean"]:.1f} |')
  return '\n'.join(lines)


def learner_table(records):
  """--learner: env steps/s and learner updates/s of every mode, against
  `ver` (the default) on the same fleet, with preempt's VER report."""
  lines = ['| fleet | mode | env steps/s | x ver | learner updates/s | x ver '
           '| x learner alone | batch | expected batch '
           '| learner ms per batch |',
           '|' + ' --- |' * 10]
  ver = {(r['fleet'], r['transport']): r for r in records
         if r['mode'] == 'ver'}
  for r in records:
    base = ver.get((r['fleet'], r['transport']))
    ratio = lambda key: (_fmt(r[key] / base[key], 2)
                         if base and base.get(key) else 'n/a')
    lines.append(
        f'| {r["fleet"]} | {_name(r)} | {r["sps"]:.0f} | {ratio("sps")} | '
        f'{r["learner_ups"]:.2f} | {ratio("learner_ups")} | '
        f'{_fmt(r["learner_ups"] / r["learner_alone_ups"], 2)} | '
        f'{r["batch_mean"]:.1f} | {_fmt(r.get("expected_batch"))} | '
        f'{_fmt(r.get("learner_ms_per_batch"))} |')
  return '\n'.join(lines)


def wal_table(records):
  """--wal: env steps/s against the replay without and with its log."""
  lines = ['| fleet | mode | env steps/s, wal off | wal flush | flush / off '
           '| flush / off per round | replay cores, off / flush |',
           '|' + ' --- |' * 7]
  for off in [r for r in records if r['wal'] == 'off']:
    on = next(r for r in records if r['wal'] == 'flush' and
              (r['fleet'], r['mode']) == (off['fleet'], off['mode']))
    per_round = ', '.join(
        f'{b / a:.2f}' for a, b in zip(off['round_sps'], on['round_sps']))
    lines.append(
        f'| {off["fleet"]} | {off["mode"]} | {off["sps"]:.0f} | '
        f'{on["sps"]:.0f} | {on["sps"] / off["sps"]:.3f} | {per_round} | '
        f'{off["cpu_replay"]:.3f} / {on["cpu_replay"]:.3f} |')
  return '\n'.join(lines)


def plot(records, path):
  try:
    import matplotlib
    matplotlib.use('Agg')
    import matplotlib.pyplot as plt
  except ImportError:
    print(f'matplotlib is not installed; skipping the plot {path}.')
    return
  fleets = list(dict.fromkeys(r['fleet'] for r in records))
  modes = list(dict.fromkeys(_name(r) for r in records))
  colors = dict(zip(MODES, ('#888888', '#4c72b0', '#55a868', '#c44e52')))
  fig, axes = plt.subplots(
      1, len(fleets), figsize=(3.2 * len(fleets), 3.6), squeeze=False)
  for ax, fleet in zip(axes[0], fleets):
    rows = {_name(r): r for r in records if r['fleet'] == fleet}
    xs = range(len(modes))
    values = [rows[m]['sps'] if m in rows else 0 for m in modes]
    bars = ax.bar(xs, values, color=[colors.get(m.split()[0], 'k')
                                     for m in modes])
    for bar, mode in zip(bars, modes):
      if mode in rows and rows[mode]['stalled']:
        bar.set_hatch('//')
        ax.text(bar.get_x() + bar.get_width() / 2, bar.get_height(),
                'stalled', ha='center', va='bottom', fontsize=7)
    if rows:
      limit = next(iter(rows.values()))['limit_sps']
      ax.axhline(limit, color='k', ls='--', lw=1)
    ax.set_xticks(list(xs), modes, rotation=30, fontsize=8)
    ax.set_title(fleet, fontsize=10)
    ax.set_ylabel('env steps/s' if fleet == fleets[0] else '')
  envs = records[0]['envs']
  fig.suptitle(
      f'{envs} env processes: env steps/s per actor mode (dashed: env-bound '
      f'limit; hatched: stalled)', fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  print(f'Wrote {path}.')


