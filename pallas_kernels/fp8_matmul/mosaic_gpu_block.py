"""Block-scaled FP8 matmul for Hopper GPUs in Pallas Mosaic GPU (wgmma, TMA).

  out[m, n] = sum_kb (sum_{k in kb} a[m, k] b[n, k]) * a_scale[m, kb]
                                                     * b_scale[., kb]

a (M, K) and b (N, K) are K-major FP8; kb runs over the K // 128 blocks of
128 along K. a_scale (M, K // 128) float32 holds one scale per row of a per
128 of K (1x128 tiles). b_scale is either per 128x128 block of b,
(cdiv(N, 128), K // 128), read as b_scale[n // 128, kb] (`'block'`: the
weights of the forward and dgrad GEMMs), or per row of b per 128 of K,
(N, K // 128), read as b_scale[n, kb] (`'row'`: the wgrad GEMM, whose
operands are both tiled along tokens). DeepSeek-V3's granularity.

The kernel is `mosaic_gpu`'s (persistent, warp specialized, TMA, wgmma,
FP32 promotion every 128 of K; overlapped tiles with THREE_WG_CONFIG, whose
stages `select_config` releases at the step's end: BLOCK_THREE_WG_CONFIG)
with the scales applied where each 128-K wgmma partial is promoted:
total += part * a_s[:, None] * b_s, with
- a_s: the warpgroup's rows of a_scale for that K block, pipelined by TMA
  beside the A and B tiles from a copy laid out (K // 128, M) in the wrapper
  (a (split_k, compute_wgs, wg_m) block per step, so that each warpgroup
  loads its own contiguous row vector, WGMMA row layout);
- b_s: for 'block' one float32 scalar per (N tile, K block), since
  block_n == 128, pipelined by TMA in a (split_k, 32) block of a
  (K // 128, N tiles) copy (32 N tiles: TMA moves whole 128 bytes per
  warpgroup) and read from SMEM after the wgmmas are issued (read from GMEM
  instead, it cost a noticeable share of the kernel's time: RESULTS.md
  "Block-scaled FP8 GEMM"); for 'row' a
  (block_n,) column vector per K block, pipelined by TMA from a
  (K // 128, N) copy (WGMMA column layout).
With 'block' b scales both are read a step ahead: each step's TMA brings
the next step's scales, which the step reads into the loop carry beside
the FP32 sum, so no promotion waits on a scale read from SMEM (it matters
most to GEMMs of few tiles, such as the 1b model's wgrads: RESULTS.md
"Block-scaled FP8 GEMM"); a tile's first step's come from GMEM.
The output is not scaled again: the FP32 sum (plus c, an optional (M, N)
operand in the output's dtype that each warpgroup copies by TMA through
its epilogue buffer) is cast and TMA-stored in column chunks, through one
SMEM buffer a warpgroup, or one a chunk for float32 outputs of three
warpgroups (`plan_smem`).

NaN and Inf propagate by IEEE rules: a NaN in a[m, :] or a_scale[m, :]
makes row m of the output NaN, a NaN in b_scale makes its block's (or
row's) output columns NaN; a zero scale times an Inf partial sum is NaN.

Needs Config(promote=True) with block_k == 128 * split_k (one scale per
wgmma partial) and block_n == 128 for 'block' scales (a multiple of 32
for 'row'). Runs on Hopper GPUs (tested with jax 0.11); imports anywhere.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NamedTuple

import jax
from jax import lax
import jax.numpy as jnp

from pallas_kernels import _mosaic
from pallas_kernels.fp8_matmul import mosaic_gpu
from pallas_kernels.fp8_matmul.mosaic_gpu import Config
from pallas_kernels.fp8_matmul.mosaic_gpu import pl
from pallas_kernels.fp8_matmul.mosaic_gpu import plgpu

SCALE_BLOCK = 128  # elements of K (and of N for 'block' scales) per scale
# N tiles per TMA block of 'block' b scales: 128 bytes of float32, the least
# a warpgroup's copy moves.
_B_TILES_PER_COPY = 32
GRANULARITIES = ('block', 'row')
_E4M3 = jnp.dtype(jnp.float8_e4m3fn)
_E5M2 = jnp.dtype(jnp.float8_e5m2)
_DTYPE_PAIRS = ((_E4M3, _E4M3), (_E5M2, _E4M3), (_E4M3, _E5M2))
_OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def validate_config(cfg: Config, b_granularity: str):
  """Raises ValueError unless `cfg` can run the block-scaled kernel."""
  cfg.validate(1)
  if not cfg.promote or cfg.block_k != SCALE_BLOCK * cfg.split_k:
    raise ValueError(
        f'{cfg}: block scales need promote=True and block_k == 128 *'
        ' split_k (one wgmma partial per 128 of K).')
  if b_granularity == 'block' and cfg.block_n != SCALE_BLOCK:
    raise ValueError(f'block_n={cfg.block_n}: \'block\' b scales need'
                     ' block_n == 128 (one scale per tile and K block).')
  if b_granularity == 'row' and cfg.block_n % 32:
    raise ValueError(f'block_n={cfg.block_n}: \'row\' b scales need a'
                     ' multiple of 32 (Mosaic GPU copies whole 128 bytes of'
                     ' float32 scales per warpgroup).')


# 'row' b scales hold a column vector per K block beside the FP32 sum and
# the wgmma partial: configs with room for it in registers (64 + 64
# accumulator registers per thread of 232 with two warpgroups, 48 + 48 of
# 160 with three), candidates for the benchmark (matmul.py --block
# --block-configs) until measured.
ROW_TWO_WG_CONFIG = Config(block_k=128, split_k=1, max_stages=4,
                           overlap_tiles=True)
ROW_THREE_WG_CONFIG = Config(block_m=192, block_n=96, block_k=128,
                             split_k=1, max_stages=4, compute_wgs=3,
                             pad_mn=False, early_release=True,
                             overlap_tiles=True)
# (config, speed per tile) per b_granularity, as mosaic_gpu.CANDIDATES.
# With 'block' scales three warpgroups gain more per tile than without
# (enough to pick them at the 1b model's 16384 x 2048 outputs, where the
# per-tensor kernel picks 128x128 tiles: benchmarks/RESULTS.md, "Block-scaled
# FP8 GEMM").
# With 'block' scales three warpgroups release a stage once its step is
# done, on one barrier: early release (THREE_WG_CONFIG) gives each of a
# stage's four inputs a barrier, and the memory warpgroup's waits and the
# compute warpgroups' arrives on the scales' two take issue slots from the
# promotion. Below EARLY_RELEASE_BELOW_WAVES waves of tiles early release is
# faster (measured with overlapped tiles, e.g. the 1b qkv wgrad; not
# understood): select_config keeps it there.
BLOCK_THREE_WG_CONFIG = dataclasses.replace(mosaic_gpu.THREE_WG_CONFIG,
                                            early_release=False)
EARLY_RELEASE_BELOW_WAVES = 2
BLOCK_CANDIDATES = ((mosaic_gpu.DEFAULT_CONFIG, 1.0),
                    (BLOCK_THREE_WG_CONFIG, 1.06))
CANDIDATES = {'block': BLOCK_CANDIDATES, 'row': mosaic_gpu.CANDIDATES}


def select_config(m: int, n: int, num_ctas: int | None = None, *,
                  b_granularity: str = 'block') -> Config:
  """The config of highest speed x wave efficiency among
  CANDIDATES[b_granularity] for an (m, n) output; three-warpgroup tiles
  that make fewer than EARLY_RELEASE_BELOW_WAVES waves release early."""
  num_ctas = num_ctas or mosaic_gpu._num_sms()  # pylint: disable=protected-access
  cfg = mosaic_gpu.select_config(m, n, num_ctas,
                                 candidates=CANDIDATES[b_granularity])
  tiles = pl.cdiv(m, cfg.block_m) * pl.cdiv(n, cfg.block_n)
  if (cfg == BLOCK_THREE_WG_CONFIG
      and tiles < EARLY_RELEASE_BELOW_WAVES * num_ctas):
    return mosaic_gpu.THREE_WG_CONFIG
  return cfg


def plan_smem(cfg: Config, out_dtype, scale_bytes: int):
  """(pipeline stages, epilogue columns per chunk, epilogue buffers) for
  the kernel, with `scale_bytes` of scales per stage.

  float32 outputs of three warpgroups get a buffer per chunk (the whole
  tile: no chunk then waits for another's store, and the next tile starts
  while they drain) at the cost of a stage (4 -> 3): the 1b step's
  wgrads run faster so. The others keep one: a second costs the
  two-warpgroup tiles a stage and made large bf16 outputs slower with as
  many stages (RESULTS.md "Block-scaled FP8 GEMM").
  """
  stages, epi_n = mosaic_gpu._plan_smem(  # pylint: disable=protected-access
      cfg, 1, jnp.dtype(out_dtype).itemsize, extra_stage_bytes=scale_bytes)
  if jnp.dtype(out_dtype) != jnp.float32 or cfg.compute_wgs != 3:
    return stages, epi_n, 1
  slots = cfg.block_n // epi_n
  try:
    tile_stages, _ = mosaic_gpu._plan_smem(  # pylint: disable=protected-access
        cfg, 1, 4, extra_stage_bytes=scale_bytes, out_cols=epi_n,
        out_slots=slots)
  except ValueError:  # the whole tile does not fit beside 2 stages
    return stages, epi_n, 1
  if tile_stages < max(3, stages - 1):  # measured at 4 -> 3 only
    return stages, epi_n, 1
  return tile_stages, epi_n, slots


def _promote_scaled(total, accs, add_scaled, release=()):
  """add_scaled(total, j-th wgmma result, j) for each wgmma, waiting for one
  at a time; arrives on the `release` barriers once all wgmmas are done,
  before the last add."""
  for j, acc in enumerate(accs):
    part = plgpu.wgmma_accumulator_load(acc, wait_n=len(accs) - 1 - j)
    if j == len(accs) - 1:
      for barrier in release:
        plgpu.barrier_arrive(barrier)
    total = add_scaled(total, part, j)
  return total


def _load_c(c_chunk, buffer, barrier):
  """A warpgroup's (wg_m, chunk) block of c as float32 in the WGMMA layout,
  copied by TMA through its epilogue buffer (free: `_store_chunks` waited
  for the store that read it last): rows past c's end come as zeros."""
  plgpu.copy_gmem_to_smem(c_chunk, buffer, barrier)
  plgpu.barrier_wait(barrier)
  return _mosaic.load(buffer, plgpu.Layout.WGMMA).astype(jnp.float32)


def _kernel(a_gmem, b_gmem, as_gmem, bs_gmem, *refs,
            cfg: Config, b_granularity: str, has_c: bool,
            m_iters: int, n_iters: int, k_iters: int, stages: int):
  """Kernel body. GMEM: a (Mp, Kp), b (Np, Kp) FP8; as (Kp / 128,
  M' / wg_m, wg_m) f32 (a_scale transposed); bs (Kp / 128, n') f32 for
  'block' (n' >= n_iters, a multiple of 4), (Kp / 128, N') for 'row'; with
  has_c, c (Mp, Np) in out's dtype, added to the sum; out (Mp, Np). Then
  out_smem, the epilogue's buffers (slots, compute_wgs, wg_m, chunk:
  `plan_smem`), and with has_c a barrier per compute warpgroup for c's
  copies into them. Scale rows past M' and columns past N'
  (or n') are read by TMA as zeros or as other scales (their outputs are
  clipped or sliced off)."""
  if has_c:
    c_gmem, out_gmem, out_smem, c_barriers = refs
  else:
    (out_gmem, out_smem), c_gmem, c_barriers = refs, None, None
  wg_m = cfg.wg_m
  blocks = cfg.split_k  # 128-K blocks (and wgmma partials) per step
  rows_b = b_granularity == 'row'
  overlap = mosaic_gpu.overlaps_tiles(cfg, k_iters, stages)
  # With 'block' b scales, step k's TMA brings step k + 1's scales (the
  # last step's are its own again, unread), which the step reads into the
  # loop carry for the next; step 0's come from GMEM at the tile start.
  ahead = not rows_b
  scale_k = (lambda k: jnp.minimum(k + 1, k_iters - 1)) if ahead else (
      lambda k: k)

  def scale_specs(mi, ni):
    """The scales' BlockSpecs for output tile (mi, ni), over the whole
    arrays: a block that reaches past an array's end is then no provably
    in-bounds block, and TMA fills the outside with zeros (a block of a
    sliced ref would be copied whole, past the end)."""
    specs = [plgpu.BlockSpec(
        (blocks, cfg.compute_wgs, wg_m), lambda k: (scale_k(k), mi, 0),
        memory_space=plgpu.SMEM)]
    if rows_b:
      specs.append(plgpu.BlockSpec(
          (blocks, cfg.block_n), lambda k: (k, ni), memory_space=plgpu.SMEM))
    else:
      specs.append(plgpu.BlockSpec(
          (blocks, _B_TILES_PER_COPY),
          lambda k: (scale_k(k), ni // _B_TILES_PER_COPY),
          memory_space=plgpu.SMEM))
    return specs
  num_inputs = 4  # a, b and their scales
  make_pipeline = lambda body, context, state=None, mi=0, ni=0: (
      mosaic_gpu._pipeline(  # pylint: disable=protected-access
          body, context, cfg=cfg, grid=(k_iters,), a_index=lambda k: (0, k),
          b_index=lambda k: (0, k), a_dtype=a_gmem.dtype,
          b_dtype=b_gmem.dtype, stages=stages,
          manual_release=cfg.early_release, state=state,
          extra_specs=scale_specs(mi, ni)))
  ignore = lambda *_, **__: None
  gmem_scales = (as_gmem, bs_gmem)
  rows_layout = plgpu.Layout.WGMMA.reduce(1)
  cols_layout = plgpu.Layout.WGMMA.reduce(0)
  # The FP32 sum is a tuple of (wg_m, chunk) column chunks, the epilogue's
  # store chunks: 'row' scales are then loaded a chunk at a time, next to
  # their adds, rather than all block_n of them held in registers at once
  # beside the sum and the partial (jax 0.10 cannot concatenate fragments).
  chunk = out_smem.shape[-1]
  chunks = [slice(c, c + chunk) for c in range(0, cfg.block_n, chunk)]
  bcast = lambda v, dim: lax.broadcast_in_dim(v, (wg_m, chunk), (dim,))
  zeros = lambda: tuple(
      plgpu.layout_cast(jnp.zeros((wg_m, chunk), jnp.float32),
                        plgpu.Layout.WGMMA) for _ in chunks)

  @functools.partial(
      pl.run_scoped,
      allocs=make_pipeline(ignore, ignore).get_allocations(
          a_gmem, b_gmem, *gmem_scales),
      tile_start=(plgpu.Barrier(num_arrivals=cfg.compute_wgs) if overlap
                  else None),
      collective_axes='wg',
  )
  def _scope(allocs, tile_start):
    wg = lax.axis_index('wg')

    @plgpu.nd_loop((m_iters * n_iters,), collective_axes='sm')
    def _tile_loop(info):
      (lin,) = info.index
      mi, ni = plgpu.planar_snake(
          lin, (m_iters, n_iters), 0 if cfg.grid_minor_m else 1,
          cfg.grid_tile_width)
      m_sl = pl.ds(mi * cfg.block_m, cfg.block_m)
      n_sl = pl.ds(ni * cfg.block_n, cfg.block_n)
      wg_sl = pl.ds(wg * wg_m, wg_m)

      def body(idx, *args):
        del idx  # the pipeline's BlockSpecs place each step's blocks
        smems, release, carry = (args[:num_inputs], args[num_inputs:-1],
                                 args[-1])
        a_smem, b_smem, as_smem, bs_smem = smems
        # A and B go back to TMA as soon as their wgmmas are done; the
        # scales once read (the adds may then interleave with their loads).
        ab_release, scale_release = release[:2], release[2:]

        def step(*accs):
          mosaic_gpu._issue_wgmmas(accs, a_smem, b_smem, wg_sl)  # pylint: disable=protected-access
          a_read = tuple(_mosaic.load(as_smem.at[j, wg], rows_layout)
                         for j in range(blocks))
          if ahead:  # this step's scales were read by the step before
            total_in, a_s, b_s = carry
            b_read = tuple(bs_smem[j, ni % _B_TILES_PER_COPY]
                           for j in range(blocks))
          else:
            total_in, a_s = carry, a_read

          def add_scaled(total, part, j):
            if rows_b:
              a_j = bcast(a_s[j], 0)
              return tuple(
                  t + part[:, cs] * bcast(_mosaic.load(bs_smem.at[j, cs],
                                                       cols_layout), 1) * a_j
                  for t, cs in zip(total, chunks))
            s = bcast(a_s[j] * b_s[j], 0)
            return tuple(t + part[:, cs] * s for t, cs in zip(total, chunks))

          total = _promote_scaled(total_in, accs, add_scaled, ab_release)
          for barrier in scale_release:
            plgpu.barrier_arrive(barrier)
          return (total, a_read, b_read) if ahead else total
        return pl.run_scoped(
            step, *[plgpu.ACC((wg_m, cfg.block_n), jnp.float32)] *
            cfg.split_k)

      def context(run_pipeline):
        if overlap:
          mosaic_gpu._line_up(tile_start)  # pylint: disable=protected-access
        if ahead:  # step 0's scales; rows past a_s's end read its last row
          row = jnp.minimum(mi * cfg.compute_wgs + wg, as_gmem.shape[1] - 1)
          a_0 = tuple(_mosaic.load(as_gmem.at[j, row], rows_layout,
                                   optimized=False)
                      for j in range(blocks))
          b_0 = tuple(bs_gmem[j, ni] for j in range(blocks))
          total = run_pipeline((zeros(), a_0, b_0))[0]
        else:
          total = run_pipeline(zeros())
        rows = pl.ds(mi * cfg.block_m + wg * wg_m, wg_m)
        out_tile = out_gmem.at[rows, n_sl]
        add_c = None
        if has_c:
          c_tile = c_gmem.at[rows, n_sl]
          add_c = lambda t, cs, buffer: t + _load_c(
              c_tile.at[:, cs], buffer, c_barriers.at[wg])
        buffers = [out_smem.at[s, wg] for s in range(out_smem.shape[0])]
        mosaic_gpu._store_chunks(zip(total, chunks), out_tile, buffers, add_c)  # pylint: disable=protected-access

      def run(state=None):
        make_pipeline(body, context, state, mi, ni)(
            a_gmem.at[m_sl, :], b_gmem.at[n_sl, :], *gmem_scales,
            allocations=allocs)

      if overlap:  # As mosaic_gpu._kernel: START, then STEADY pipelines.
        states = plgpu.PipelinePipeline
        lax.cond(info.local_index == 0, lambda: run(states.START),
                 lambda: run(states.STEADY))
      else:
        run()

  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def fp8_matmul_block_scaled_mosaic(
    a: jax.Array, b: jax.Array, a_scale: jax.Array, b_scale: jax.Array, *,
    b_granularity: str | None = None, out_dtype=jnp.bfloat16,
    config: Config | None = None, a_scale_transposed: bool = False,
    b_scale_transposed: bool = False, c: jax.Array | None = None
) -> jax.Array:
  """Block-scaled (a @ b.T) (+ c) on Hopper with Pallas Mosaic GPU.

  Args:
    a: (M, K) float8_e4m3fn or float8_e5m2, M a multiple of 16, K of 128.
    b: (N, K) float8 (K-major, like a), N a multiple of 16. E5M2 x E5M2 is
      rejected.
    a_scale: (M, K // 128) float32, the scale of a[m, 128 kb : 128 (kb + 1)];
      (K // 128, M) if a_scale_transposed.
    b_scale: float32, (cdiv(N, 128), K // 128) for b_granularity='block'
      (the scale of the 128x128 block b[128 nb :, 128 kb :]), or
      (N, K // 128) for 'row' (the scale of b[n, 128 kb : 128 (kb + 1)]);
      (K // 128, cdiv(N, 128)) or (K // 128, N) if b_scale_transposed.
    b_granularity: 'block' or 'row' (static); None: read from b_scale's
      shape (N scale rows: 'row', cdiv(N, 128): 'block').
    out_dtype: bfloat16 or float32.
    config: tiling; `select_config(M, N, b_granularity)` when None (see
      `validate_config`).
    a_scale_transposed, b_scale_transposed: the scales come K-block first,
      the layout the kernel reads: no transpose runs per call (when M is a
      multiple of 64, K // 128 of the config's split_k and, with 'block' b
      scales, cdiv(N, 128) of 4, nothing at all runs besides the kernel).
      A quantizer can write this layout directly; the 'block' scales of W
      serve W^T (dgrad) transposed this way.
    c: None, or (M, N) out_dtype added to the FP32 sum in the epilogue
      before the one rounding (a residual stream, another GEMM's part):
      no pass of its own over the output.

  Returns:
    (M, N) out_dtype: sum over kb of each 128-K partial sum (FP32, exact
    products, promoted every 128 of K) times a_scale[m, kb] times b's scale
    (plus c).
  """
  if plgpu is None:
    raise RuntimeError('jax.experimental.pallas.mosaic_gpu is unavailable.')
  if b_granularity is None:
    b_granularity = _granularity_of(b, b_scale, b_scale_transposed)
  m, n, k = _check_args(a, b, a_scale, b_scale, b_granularity, out_dtype,
                        a_scale_transposed, b_scale_transposed)
  if c is not None and (c.shape != (m, n)
                        or jnp.dtype(c.dtype) != jnp.dtype(out_dtype)):
    raise ValueError(f'c has shape {c.shape} and dtype {c.dtype}; it must be'
                     f' the output\'s, {(m, n)} {jnp.dtype(out_dtype)}.')
  cfg = config or select_config(m, n, b_granularity=b_granularity)
  validate_config(cfg, b_granularity)
  return _call_kernel(a, b, a_scale, b_scale, c, b_granularity,
                      jnp.dtype(out_dtype), cfg, a_scale_transposed,
                      b_scale_transposed, _Settings.now())


def _granularity_of(b, b_scale, transposed):
  """'row' or 'block' from b_scale's shape, or a ValueError."""
  n = getattr(b, 'shape', (0,))[0]
  shape = getattr(b_scale, 'shape', ())
  rows = shape[1 if transposed else 0] if len(shape) == 2 else None
  if rows == n:
    return 'row'
  if rows == pl.cdiv(n, SCALE_BLOCK):
    return 'block'
  raise ValueError(
      f'b_scale has shape {shape}: with b_granularity=None it needs N = {n}'
      f' (\'row\') or cdiv(N, 128) = {pl.cdiv(n, SCALE_BLOCK)} (\'block\')'
      f' scale {"columns" if transposed else "rows"}.')


def scale_shapes(m: int, n: int, k: int, b_granularity: str, *,
                 a_scale_transposed: bool = False,
                 b_scale_transposed: bool = False):
  """(a_scale shape, b_scale shape) for an (M, K) x (N, K) product."""
  kb = k // SCALE_BLOCK
  nb = n if b_granularity == 'row' else pl.cdiv(n, SCALE_BLOCK)
  a_shape = (kb, m) if a_scale_transposed else (m, kb)
  b_shape = (kb, nb) if b_scale_transposed else (nb, kb)
  return a_shape, b_shape


def _check_args(a, b, a_scale, b_scale, b_granularity, out_dtype,
                a_scale_transposed=False, b_scale_transposed=False):
  """Validates the arguments; returns (M, N, K)."""
  if b_granularity not in GRANULARITIES:
    raise ValueError(f'b_granularity must be \'block\' or \'row\', got'
                     f' {b_granularity!r}.')
  for name, x in (('a', a), ('b', b)):
    if getattr(x, 'ndim', None) != 2:
      raise ValueError(f'{name} must be 2-D, got shape'
                       f' {getattr(x, "shape", None)}.')
  if (jnp.dtype(a.dtype), jnp.dtype(b.dtype)) not in _DTYPE_PAIRS:
    raise ValueError(
        f'a, b dtypes {a.dtype}, {b.dtype}: need float8_e4m3fn x'
        ' float8_e4m3fn, float8_e5m2 x float8_e4m3fn or float8_e4m3fn x'
        ' float8_e5m2.')
  (m, k), (n, k2) = a.shape, b.shape
  if k != k2:
    raise ValueError(f'a {a.shape} and b {b.shape} must have the same K.')
  if k % SCALE_BLOCK or m % 16 or n % 16:
    raise ValueError(
        f'a {a.shape}, b {b.shape}: need K a multiple of 128 and M, N'
        ' multiples of 16 (pad the operands and their scales).')
  wants = scale_shapes(m, n, k, b_granularity,
                       a_scale_transposed=a_scale_transposed,
                       b_scale_transposed=b_scale_transposed)
  for name, s, want, flag in (
      ('a_scale', a_scale, wants[0], a_scale_transposed),
      ('b_scale', b_scale, wants[1], b_scale_transposed)):
    if getattr(s, 'shape', None) != want:
      raise ValueError(
          f'{name} has shape {getattr(s, "shape", None)}; need {want} for a'
          f' {a.shape}, b {b.shape}, b_granularity={b_granularity!r} and'
          f' {name}_transposed={flag}.')
    if jnp.dtype(s.dtype) != jnp.float32:
      raise ValueError(f'{name} must be float32, got {s.dtype}.')
  if jnp.dtype(out_dtype) not in _OUT_DTYPES:
    raise ValueError(f'out_dtype must be bfloat16 or float32, got'
                     f' {out_dtype}.')
  return m, n, k


def _pad_to(x, shape):
  """x zero-padded at the end of each dim to `shape` (x itself if equal)."""
  if x.shape == tuple(shape):
    return x
  return jnp.pad(x, [(0, t - s) for s, t in zip(x.shape, shape)])


def scale_layout(a_scale, b_scale, b_granularity: str, cfg: Config,
                 n_iters: int | None = None, *,
                 a_scale_transposed: bool = False,
                 b_scale_transposed: bool = False):
  """The scales as the kernel reads them, for a K padded to whole
  `cfg.block_k`:

  a_s: (Kp / 128, M' / wg_m, wg_m), a_s[kb, i, r] = a_scale[i * wg_m + r, kb]
    (one TMA block of (split_k, compute_wgs, wg_m) per K step and M tile).
    From (M, K / 128) scales, M' is M padded to whole tiles. From transposed
    ones it is M when M is a multiple of wg_m (a reshape: free), else
    padded; the last tile's block then reaches past M'.
  b_s: 'row': (Kp / 128, N') with b_s[kb, n] = b_scale[n, kb], N' = whole
    tiles (N itself from transposed scales). 'block': (Kp / 128, n') with
    b_s[kb, ni] = b_scale[ni, kb], n' = n_iters rounded up to a multiple of
    4 (TMA's 16-byte rows; blocks of 32 tiles reach past it, read as
    zeros); from transposed scales with n_iters % 4 == 0, the input.
  Zeros pad K (the padded K of a and b is zero too: 0 * 0, no NaN).
  n_iters: N tiles (default: cdiv(N, block_n)).
  """
  if a_scale_transposed:
    kb, m = a_scale.shape
  else:
    m, kb = a_scale.shape
  kbp = mosaic_gpu._round_up(kb * SCALE_BLOCK, cfg.block_k) // SCALE_BLOCK  # pylint: disable=protected-access
  if a_scale_transposed:
    mw = m if m % cfg.wg_m == 0 else mosaic_gpu._round_up(m, cfg.block_m)  # pylint: disable=protected-access
    a_s = _pad_to(a_scale, (kbp, mw))
  else:
    mw = mosaic_gpu._round_up(m, cfg.block_m)  # pylint: disable=protected-access
    a_s = _pad_to(a_scale.T, (kbp, mw))
  a_s = a_s.reshape(kbp, mw // cfg.wg_m, cfg.wg_m)
  if b_granularity == 'row':
    if b_scale_transposed:
      b_s = _pad_to(b_scale, (kbp, b_scale.shape[1]))
    else:
      n = b_scale.shape[0]
      n_iters = n_iters or pl.cdiv(n, cfg.block_n)
      b_s = _pad_to(b_scale.T, (kbp, n_iters * cfg.block_n))
  else:
    nb = b_scale.shape[1 if b_scale_transposed else 0]
    n_iters = n_iters or nb
    b_s = b_scale if b_scale_transposed else b_scale.T
    b_s = _pad_to(b_s, (kbp, mosaic_gpu._round_up(n_iters, 4)))  # pylint: disable=protected-access
  return a_s, b_s


class _Settings(NamedTuple):
  """What a kernel is traced with besides its arguments: the lowering
  semantics in force and the device's SM count."""

  lowering_semantics: object
  num_sms: int

  @classmethod
  def now(cls) -> _Settings:
    return cls(mosaic_gpu.LOWERING_SEMANTICS[0], mosaic_gpu._num_sms())  # pylint: disable=protected-access


# A jit, so that calls of equal shapes and static arguments share one trace
# and one lowering: unrolled layers then lower each distinct GEMM once, not
# once per call (~0.7 s each).
@functools.partial(jax.jit, static_argnames=(
    'b_granularity', 'out_dtype', 'cfg', 'a_scale_transposed',
    'b_scale_transposed', 'settings'))
def _call_kernel(a, b, a_scale, b_scale, c, b_granularity, out_dtype, cfg,
                 a_scale_transposed, b_scale_transposed, settings):
  """Pads to whole tiles, lays the scales out for TMA, runs the kernel."""
  m, k = a.shape
  n = b.shape[0]
  rows_b = b_granularity == 'row'
  if m < cfg.block_m or n < cfg.block_n:
    # Operands smaller than one tile are padded to it: unpadded, a 16 x 16
    # output with THREE_WG_CONFIG came back all zeros (the only shape whose
    # output and B were narrower than one TMA tile of each).
    cfg = dataclasses.replace(cfg, pad_mn=True)
  # Per stage: a_s (split_k, block_m) f32, b_s (split_k, block_n) f32 for
  # 'row', (split_k, 32) for 'block'.
  scale_bytes = cfg.split_k * 4 * (
      cfg.block_m + (cfg.block_n if rows_b else _B_TILES_PER_COPY))
  stages, epi_n, slots = plan_smem(cfg, out_dtype, scale_bytes)
  out_smem = plgpu.SMEM((slots, cfg.compute_wgs, cfg.wg_m, epi_n), out_dtype,
                        transforms=_mosaic.smem_transforms(out_dtype, epi_n))
  if cfg.pad_mn:
    mp = mosaic_gpu._round_up(m, cfg.block_m)  # pylint: disable=protected-access
    np_ = mosaic_gpu._round_up(n, cfg.block_n)  # pylint: disable=protected-access
  else:  # TMA stores need N to be whole columns of the output's SMEM tiling.
    mp = m
    np_ = mosaic_gpu._round_up(n, out_smem.transforms[0].tiling[1])  # pylint: disable=protected-access
  kp = mosaic_gpu._round_up(k, cfg.block_k)  # pylint: disable=protected-access
  if (mp, kp) != (m, k):
    a = jnp.pad(a, ((0, mp - m), (0, kp - k)))
  if (np_, kp) != (n, k):
    b = jnp.pad(b, ((0, np_ - n), (0, kp - k)))
  if c is not None and (mp, np_) != (m, n):
    c = jnp.pad(c, ((0, mp - m), (0, np_ - n)))
  m_iters = pl.cdiv(mp, cfg.block_m)
  n_iters = pl.cdiv(np_, cfg.block_n)
  k_iters = kp // cfg.block_k
  a_s, b_s = scale_layout(a_scale, b_scale, b_granularity, cfg, n_iters,
                          a_scale_transposed=a_scale_transposed,
                          b_scale_transposed=b_scale_transposed)
  f = plgpu.kernel(
      _mosaic.named('fp8_matmul_block', _kernel, cfg=cfg,
                    b_granularity=b_granularity, has_c=c is not None,
                    m_iters=m_iters, n_iters=n_iters, k_iters=k_iters,
                    stages=stages),
      out_type=jax.ShapeDtypeStruct((mp, np_), out_dtype),
      scratch_types=[out_smem] + ([] if c is None else [
          plgpu.Barrier(num_arrivals=1, num_barriers=cfg.compute_wgs)]),
      grid=(settings.num_sms,),
      grid_names=('sm',),
      num_threads=cfg.compute_wgs + 1,
      thread_name='wg',
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=settings.lowering_semantics),
  )
  out = f(a, b, a_s, b_s, *([] if c is None else [c]))
  return out[:m, :n] if (mp, np_) != (m, n) else out
