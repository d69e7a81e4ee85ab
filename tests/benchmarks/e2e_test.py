"""benchmarks/e2e.py: the sweep's logic on hand-built records."""

import json

from flax import nnx
import jax
import numpy as np
import pytest

from benchmarks import e2e
from coat_jax import models
from coat_jax import recipes
from coat_jax.models import vlm
from coat_jax.training import tasks


def test_parse_variant_keeps_tuple_values():
  assert e2e.parse_variant(
      'm=coat:optim.moment_dtypes=e4m3,e5m2,model.scan_layers=false') == (
          'm', 'coat', ['optim.moment_dtypes=e4m3,e5m2',
                        'model.scan_layers=false'])
  assert e2e.parse_variant('x=plain') == ('x', 'plain', [])


@pytest.mark.parametrize('spec', ['coat:a.b=1', 'x=fp16:a.b=1', '=coat'])
def test_bad_variant_names_the_flag(spec):
  with pytest.raises(ValueError, match='--variants'):
    e2e.parse_variant(spec)


def test_runs_reject_unknown_modes_and_taken_names():
  assert e2e.runs_from_args('plain,coat', ['u=coat:model.scan_layers=false']
                            ) == {'plain': ('plain', []),
                                  'coat': ('coat', []),
                                  'u': ('coat', ['model.scan_layers=false'])}
  with pytest.raises(ValueError, match='--modes'):
    e2e.runs_from_args('plain,fp16', [])
  with pytest.raises(ValueError, match='taken'):
    e2e.runs_from_args('coat', ['coat=coat:model.scan_layers=false'])


@pytest.mark.parametrize('largest', [1, 3, 4, 10, 37, 64, 1000])
def test_max_batch_search_finds_the_largest(largest):
  tried = []

  def fits(b):
    tried.append(b)
    return b <= largest

  assert e2e.search_max_batch(fits, 4, max_tries=20) == largest
  assert len(tried) == len(set(tried))


def test_max_batch_search_respects_tries_multiple_and_none():
  tried = []
  best = e2e.search_max_batch(lambda b: tried.append(b) or b <= 13, 4,
                              multiple=2, max_tries=5)
  assert tried == [4, 8, 16, 12, 14] and best == 12
  assert e2e.search_max_batch(lambda b: False, 4) is None


@pytest.mark.parametrize('preset', ['tiny', '125m', '1b'])
def test_model_flops_is_six_matmul_params_plus_causal_attention(preset):
  cfg = models.LlamaConfig.preset(preset)
  params = sum(x.size for x in jax.tree.leaves(nnx.state(nnx.eval_shape(
      lambda: models.Llama(cfg, precision='bf16', rngs=nnx.Rngs(0))),
      nnx.Param)))
  norms = (2 * cfg.num_layers + 1) * cfg.hidden_size
  lookup = 0 if cfg.tie_embeddings else cfg.vocab_size * cfg.hidden_size
  matmul = params - norms - lookup
  b, s = 3, 128
  attention = cfg.num_layers * 3 * 4 * b * s * s * cfg.hidden_size / 2
  assert e2e.model_flops(cfg, b, s) == 6 * matmul * b * s + attention


def _record(name, batch, status='ok', tok=1000.0, peak=2**30):
  return dict(name=name, mode=name, preset='1b', seq=2048, batch=batch,
              overrides=[], profile=False, mem_fraction=0.97, steps=10,
              status=status,
              device='H200', jax='0.11', tokens_per_s=tok, model_tflops=1.0,
              peak_bytes=peak, compile_s=1.0, step_ms=1.0, loss=2.0,
              error='OOM')


def test_tables_ratios_and_largest_batch():
  records = [_record('plain', 4, tok=1000.0, peak=4 * 2**30),
             _record('plain', 8, 'does not fit'),
             _record('coat', 4, tok=1500.0, peak=2**30),
             _record('coat', 8, tok=2000.0, peak=2 * 2**30),
             _record('coat', 16, 'does not fit')]
  text = e2e.tables(records)
  assert '| coat | 4 | 1,500 | 1.50x | 1.0 | 1.0 | 0.25x |' in text
  assert '| plain | 8 | does not fit |' in text
  assert '| coat | 8 | 16 | 2,000 | 2.00x | 2.0 |' in text
  assert '| plain | 4 | 8 | 1,000 | 1.00x | 4.0 |' in text
  assert 'Largest' not in e2e.tables(records, {4}, largest_table=False)


def test_out_of_memory_messages_are_recognized():
  assert e2e.OOM.search('jaxlib.xla_extension.XlaRuntimeError:'
                        ' RESOURCE_EXHAUSTED: Out of memory while trying to'
                        ' allocate 1.00GiB.')
  assert not e2e.OOM.search('ValueError: model.precision=x must be one of')


def test_scanned_adds_a_run_per_coat_jax_mode():
  assert e2e.runs_from_args('plain,bf16,coat', [], scanned=True) == {
      'plain': ('plain', []), 'bf16': ('bf16', []), 'coat': ('coat', []),
      'bf16_scanned': ('bf16', ['model.scan_layers=true']),
      'coat_scanned': ('coat', ['model.scan_layers=true'])}


def test_budget_stops_before_a_point_that_would_not_end_in_time(
    monkeypatch, tmp_path, capsys):
  clock = [0.0]
  calls = []

  def fake_run(p, timeout):
    calls.append((p['name'], p['batch'], timeout))
    clock[0] += 40.0
    return {**p, **_record(p['name'], p['batch']), 'wall_s': 40.0}

  monkeypatch.setattr(e2e, 'run_in_process', fake_run)
  monkeypatch.setattr(e2e.time, 'perf_counter', lambda: clock[0])
  out = tmp_path / 'e2e.jsonl'
  argv = ['--preset', '1b', '--modes', 'plain,coat', '--budget-s', '100',
          '--out', str(out)]
  assert e2e.main(argv) == 0
  # 100 s: two 40 s points; the third (20 s left < 40 s) is not started.
  assert calls == [('plain', 8, 100.0), ('coat', 8, 60.0)]
  assert 'stopped before the next point' in capsys.readouterr().out
  clock[0] = 0.0
  assert e2e.main(argv) == 0  # goes on from the file
  assert [c[:2] for c in calls[2:]] == [('plain', 16), ('coat', 16)]
  assert '| coat | 16 | 1,000 | 1.00x |' in capsys.readouterr().out


def test_profiled_points_get_the_kernel_class_table():
  r = _record('coat', 8)
  r['kernel_ms'] = {'fp8 gemm': 75.0, 'attention': 34.0, 'gemm': 13.0,
                    'reduce': 22.0, 'fusion (elementwise)': 26.5}
  text = e2e.tables([_record('plain', 8), r])
  assert '| outside GEMM+attention | 48.5 |' in text
  assert '| reduce | 22.0 |' in text
  assert '| coat | 8 | 1,000 | 1.00x | 1.0 | 1.0 | 1.00x | 1 | 1.0 | 48.5 |'\
      in text


def test_report_only_shows_the_latest_record_of_a_point(tmp_path, capsys):
  out = tmp_path / 'e2e.jsonl'
  out.write_text('\n'.join(json.dumps(r) for r in [
      _record('coat', 4, 'failed'), _record('coat', 4, tok=3000.0),
      _record('plain', 4)]) + '\n')
  assert e2e.main(['--report-only', str(out)]) == 0
  text = capsys.readouterr().out
  assert '| coat | 4 | 3,000 | 3.00x |' in text and 'failed' not in text


def test_train_config_applies_the_mode_then_the_overrides():
  config = e2e.train_config('tiny', 256, 4, 'fp8_linear', ['model.remat=full'])
  assert config.model.recipe == recipes.FP8_LINEAR
  assert config.optim.name == 'adamw'
  assert (config.data.seq_len, config.train.batch_size) == (256, 4)
  assert config.model.remat == 'full' and config.train.checkpoint_every == 0
  assert config.model.max_seq_len is None  # the preset's 256 positions
  config = e2e.train_config('tiny', 4096, 1, 'bf16', ['optim.name=coat_adamw'])
  assert config.model.recipe == recipes.BF16
  assert config.optim.name == 'coat_adamw'
  assert config.model.max_seq_len == 4096


def test_a_vlm_point_trains_on_the_shapes_data_and_counts_image_tokens():
  config = e2e.train_config('vlm_tiny', None, 2, 'coat', [])
  assert config.data.source == 'shapes' and config.model.preset == 'vlm_tiny'
  p = dict(name='coat', mode='coat', preset='vlm_tiny', seq=None, batch=2,
           overrides=[], profile=False, steps=2, mem_fraction=0.97)
  r = e2e.run_point(p)
  text = tasks.shapes_dataset(vlm.VLMConfig.preset('vlm_tiny')).seq_len
  positions = (32 // 8) ** 2 + text
  assert r['tokens_per_s'] == pytest.approx(
      2 * positions / (r['step_ms'] / 1e3))
  assert r['examples_per_s'] == pytest.approx(2 / (r['step_ms'] / 1e3))
  assert np.isfinite(r['loss'])
  with pytest.raises(SystemExit):
    e2e.main(['--preset', 'vlm_tiny', '--modes', 'plain,coat'])


def test_vlm_flops_add_the_vits_matmuls_and_attention_to_the_decoders():
  config = vlm.VLMConfig.preset('vlm_tiny')
  task = tasks.of_config(e2e.train_config('vlm_tiny', None, 2, 'coat', []))
  v = config.vision
  model = nnx.eval_shape(lambda: vlm.VLM(config, recipe='bf16',
                                          rngs=nnx.Rngs(0)))
  kernels = [x.size for path, x in nnx.to_flat_state(
      nnx.state(model.vision, nnx.Param))
             if path[-1] == 'kernel' and x.ndim == 2]
  projector = sum(x.size for x in jax.tree.leaves(
      nnx.state(model.projector, nnx.Param)) if x.ndim == 2)
  b, p = 3, config.num_image_tokens
  vit = (6 * (sum(kernels) + projector) * b * p
         + 12 * v.num_layers * b * p * p * v.hidden_size)
  assert e2e.vlm_flops(config, b, task) == pytest.approx(
      e2e.model_flops(config.decoder, b, task.tokens_per_example) + vit)


def test_vlm_tables_compare_with_bf16():
  records = [dict(_record('bf16', 32, tok=1000.0, peak=4 * 2**30),
                  preset='vlm_1b', seq=None),
             dict(_record('coat', 32, tok=1300.0, peak=2 * 2**30),
                  preset='vlm_1b', seq=None)]
  text = e2e.tables(records)
  assert 'vs bf16' in text and 'shapes data' in text
  assert '| coat | 32 | 1,300 | 1.30x | 1.0 | 2.0 | 0.50x |' in text
