"""bench/system/e2e.py's arithmetic: what a run's stamped metrics lines become."""


from bench.system import e2e


def test_summarize_rates_first_times_and_usage():
  lines = [  # (seconds since start, metrics line)
      (10.0, {'step': 0, 'usage/agent/cpu': 0.5}),
      (20.0, {'step': 400, 'episode/score': 7.0}),
      (30.0, {'step': 900, 'fps/train': 64.0, 'usage/agent/cpu': 0.9,
              'usage/env0/cpu': 0.2}),
      (40.0, {'step': 1500, 'fps/train': 128.0,
              'train/policy_lag/mean': 3.0}),
      (50.0, {'step': 2000, 'train/policy_lag/mean': 5.0,
              'episode/score': 9.5}),
  ]
  result = e2e.summarize(lines, batch_steps=32, seconds=50.0, window=15.0)
  assert result['env_steps'] == 2000
  assert result['env_steps_per_s'] == 40.0
  assert result['first_action_s'] == 20.0
  assert result['first_update_s'] == 30.0
  # 64 replayed steps/s over the first window (15 s: the line before it
  # carried no rate), 128 over the 10 s to the next: 2,240 steps = 70.
  assert result['updates'] == 70.0
  assert result['updates_per_s'] == 1.4
  # Once training: the window after the first update's line alone, 128
  # replayed steps/s over 10 s = 4 updates/s (the first window's rate is
  # left out: it began before the first update).
  assert result['training_updates_per_s'] == 4.0
  assert result['policy_lag_mean'] == 4.0
  assert result['scores'] == [[20.0, 400, 7.0], [50.0, 2000, 9.5]]
  assert result['usage'] == {'usage/agent/cpu': 0.9, 'usage/env0/cpu': 0.2}


def test_blank_frames_only_where_mujoco_cannot_render_a_dmc_task():
  assert e2e.blank_render('dmc_walker_walk', {'MUJOCO_GL': 'disable'})
  assert not e2e.blank_render('dmc_walker_walk', {'MUJOCO_GL': 'egl'})
  assert not e2e.blank_render('dmc_walker_walk', {})
  assert not e2e.blank_render('dummy_disc', {'MUJOCO_GL': 'disable'})


def test_a_system_that_ended_no_episode_is_left_out_of_the_figure(tmp_path):
  """Upstream at train ratio 1024 ended no episode in 10 minutes: the
  figure shows ours and says so, where the plot used to fail the bench
  after its results were written."""
  def rounds(*scores):
    return {'rounds': [{'scores': list(s)} for s in scores]}
  result = {'commit': 'abc', 'machine': {'cores': 2}, 'tasks': {'t': {
      'ours': rounds([[10.0, 100, 5.0], [20.0, 200, 7.0]],
                     [[12.0, 110, 6.0], [22.0, 220, 8.0]]),
      'upstream': rounds([], [])}}}
  assert e2e.figure(result, tmp_path / 'f.png') == ['upstream']
  assert (tmp_path / 'f.png').stat().st_size > 0


def test_kept_is_the_training_rate_over_the_learner_alone():
  """`kept` divides the median training rate over rounds by the median of
  the learner's rounds alone, before the runs and after; a run that never
  trained keeps nothing to report."""
  class Args:
    tasks, size, minutes, seed, envs, train_ratio = ['t'], 'debug', 1, 0, 2, 32
    batch_size, batch_length, log_every = 4, 8, 5
    platform, dtype = 'cpu', 'float32'
  def record(rate):
    return {'task': 't', 'system': 'ours', 'training_updates_per_s': rate,
            'env_steps_per_s': 1.0, 'updates_per_s': 1.0}
  alone = {'t': {'before': [4.0, 5.0, 6.0], 'after': [5.0, 5.0, 7.0]}}
  result = e2e.report(Args, [record(3.0), record(4.0), record(5.0)], '',
                      alone=alone)
  ours = result['tasks']['t']['ours']
  assert ours['learner_alone_updates_per_s'] == 5.0  # the median of all 6
  assert ours['kept'] == 0.8
  assert ours['learner_alone'] == alone['t']  # the rounds, for drift
  result = e2e.report(Args, [record(None)], '', alone=alone)
  assert 'kept' not in result['tasks']['t']['ours']


def test_a_run_without_a_second_training_window_has_no_training_rate():
  lines = [(10.0, {'step': 10}), (20.0, {'step': 20, 'fps/train': 50.0})]
  result = e2e.summarize(lines, batch_steps=32, seconds=20.0, window=15.0)
  assert result['first_update_s'] == 20.0
  assert result['training_updates_per_s'] is None


def test_upstream_runs_without_its_default_profiler(tmp_path):
  """Upstream's `jax.profiler` (on by default) traces updates 100 to 120;
  on the CPU its stop_trace stalled the learner for good and grew the
  process to 20 GB until the kernel killed it (1,306 env steps and about
  112 updates in every 10- and 30-minute run at train ratio 1024). Ours
  profiles nothing unless asked, so upstream runs with it off (its flags
  have no such key: the shim's UPSTREAM_NO_PROFILER, tested in
  test_upstream_shim.py)."""
  class Args:
    upstream, site, size, seed = str(tmp_path), '', 'size1m', 0
    envs, train_ratio = 4, 1024
    batch_size, batch_length, log_every = 16, 64, 15
    platform, dtype = 'cpu', 'float32'
  _, env = e2e.command('upstream', Args, 'dmc_cartpole_balance', tmp_path)
  assert env['UPSTREAM_NO_PROFILER'] == '1'
  _, env = e2e.command('ours', Args, 'dmc_cartpole_balance', tmp_path)
  assert 'UPSTREAM_NO_PROFILER' not in env
