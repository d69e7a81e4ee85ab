"""benchmarks/step_profile.py's bookkeeping (the GPU traces themselves are
read on the GPU)."""

from benchmarks import step_profile


def test_nccl_kernels_are_collectives_not_reductions():
  for name in ('ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage)',
               'ncclDevKernel_ReduceScatter_Sum_f32_RING_LL'):
    assert step_profile.classify(name) == 'collectives (nccl)'
  assert step_profile.classify('input_reduce_fusion_3') == 'reduce'


def test_uncovered_counts_collective_time_that_no_kernel_hides():
  compute = [(0, 10), (5, 20), (30, 40)]  # busy 0-20 and 30-40
  assert step_profile.uncovered([(15, 35)], compute) == 10  # 20-30
  assert step_profile.uncovered([(15, 25), (18, 35)], compute) == 10
  assert step_profile.uncovered([(41, 45)], compute) == 4
  assert step_profile.uncovered([(2, 8)], compute) == 0
  assert step_profile.uncovered([], compute) == 0
  assert step_profile.uncovered([(0, 7)], []) == 7
