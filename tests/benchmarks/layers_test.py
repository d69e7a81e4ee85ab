"""benchmarks/layers.py on one tiny decoder layer (CPU): its figures are
real measurements of the layer it builds."""

from benchmarks import layers
import coat_jax.models as cm


def test_coat_layer_saves_fp8_residuals_and_fewer_bytes_than_bf16():
  cfg = cm.LlamaConfig.preset('tiny')
  run = lambda precision: layers.bench(cfg, precision, None, batch=2, seq=32,
                                       warmup_s=0.0, runs=2)
  bf16, coat = run('bf16'), run('coat')
  assert bf16['mode'] == 'bf16' and coat['mode'] == 'coat'
  assert not any('float8' in dtype for _, dtype in bf16['residuals'])
  assert any(dtype == 'float8_e4m3fn' for _, dtype in coat['residuals'])
  # tiny: 0.625x on this CPU (attention's bf16 q/k/v/out dominate there).
  assert 0 < coat['saved'] < 0.7 * bf16['saved']
  for row in (bf16, coat):
    assert 0 < row['ms_min'] <= row['ms'] <= row['ms_max']
    assert row['temp'] > 0
    assert row['f8'] == 0  # cuBLASLt's FP8 GEMM exists on GPUs only
