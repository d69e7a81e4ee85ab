"""FSDP on 8 fake CPU devices: the state is sharded, the step's collectives
are FSDP's, FP8 weight all-gathers change no number, and a checkpoint saved
on 4 devices trains on with the same losses on 2 and 1."""

import collections
import dataclasses
import json
import os

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import numpy as np
import pytest

from benchmarks import fsdp as fsdp_bench
from coat_jax import recipes
from coat_jax import training
from coat_jax.models import remat
from coat_jax.nn import fsdp
from coat_jax.training import config as config_lib
from coat_jax.training import memory
from coat_jax.training import sharding
from coat_jax.training import trainer

# hidden 128 / 8 devices = 16 per shard: whole groups of 16 on every axis,
# so no axis is dropped from the FSDP sharding.
MODEL = {'hidden_size': 128, 'intermediate_size': 256}
LAYER_WEIGHTS = 7  # q, k, v, o, gate, up, down


def _config(tiny_config, n, *, model=None, mesh=None, train=None,
            optim=None):
  return tiny_config(
      model={**MODEL, **(model or {})},
      optim={'group_size': 16, **(optim or {})},
      mesh={'data': 1, 'fsdp': n, 'tensor': 1, **(mesh or {})},
      train=train or {})


def _gather(on):
  """The default recipe with fp8_weight_gather on or off."""
  return dataclasses.replace(recipes.COAT, fp8_weight_gather=on)


def _shapes(tree):
  return [tuple(x.shape) for x in jax.tree.leaves(tree)]


@pytest.mark.parametrize('n', [8, 4])
def test_params_and_fp8_states_are_sharded(tiny_config, n):
  """Per-device bytes = sharded bytes / n + replicated bytes, and the only
  replicated leaves are RMSNorm scales (logical axis 'norm', kept whole),
  their moments and the scalar step counts."""
  setup = training.build(_config(tiny_config, n), jax.devices()[:n])
  state = setup.init_state()
  for key in ('params', 'opt_state'):
    b = fsdp_bench.sharded_bytes(state[key])
    assert b['devices'] == n
    replicated = sum(nbytes for _, _, nbytes in b['replicated'])
    for path, shape, _ in b['replicated']:
      assert 'norm' in path or shape == (), (key, path, shape)
    assert replicated < 0.02 * b['total'], b['replicated']
    assert b['per_device'] == (b['total'] - replicated) // n + replicated
  values = [x for path, x in jax.tree_util.tree_leaves_with_path(
      state['opt_state']) if x.dtype == jnp.float8_e4m3fn
            and 'norm' not in jax.tree_util.keystr(path)]
  # FP8 mu and nu of the 7 layer kernels, the embedding and the LM head
  # (the norms' are the replicated ones above).
  assert len(values) == 2 * (LAYER_WEIGHTS + 2)
  assert all(x.sharding.spec.count('fsdp') == 1 for x in values)


def test_new_params_are_made_in_their_shards(tiny_config):
  """A new run's params are made under jit, each device its own shard, with
  no transfer (also under jax.set_mesh, train.py's context), and come out
  the same on any mesh. Made eagerly, the whole float32 params sat on one
  device first (Llama-2-7B, FSDP on 4 H200s: device 0 peaked at 39.3 GiB
  at init, its step at 22.3): FSDP could not start a model larger than
  one GPU."""
  setup = training.build(_config(tiny_config, 8), jax.devices())
  with jax.set_mesh(setup.mesh), jax.transfer_guard('disallow'):
    state = setup.init_state()
  for x, want in zip(jax.tree.leaves(state),
                     jax.tree.leaves(setup.state_shardings)):
    assert x.sharding == want
  one = training.build(_config(tiny_config, 1), jax.devices()[:1])
  with jax.set_mesh(one.mesh):
    params = one.init_state()['params']
  for a, b in zip(jax.tree.leaves(state['params']), jax.tree.leaves(params)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_device_batch_cuts_each_slice_on_its_array_s_device(tiny_config,
                                                            monkeypatch):
  """Under a caller's jax.set_mesh an eager slice of a device array is
  replicated on every device of the mesh, with the whole array copied
  there first (Llama-2-7B's params placed this way, FSDP on 4 H200s:
  devices 1-3 peaked at 47.8 GiB, twice the float32 layer stack)."""
  setup = training.build(_config(tiny_config, 8), jax.devices())
  sharding_ = jax.sharding.NamedSharding(setup.mesh, P('fsdp'))
  with jax.set_mesh(None):
    x = jnp.arange(64.0).reshape(16, 4)
  slices = []
  make_array_from_callback = jax.make_array_from_callback

  def spy(shape, target, callback):
    def sliced(idx):
      part = callback(idx)
      slices.append(part.sharding.device_set)
      return part
    return make_array_from_callback(shape, target, sliced)

  monkeypatch.setattr(jax, 'make_array_from_callback', spy)
  with jax.set_mesh(setup.mesh):
    y = trainer.device_batch(x, sharding_)
  assert len(slices) == 8 and all(d == x.sharding.device_set for d in slices)
  assert y.sharding == sharding_
  np.testing.assert_array_equal(np.asarray(y), np.asarray(x))


def _partitioned_step(config):
  setup = training.build(config, jax.devices())
  batch = jax.ShapeDtypeStruct(
      (config.train.batch_size, config.data.seq_len), jnp.int32)
  with jax.set_mesh(setup.mesh):
    compiled, hlo = fsdp_bench.partitioned_hlo(
        setup.train_step.lower(setup.abstract_state, batch, batch))
  return (setup, fsdp_bench.collectives(hlo),
          fsdp_bench.collectives(compiled.as_text()))


def _layer_shapes(params, times):
  """The layer weights' (sorted) shapes, each `times`, as two Counters: with
  Q/K/V apart, and with Q/K/V as their one (K, sum N) concatenation."""
  layer_params = params['layers']
  shapes = [tuple(sorted(s[1:])) for s in _shapes(layer_params)
            if len(s) == 3]
  qkv = [layer_params['attn'][k]['kernel'].shape[1:]
         for k in ('q_proj', 'k_proj', 'v_proj')]
  others = collections.Counter(shapes)
  others.subtract(tuple(sorted(shape)) for shape in qkv)
  apart = others + collections.Counter(tuple(sorted(s)) for s in qkv)
  fused = others + collections.Counter(
      [tuple(sorted((qkv[0][0], sum(n for _, n in qkv))))])
  return [collections.Counter({s: n * times for s, n in c.items()})
          for c in (apart, fused)]


@pytest.mark.parametrize('scan_layers', [True, False])
@pytest.mark.parametrize('gather', [False, True])
def test_step_collectives_are_fsdp(tiny_config, gather, scan_layers):
  """The SPMD-partitioned step (before XLA:CPU's backend passes):

  - each layer's 7 weights are all-gathered once in forward and once in
    backward (scanned: in the loop bodies, where the default remat 'full'
    gathers them once more for the recomputed forward; unrolled: per
    layer), float32
    shards (Q/K/V's possibly as one concatenation), or FP8 codes (as uint8)
    with the recipe's fp8_weight_gather; nothing
    else is all-gathered but the LM head (BF16, in the loss' chunk loop,
    and float32 outside the loops) and the token ids of the embedding's
    lookup;
  - each weight's gradient is summed over the devices once per layer. The
    CPU partitioner emits all-reduce (each device then keeps its slice); on
    GPUs XLA rewrites all-reduce + dynamic-slice into reduce-scatter;
  - no optimizer state moves: no collective of FP8 codes but the gathered
    weights', none of a stacked (layers, ...) array;
  - activations move only where the embedding table (sharded on its hidden
    axis) is looked up: one all-to-all forward, one backward
    (`fsdp.embed_lookup`).
  """
  # vocab 512: the embedding's and LM head's shapes differ from every
  # layer weight's (unrolled, all of them are gathered outside any loop).
  config = _config(tiny_config, 8, model={
      'recipe': _gather(gather), 'scan_layers': scan_layers,
      'vocab_size': 512})
  setup, colls, final = _partitioned_step(config)
  params = setup.abstract_state['params']
  layers = [tuple(sorted(s[1:])) for s in _shapes(params['layers'])
            if len(s) == 3]
  assert len(layers) == LAYER_WEIGHTS
  top = {tuple(sorted(params[k].shape)) for k in ('embed', 'lm_head')}
  num_layers = params['layers']['attn']['q_proj']['kernel'].shape[0]
  kinds = collections.Counter(c['kind'] for c in colls)
  print(fsdp_bench.summarize(colls))
  assert set(kinds) <= {'all-gather', 'all-reduce', 'all-to-all'}, kinds

  weight_dtype = 'u8' if gather else 'f32'
  gathered = collections.Counter()
  for c in colls:
    if c['kind'] != 'all-gather':
      continue
    (dtype, shape), = c['arrays']
    shape = tuple(sorted(shape))
    if dtype == 's32':
      # Token ids, within each FSDP group (`fsdp.embed_lookup`).
      assert c['op_name'].endswith('all_gather'), c
    elif shape in top:
      if c['entry']:
        assert dtype == 'f32', c
      else:  # the loss' chunk loop
        assert dtype == 'bf16' and shape == tuple(sorted(
            params['lm_head'].shape)), c
    else:
      assert dtype == weight_dtype and c['entry'] != scan_layers, c
      gathered[shape] += 1
  per_layer = 1 if scan_layers else num_layers  # scanned: per loop body
  policy = remat.resolve(setup.architecture.remat,
                         config_lib.recipe(config.model), scan_layers)
  passes = 3 if policy == 'full' else 2
  # Q/K/V are one fused projection: XLA may gather their float32 shards as
  # one concatenation (the same bytes in one collective).
  expected = _layer_shapes(params, passes * per_layer)
  assert gathered in expected, (gathered, expected)
  # XLA:CPU's later passes keep the dtype of the gathered weights.
  assert {c['dtype'] for c in final if c['kind'] == 'all-gather'
          and c['entry'] != scan_layers
          and tuple(sorted(c['arrays'][0][1])) in layers
          } == {weight_dtype}

  reduced = collections.Counter(
      tuple(sorted(s)) for c in colls if c['kind'] == 'all-reduce'
      and c['entry'] != scan_layers for d, s in c['arrays'] if len(s) == 2)
  # Q/K/V's gradients may be summed as one concatenation too.
  assert any(all(reduced[shape] >= n for shape, n in counts.items())
             for counts in _layer_shapes(params, per_layer)), reduced

  for c in colls:
    for dtype, shape in c['arrays']:
      assert not (len(shape) == 3 and shape[0] == num_layers), c
      if dtype.startswith('f8') or dtype == 'u8':  # FP8 codes travel as u8
        assert gather and dtype == 'u8' and c['kind'] == 'all-gather', c
        assert c['entry'] != scan_layers, c
  # The embedding's rows (forward) and their gradient (backward), each
  # device's slice of H (`fsdp.embed_lookup`).
  moved = [c for c in colls if c['kind'] == 'all-to-all']
  assert len(moved) == 2 and all(
      c['op_name'].endswith('all_to_all') and (
          c['entry'] or 'manual_computation' in c['computation'])
      for c in moved), moved


def test_fp8_weight_gather_changes_no_number(tiny_config):
  """Two steps with and without the recipe's fp8_weight_gather on fsdp=8:
  the same losses and params, bit for bit (the codes are cast from the same
  scale, before or after the gather)."""
  runs = []
  tokens = np.random.default_rng(1).integers(0, 256, (8, 33), np.int32)
  for gather in (False, True):
    config = _config(tiny_config, 8, model={'recipe': _gather(gather)})
    setup = training.build(config, jax.devices())
    with jax.set_mesh(setup.mesh):
      state = setup.init_state()
      losses = []
      for _ in range(2):
        state, metrics = setup.train_step(state, tokens[:, :-1],
                                          tokens[:, 1:])
        losses.append(float(metrics['loss']))
    runs.append((losses, jax.tree.map(np.asarray, state['params'])))
  (loss_off, params_off), (loss_on, params_on) = runs
  assert np.isfinite(loss_off).all() and loss_off == loss_on
  jax.tree.map(np.testing.assert_array_equal, params_on, params_off)


def _per_shard_against_xla(tiny_config, monkeypatch, n, data=1):
  """Two coat steps on data x fsdp = n with the layers' Pallas kernels on each
  device's rows (`fsdp.row_wise`) and with XLA's quantizers (CPUs, and
  several GPUs before): the same losses and gradient norms to float
  rounding, the step's program holding the kernels, and no all-gather of
  an activation (a bare pallas_call would have been replicated)."""
  from pallas_kernels import _common  # noqa: PLC0415
  # 8 x 24 tokens: 192 rows, a size no weight has (vocab 512, hidden 128,
  # intermediate 256).
  tokens = np.random.default_rng(2).integers(0, 256, (8, 25), np.int32)
  runs = {}
  for per_shard in (False, True):
    monkeypatch.setattr(_common, 'gpus_run_pallas', lambda p=per_shard: p)
    # No warmup: the first step moves the params, the second sees them.
    setup = training.build(
        _config(tiny_config, n // data, mesh={'data': data},
                model={'vocab_size': 512}, optim={'warmup_steps': 0}),
        jax.devices()[:n])
    with jax.set_mesh(setup.mesh):
      state = setup.init_state()
      # A top-level trace: on several devices the step's jit carries XLA
      # compiler options, which jax refuses under another trace.
      jaxpr = str(setup.train_step.trace(
          state, tokens[:, :-1], tokens[:, 1:]).jaxpr)
      assert (jaxpr.count('pallas_call') > 0) == per_shard
      # The optimizer too steps each device's shard with its kernel.
      assert ('coat_adam_step' in jaxpr) == per_shard
      if per_shard:
        colls = fsdp_bench.collectives(setup.train_step.lower(
            state, tokens[:, :-1], tokens[:, 1:]).compile().as_text())
        # What travels: weights (float32, bf16 or FP8 codes, either
        # orientation), amaxes and norm scales (1-D), tokens (int32).
        weights = {tuple(sorted(s[-2:])) for s in _shapes(state['params'])}
        gathered = [(d, s) for c in colls if c['kind'] == 'all-gather'
                    for d, s in c['arrays']]
        assert gathered and all(
            tuple(sorted(s)) in weights or len(s) == 1 or d == 's32'
            for d, s in gathered), gathered
      logged = []
      for _ in range(2):
        state, metrics = setup.train_step(state, tokens[:, :-1],
                                          tokens[:, 1:])
        logged.append((float(metrics['loss']), float(metrics['grad_norm'])))
    runs[per_shard] = np.array(logged)
  (loss, norm), (want_loss, want_norm) = runs[True].T, runs[False].T
  assert np.isfinite(runs[True]).all() and loss[1] < loss[0]
  np.testing.assert_allclose(loss, want_loss, rtol=2e-3)
  # The gradients' scale, which Adam and clipping hide from the losses: at
  # the first step (the same params) as in train_test.py's mesh test; the
  # second step's params differ by the first step's rounding.
  np.testing.assert_allclose(norm[0], want_norm[0], rtol=5e-3)
  np.testing.assert_allclose(norm[1], want_norm[1], rtol=2e-2)


@pytest.mark.parametrize('data', [1, 2])
def test_per_shard_pallas_kernels_train_as_xla_s(tiny_config, monkeypatch,
                                                 data):
  """On 8 CPU devices, the kernels interpreted (compiled on GPUs); data 2:
  data parallel over 2 x FSDP over 4."""
  _per_shard_against_xla(tiny_config, monkeypatch, 8, data)


@pytest.mark.gpu
def test_gpus_run_the_kernels_per_shard_as_xla_s(tiny_config, monkeypatch):
  """On 2, 4 or 8 GPUs, the kernels compiled."""
  n = jax.device_count()
  if n < 2 or 8 % n:
    pytest.skip(f'needs 2, 4 or 8 GPUs; found {n}')
  _per_shard_against_xla(tiny_config, monkeypatch, n)


def test_gather_fp8_weight_outside_fsdp_is_the_identity():
  x = jnp.ones((32, 16), jnp.float8_e4m3fn)
  assert fsdp.gather_fp8_weight(x, ('embed', 'mlp')) is x  # no mesh
  assert fsdp.shard_batch(x) is x
  mesh = sharding.make_mesh((1, 4, 2))
  with jax.set_mesh(mesh):  # tensor parallel: left to the partitioner
    assert fsdp.gather_fp8_weight(x, ('embed', 'mlp')) is x
  mesh = sharding.make_mesh((2, 4, 1))
  with jax.set_mesh(mesh):
    assert fsdp.gather_fp8_weight(x, None) is x
    assert fsdp.gather_fp8_weight(x, ('mlp', 'mlp')) is x  # no FSDP axis
    with pytest.raises(ValueError, match='must name each'):
      fsdp.gather_fp8_weight(x, ('embed',))
    codes = jax.random.normal(jax.random.key(0), (32, 16)).astype(
        jnp.float8_e4m3fn)
    shards = jax.device_put(codes, jax.NamedSharding(mesh, P('fsdp', None)))
    y = jax.jit(lambda v: fsdp.gather_fp8_weight(v, ('embed', 'mlp')))(
        shards)
    assert y.sharding.is_fully_replicated and y.dtype == jnp.float8_e4m3fn
    np.testing.assert_array_equal(np.asarray(y, np.float32),
                                  np.asarray(codes, np.float32))
  explicit = jax.make_mesh((2, 4, 1), ('data', 'fsdp', 'tensor'),
                           axis_types=(jax.sharding.AxisType.Explicit,) * 3)
  with jax.set_mesh(explicit):  # shardings are in the types: left alone
    assert fsdp.gather_fp8_weight(x, ('embed', 'mlp')) is x
    acts = jnp.ones((8, 4))
    assert fsdp.shard_batch(acts) is acts


def test_shard_batch_pins_the_batch_axis():
  mesh = sharding.make_mesh((2, 4, 1))
  with jax.set_mesh(mesh):
    y = jax.jit(fsdp.shard_batch)(jnp.ones((8, 3, 4)))
    assert y.sharding.is_equivalent_to(jax.NamedSharding(
        mesh, P(('data', 'fsdp'), None, None)), 3)
    odd = jnp.ones((6, 4))  # 6 rows do not divide over 8 devices
    assert fsdp.shard_batch(odd) is odd


def _logged(run_dir):
  """{step: (loss, grad_norm)} from metrics.jsonl."""
  with open(os.path.join(run_dir, 'metrics.jsonl')) as f:
    return {r['step']: (r['loss'], r['grad_norm'])
            for r in map(json.loads, f) if 'loss' in r}


def test_checkpoint_from_4_devices_trains_on_with_2_and_1(tiny_config,
                                                          tmp_path):
  """Saved at step 3 with fsdp=4, restored with fsdp=2, fsdp=1 and data=2:
  steps 4-5 give the uninterrupted run's losses and gradient norms up to
  the reduction order of other shardings (2e-3 and 5e-3 relative, as the
  mesh test in train_test.py)."""
  ref = str(tmp_path / 'fsdp4')
  training.train(_config(tiny_config, 4, train={
      'steps': 5, 'checkpoint_every': 3, 'run_dir': ref}),
      devices=jax.devices()[:4])
  expected = _logged(ref)
  for name, n, mesh in [('fsdp2', 2, {}), ('fsdp1', 1, {}),
                        ('data2', 1, {'data': 2})]:
    run = str(tmp_path / name)
    fsdp_bench.copy_checkpoint(ref, 3, run)
    devices = jax.devices()[:n * mesh.get('data', 1)]
    summary = training.train(_config(tiny_config, n, mesh=mesh, train={
        'steps': 5, 'checkpoint_every': 3, 'run_dir': run}), devices=devices)
    assert summary['resumed_from'] == 3 and summary['step'] == 5, name
    logged = _logged(run)
    assert sorted(logged) == [4, 5], (name, logged)
    got, want = (np.array([d[4], d[5]]) for d in (logged, expected))
    np.testing.assert_allclose(got[:, 0], want[:, 0], rtol=2e-3,
                               err_msg=f'{name}: losses')
    np.testing.assert_allclose(got[:, 1], want[:, 1], rtol=5e-3,
                               err_msg=f'{name}: gradient norms')


@pytest.mark.gpu
@pytest.mark.parametrize('gather', [False, True])
def test_gpus_gather_layer_weights_and_reduce_scatter_grads(tiny_config,
                                                            gather):
  """On 2+ GPUs, the compiled step (after every XLA:GPU pass): each layer's
  weights all-gathered as 1-byte FP8 codes, never as float32 (float8: each
  device casts its shard; uint8 with the recipe's fp8_weight_gather), and
  the gradients reduce-scattered in bf16 (the FP8 wgrad GEMMs write bf16 where
  their result is summed over devices)."""
  n = jax.device_count()
  if n < 2 or 8 % n:
    pytest.skip(f'needs 2, 4 or 8 GPUs; found {n}')
  # vocab 512: the LM head's shape differs from every layer weight's.
  config = _config(tiny_config, n, model={'recipe': _gather(gather),
                                          'vocab_size': 512})
  setup = training.build(config, jax.devices())
  batch = jax.ShapeDtypeStruct((8, 32), jnp.int32)
  with jax.set_mesh(setup.mesh):
    hlo = setup.train_step.lower(setup.abstract_state, batch,
                                 batch).compile().as_text()
  colls = fsdp_bench.collectives(hlo)
  print(fsdp_bench.summarize(colls))
  params = setup.abstract_state['params']
  layers = {tuple(sorted(s[1:])) for s in _shapes(params['layers'])
            if len(s) == 3}
  dtypes = {dtype for c in colls if c['kind'] == 'all-gather'
            for dtype, shape in c['arrays'] if tuple(sorted(shape)) in layers}
  assert dtypes == ({'u8'} if gather else {'f8e4m3fn'}), dtypes
  shards = {tuple(sorted(s[:i] + (s[i] // n,) + s[i + 1:]))
            for s in (s[1:] for s in _shapes(params['layers']) if len(s) == 3)
            for i in range(2)}
  summed = [dtype for c in colls if c['kind'] == 'reduce-scatter'
            for dtype, shape in c['arrays'] if tuple(sorted(shape)) in shards]
  assert summed and set(summed) == {'bf16'}, summed


def test_a_hidden_size_that_splits_groups_still_shards_every_weight(
    tiny_config):
  """hidden 192 over fsdp=8 is 24 per shard, 1.5 groups of 16: the weights
  whose last axis is the hidden size shard another axis instead (never the
  layer axis, here divisible by 8 too), and train as on one device; the
  FP8 weight gather changes no number there either."""
  model = {'hidden_size': 192, 'intermediate_size': 256, 'num_layers': 8,
           'num_heads': 4, 'num_kv_heads': 2}
  tokens = np.random.default_rng(2).integers(0, 256, (8, 33), np.int32)
  runs = {}
  for n, gather in ((8, True), (8, False), (1, True)):
    config = _config(tiny_config, n,
                     model={**model, 'recipe': _gather(gather)})
    setup = training.build(config, jax.devices()[:n])
    if n == 8:
      for path, s in jax.tree_util.tree_leaves_with_path(
          setup.state_shardings['params']):
        name = jax.tree_util.keystr(path)
        if 'kernel' in name or name in ("['embed']", "['lm_head']"):
          assert list(s.spec).count('fsdp') == 1, (name, s.spec)
          assert 'layers' not in name or s.spec[0] is None, (name, s.spec)
    with jax.set_mesh(setup.mesh):
      state = setup.init_state()
      losses = []
      for _ in range(3):  # the first at learning rate 0 (warmup)
        state, metrics = setup.train_step(state, tokens[:, :-1],
                                          tokens[:, 1:])
        losses.append(float(metrics['loss']))
    runs[n, gather] = losses
  assert runs[8, True] == runs[8, False]
  assert runs[8, True][2] < runs[8, True][1]
  # Sharded reductions round differently. The first two losses come from
  # the initial params (the first step's learning rate is 0); the third
  # follows an update whose FP8 codes that rounding may have flipped.
  np.testing.assert_allclose(runs[8, True][:2], runs[1, True][:2], rtol=1e-3)
  np.testing.assert_allclose(runs[8, True][2], runs[1, True][2], rtol=5e-3)


def test_the_33b_config_shards_its_state_8_ways():
  """configs/llama_33b_fsdp.py on 8 devices (abstract: nothing is made):
  32.5B params, every weight sharded, about 38 GiB of params, FP8 moments
  and gradients a device."""
  config = training.load_config(os.path.join(
      os.path.dirname(__file__), '..', '..', 'configs', 'llama_33b_fsdp.py'))
  setup = training.build(config, jax.devices())
  params = setup.abstract_state['params']
  assert 32.5e9 < sum(x.size for x in jax.tree.leaves(params)) < 32.6e9
  for path, s in jax.tree_util.tree_leaves_with_path(
      setup.state_shardings['params']):
    if 'norm' not in jax.tree_util.keystr(path):
      assert list(s.spec).count('fsdp') == 1, (path, s.spec)
  total = sum(memory.state_bytes(setup)) / 2**30
  assert 37 < total < 39, total


def test_a_dropped_axis_never_goes_to_the_layer_axis():
  """The stack's layer axis (unnamed, here the largest) is passed over: the
  fsdp axis the embed axis cannot take goes to the heads axis; a norm's
  features and an axis nothing divides stay whole."""
  mesh = sharding.make_mesh((1, 8, 1), jax.devices())
  spec = lambda names, shape: sharding.logical_to_spec(
      names, shape, mesh, group_size=16)
  # 96 / 8 = 12 per shard splits the groups of 16.
  assert spec((None, 'heads', 'embed'), (64, 24, 96)) == P(None, 'fsdp', None)
  assert spec((None, 'norm', 'embed'), (64, 24, 96)) == P(None, None, None)
  assert spec((None, 'heads', 'embed'), (64, 20, 96)) == P(None, None, None)
  assert spec((None, 'heads', 'embed'), (64, 24, 128)) == P(None, None,
                                                            'fsdp')
