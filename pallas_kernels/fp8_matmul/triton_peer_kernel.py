"""Triton-language kernel of the FP8 matmul peer; imports triton.

Only `triton_peer` imports this module, when the kernel is first called, so
the package imports where triton is missing. See `triton_peer` for the
design; the launch parameters (grid, constexprs) are set there.
"""

import triton
import triton.language as tl


@triton.jit
def _tile_coords(tile_id, num_pid_in_group, num_pid_m,
                 GROUP_M: tl.constexpr):
  """Grouped order: bands of GROUP_M tile rows, walked column by column."""
  group_id = tile_id // num_pid_in_group
  first_pid_m = group_id * GROUP_M
  group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
  pid_m = first_pid_m + (tile_id % group_size_m)
  pid_n = (tile_id % num_pid_in_group) // group_size_m
  return pid_m, pid_n


@triton.jit
def fp8_matmul_kernel(
    a_ptr, b_ptr, scale_ptr, c_ptr,
    M: tl.constexpr, N: tl.constexpr, K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
    FAST_ACCUM: tl.constexpr, PROMOTE_EVERY: tl.constexpr,
    EVEN_K: tl.constexpr, EVEN_MN: tl.constexpr, INT64: tl.constexpr,
    FLATTEN: tl.constexpr):
  """c (M, N) = (a (M, K) @ b (N, K).T) * scale[0]; persistent.

  a_ptr, b_ptr: FP8 (fp8e4nv or fp8e5), row-major, K contiguous.
  scale_ptr: (1,) fp32. c_ptr: (M, N) bf16 or fp32, row-major.
  Program p computes tiles p, p + NUM_PROGRAMS, ... in grouped order.
  """
  start_pid = tl.program_id(axis=0)
  num_pid_m = tl.cdiv(M, BLOCK_M)
  num_pid_n = tl.cdiv(N, BLOCK_N)
  k_tiles = tl.cdiv(K, BLOCK_K)
  num_tiles = num_pid_m * num_pid_n
  num_pid_in_group = GROUP_M * num_pid_n
  scale = tl.load(scale_ptr)
  offs_k0 = tl.arange(0, BLOCK_K)
  # The epilogue recomputes the tile from its own counter, as Triton's
  # persistent-matmul tutorial does, so that a flattened, pipelined loop
  # does not carry the mainloop's tile id into the epilogue.
  tile_id_c = start_pid - NUM_PROGRAMS

  for tile_id in tl.range(start_pid, num_tiles, NUM_PROGRAMS,
                          flatten=FLATTEN):
    pid_m, pid_n = _tile_coords(tile_id, num_pid_in_group, num_pid_m,
                                GROUP_M)
    offs_am = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_bn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    # Rows past the edge reread row 0; their results are never stored.
    offs_am = tl.where(offs_am < M, offs_am, 0)
    offs_bn = tl.where(offs_bn < N, offs_bn, 0)
    offs_am = tl.max_contiguous(tl.multiple_of(offs_am, BLOCK_M), BLOCK_M)
    offs_bn = tl.max_contiguous(tl.multiple_of(offs_bn, BLOCK_N), BLOCK_N)
    if INT64:
      offs_am = offs_am.to(tl.int64)
      offs_bn = offs_bn.to(tl.int64)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for ki in range(k_tiles):
      offs_k = ki * BLOCK_K + offs_k0
      # a tile (BLOCK_M, BLOCK_K) and b tile (BLOCK_K, BLOCK_N), both with K
      # contiguous in memory: the K-major operands FP8 wgmma needs.
      a_ptrs = a_ptr + (offs_am[:, None] * K + offs_k[None, :])
      b_ptrs = b_ptr + (offs_k[:, None] + offs_bn[None, :] * K)
      if EVEN_K:
        a = tl.load(a_ptrs)
        b = tl.load(b_ptrs)
      else:
        a = tl.load(a_ptrs, mask=offs_k[None, :] < K, other=0.0)
        b = tl.load(b_ptrs, mask=offs_k[:, None] < K, other=0.0)
      if FAST_ACCUM:
        acc = tl.dot(a, b, acc)
      else:
        # Every PROMOTE_EVERY of K the wgmma partial sums are added to the
        # fp32 accumulator in registers (Triton's Hopper FP8 lowering).
        acc = tl.dot(a, b, acc, max_num_imprecise_acc=PROMOTE_EVERY)

    tile_id_c += NUM_PROGRAMS
    pid_m, pid_n = _tile_coords(tile_id_c, num_pid_in_group, num_pid_m,
                                GROUP_M)
    offs_cm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_cn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    if INT64:
      offs_cm = offs_cm.to(tl.int64)
    c_ptrs = c_ptr + (offs_cm[:, None] * N + offs_cn[None, :])
    c = (acc * scale).to(c_ptr.dtype.element_ty)
    if EVEN_MN:
      tl.store(c_ptrs, c)
    else:
      tl.store(c_ptrs, c,
               mask=(offs_cm[:, None] < M) & (offs_cn[None, :] < N))
