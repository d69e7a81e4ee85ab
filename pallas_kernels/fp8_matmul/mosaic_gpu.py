"""FP8 matmul for Hopper GPUs in Pallas Mosaic GPU (wgmma, TMA).

out = (a @ b.T) * scale with a (M, K) and b (N, K), both K-major FP8.

The kernel is persistent (one CTA per SM) and warp specialized: one memory
warpgroup streams (block_m, block_k) tiles of A and (block_n, block_k)
tiles of B into shared memory with TMA, two or three compute warpgroups
each own 64 or more rows of the output tile and issue wgmma.
`select_config` picks the tiling per shape. B stays (N, K) in shared memory
with an (8, 128) tiling and a 128-byte swizzle and is fed to wgmma as
``b_smem.T``, which FP8 wgmma accepts since K is the fastest dimension of
both operands.

Hopper's FP8 tensor cores add partial products with reduced precision. With
``promote=True`` (the default) every ``block_k // split_k`` (default 128)
elements of K run into a fresh wgmma accumulator that is then added to an
FP32 accumulator in registers, as CUTLASS and DeepGEMM do: the error of
cuBLASLt's precise mode (the GPU tests hold it to that).
``promote=False`` keeps one wgmma accumulator for all of K (like cuBLASLt
fast accumulation).

Runs on Hopper GPUs (tested with jax 0.11); imports anywhere.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax import lax
import jax.numpy as jnp

from pallas_kernels import _common
from pallas_kernels import _mosaic
from pallas_kernels.quantize_per_group import reference as group_reference

try:  # Mosaic GPU is in jax >= 0.6; keep the module importable without it.
  from jax.experimental import pallas as pl
  from jax.experimental.pallas import mosaic_gpu as plgpu
except ImportError:  # pragma: no cover
  pl = None
  plgpu = None

FP8_DTYPES = (jnp.float8_e4m3fn, jnp.float8_e5m2)
_SMEM_BUDGET = 226 * 1024  # bytes of the 227 KiB a CTA may use
_MEMORY_REGISTERS = {2: 40, 3: 24}  # per number of compute warpgroups


@dataclasses.dataclass(frozen=True)
class Config:
  """Tiling of the kernel.

  Attributes:
    block_m: rows of the output tile of one CTA, block_m // compute_wgs per
      compute warpgroup (a multiple of 64 each).
    block_n: columns of the output tile (multiple of 8, <= 256).
    block_k: K per pipeline step (multiple of 128 bytes of input).
    max_stages: most shared-memory pipeline stages (fewer if they do not fit).
    promote: add each step's wgmma result to an FP32 register accumulator.
    split_k: with promote, split a step's K into this many wgmmas, each into
      its own accumulator, so that adding one overlaps the next wgmma; the
      promotion interval is then block_k // split_k.
    grid_minor_m: walk the tile grid with M as the minor dimension.
    grid_tile_width: width of the snake-order bands of the tile walk.
    pad_mn: zero-pad M and N to whole tiles in the wrapper (a copy of the
      operands and of the result). False leaves partial tiles to TMA, which
      fills loads past the edge with zeros and clips stores (the grouped
      output always pads).
    compute_wgs: compute warpgroups, 2 or 3 (with 3, 24 registers for the
      memory warpgroup leave 160 per compute thread: 128 for accumulators).
    early_release: with promote, release a stage's SMEM as soon as its
      wgmmas are done, before the FP32 adds (manual consumed barriers), so
      TMA refills it a little sooner.
    overlap_tiles: with promote, load a tile's first stages while the
      compute warpgroups finish the previous tile and write it (jax's
      pipeline of pipelines), and line the compute warpgroups up at each
      tile start, as the drain did: left to drift apart they starve each
      other of stages. Needs K steps that
      divide by the stages; other K drain between tiles as before.
  """

  block_m: int = 128
  block_n: int = 128
  block_k: int = 256
  max_stages: int = 4
  promote: bool = True
  split_k: int = 2
  grid_minor_m: bool = True
  grid_tile_width: int = 8
  pad_mn: bool = True
  compute_wgs: int = 2
  early_release: bool = False
  overlap_tiles: bool = False

  @property
  def wg_m(self) -> int:
    """Rows of the output tile per compute warpgroup."""
    return self.block_m // self.compute_wgs

  def validate(self, itemsize: int):
    if self.compute_wgs not in (2, 3):
      raise ValueError(f'compute_wgs={self.compute_wgs} must be 2 or 3.')
    if self.block_m % (64 * self.compute_wgs):
      raise ValueError(f'block_m={self.block_m} must be a multiple of'
                       f' {64 * self.compute_wgs} ({self.compute_wgs} compute'
                       ' warpgroups, 64 rows each).')
    if self.block_n % 8 or not 8 <= self.block_n <= 256:
      raise ValueError(f'block_n={self.block_n} must be 8..256, multiple of 8.')
    if (self.block_k * itemsize) % 128:
      raise ValueError(f'block_k={self.block_k} must span a multiple of 128 B.')
    if self.block_k % self.split_k or (
        (self.block_k // self.split_k * itemsize) % 128):
      raise ValueError('block_k / split_k must span a multiple of 128 B.')
    if self.split_k > 1 and not self.promote:
      raise ValueError('split_k > 1 needs promote=True.')
    if self.early_release and not self.promote:
      raise ValueError('early_release needs promote=True.')
    if self.overlap_tiles and not self.promote:
      raise ValueError('overlap_tiles needs promote=True.')
    wg_regs = self.wg_m * self.block_n // 128
    n_acc = 1 + self.split_k if self.promote else 1
    limit = {2: 216, 3: 128}[self.compute_wgs]
    if wg_regs * n_acc > limit:
      raise ValueError(
          f'{self} needs {wg_regs * n_acc} accumulator registers per thread;'
          f' at most {limit} fit.')


DEFAULT_CONFIG = Config()
# 192 x 128 tiles over three compute warpgroups: faster per tile than
# DEFAULT_CONFIG, but 192-row tiles can fill the last wave of tiles worse
# (M = 4096: 22 x 32 tiles are 5.3 waves of 132 SMs). Stages are released
# before the FP32 adds and tiles overlap, each measured no slower over the
# Llama shapes (the two-warpgroup default is slower with early release):
# RESULTS.md "FP8 GEMM: Pallas Mosaic GPU vs cuBLASLt".
THREE_WG_CONFIG = Config(block_m=192, block_k=128, split_k=1, max_stages=4,
                         compute_wgs=3, pad_mn=False, early_release=True,
                         overlap_tiles=True)
# (config, its speed per tile relative to DEFAULT_CONFIG) for select_config.
CANDIDATES = ((DEFAULT_CONFIG, 1.0), (THREE_WG_CONFIG, 1.03))
# Pinned: jax 0.11 on the GPU lowers with Warpgroup semantics by default,
# jax 0.10 (the CPU tests) with Lane. Lane lowers the grouped epilogue (jax
# 0.10's Warpgroup layout inference does not finish on it) and is what the
# CPU tests check. A list so a benchmark can compare the two.
LOWERING_SEMANTICS = [plgpu.LoweringSemantics.Lane if plgpu else None]


def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def _num_sms() -> int:
  try:
    return jax.devices()[0].core_count
  except Exception:  # pylint: disable=broad-except
    return 132


def select_config(m: int, n: int, num_ctas: int | None = None,
                  candidates=None) -> Config:
  """The candidate config of highest speed x wave efficiency for an (m, n)
  output, where wave efficiency is m * n over the tile area of all CTAs in
  the whole waves that the tiles take (the last wave may be partly idle).
  candidates: ((config, speed per tile), ...); default CANDIDATES."""
  num_ctas = num_ctas or _num_sms()

  def score(candidate):
    cfg, speed = candidate
    tiles = pl.cdiv(m, cfg.block_m) * pl.cdiv(n, cfg.block_n)
    waves = pl.cdiv(tiles, num_ctas)
    return speed * m * n / (waves * num_ctas * cfg.block_m * cfg.block_n)
  return max(candidates or CANDIDATES, key=score)[0]


def _epilogue_n(cfg: Config, out_itemsize: int, limit: int) -> int:
  """Columns stored per epilogue chunk: the widest divisor of block_n whose
  chunk fits `limit` bytes of SMEM and whose rows span a multiple of 32 B
  (the narrowest swizzle)."""
  fits = [d for d in range(8, cfg.block_n + 1, 8)
          if cfg.block_n % d == 0 and (d * out_itemsize) % 32 == 0
          and cfg.block_m * d * out_itemsize <= limit]
  if not fits:
    raise ValueError(f'block_n={cfg.block_n} has no epilogue chunk that fits.')
  return max(fits)


def _plan_smem(cfg: Config, in_itemsize: int, out_itemsize: int, *,
               out_cols: int | None = None, extra_bytes: int = 0,
               extra_stage_bytes: int = 0,
               out_slots: int = 1) -> tuple[int, int]:
  """(pipeline stages, epilogue columns) that fit shared memory, with
  `out_cols` epilogue columns if given, `out_slots` epilogue buffers of
  them and `extra_bytes` more for the epilogue, and `extra_stage_bytes`
  more per stage (further pipelined inputs)."""
  per_stage = ((cfg.block_m + cfg.block_n) * cfg.block_k * in_itemsize
               + extra_stage_bytes)
  best = None
  for limit in (32 * 1024, 16 * 1024):
    epi_n = out_cols or _epilogue_n(cfg, out_itemsize, limit)
    out_bytes = cfg.block_m * epi_n * out_itemsize * out_slots + extra_bytes
    stages = min(cfg.max_stages, (_SMEM_BUDGET - out_bytes) // per_stage)
    if best is None or stages > best[0]:
      best = (stages, epi_n)
  if best[0] < 2:
    raise ValueError(f'{cfg} does not fit shared memory with 2 stages.')
  return best


def _store_chunks(chunks, out_tile, buffers, add=None):
  """TMA-stores a warpgroup's tile to out_tile (GMEM) in column chunks,
  [(values (rows, cols) in WGMMA layout, column slice)], cast to
  out_tile's dtype, chunk j through SMEM buffers[j % len(buffers)]: a
  buffer is written once the store that last read it is done, while up to
  len(buffers) - 1 stores still read the others (len(buffers) divides the
  chunks: each tile's first chunk then finds its buffer's last store that
  many stores back). add(values, column slice, buffer), if given, runs
  once the buffer is free, before the cast (the block kernel adds c,
  copied in through the buffer)."""
  slots = len(buffers)
  for j, (values, cols) in enumerate(chunks):
    buffer = buffers[j % slots]
    plgpu.wait_smem_to_gmem(slots - 1, wait_read_only=True)
    if add is not None:
      values = add(values, cols, buffer)
    buffer[...] = values.astype(out_tile.dtype)
    plgpu.commit_smem()
    plgpu.copy_smem_to_gmem(buffer, out_tile.at[:, cols])


def _store_tile(acc, scale_ref, out_tile, out_smem, wg):
  """Scales warpgroup wg's f32 accumulator by scale_ref[0] (unless
  scale_ref is None), casts it to out_tile's dtype and TMA-stores it to
  out_tile (GMEM), through out_smem[wg] in column chunks."""
  epi_n = out_smem.shape[-1]
  y = acc if scale_ref is None else acc * scale_ref[0]
  y = y.astype(out_tile.dtype)
  cols = [slice(c, c + epi_n) for c in range(0, acc.shape[1], epi_n)]
  _store_chunks([(y[:, c], c) for c in cols], out_tile, [out_smem.at[wg]])


GROUP = 16  # columns per scale of the FP8 grouped output


def _store_groups(acc, scale_ref, values_tile, scales_tile, values_smem,
                  scales_smem, wg):
  """Writes warpgroup wg's scaled accumulator y (rows, n) as FP8 1x16 groups.

  The math of `quantize_per_group(y, 16, dtype)` (linear, float32 scales):
  per group, scale = amax |y| / fp8_max (1 for an all-zero group, NaN for a
  group holding NaN or Inf), values = saturate(y / scale). TMA-stores the
  codes (rows, n) to values_tile and the scales (rows, n / 16) to
  scales_tile, through values_smem[wg] and scales_smem[wg].
  """
  dtype = values_tile.dtype
  fmax = _common.fp8_max(dtype)
  y = acc * scale_ref[0]
  group = plgpu.layout_cast(lax.broadcasted_iota(jnp.int32, y.shape, 1),
                            plgpu.Layout.WGMMA) // GROUP
  den = y  # every column is overwritten by its group's scale below
  plgpu.wait_smem_to_gmem(0, wait_read_only=True)
  for j in range(y.shape[1] // GROUP):
    amax = jnp.max(jnp.abs(y[:, j * GROUP:(j + 1) * GROUP]), axis=1)
    scale = group_reference.store_scale(
        amax * group_reference.reciprocal(fmax), amax, jnp.float32)
    scales_smem[wg, :, j] = scale
    den = jnp.where(group == j, lax.broadcast_in_dim(scale, y.shape, (0,)), den)
  values_smem[wg] = _mosaic.saturated_codes(y, den, dtype)
  plgpu.commit_smem()
  plgpu.copy_smem_to_gmem(values_smem.at[wg], values_tile)
  plgpu.copy_smem_to_gmem(scales_smem.at[wg], scales_tile)


def _tile_writer(cfg: Config, s_gmem, refs):
  """write(acc, mi, ni, wg): stores warpgroup wg's rows of output tile
  (mi, ni). refs are the kernel's outputs, then their SMEM buffers:
  (out, out_smem) for `out_dtype`, or (values, scales, values_smem,
  scales_smem) for FP8 1x16 groups."""
  outs, smems = refs[:len(refs) // 2], refs[len(refs) // 2:]
  wg_m = cfg.wg_m
  rows = lambda mi, wg: pl.ds(mi * cfg.block_m + wg * wg_m, wg_m)
  cols = lambda ni: pl.ds(ni * cfg.block_n, cfg.block_n)
  if len(outs) == 1:
    (out,), (out_smem,) = outs, smems

    def write(acc, mi, ni, wg):
      _store_tile(acc, s_gmem, out.at[rows(mi, wg), cols(ni)], out_smem, wg)
  else:
    (values, scales), (values_smem, scales_smem) = outs, smems
    groups = cfg.block_n // GROUP

    def write(acc, mi, ni, wg):
      r = rows(mi, wg)
      _store_groups(acc, s_gmem, values.at[r, cols(ni)],
                    scales.at[r, pl.ds(ni * groups, groups)], values_smem,
                    scales_smem, wg)
  return write


def _zero_acc(cfg: Config):
  """A warpgroup's float32 (wg_m, block_n) zeros in WGMMA layout."""
  return plgpu.layout_cast(
      jnp.zeros((cfg.wg_m, cfg.block_n), jnp.float32),
      plgpu.Layout.WGMMA)


def _issue_wgmmas(accs, a_smem, b_smem, rows):
  """One wgmma per accumulator, each over its 1/len(accs) share of K, with
  the A rows `rows` (this warpgroup's)."""
  sub_k = a_smem.shape[1] // len(accs)
  for j, acc in enumerate(accs):
    ks = pl.ds(j * sub_k, sub_k)
    plgpu.wgmma(acc, a_smem.at[rows, ks], b_smem.at[:, ks].T)


def _promote(total, accs, release=()):
  """total + the wgmma results, waiting for one wgmma at a time; arrives on
  the `release` barriers once all wgmmas are done, before the last add."""
  for j, acc in enumerate(accs):
    part = plgpu.wgmma_accumulator_load(acc, wait_n=len(accs) - 1 - j)
    if j == len(accs) - 1:
      for barrier in release:
        plgpu.barrier_arrive(barrier)
    total = total + part
  return total


def _pipeline(body, context, *, cfg: Config, grid, a_index, b_index,
              a_dtype, b_dtype, stages: int, delay: int = 0,
              manual_release: bool = False, state=None, extra_specs=()):
  """The warp-specialized pipeline both kernels run: TMA streams
  (block_m, block_k) tiles of A at `a_index(*step)` and (block_n, block_k)
  tiles of B at `b_index(*step)` to the compute warpgroups, and the blocks
  of `extra_specs` (BlockSpecs of further inputs) after them. `state` is a
  `plgpu.PipelinePipeline` for a pipeline that follows or precedes another
  over the same allocations, or None for one that drains."""
  return plgpu.emit_pipeline_warp_specialized(
      body,
      grid=grid,
      memory_registers=_MEMORY_REGISTERS[cfg.compute_wgs],
      in_specs=[
          plgpu.BlockSpec(
              (cfg.block_m, cfg.block_k), a_index,
              transforms=_mosaic.smem_transforms(a_dtype, cfg.block_k),
              memory_space=plgpu.SMEM, delay_release=delay),
          plgpu.BlockSpec(
              (cfg.block_n, cfg.block_k), b_index,
              transforms=_mosaic.smem_transforms(b_dtype, cfg.block_k),
              memory_space=plgpu.SMEM, delay_release=delay),
          *extra_specs,
      ],
      wg_axis='wg',
      num_compute_wgs=cfg.compute_wgs,
      max_concurrent_steps=stages,
      manual_consumed_barriers=manual_release,
      compute_context=context,
      pipeline_state=state,
  )


def _kernel(a_gmem, b_gmem, s_gmem, *refs, cfg: Config, m_iters: int,
            n_iters: int, k_iters: int, stages: int):
  """Kernel body: a (M, K), b (N, K), s (1,) f32 in GMEM, then the outputs
  and their SMEM buffers (see `_tile_writer`)."""
  wg_m = cfg.wg_m
  write_tile = _tile_writer(cfg, s_gmem, refs)
  # Without promotion, keep one wgmma in flight and release its SMEM a step
  # later; with promotion each step waits for its own wgmma.
  delay = 0 if cfg.promote or k_iters < 2 else 1
  overlap = overlaps_tiles(cfg, k_iters, stages)
  make_pipeline = lambda body, context, state=None: _pipeline(
      body, context, cfg=cfg, grid=(k_iters,), a_index=lambda k: (0, k),
      b_index=lambda k: (0, k), a_dtype=a_gmem.dtype, b_dtype=b_gmem.dtype,
      stages=stages, delay=delay, manual_release=cfg.early_release,
      state=state)

  ignore = lambda *_, **__: None

  @functools.partial(
      pl.run_scoped,
      allocs=make_pipeline(ignore, ignore).get_allocations(a_gmem, b_gmem),
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

      def epilogue(acc):
        write_tile(acc, mi, ni, wg)

      if cfg.promote:
        def body(_, a_smem, b_smem, *release_and_carry):
          *release, carry = release_and_carry  # release: consumed barriers
          def step(*accs):
            _issue_wgmmas(accs, a_smem, b_smem, wg_sl)
            return _promote(carry, accs, release)
          return pl.run_scoped(
              step, *[plgpu.ACC((wg_m, cfg.block_n), jnp.float32)] *
              cfg.split_k)

        def context(run_pipeline):
          if overlap:
            _line_up(tile_start)
          epilogue(run_pipeline(_zero_acc(cfg)))
      else:
        def body(_, a_smem, b_smem, acc_ref):
          plgpu.wgmma(acc_ref, a_smem.at[wg_sl], b_smem.T)
          plgpu.wgmma_wait(delay)
          return acc_ref

        def context(run_pipeline):
          def acc_scope(acc_ref):
            run_pipeline(acc_ref)
            return acc_ref[...]
          epilogue(pl.run_scoped(
              acc_scope, plgpu.ACC((wg_m, cfg.block_n), jnp.float32)))

      def run(state=None):
        make_pipeline(body, context, state)(
            a_gmem.at[m_sl, :], b_gmem.at[n_sl, :], allocations=allocs)

      if overlap:
        # A CTA's first tile fills the stages, every later one refills them
        # as the last tile frees them. No STOP state: its only work, waiting
        # for the last stages to be consumed, guards a reuse of the barriers
        # that never comes (the kernel ends with the compute warpgroups).
        states = plgpu.PipelinePipeline
        lax.cond(info.local_index == 0, lambda: run(states.START),
                 lambda: run(states.STEADY))
      else:
        run()

  plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def overlaps_tiles(cfg: Config, k_iters: int, stages: int) -> bool:
  """Whether `_kernel` overlaps a CTA's tiles: `cfg.overlap_tiles` and whole
  rounds of stages per tile (jax's pipeline of pipelines needs them; a
  pipeline of fewer steps than stages uses one stage per step)."""
  return cfg.overlap_tiles and k_iters % min(stages, k_iters) == 0


def _line_up(barrier):
  """Waits until every compute warpgroup has arrived on `barrier` (a
  Barrier of one arrival per compute warpgroup)."""
  plgpu.barrier_arrive(barrier)
  plgpu.barrier_wait(barrier)


def fp8_matmul_mosaic(a: jax.Array, b: jax.Array, scale: jax.Array, *,
                      out_dtype=jnp.bfloat16,
                      config: Config | None = None) -> jax.Array:
  """(a @ b.T) * scale on Hopper with Pallas Mosaic GPU.

  Args:
    a: (M, K) float8_e4m3fn or float8_e5m2.
    b: (N, K) float8_e4m3fn or float8_e5m2 (K-major, like a).
    scale: () float32, the product of the two dequantization scales.
    out_dtype: bfloat16 or float32.
    config: tiling; `select_config(M, N)` when None.

  Returns:
    (M, N) array of out_dtype. Shapes not divisible by the tiles are padded
    with zeros here and the result is sliced back (see `Config.pad_mn`).
  """
  return _fp8_matmul_mosaic(a, b, scale, out_dtype, config)


def fp8_matmul_mosaic_groups(
    a: jax.Array, b: jax.Array, scale: jax.Array, *,
    dtype=jnp.float8_e4m3fn, config: Config | None = None,
) -> tuple[jax.Array, jax.Array]:
  """(a @ b.T) * scale written as FP8 1x16 groups by the kernel's epilogue.

  The float32 result y never reaches memory: each 16 columns of a row are
  quantized as `quantize_per_group(y, 16, dtype)` does (linear, float32
  scales), with its rounding on the GPU.

  Args:
    a, b, scale: as `fp8_matmul_mosaic` (N a multiple of 16).
    config: tiling; DEFAULT_CONFIG when None.
    dtype: the FP8 format of the values, float8_e4m3fn or float8_e5m2.

  Returns:
    (values (M, N) dtype, scales (M, N // 16) float32).
  """
  if jnp.dtype(dtype) not in FP8_DTYPES:
    raise ValueError(
        f'dtype must be float8_e4m3fn or float8_e5m2, got {dtype}.')
  if b.shape[0] % GROUP:
    raise ValueError(f'b.shape = {b.shape}: N must be a multiple of {GROUP}.')
  return _fp8_matmul_mosaic(a, b, scale, jnp.dtype(dtype), config)


def _fp8_matmul_mosaic(a, b, scale, out_dtype, config):
  """Runs the kernel; an FP8 out_dtype selects the grouped epilogue."""
  if plgpu is None:
    raise RuntimeError('jax.experimental.pallas.mosaic_gpu is unavailable.')
  if a.dtype != b.dtype and not _MIXED_FP8_WGMMA[0]:
    return _mixed_via_f16(a, b, scale, out_dtype)
  if a.dtype != b.dtype:
    try:
      return _call_kernel(a, b, scale, out_dtype, config)
    except ValueError as e:  # jax versions whose wgmma rejects mixed FP8.
      if 'dtype' not in str(e):
        raise
      _MIXED_FP8_WGMMA[0] = False
      return _mixed_via_f16(a, b, scale, out_dtype)
  return _call_kernel(a, b, scale, out_dtype, config)


# Whether plgpu.wgmma takes E5M2 x E4M3 operands; set False on first failure.
_MIXED_FP8_WGMMA = [True]
F16_CONFIG = Config(block_m=256, block_n=128, block_k=64, promote=False,
                    split_k=1)


def _mixed_via_f16(a, b, scale, out_dtype):
  """Fallback: both FP8 formats are exact in float16, whose wgmma is exact."""
  return _call_kernel(
      a.astype(jnp.float16), b.astype(jnp.float16), scale, out_dtype,
      F16_CONFIG)


def _call_kernel(a, b, scale, out_dtype, config):
  """The kernel call: pads to whole tiles and slices the outputs back."""
  return _jit_call_kernel(a, b, scale, jnp.dtype(out_dtype), config,
                          LOWERING_SEMANTICS[0], _num_sms())


# A jit, so that calls of equal shapes and static arguments share one trace
# and one lowering: unrolled layers then lower each distinct GEMM once.
@functools.partial(jax.jit, static_argnames=(
    'out_dtype', 'config', 'lowering_semantics', 'num_sms'))
def _jit_call_kernel(a, b, scale, out_dtype, config, lowering_semantics,
                     num_sms):
  grouped = jnp.dtype(out_dtype) in FP8_DTYPES
  # The grouped epilogue was measured with DEFAULT_CONFIG only.
  cfg = config or (DEFAULT_CONFIG if grouped else
                   select_config(a.shape[0], b.shape[0], num_sms))
  cfg.validate(jnp.dtype(a.dtype).itemsize)
  if grouped and cfg.block_n % 64:
    raise ValueError(f'block_n={cfg.block_n}: the grouped epilogue needs a'
                     ' multiple of 64 (whole 16 B rows of scales).')
  m, k = a.shape
  n, k2 = b.shape
  if k != k2:
    raise ValueError(f'a {a.shape} and b {b.shape} differ in K.')
  in_itemsize = jnp.dtype(a.dtype).itemsize
  wg_m = cfg.wg_m
  if grouped:
    stages = _plan_smem(cfg, in_itemsize, 1, out_cols=cfg.block_n,
                        extra_bytes=cfg.block_m * cfg.block_n // GROUP * 4)[0]
    out_smem = plgpu.SMEM(
        (cfg.compute_wgs, wg_m, cfg.block_n), out_dtype,
        transforms=_mosaic.smem_transforms(out_dtype, cfg.block_n))
    scratch = [out_smem, plgpu.SMEM(
        (cfg.compute_wgs, wg_m, cfg.block_n // GROUP), jnp.float32)]
  else:
    stages, epi_n = _plan_smem(cfg, in_itemsize,
                               jnp.dtype(out_dtype).itemsize)
    out_smem = plgpu.SMEM((cfg.compute_wgs, wg_m, epi_n), out_dtype,
                          transforms=_mosaic.smem_transforms(out_dtype, epi_n))
    scratch = [out_smem]
  if cfg.pad_mn or grouped:
    mp = _round_up(m, cfg.block_m)
    np_ = _round_up(n, cfg.block_n)
  else:  # TMA stores need N to be whole columns of the output's SMEM tiling.
    mp, np_ = m, _round_up(n, out_smem.transforms[0].tiling[1])
  kp = _round_up(k, cfg.block_k)
  if (mp, kp) != (m, k):
    a = jnp.pad(a, ((0, mp - m), (0, kp - k)))
  if (np_, kp) != (n, k):
    b = jnp.pad(b, ((0, np_ - n), (0, kp - k)))
  m_iters = pl.cdiv(mp, cfg.block_m)
  n_iters = pl.cdiv(np_, cfg.block_n)
  k_iters = kp // cfg.block_k
  out_types = (jax.ShapeDtypeStruct((mp, np_), out_dtype),)
  if grouped:
    out_types += (jax.ShapeDtypeStruct((mp, np_ // GROUP), jnp.float32),)
  f = plgpu.kernel(
      _mosaic.named('fp8_matmul_groups' if grouped else 'fp8_matmul',
                    _kernel, cfg=cfg, m_iters=m_iters, n_iters=n_iters,
                    k_iters=k_iters, stages=stages),
      out_type=out_types,
      scratch_types=scratch,
      grid=(num_sms,),
      grid_names=('sm',),
      num_threads=cfg.compute_wgs + 1,
      thread_name='wg',
      compiler_params=plgpu.CompilerParams(
          lowering_semantics=lowering_semantics),
  )
  s = jnp.reshape(scale.astype(jnp.float32), (1,))
  outs = f(a, b, s)
  if grouped:
    values, scales = outs
    return values[:m, :n], scales[:m, :n // GROUP]
  (out,) = outs
  return out[:m, :n] if (mp, np_) != (m, n) else out
