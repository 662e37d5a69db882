"""The preemption decider, deterministic with a fake clock."""

import collections

import pytest

from dreamer_ver.actor import batching, preemption

Req = collections.namedtuple('Req', 'arrival envid')


def trained(envs, step_time, inference, now=0.0, **kw):
  """A Preempt policy that has seen `envs` step `step_time` apart for a
  few rounds and batches of every bucket take `inference` seconds."""
  policy = preemption.Preempt(1, 16, [1, 2, 4, 8, 16],
                          inference={b: inference for b in (1, 2, 4, 8, 16)},
                          **kw)
  t = now - 10 * step_time
  for _ in range(5):
    for env in envs:
      policy.observe_reply(env, t)
    t += step_time
    policy.decide([Req(t, env) for env in envs], t)
  for env in envs:
    policy.observe_reply(env, t)
  return policy, t


def test_waits_when_an_arrival_is_imminent_and_worth_it():
  # Inference is expensive (20 ms) and the other env is due in 1 ms:
  # serving both at 21 ms (total 21 + 20 ms) beats serving env 0 at 20 ms
  # and env 1 after a second batch at 40 ms (total 20 + 39 ms).
  policy, t = trained([0, 1], step_time=0.010, inference=0.020)
  policy.observe_reply(1, t + 0.001)  # Env 1 got its reply 1 ms later.
  now = t + 0.010
  decision = policy.decide([Req(now, 0)], now)
  assert isinstance(decision, float)
  assert decision == pytest.approx(0.001, abs=2e-4)
  # When it arrives, both go in one batch.
  decision = policy.decide([Req(now, 0), Req(now + 0.001, 1)], now + 0.001)
  assert decision == preemption.Cut(2, 'optimum')


def test_cuts_when_waiting_is_not_worth_it():
  # Inference is cheap (0.5 ms) and the next env is 8 ms away: waiting
  # would serve 2 in 8.5 ms instead of 1 in 0.5 ms.
  policy, t = trained([0, 1], step_time=0.010, inference=0.0005)
  policy.observe_reply(1, t + 0.008)
  now = t + 0.010
  assert policy.decide([Req(now, 0)], now) == preemption.Cut(1, 'optimum')


@pytest.mark.parametrize('due_ms, waits', [(1.5, True), (2.5, False)])
def test_waits_only_while_an_arrival_beats_a_second_batch(due_ms, waits):
  # One queued request, 4 ms per batch, the other env due in d ms. Waiting
  # costs the queued request d ms and the arrival 0; cutting now makes the
  # arrival wait for the running batch, 4 - d ms more. So it waits while
  # 2 d < 4 ms.
  policy, t = trained([0, 1], step_time=0.010, inference=0.004)
  policy.observe_reply(1, t + due_ms / 1000)
  now = t + 0.010
  decision = policy.decide([Req(now, 0)], now)
  if waits:
    assert decision == pytest.approx(due_ms / 1000, abs=2e-4)
  else:
    assert decision == preemption.Cut(1, 'optimum')


def test_waits_price_in_how_much_past_waits_overran():
  # As above with d = 1.5 ms, which is worth waiting for; but if waits
  # have run 1 ms past their predictions, the arrival is as good as 2.5 ms
  # away, and cutting now wins.
  policy, t = trained([0, 1], step_time=0.010, inference=0.004)
  policy.observe_reply(1, t + 0.0015)
  now = t + 0.010
  assert policy.decide([Req(now, 0)], now) == pytest.approx(0.0015, abs=2e-4)
  for _ in range(8):
    policy.shared.wait_errors.add(0.001)
  assert policy.decide([Req(now, 0)], now) == preemption.Cut(1, 'optimum')


def test_cuts_now_when_arrivals_are_spread_out():
  # 1 ms per batch, four envs due 2, 4, 6 and 8 ms from now: each can be
  # served on arrival, so holding the queued request for any of them only
  # adds its wait (a model that lumps the later arrivals into one batch
  # after the last one would wait 2 ms here).
  policy, t = trained(list(range(5)), step_time=0.010, inference=0.001)
  for env in range(1, 5):
    policy.observe_reply(env, t + 0.002 * env)
  now = t + 0.010
  assert policy.decide([Req(now, 0)], now) == preemption.Cut(1, 'optimum')


def test_the_learners_time_is_reported_per_batch_and_costs_nothing_more():
  # As above with d = 2.5 ms, not worth waiting for (2 d > 4 ms). A learner
  # beside the actor that takes 2 ms of the device per batch (VER's LT) is
  # reported, but not added to a batch's cost: its share of the device is
  # already in the measured inference times.
  policy, t = trained([0, 1], step_time=0.010, inference=0.004)
  policy.observe_reply(1, t + 0.0025)
  now = t + 0.010
  assert policy.decide([Req(now, 0)], now) == preemption.Cut(1, 'optimum')
  policy.observe_reply(0, t)  # (that cut's reply, back as it was)
  for _ in range(16):  # The window's cuts, each with 2 ms of learning.
    policy.learner_time(0.0015)
    policy.learner_time(0.0005)
    policy.shared.cut(1, 1, None)
  assert policy.stats()['preempt/learner_ms_per_batch'] == pytest.approx(2.0)
  assert policy.decide([Req(now, 0)], now) == preemption.Cut(1, 'optimum')


def test_lanes_share_one_decider_and_report_real_against_expected():
  shared = preemption.Shared()
  lane0, t = trained([0, 1], step_time=0.010, inference=0.020, shared=shared)
  lane1, _ = trained([2, 3], step_time=0.010, inference=0.004, shared=shared)
  assert lane0.shared is lane1.shared
  lane0.shared.__init__()  # the report from here on
  # Lane 0 expects env 1 in 1 ms (a batch of 2); it comes 3 ms late.
  lane0.observe_reply(1, t + 0.001)
  now = t + 0.010
  assert lane0.decide([Req(now, 0)], now) == pytest.approx(0.001, abs=2e-4)
  assert lane0.decide([Req(now, 0), Req(now + 0.004, 1)], now + 0.004) == (
      preemption.Cut(2, 'optimum'))
  # The overrun is lane 1's too (4 ms per batch there): its arrival due in
  # 1.5 ms, worth waiting for alone (2 x 1.5 < 4 ms), is priced 4.5 ms
  # away, past a second batch.
  lane1.observe_reply(3, t + 0.0015)
  assert lane1.decide([Req(now, 2)], now) == preemption.Cut(1, 'optimum')
  stats = lane1.stats()
  assert stats['preempt/wait_error_ms'] == pytest.approx(3.0, abs=0.1)
  assert stats['preempt/expected_batch'] == pytest.approx(1.5)  # (2 + 1) / 2
  assert stats['preempt/real_batch'] == pytest.approx(1.5)
  # The learner's time reaches every lane through the one decider.
  lane1.learner_time(0.008)
  lane0.decide([Req(now, 0)] * 2, now)  # a cut takes it as one batch's
  # (the two cuts before had no learning)
  assert lane1.stats()['preempt/learner_ms_per_batch'] == pytest.approx(8 / 3)


def test_min_batch_follows_the_live_envs_as_in_ver():
  # 12 envs, one inference thread: VER's min is 12 / 1.5 = 8. Once 9 of
  # them went silent for longer than `forget`, it is 3 / 1.5 = 2, so two
  # queued requests are cut at once instead of waiting for the min wait.
  policy = preemption.Preempt(8, 12, [1, 2, 4, 8, 12], forget=1.0, threads=1)
  t = 0.0
  for _ in range(3):
    for env in range(12):
      policy.observe_reply(env, t)
    t += 0.010
    policy.decide([Req(t, env) for env in range(12)], t)
  for env in range(12):
    policy.observe_reply(env, t)
  policy.observe_batch(12, 0.010)  # min wait: 5 ms after the last batch
  assert policy._min_batch() == 8
  now = t + 0.002
  assert isinstance(policy.decide([Req(now, 0), Req(now, 1)], now), float)
  policy.observe_reply(0, t)
  policy.observe_reply(1, t)
  for env in range(3):  # Only envs 0, 1, 2 go on stepping.
    policy.observe_reply(env, t + 2.0)
  policy.observe_reply(0, t + 2.0)
  now = t + 2.002
  assert policy.decide([Req(now, 0), Req(now, 1)], now) == (
      preemption.Cut(2, 'optimum'))
  assert policy._min_batch() == 2


def test_never_exceeds_latency_cap_or_max():
  policy, t = trained(list(range(4)), step_time=0.010, inference=0.050,
                      max_wait=0.005)
  for env in range(1, 4):
    policy.observe_reply(env, t + 0.0005)  # Due 0.5 ms after `now`.
  now = t + 0.010
  # Expensive inference makes waiting attractive, but never past the cap.
  decision = policy.decide([Req(now - 0.004, 0)], now)
  assert isinstance(decision, float) and decision <= 0.001 + 1e-9
  assert policy.decide([Req(now - 0.005, 0)], now) == preemption.Cut(1, 'latency_cap')
  small = preemption.Preempt(1, 3, [1, 2, 4], max_wait=1.0)
  reqs = [Req(0.0, e) for e in range(5)]
  assert small.decide(reqs, 0.0) == preemption.Cut(3, 'max')


def test_forgets_dead_envs_and_ignores_late_ones():
  policy, t = trained([0, 1, 2], step_time=0.010, inference=0.020,
                      forget=1.0)
  # Slightly overdue envs (within jitter + 5 ms) are still expected, later
  # the longer they are overdue: 2 ms late -> expected 2 * 2 + 1 ms on.
  now = t + 0.010
  arrivals = policy._predicted_arrivals(now + 0.002, now + 1)
  assert arrivals == pytest.approx([now + 0.007] * 3)
  # Far overdue envs are late: not waited for.
  late_now = t + 0.5
  assert policy._predicted_arrivals(late_now, late_now + 1) == []
  # After `forget` seconds of silence the env is dropped entirely.
  policy._predicted_arrivals(t + 2.0, t + 3.0)
  assert 2 not in policy.step and 2 not in policy.replied
  # A new env joins the prediction once it has a step time.
  policy.observe_reply(7, t + 2.0)
  policy.decide([Req(t + 2.01, 7)], t + 2.01)
  assert 7 in policy.step


def test_min_batch_guard_waits_for_adaptive_min_wait():
  policy = preemption.Preempt(4, 8, [1, 2, 4, 8], inference={b: 0.010 for b in (1, 2, 4, 8)})
  policy.observe_batch(1, 0.010)
  # No predictions yet: the optimum is "now", but 1 < min_batch and the
  # request has waited less than half the mean inference time.
  decision = policy.decide([Req(0.0, 0)], 0.001)
  assert isinstance(decision, float) and decision == pytest.approx(0.004)
  assert policy.decide([Req(0.0, 0)], 0.005) == preemption.Cut(1, 'optimum')
  # As in VER, the minimum wait counts from the last batch: an actor idle
  # for longer than that cuts a lone request at once ...
  policy.observe_reply(0, 0.005)
  assert policy.decide([Req(0.030, 0)], 0.030) == preemption.Cut(1, 'optimum')
  # ... and one that just replied holds it for the rest of the minimum wait.
  policy.observe_reply(0, 0.031)
  decision = policy.decide([Req(0.032, 0)], 0.032)
  assert isinstance(decision, float) and decision == pytest.approx(0.004)


def test_ver_cuts_at_min_batch_or_min_wait_and_caps_at_max_batch():
  policy = preemption.VER(3, 6, min_wait=0.01, max_wait=0.05)
  assert policy.decide([Req(0.0, 0)], 0.0) == pytest.approx(0.01)
  assert policy.decide([Req(0.0, e) for e in range(3)], 0.0) == preemption.Cut(3, 'min')
  assert policy.decide([Req(0.0, 0)], 0.011) == preemption.Cut(1, 'min_wait')
  policy.observe_batch(2, 0.004)
  assert policy.min_wait == pytest.approx(0.002)
  assert policy.decide([Req(0.0, e) for e in range(9)], 0.0) == preemption.Cut(6, 'max')


def test_deadline_fills_a_batch_for_at_most_its_timeout():
  policy = preemption.Deadline(4, timeout=0.02)
  assert policy.decide([], 0.0) is None
  assert policy.decide([Req(0.0, 0)], 0.005) == pytest.approx(0.015)
  assert policy.decide([Req(0.0, 0), Req(0.01, 1)], 0.02) == (
      preemption.Cut(2, 'timeout'))
  assert policy.decide([Req(0.0, e) for e in range(6)], 0.0) == (
      preemption.Cut(4, 'max'))
  with pytest.raises(ValueError, match='timeout'):
    preemption.Deadline(4, timeout=-1)


def test_make_cutoff_builds_the_configured_policy_from_run_settings():
  from dreamer_ver.config import loading as configlib
  cfg = configlib.compose(['debug'])
  for mode, cls in [('fixed', preemption.Fixed), ('ver', preemption.VER),
                    ('preempt', preemption.Preempt)]:
    run = configlib.override(cfg, {'run.actor_cutoff': mode}).run
    assert isinstance(batching.make_cutoff(run, 5, [1, 2, 4, 5]), cls)
  default = batching.make_cutoff(cfg.run, 5, [1, 2, 4, 5])
  assert isinstance(default, preemption.VER)
  assert default.min_batch == 3 and default.max_batch == 5
  assert default.max_wait == cfg.run.actor_max_wait
  run = configlib.override(cfg, {'run.actor_cutoff': 'preempt'}).run
  assert batching.make_cutoff(run, 5, [1, 2, 4, 5]).forget == 5.0
  run = configlib.override(cfg, {'run.actor_cutoff': 'preempt',
                                 'run.env_timeout': 0.5}).run
  assert batching.make_cutoff(run, 5, [1, 2, 4, 5]).forget == 0.5


def test_max_batch_and_buckets_default_to_the_lanes_share():
  from dreamer_ver.config import loading as configlib
  run = configlib.compose(['debug']).run
  assert batching.max_batch(run, 5) == 5
  assert batching.max_batch(run, 5, lanes=2) == 3
  assert batching.make_cutoff(run, 5, [1, 2, 3], lanes=2).max_batch == 3
  assert batching.bucket_sizes(run, 5) == [1, 2, 4, 5]
  fixed = configlib.override(configlib.compose(['debug']), {
      'run.actor_max_batch': 4, 'run.actor_buckets': [2, 3]}).run
  assert batching.max_batch(fixed, 5, lanes=2) == 4
  assert batching.bucket_sizes(fixed, 4) == [2, 3, 4]
