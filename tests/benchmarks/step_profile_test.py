"""benchmarks/step_profile.py's bookkeeping (the GPU traces themselves are
read on the GPU)."""

from benchmarks import step_profile


def test_nccl_kernels_are_collectives_not_reductions():
  for name in ('ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage)',
               'ncclDevKernel_ReduceScatter_Sum_f32_RING_LL'):
    assert step_profile.classify(name) == 'collectives (nccl)'
  assert step_profile.classify('input_reduce_fusion_3') == 'reduce'


def test_mosaic_kernels_are_classed_by_their_names():
  """The Mosaic GPU kernels carry their op's name (`_mosaic.named`): the
  GEMMs count as FP8 GEMMs, the block quantizer as a Pallas kernel."""
  for name in ('fp8_matmul_mosaic_gpu_kernel',
               'fp8_matmul_block_mosaic_gpu_kernel',
               'fp8_matmul_groups_mosaic_gpu_kernel'):
    assert step_profile.classify(name) == 'fp8 gemm'
  assert step_profile.classify('quantize_tiles_t_mosaic_gpu_kernel') == (
      'other')


def test_uncovered_counts_collective_time_that_no_kernel_hides():
  compute = [(0, 10), (5, 20), (30, 40)]  # busy 0-20 and 30-40
  assert step_profile.uncovered([(15, 35)], compute) == 10  # 20-30
  assert step_profile.uncovered([(15, 25), (18, 35)], compute) == 10
  assert step_profile.uncovered([(41, 45)], compute) == 4
  assert step_profile.uncovered([(2, 8)], compute) == 0
  assert step_profile.uncovered([], compute) == 0
  assert step_profile.uncovered([(0, 7)], []) == 7


def test_nccl_kernels_by_collective_with_their_time_not_hidden():
  names = {'ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage)':
           'all-gather',
           'ncclDevKernel_ReduceScatter_Sum_bf16_RING_LL': 'reduce-scatter',
           'ncclDevKernel_AllReduce_Sum_f32_RING_LL': 'all-reduce',
           'ncclDevKernel_SendRecv': 'send-recv', 'ncclKernel_Foo': 'other'}
  for name, kind in names.items():
    assert step_profile.nccl_kind(name) == kind
  compute = [(0, 10e6), (30e6, 40e6)]  # busy 0-10 and 30-40 ms
  collectives = [('all-gather', (5e6, 15e6)), ('all-gather', (35e6, 50e6)),
                 ('reduce-scatter', (12e6, 20e6))]
  got = step_profile.split_by_kind(collectives, compute, steps=2)
  assert got == {'all-gather': (1.0, 12.5, 7.5),  # (5 + 10) / 2 ms
                 'reduce-scatter': (0.5, 4.0, 4.0)}
  assert step_profile.split_by_kind([], compute, 1) == {}


def test_class_totals_sum_each_kernel_into_its_op_class(monkeypatch):
  kernels = {'ncclDevKernel_AllGather_RING_LL': 2.0,
             'nvjet_sm90_qqtst_128x128': 5.0, 'nvjet_sm90_bf16_64x64': 1.5,
             'input_reduce_fusion_3': 0.25, 'loop_add_fusion': 0.5,
             'loop_multiply_fusion': 0.75}
  monkeypatch.setattr(step_profile, 'kernel_totals',
                      lambda trace_dir, steps: kernels)
  assert step_profile.class_totals('unused', 3) == {
      'collectives (nccl)': 2.0, 'fp8 gemm': 5.0, 'gemm': 1.5,
      'reduce': 0.25, 'fusion (elementwise)': 1.25}


def test_gemm_shapes_read_m_n_k_from_compiled_hlo():
  """Each dot of a compiled step, whatever its operands' layouts, with the
  (M, N, K) its result and operands imply."""
  import jax  # noqa: PLC0415
  import jax.numpy as jnp  # noqa: PLC0415

  def f(a, b, w):
    h = jnp.tanh(a @ b.T)  # (64, 48) from K = 32
    return jax.lax.dot_general(h, w, (((0,), (0,)), ((), ())))  # K = 64

  args = [jnp.ones(s, jnp.float32) for s in ((64, 32), (48, 32), (64, 16))]
  hlo = jax.jit(f).lower(*args).compile().as_text()
  got = set(step_profile.gemm_shapes(hlo).values())
  assert {(64, 48, 32, 'f32 x f32'), (48, 16, 64, 'f32 x f32')} <= got
  assert all((m, n, k) in {(64, 48, 32), (48, 16, 64)}
             for m, n, k, _ in got), got


def test_gemm_table_groups_gemm_kernels_by_shape():
  hlo = '\n'.join((
      '%a = f8e4m3fn[256,64]{1,0} parameter(0)',
      '%b = f8e4m3fn[32,64]{1,0} parameter(1)',
      '%s = f32[] parameter(2)',
      '%mm.1 = (bf16[256,32]{1,0}, s8[1024]{0}) custom-call(%a, %b, %s),'
      ' custom_call_target="__cublas$lt$matmul$f8"',
      '%mm.2 = (bf16[256,32]{1,0}, s8[1024]{0}) custom-call(%a, %b, %s),'
      ' custom_call_target="__cublas$lt$matmul$f8"',
      '%sum = bf16[256,32]{1,0} add(%x, %y)'))
  ops = {('nvjet_sm90_qqtst_128x128', 'mm.1'): (2.0, 1.0),
         ('nvjet_sm90_qqtst_128x128', 'mm.2'): (4.0, 1.0),
         ('loop_add_fusion', 'sum'): (1.0, 1.0),
         ('fp8_matmul_block_mosaic_gpu_kernel', 'unknown'): (0.5, 2.0)}
  table = step_profile.gemm_table(ops, hlo)
  flops = 2 * 256 * 32 * 64
  assert table == [
      ('fp8 gemm', 'nvjet_sm90_qqtst_128x128', 256, 32, 64,
       'f8e4m3fn x f8e4m3fn', 2.0, 6.0, 2 * flops / 6e9),
      ('fp8 gemm', 'fp8_matmul_block_mosaic_gpu_kernel', 0, 0, 0, '', 2.0,
       0.5, 0.0)]


def test_kernel_and_op_stats_per_step_and_device(monkeypatch):
  """Kernel time per step and device, by kernel name and by the HLO
  instruction that launched it (the 'hlo_op' stat of a trace's event)."""
  import types  # noqa: PLC0415

  def event(name, us, op=None):
    return types.SimpleNamespace(
        name=name, duration_ns=us * 1e3, start_ns=0,
        stats=[('hlo_op', op)] if op else [])

  line = lambda *events: types.SimpleNamespace(events=list(events))
  devices = [[line(event('gemm', 100, 'mm.1'), event('gemm', 300, 'mm.2')),
              line(event('add', 50))],
             [line(event('gemm', 100, 'mm.1'), event('gemm', 300, 'mm.2'))]]
  monkeypatch.setattr(step_profile, '_gpu_streams', lambda trace_dir: devices)
  ops = step_profile.op_stats('unused', steps=2)  # ms, launches per step
  assert ops == {('gemm', 'mm.1'): (0.05, 0.5), ('gemm', 'mm.2'): (0.15, 0.5),
                 ('add', ''): (0.0125, 0.25)}
  assert step_profile.kernel_stats('unused', 2) == {'gemm': (0.2, 1.0),
                                                    'add': (0.0125, 0.25)}
