"""Config blocks, composition, flags, validation and the main.py CLI."""

import datetime
import os
import subprocess
import sys
import textwrap

import elements
import pytest

from dreamer_ver.config import loading as C
from dreamer_ver import main as M
from dreamer_ver.config import validation as V

from helpers import ROOT

SIZES = {  # preset: (deter, hidden, classes, cnn depth, mlp units)
    'size1m': (512, 64, 4, 4, 64),
    'size12m': (2048, 256, 16, 16, 256),
    'size25m': (3072, 384, 24, 24, 384),
    'size50m': (4096, 512, 32, 32, 512),
    'size100m': (6144, 768, 48, 48, 768),
    'size200m': (8192, 1024, 64, 64, 1024),
    'size400m': (12288, 1536, 96, 96, 1536),
}
MLPS = ('enc', 'dec', 'rewhead', 'conhead', 'policy', 'value')


def error(fn, *args, **kwargs):
  with pytest.raises(C.ConfigError) as info:
    fn(*args, **kwargs)
  message = str(info.value)
  assert '\n' not in message
  return message


# --- blocks -----------------------------------------------------------------

def test_all_blocks_load_and_validate():
  names = C.block_names()
  for name in ['defaults', 'debug', 'cartpole', 'dmc_proprio', 'dmc_vision',
               'atari100k', *SIZES]:
    assert name in names
  for name in names:
    V.validate(C.compose([name]))


def test_defaults_block_sets_the_expected_values():
  c = C.compose()
  assert c.logdir == '' and c.task == 'dummy_disc' and c.script == 'parallel'
  assert (c.batch_size, c.batch_length, c.report_length) == (16, 64, 32)
  assert c.replay_context == 1
  assert c.jax.platform == '' and c.jax.policy_devices == (0,)
  assert c.env.dmc.size == (64, 64) and c.env.dmc.camera == -1
  assert c.run.envs == 16 and c.run.eval_envs == 4 and c.run.actor_batch == -1
  a = c.agent
  assert dict(a.loss_scales) == dict(
      rec=1.0, rew=1.0, con=1.0, dyn=1.0, rep=0.1, policy=1.0, value=1.0,
      repval=0.3)
  assert (a.rssm.deter, a.rssm.hidden, a.rssm.stoch, a.rssm.classes,
          a.rssm.blocks) == (8192, 1024, 32, 64, 8)
  assert a.enc.mults == (2, 3, 4, 4) and a.dec.bspace == 8
  assert a.rewhead.outscale == 0.0 and a.policy.outscale == 0.01
  assert a.imag_length == 15 and a.horizon == 333 and a.contdisc is True
  assert a.retnorm.perchi == 95.0 and a.slowvalue.every == 1
  assert a.reward_grad and a.repval_loss and a.repval_grad


def test_floats_parse_as_floats():
  c = C.compose()
  for key, value in [
      ('agent.opt.eps', 1e-20), ('agent.opt.lr', 4e-5),
      ('replay.size', 5e6), ('run.steps', 1e10),
      ('agent.imag_loss.actent', 3e-4), ('replay.prio.initial', float('inf')),
      ('run.train_ratio', 32.0)]:
    assert type(c[key]) is float, key
    assert c[key] == value, key
  d = C.compose(['dmc_proprio'])
  assert type(d.run.steps) is float and d.run.steps == 1.1e6
  assert type(C.compose(['debug']).replay.size) is float


@pytest.mark.parametrize('name', list(SIZES))
def test_size_preset_sets_model_widths_and_keeps_other_defaults(name):
  deter, hidden, classes, depth, units = SIZES[name]
  a = C.compose([name]).agent
  assert (a.rssm.deter, a.rssm.hidden, a.rssm.classes) == (
      deter, hidden, classes)
  assert a.rssm.stoch == 32 and a.rssm.blocks == 8
  assert a.enc.depth == depth and a.dec.depth == depth
  for head in MLPS:
    assert a[head].units == units, head
  # Untouched keys keep their defaults.
  assert a.enc.layers == 3 and a.value.bins == 255


def test_debug_block_shrinks_batches_replay_and_model():
  c = C.compose(['debug'])
  assert (c.batch_size, c.batch_length, c.report_length) == (8, 10, 5)
  assert c.replay.size == 1e4 and c.run.envs == 4 and c.run.eval_envs == 1
  assert c.run.train_ratio == 8.0 and c.run.log_every <= 10
  a = c.agent
  assert a.rewhead.bins == 5 and a.value.bins == 5
  assert all(a[h].layers == 1 and a[h].units == 8 for h in MLPS)
  assert (a.rssm.stoch, a.rssm.classes, a.rssm.deter, a.rssm.hidden,
          a.rssm.blocks) == (2, 4, 8, 3, 4)
  assert a.enc.depth == 2 and a.dec.depth == 2
  assert a.rssm.imglayers == 2  # '.*\.layers' matches whole names only


def test_task_blocks_set_task_steps_ratio_and_model_size():
  c = C.compose(['cartpole'])
  assert c.task == 'gym_CartPole-v1' and c.run.steps == 5e4
  assert c.run.envs == 4 and c.agent.rssm.deter == 256
  assert c.agent.opt.lr == 3e-4 and c.run.train_ratio == 128
  c = C.compose(['dmc_proprio'])
  assert c.task == 'dmc_walker_walk' and c.env.dmc.image is False
  assert c.env.dmc.proprio is True and c.run.train_ratio == 1024.0
  assert c.agent == C.compose(['size1m']).agent
  # cartpole: size1m's widths, a smaller deter state and a larger step.
  cartpole = C.compose(['cartpole']).agent
  size1m = C.compose(['size1m']).agent
  for key in ('enc', 'dec', 'rewhead', 'conhead', 'policy', 'value'):
    assert cartpole[key] == size1m[key], key
  assert cartpole.rssm.deter == 256 and size1m.rssm.deter == 512
  c = C.compose(['dmc_vision'])
  assert c.env.dmc.proprio is False and c.env.dmc.image is True
  assert c.run.train_ratio == 256.0 and c.agent.rssm.deter == 8192
  c = C.compose(['atari100k'])
  assert c.task == 'atari100k_pong' and c.run.steps == 1.1e5
  assert c.run.envs == 1 and c.run.train_ratio == 256.0


# --- composition and flags --------------------------------------------------

def test_blocks_apply_in_order_later_wins():
  a = C.compose(['size12m', 'size1m'])
  b = C.compose(['size1m', 'size12m'])
  assert a.agent.rssm.deter == 512 and b.agent.rssm.deter == 2048
  c = C.compose(['debug', 'size1m'])  # size1m overrides debug's model sizes
  assert c.agent.rssm.deter == 512 and c.batch_size == 8
  assert c.agent.rssm.stoch == 2  # but not what size1m leaves alone


def test_flags_override_blocks():
  c = C.load_config(['--configs', 'debug', '--run.envs', '2',
                     '--agent.opt.lr=1e-3', '--jax.train_devices', '0', '1',
                     '--logger.outputs', 'jsonl,tensorboard',
                     '--jax.jit', 'False', '--task', 'gym_CartPole-v1',
                     '--replay.size', '20000', '--run.steps', '1e3',
                     '--batch_size', '4e0'])
  assert c.run.envs == 2 and c.agent.opt.lr == 1e-3
  assert c.jax.train_devices == (0, 1)
  assert c.logger.outputs == ('jsonl', 'tensorboard')
  assert c.jax.jit is False and c.task == 'gym_CartPole-v1'
  assert type(c.replay.size) is float and c.replay.size == 2e4
  assert c.batch_size == 4 and type(c.batch_size) is int
  assert c.agent.rssm.deter == 8  # the debug block still applies
  # Flags win regardless of where --configs appears.
  c = C.load_config(['--batch_size', '3', '--configs', 'debug'])
  assert c.batch_size == 3
  # Several --configs and comma lists compose in order.
  c = C.load_config(['--configs', 'size12m,debug', '--configs', 'size1m'])
  assert c.agent.rssm.deter == 512 and c.batch_size == 8


def test_regex_keys_set_every_matching_key_in_flags_and_overrides():
  c = C.load_config(['--.*\\.units', '32'])
  assert all(c.agent[h].units == 32 for h in MLPS)
  c = C.override(C.compose(), {'agent': {'.*\\.bins': 7}, 'run.envs': 3})
  assert c.agent.value.bins == 7 and c.agent.rewhead.bins == 7
  assert c.run.envs == 3


def test_a_unique_last_part_names_its_key():
  c = C.load_config(['--script', 'eval_only', '--from_checkpoint', 'runs/a',
                     '--envs', '3'])
  assert c.run.from_checkpoint == 'runs/a' and c.run.envs == 3
  msg = error(C.load_config, ['--units', '8'])
  assert "'units' is ambiguous" in msg and 'agent.policy.units' in msg


def test_unknown_key_errors_name_the_key():
  msg = error(C.load_config, ['--configs', 'debug', '--bogus.key', '1'])
  assert "'bogus.key'" in msg and '--bogus.key' in msg
  msg = error(C.load_config, ['--run.envz', '4'])
  assert "'run.envz'" in msg and "did you mean '--run.envs'" in msg
  msg = error(C.compose, (), {'agent.rssm.deterr': 4})
  assert "'agent.rssm.deterr'" in msg
  msg = error(C.load_config, ['--agent.rssm', '4'])
  assert "'agent.rssm' is a group" in msg
  msg = error(C.compose, (), {'.*\\.nosuch': 4})
  assert 'nosuch' in msg and 'matches no key' in msg
  msg = error(C.load_config, ['stray'])
  assert "'stray'" in msg
  msg = error(C.load_config, ['--run.envs'])
  assert '--run.envs' in msg and 'missing value' in msg


def test_wrong_type_errors_name_the_key():
  msg = error(C.load_config, ['--run.envs', 'abc'])
  assert "'run.envs'" in msg and 'expects int' in msg and 'abc' in msg
  msg = error(C.load_config, ['--run.envs', '2.5'])
  assert "'run.envs'" in msg
  msg = error(C.load_config, ['--jax.jit', 'yes'])
  assert "'jax.jit'" in msg and 'expects bool' in msg
  msg = error(C.load_config, ['--agent.opt.lr', 'fast'])
  assert "'agent.opt.lr'" in msg and 'expects float' in msg
  msg = error(C.load_config, ['--jax.train_devices', '0', 'x'])
  assert "'jax.train_devices'" in msg
  msg = error(C.load_config, ['--task', 'a_b', 'c_d'])
  assert "'task'" in msg and 'single' in msg
  # Typed values from blocks or Python are not converted between kinds.
  for key, value, expects in [
      ('run.envs', '4', 'int'), ('run.envs', True, 'int'),
      ('jax.jit', 1, 'bool'), ('task', 5, 'str'),
      ('agent.opt.lr', 'x', 'float'), ('env.dmc.size', 64, 'list of int'),
      ('env.dmc.size', [64.5, 64], 'int')]:
    msg = error(C.compose, (), {key: value})
    assert f"'{key}'" in msg and f'expects {expects}' in msg, msg
  # Ints are fine for floats, whole floats for ints.
  c = C.compose((), {'run.train_ratio': 64, 'run.envs': 8.0})
  assert c.run.train_ratio == 64.0 and type(c.run.train_ratio) is float
  assert c.run.envs == 8 and type(c.run.envs) is int


def test_unknown_or_path_like_block_names_are_rejected():
  msg = error(C.load_config, ['--configs', 'debug', 'nosuchblock'])
  assert "'nosuchblock'" in msg and 'debug' in msg  # lists what exists
  msg = error(C.compose, ['../configs/debug'])
  assert 'unknown config block' in msg


def test_block_errors_name_block_and_key(tmp_path):
  (tmp_path / 'defaults.yaml').write_text(
      (C.CONFIG_DIR / 'defaults.yaml').read_text())
  (tmp_path / 'typo.yaml').write_text('run: {envs: 4, evals: 2}\n')
  (tmp_path / 'badtype.yaml').write_text('run.envs: four\n')
  (tmp_path / 'empty.yaml').write_text('# nothing\n')
  (tmp_path / 'broken.yaml').write_text('run: {envs: 4\n')
  (tmp_path / 'null.yaml').write_text('task:\n')
  assert C.compose(['empty'], folder=tmp_path) == C.compose()
  msg = error(C.compose, ['typo'], folder=tmp_path)
  assert "block 'typo'" in msg and "'run.evals'" in msg
  msg = error(C.compose, ['badtype'], folder=tmp_path)
  assert "block 'badtype'" in msg and "'run.envs'" in msg
  msg = error(C.compose, ['broken'], folder=tmp_path)
  assert 'broken.yaml' in msg
  msg = error(C.compose, ['null'], folder=tmp_path)
  assert "'task'" in msg and 'no value' in msg


# --- validation -------------------------------------------------------------

@pytest.mark.parametrize('overrides, expected', [
    ({'report_length': 12}, 'report_length (12) must be <= batch_length + '
                            'replay_context (11)'),
    ({'run.actor_batch': 5}, 'run.actor_batch (5) must be <= run.envs (4)'),
    ({'batch_size': 1000}, 'must be <= replay.size'),
    ({'agent.rssm.deter': 10}, 'agent.rssm.deter (10) must be divisible by '
                               'agent.rssm.blocks (4)'),
    ({'batch_size': 0}, 'batch_size must be >= 1'),
    ({'run.envs': 0}, 'run.envs must be >= 1'),
    ({'run.envs_per_worker': 0}, 'run.envs_per_worker must be >= 1'),
    ({'run.envid_offset': -1}, 'run.envid_offset must be >= 0'),
    ({'run.peer_timeout': -1}, 'run.peer_timeout must be >= 0'),
    ({'run.eval_worker_envs': 0}, 'run.eval_worker_envs must be >= 1'),
    ({'agent.value.units': 0}, 'agent.value.units must be >= 1'),
    ({'run.train_ratio': 0}, 'run.train_ratio must be > 0'),
    ({'replay.fracs.uniform': 0.5}, 'replay.fracs.* must sum to 1'),
    ({'run.actor_min_batch': 4, 'run.actor_max_batch': 2},
     'run.actor_min_batch (4) must be <= run.actor_max_batch (2)'),
    ({'run.actor_buckets': [1, 2]}, 'run.actor_buckets'),
    ({'run.actor_buckets': [4, 2, 8]}, 'run.actor_buckets'),
    ({'run.actor_cutoff': 'magic'}, 'run.actor_cutoff'),
    ({'run.eval_mode': 'mode'},
     "run.eval_mode must be one of 'greedy', 'sample' (got 'mode')"),
    ({'jax.compute_dtype': 'float64'}, 'jax.compute_dtype'),
    ({'jax.compute_dtype': 'float16'},
     "jax.compute_dtype must be one of 'float32', 'bfloat16' (got 'float16')"),
    ({'task': 'cartpole'}, 'task must look like <suite>_<name>'),
    ({'task': 'dmc_walker_walk', 'env.dmc.image': False,
      'env.dmc.proprio': False}, 'env.dmc.proprio and env.dmc.image'),
    ({'run.remote_envs': True}, 'run.actor_addr needs an explicit port'),
    ({'script': 'parallel_env'}, 'run.logger_addr needs an explicit port'),
    ({'run.actor_addr': 'localhost'}, 'run.actor_addr must be host:port'),
    ({'agent.policy.minstd': 2.0}, 'agent.policy.minstd'),
    ({'agent.rewhead.bins': 1}, 'agent.rewhead.bins must be >= 2'),
    ({'env.atari100k.lives': 'never'}, 'env.atari100k.lives must be one of'),
    ({'env.dmc.size': [64]}, 'env.dmc.size must be two positive ints'),
    ({'random_agent': True}, 'random_agent is only supported by --script '
                             "eval_only (got script 'parallel')"),
    ({'random_agent': True, 'script': 'train'}, 'random_agent'),
])
def test_validate_rejects_each_invalid_setting_with_a_specific_message(overrides, expected):
  config = C.compose(['debug'], overrides)
  msg = error(V.validate, config)
  assert msg.startswith('invalid config: ')
  assert expected in msg, msg


def test_validate_accepts_values_at_the_limits():
  V.validate(C.compose(['debug'], {
      'report_length': 11, 'run.actor_batch': 4, 'batch_size': 909,
      'run.actor_buckets': [1, 2, 4, 8], 'run.actor_min_batch': 2,
      'run.actor_max_batch': 5}))
  V.validate(C.compose(['debug'], {
      'script': 'parallel_env', 'run.actor_addr': 'host1:2000',
      'run.replay_addr': 'host2:2001', 'run.logger_addr': '[::1]:2002'}))


def test_random_agent_is_for_eval_only():
  V.validate(C.compose(['debug'], {'random_agent': True,
                                   'script': 'eval_only'}))


def test_validation_reports_all_problems_at_once():
  config = C.compose(['debug'], {'run.actor_batch': 9, 'batch_size': 10000})
  msg = error(V.validate, config)
  assert 'run.actor_batch' in msg and 'replay.size' in msg and '; ' in msg


def test_load_config_validates_unless_asked_not_to():
  argv = ['--configs', 'debug', '--run.actor_batch', '9']
  assert 'run.actor_batch' in error(C.load_config, argv)
  assert C.load_config(argv, check=False).run.actor_batch == 9


def test_parse_known_returns_unknown_flags():
  config, remaining = C.parse_known(['--configs', 'debug', '--mine', 'x',
                                     '--run.envs', '2'])
  assert remaining == ['--mine', 'x'] and config.run.envs == 2


# --- logdir and summary -----------------------------------------------------

def test_resolve_logdir_fills_timestamp_and_anchors_relative_paths(tmp_path, monkeypatch):
  monkeypatch.chdir(tmp_path)
  now = datetime.datetime(2025, 1, 2, 3, 4, 5)
  c = C.resolve_logdir(C.compose(), now)
  assert c.logdir == str(tmp_path / 'runs' / '20250102T030405')
  c = C.resolve_logdir(C.compose((), {'logdir': 'x/{timestamp}-a'}), now)
  assert c.logdir == str(tmp_path / 'x' / '20250102T030405-a')
  c = C.resolve_logdir(C.compose((), {'logdir': '/abs/dir'}), now)
  assert c.logdir == '/abs/dir'
  assert C.resolve_logdir(c).logdir == '/abs/dir'


def test_summary_lists_blocks_and_changes():
  c = C.load_config(['--configs', 'debug', '--run.envs', '2'])
  text = C.summary(c, ['debug'])
  assert 'defaults, debug' in text and 'run.envs' in text
  assert 'agent.opt.lr' not in text


# --- main.py ----------------------------------------------------------------

def run_main(*args, env=None):
  return subprocess.run(
      [sys.executable, '-m', 'dreamer_ver.main', *args], cwd=ROOT,
      capture_output=True, text=True, timeout=60,
      env={**os.environ, **(env or {})})


def test_main_rejects_unknown_key_in_one_line():
  result = run_main('--configs', 'debug', '--bogus.key', '1')
  assert result.returncode == 2
  lines = result.stderr.strip().splitlines()
  assert len(lines) == 1 and 'bogus.key' in lines[0]
  assert lines[0].startswith('error: ')


def test_main_errors_exit_2_in_one_line(capsys):
  for argv, needle in [
      (['--configs', 'nosuch'], "'nosuch'"),
      (['--configs', 'debug', '--run.envs', 'x'], "'run.envs'"),
      (['--configs', 'debug', '--run.actor_batch', '9'], 'run.actor_batch'),
      (['--configs', 'debug', '--script', 'nosuch'], "script 'nosuch'"),
  ]:
    assert M.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and needle in err[0], err


def test_main_dispatches_to_registered_script(tmp_path, monkeypatch, capsys):
  (tmp_path / 'fake_script_mod.py').write_text(textwrap.dedent('''
      CALLS = []
      def run(config):
        CALLS.append(config)
        return 7
  '''))
  monkeypatch.syspath_prepend(str(tmp_path))
  monkeypatch.setitem(M.SCRIPTS, 'fake', 'fake_script_mod:run')
  monkeypatch.setitem(M.SCRIPTS, 'fake_env', 'fake_script_mod:run')
  monkeypatch.setenv('JOB_COMPLETION_INDEX', '3')
  import fake_script_mod
  logdir = tmp_path / 'run1'
  argv = ['--configs', 'debug', '--script', 'fake', '--logdir', str(logdir),
          '--run.envs', '2']
  assert M.main(argv) == 7
  config = fake_script_mod.CALLS[-1]
  assert config.script == 'fake' and config.run.envs == 2
  assert config.logdir == str(logdir) and config.replica == 3
  saved = C.override(
      C.compose(), elements.Config.load(logdir / 'config.yaml'))
  assert saved == config
  out = capsys.readouterr().out
  assert 'defaults, debug' in out and 'run.envs' in out
  # Env-only scripts do not create the logdir.
  other = tmp_path / 'run2'
  argv = ['--configs', 'debug', '--script', 'fake_env', '--logdir',
          str(other), '--run.actor_addr', 'h:1', '--run.replay_addr', 'h:2',
          '--run.logger_addr', 'h:3']
  assert M.main(argv) == 7 and not other.exists()
  # Unavailable scripts list what is registered.
  assert M.main(['--configs', 'debug', '--script', 'nope']) == 2
  assert 'fake, fake_env' in capsys.readouterr().err


def test_main_never_prints_or_saves_the_token(tmp_path, monkeypatch, capsys):
  (tmp_path / 'token_script_mod.py').write_text(textwrap.dedent('''
      CALLS = []
      def run(config):
        CALLS.append(config)
  '''))
  monkeypatch.syspath_prepend(str(tmp_path))
  monkeypatch.setitem(M.SCRIPTS, 'fake', 'token_script_mod:run')
  import token_script_mod
  logdir = tmp_path / 'run'
  assert M.main(['--configs', 'debug', '--script', 'fake', '--logdir',
                 str(logdir), '--run.token', 'sekrit-token']) == 0
  assert token_script_mod.CALLS[-1].run.token == 'sekrit-token'
  out = capsys.readouterr().out
  assert 'run.token' in out and 'sekrit' not in out
  assert 'sekrit' not in (logdir / 'config.yaml').read_text()
  assert M.main(['--run.token', 'sekrit-token', '--help']) == 0
  assert 'sekrit' not in capsys.readouterr().out


def test_a_config_error_a_script_raises_at_start_is_one_line_and_exit_2(
    tmp_path, monkeypatch, capsys):
  (tmp_path / 'refusing_script_mod.py').write_text(textwrap.dedent('''
      from dreamer_ver.config.loading import ConfigError
      def run(config):
        raise ConfigError('the token file is empty')
  '''))
  monkeypatch.syspath_prepend(str(tmp_path))
  monkeypatch.setitem(M.SCRIPTS, 'fake', 'refusing_script_mod:run')
  assert M.main(['--configs', 'debug', '--script', 'fake', '--logdir',
                 str(tmp_path / 'run')]) == 2
  err = capsys.readouterr().err.strip().splitlines()
  assert err == ['error: the token file is empty']


def test_main_help_gives_every_key_its_value_and_meaning(capsys):
  assert M.main(['--configs', 'debug', '--help']) == 0
  out = capsys.readouterr().out
  assert 'usage:' in out
  lines = {line.split()[0]: line for line in out.splitlines()
           if line.startswith('  ')}
  config = C.compose(['debug'])
  for key, value in config.flat.items():
    assert key in lines, key
    shown, _, meaning = lines[key].partition('  # ')
    assert meaning.strip(), key
    assert shown.split(None, 1)[1].strip() == M._show(value), key
  assert lines['agent.rssm.deter'].split()[1] == '8'  # After the blocks.


def test_every_default_key_has_a_one_line_meaning():
  meanings = C.meanings()
  assert list(meanings) == list(C.compose().flat)
  missing = [key for key, meaning in meanings.items() if not meaning]
  assert not missing, f'keys in defaults.yaml without a # comment: {missing}'


def test_meanings_read_nested_keys_and_quoted_hashes(tmp_path):
  (tmp_path / 'defaults.yaml').write_text(textwrap.dedent('''
      # header
      a: 'x # y'   # the a
      group:       # a group
        b: [1, 2]  # the b
        inner:
          c: "#"   # the c

      d: 1
  '''))
  assert C.meanings(tmp_path) == {
      'a': 'the a', 'group.b': 'the b', 'group.inner.c': 'the c', 'd': ''}


def test_the_config_blocks_live_at_the_top_level_and_ship_with_the_package():
  """configs/ beside dreamer_ver/ (the design card's layout); the package's
  configs/ is a link to it, so a wheel holds the files (.ci/wheel_check
  runs one outside the repo)."""
  from pathlib import Path
  import dreamer_ver
  from dreamer_ver.config import loading as configlib
  root = Path(dreamer_ver.__file__).resolve().parent.parent
  top = sorted(p.name for p in (root / 'configs').glob('*.yaml'))
  assert 'defaults.yaml' in top and 'debug.yaml' in top
  assert sorted(p.name for p in configlib.CONFIG_DIR.iterdir()
                if p.name.endswith('.yaml')) == top

