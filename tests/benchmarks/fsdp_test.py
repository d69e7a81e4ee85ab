"""benchmarks/fsdp.py: the HLO parser, the child environment, the tables."""

import pytest

from benchmarks import fsdp

HLO = """\
HloModule jit_train_step

%loop_rs (p.2: bf16[64,64]) -> bf16[16,64] {
  ROOT %rs.2 = bf16[16,64]{1,0} reduce-scatter(%p.2), dimensions={0}
}

%body (p: (s32[], f32[2,16,64])) -> (s32[], f32[2,16,64]) {
  %ag = f8e4m3fn[128,64]{1,0} all-gather(%c), channel_id=3, dimensions={0}, metadata={op_name="jit(train_step)/while/body/sharding_constraint"}
  %ar.1 = (f32[128,64]{1,0}, f32[], bf16[128]{0}) all-reduce(%a, %b, %d), to_apply=%add
  %rs.3 = ((bf16[64,64]{1,0}), bf16[16,64]{1,0}) async-start(%g.2), calls=%loop_rs
  ROOT %t = (s32[], f32[2,16,64]) tuple(%i, %x)
}

%cond (p.1: (s32[], f32[2,16,64])) -> pred[] {
  ROOT %lt = pred[] compare(%i.1, %n), direction=LT
}

%entry_rs (p.3: bf16[64,64]) -> bf16[16,64] {
  ROOT %rs.4 = bf16[16,64]{1,0} reduce-scatter(%p.3), dimensions={0}
}

ENTRY %main.1 (a: f32[8,32]) -> f32[] {
  %tok = s32[8,32,1]{2,1,0} all-gather(%x), dimensions={0}, metadata={op_name="jit(train_step)/jvp(jit(_take))/gather"}
  %ags = (f32[16,64]{1,0}, f32[128,64]{1,0}) all-gather-start(%w), dimensions={0}
  %rs = bf16[16,64]{1,0} reduce-scatter(%g), dimensions={0}
  %two = ((f32[16,64]{1,0}, bf16[8]{0}), (f32[128,64]{1,0}, bf16[64]{0})) all-gather-start(%w, %v), dimensions={0}
  %w.1 = (s32[], f32[2,16,64]) while(%init), condition=%cond, body=%body
  %rs.5 = ((bf16[64,64]{1,0}), bf16[16,64]{1,0}) async-start(%g.3), calls=%entry_rs
  ROOT %r = f32[] all-reduce(%l), to_apply=%add
}
"""  # noqa: E501 (HLO lines as XLA prints them)


def test_collectives_by_kind_dtype_bytes_and_place():
  colls = fsdp.collectives(HLO)
  assert [(c['kind'], c['dtype'], c['entry'], c['in_loop'])
          for c in colls] == [
      ('reduce-scatter', 'bf16', False, True),  # wrapped, in the loop
      ('all-gather', 'f8e4m3fn', False, True),
      ('all-reduce', 'f32', False, True),
      ('reduce-scatter', 'bf16', False, False),  # wrapped, outside loops
      ('all-gather', 's32', True, False), ('all-gather', 'f32', True, False),
      ('reduce-scatter', 'bf16', True, False),
      ('all-gather', 'f32', True, False), ('all-reduce', 'f32', True, False)]
  assert colls[1]['bytes'] == 128 * 64
  assert colls[1]['op_name'].endswith('sharding_constraint')
  assert colls[2]['bytes'] == 128 * 64 * 4 + 4 + 128 * 2
  assert colls[5]['arrays'] == [('f32', (128, 64))]  # an async start's result
  assert colls[6]['bytes'] == 16 * 64 * 2
  assert colls[7]['arrays'] == [('f32', (128, 64)), ('bf16', (64,))]
  summary = fsdp.summarize(colls)
  assert summary['all-gather f8e4m3fn'] == dict(count=1, bytes=8192,
                                                 in_loops=1)
  assert summary['all-reduce f32'] == dict(count=2, bytes=32768 + 260 + 4,
                                           in_loops=1)
  assert summary['reduce-scatter bf16'] == dict(count=3, bytes=3 * 2048,
                                                in_loops=1)
  assert list(summary) == sorted(summary)


def test_child_env_restricts_devices_and_keeps_nvls_off(monkeypatch):
  monkeypatch.setenv('XLA_FLAGS', '--xla_force_host_platform_device_count=8'
                     ' --xla_foo=1')
  monkeypatch.setenv('CUDA_VISIBLE_DEVICES', '3,5,6,7')
  cpu = fsdp.child_env(2, 'cpu', 0.9)
  assert cpu['XLA_FLAGS'] == (
      '--xla_foo=1 --xla_force_host_platform_device_count=2')
  assert cpu['NCCL_NVLS_ENABLE'] == '0'
  assert cpu['XLA_PYTHON_CLIENT_MEM_FRACTION'] == '0.9'
  assert fsdp.child_env(2, 'gpu', 0.9)['CUDA_VISIBLE_DEVICES'] == '3,5'
  monkeypatch.delenv('CUDA_VISIBLE_DEVICES')
  assert fsdp.child_env(4, 'gpu', 0.9)['CUDA_VISIBLE_DEVICES'] == '0,1,2,3'


def _train(name, devices, batch, tok, peak, part='equal', status='ok'):
  n = devices
  return dict(
      kind='train', part=part, name=name, mode=name, preset='llama2_7b',
      seq=2048, batch=batch, devices=n, overrides=[], steps=10,
      mem_fraction=0.97, status=status, device='H200', jax='0.11',
      tokens_per_s=tok, peak_bytes=peak, step_ms=1.0, compile_s=1.0,
      loss=2.0, bytes_in_use_after_init=2**30,
      sharding={k: dict(total=8 * 2**30, per_device=2**30, devices=n,
                        replicated=[['norm', [4096], 16384]])
                for k in ('params', 'opt_state')},
      collectives={'all-gather f32': dict(count=64, bytes=2**31,
                                          in_loops=64)})


def test_tables_ratios_sharding_and_restore():
  records = [
      _train('bf16', 8, 8, 1000.0, 40 * 2**30),
      _train('coat', 8, 8, 1500.0, 20 * 2**30),
      _train('coat', 8, 32, 1800.0, 60 * 2**30, part='max'),
      _train('bf16', 8, 16, 0, 0, part='max', status='does not fit'),
      dict(kind='restore', part='restore', name='fsdp4', status='ok',
           device='H200', jax='0.11', resumed_from=None,
           losses={'1': 3.0, '2': 2.5, '3': 2.0, '4': 1.5}),
      dict(kind='restore', part='restore', name='fsdp4_to_2', status='ok',
           resumed_from=3, losses={'4': 1.503}),
  ]
  text = fsdp.tables(records)
  assert ('| equal | coat | llama2_7b | 8 | 8 | 1,500 | 1.50x | 20.00 |'
          ' 2.00x |') in text
  assert '| max | bf16 | llama2_7b | 8 | 16 | does not fit |' not in text
  assert '| max | coat | llama2_7b | 8 | 32 | 1,800 |' in text  # largest
  assert '| coat b8 llama2_7b | 8 | 8.00 | 1.00 | 8.00 | 1.00 | 2 (0.0) |'\
      in text
  assert '| all-gather f32 | 64, 2048.0, 64 |' in text
  assert '| fsdp4_to_2 | 3 | 1.5030 | 2.00e-03 |' in text


def test_profiled_points_table_nccl_time_by_collective():
  coat = _train('coat', 2, 4, 15000.0, 33 * 2**30)
  coat['step_ms'] = 268.9
  coat['nccl'] = {'all-gather': [465.0, 41.95, 20.91],
                  'reduce-scatter': [160.0, 39.4, 11.47]}
  coat['kernel_classes'] = {'fp8 gemm': 120.04, 'collectives (nccl)': 81.35}
  coat['idle_ms'] = 3.26
  bf16 = _train('bf16', 2, 4, 8000.0, 62 * 2**30)  # not profiled
  text = fsdp.tables([coat, bf16])
  assert ('| coat llama2_7b | 2 | 4 | 268.9 | 81.3 | 32.4 | 42.0 (20.9) |'
          ' 39.4 (11.5) |') in text
  assert ('| run | devices | batch | step ms | collectives (nccl) | fp8 gemm'
          ' | all kernels | idle ms |') in text
  assert ('| coat llama2_7b | 2 | 4 | 268.9 | 81.3 | 120.0 | 201.4 | 3.3 |'
          in text)
  assert '| bf16 llama2_7b |' not in text


def test_scaling_and_fp8_gather_tables():
  gather = _train('coat_fp8_gather', 8, 8, 1200.0, 20 * 2**30,
                  part='gather')
  gather['collectives'] = {'all-gather f8e4m3fn': dict(
      count=64, bytes=2**29, in_loops=64)}
  records = [_train('coat', 8, 8, 1000.0, 20 * 2**30), gather,
             _train('coat', 1, 1, 1100.0, 9 * 2**30, part='scaling'),
             _train('coat', 2, 2, 1045.0, 9 * 2**30, part='scaling')]
  text = fsdp.tables(records)
  assert '| coat | 1,100 (1.00x) | 1,045 (0.95x) | 1,000 (0.91x) |' in text
  assert ('| llama2_7b | 8 | 8 | 1,000 | 1,200 | 1.20x | f32 2048.0 |'
          ' f8e4m3fn 512.0 |') in text


def test_point_key_ignores_the_run_dir_and_results():
  p = dict(kind='restore', name='a', devices=2, run_dir='/x')
  assert fsdp.point_key(p) == fsdp.point_key(dict(p, run_dir='/y',
                                                  status='ok', loss=1.0))
  assert fsdp.point_key(p) != fsdp.point_key(dict(p, devices=1))


def test_unknown_part_names_the_flag(capsys):
  with pytest.raises(SystemExit):
    fsdp.main(['--parts', 'equal,speed'])
  assert '--parts' in capsys.readouterr().err
