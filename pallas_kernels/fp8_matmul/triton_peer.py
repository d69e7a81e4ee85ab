"""FP8 matmul in the Triton language through `jax_triton` (a benchmark peer).

out = (a @ b.T) * scale for a (M, K) and b (N, K), both K-major FP8
(E4M3 x E4M3, E5M2 x E4M3 or E4M3 x E5M2), FP32 accumulation, BF16 or F32
out. The kernel (`triton_peer_kernel.py`) follows the persistent matmul of
Triton's tutorial 09: grid = min(#SMs, #tiles) programs, each walking the
output tiles pid, pid + grid, ... in grouped order (bands of `group_m` tile
rows), with plain pointer loads that Triton pipelines into shared memory
(`num_stages`) and `tl.dot` lowered to Hopper wgmma. The scale is applied in
the epilogue, before the cast to the output dtype.

Accumulation: on sm_90 Triton's FP8 `tl.dot` defaults to fast accumulation
(`max_num_imprecise_acc_default = 2**30`: the wgmma partial sums are never
promoted, like cuBLASLt's fast mode). `Config.promote_every = 128` (the
default) passes `max_num_imprecise_acc=128`: each `block_k` step runs its
wgmmas into a fresh partial accumulator that is added to the FP32
accumulator every 128 of K, the interval of cuBLASLt's precise mode and of
the Mosaic GPU kernel. `promote_every=None` keeps Triton's fast default.

M, N and K need not divide the tiles: edge tiles reread valid rows, mask K
and mask the store, so no padded copies are made. `triton` and `jax_triton`
are imported on first use; without them `unavailable_reason()` says what to
install (`pip install jax-triton`, the `triton` extra of coat-jax).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib

import jax
import jax.numpy as jnp

FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2))
OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
INSTALL_HINT = (
    'pip install jax-triton (the `triton` extra: pip install'
    ' "coat-jax[triton]"); it needs triton and a CUDA jaxlib')
_SMEM_LIMIT = 227 * 1024  # bytes of shared memory one Hopper CTA may use


def _pow2(x: int) -> bool:
  return x > 0 and x & (x - 1) == 0


@dataclasses.dataclass(frozen=True)
class Config:
  """Tiling and launch parameters of the Triton kernel.

  Attributes:
    block_m: rows of an output tile (power of 2, >= 64).
    block_n: columns of an output tile (power of 2, 16..256).
    block_k: K per pipelined step (power of 2, >= 32).
    group_m: tile rows per band of the grouped tile order (L2 reuse).
    num_warps: 4 or 8 (one or two warpgroups).
    num_stages: shared-memory pipeline depth.
    promote_every: add the wgmma partial sums to the FP32 accumulator every
      this many of K (a multiple of 32, <= block_k); None: Triton's fast
      accumulation (no promotion, as cuBLASLt's fast mode).
    flatten: flatten the tile and K loops into one pipelined loop.
  """

  block_m: int = 128
  block_n: int = 128
  block_k: int = 128
  group_m: int = 8
  num_warps: int = 8
  num_stages: int = 4
  promote_every: int | None = 128
  flatten: bool = True

  def validate(self, out_itemsize: int = 2) -> None:
    """Raises ValueError on a config the kernel cannot run.

    Args:
      out_itemsize: bytes per output element (2: bfloat16, 4: float32); the
        epilogue stages the output tile through shared memory.
    """
    if not _pow2(self.block_m) or self.block_m < 64:
      raise ValueError(f'block_m={self.block_m}: a power of 2, >= 64.')
    if not _pow2(self.block_n) or not 16 <= self.block_n <= 256:
      raise ValueError(f'block_n={self.block_n}: a power of 2 in 16..256.')
    if not _pow2(self.block_k) or self.block_k < 32:
      raise ValueError(f'block_k={self.block_k}: a power of 2, >= 32.')
    if self.group_m < 1:
      raise ValueError(f'group_m={self.group_m} must be >= 1.')
    if self.num_warps not in (4, 8):
      raise ValueError(f'num_warps={self.num_warps} must be 4 or 8.')
    if self.num_stages < 1:
      raise ValueError(f'num_stages={self.num_stages} must be >= 1.')
    p = self.promote_every
    if p is not None and (p <= 0 or p % 32 or p > self.block_k):
      raise ValueError(
          f'promote_every={p}: None or a multiple of 32 in 32..block_k'
          f' ({self.block_k}).')
    # Pipeline stages of FP8 A and B tiles plus the epilogue's output tile:
    # an upper bound of what Triton 3.6 allocated for sm_90 in every config
    # tried, exact for 128x128 tiles (160 KiB for the default config with
    # bf16 out, 192 KiB with f32).
    smem = (self.num_stages * (self.block_m + self.block_n) * self.block_k
            + self.block_m * self.block_n * out_itemsize)
    if smem > _SMEM_LIMIT:
      raise ValueError(
          f'{self.short()} with {out_itemsize}-byte outputs needs about'
          f' {smem} bytes of shared memory; at most {_SMEM_LIMIT} fit'
          ' (use fewer stages or a smaller block_k).')

  def short(self) -> str:
    """A compact label, e.g. '128x128x128 g8 w8 s4 p128'."""
    p = 'fast' if self.promote_every is None else f'p{self.promote_every}'
    flat = '' if self.flatten else ' noflat'
    return (f'{self.block_m}x{self.block_n}x{self.block_k} g{self.group_m}'
            f' w{self.num_warps} s{self.num_stages} {p}{flat}')


# Precise configs only (promotion every 128 of K, as cuBLASLt precise), tried
# per shape by benchmarks/matmul.py. ptxas for sm_90a (triton 3.6): 128x128
# tiles use ~167 registers per thread (the FP32 accumulator and the wgmma
# partial accumulator), 256x128 253 without spills; 128x256 spills. The
# 128x128x256 and 256x128 configs fit only with bfloat16 outputs.
DEFAULT_CONFIG = Config()
CONFIGS = (
    DEFAULT_CONFIG,
    Config(block_k=256, num_stages=3),
    Config(block_m=256, num_stages=3),
)
FAST_CONFIG = Config(block_n=256, num_stages=3, promote_every=None)


_MODULES = ('triton', 'jax_triton')  # imported in this order; the last used


def _import_jax_triton():
  """(jax_triton module, None) or (None, why it cannot be used)."""
  module = None
  for name in _MODULES:
    try:
      module = importlib.import_module(name)
    except Exception as e:  # pylint: disable=broad-except
      return None, f'import {name} failed ({type(e).__name__}: {e})'
  lib = getattr(module, 'triton_lib', None)
  if not getattr(lib, 'CAN_USE_TRITON', True):
    return None, 'jax_triton cannot use the installed triton'
  return module, None


def _gpu_reason() -> str | None:
  """None on an NVIDIA GPU of compute capability >= 9.0, else why not."""
  try:
    device = jax.devices()[0]
  except RuntimeError as e:
    return f'no jax device ({e})'
  if device.platform != 'gpu':
    return f'the default jax device is {device.platform}, not a CUDA GPU'
  capability = str(getattr(device, 'compute_capability', ''))
  try:
    major = int(capability.split('.')[0])
  except ValueError:
    return f'unknown compute capability {capability!r}'
  if major < 9:
    return f'compute capability {capability} < 9.0 (FP8 wgmma is Hopper+)'
  return None


@functools.cache
def unavailable_reason() -> str | None:
  """None when the Triton peer can run here, else a sentence saying why."""
  _, why = _import_jax_triton()
  if why is not None:
    return f'{why}; {INSTALL_HINT}.'
  why = _gpu_reason()
  if why is not None:
    return f'it needs an NVIDIA Hopper (sm_90) GPU: {why}.'
  return None


def available() -> bool:
  return unavailable_reason() is None


def _num_sms() -> int:
  try:
    return int(jax.devices()[0].core_count)
  except Exception:  # pylint: disable=broad-except
    return 132


def _cdiv(x: int, y: int) -> int:
  return -(-x // y)


def fp8_matmul_triton(a: jax.Array, b: jax.Array, scale, *,
                      out_dtype=jnp.bfloat16,
                      config: Config | None = None) -> jax.Array:
  """(a @ b.T) * scale with the persistent Triton kernel (jax_triton).

  Args:
    a: (M, K) float8_e4m3fn or float8_e5m2, M and K multiples of 16.
    b: (N, K) float8_e4m3fn or float8_e5m2 (K-major, like a).
    scale: () or (1,) float32, the product of the dequantization scales.
    out_dtype: bfloat16 or float32.
    config: tiling and launch parameters; DEFAULT_CONFIG when None.

  Returns:
    (M, N) array of out_dtype.

  Raises:
    RuntimeError: jax_triton, triton or a Hopper GPU is missing.
    ValueError: bad shapes, dtypes or config.
  """
  why = unavailable_reason()
  if why is not None:
    raise RuntimeError(f'The Triton FP8 matmul cannot run: {why}')
  if a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1]:
    raise ValueError(f'a (M, K) {a.shape} and b (N, K) {b.shape} mismatch.')
  if jnp.dtype(a.dtype) not in FP8_DTYPES or (
      jnp.dtype(b.dtype) not in FP8_DTYPES):
    raise ValueError(f'a, b must be FP8; got {a.dtype}, {b.dtype}.')
  if jnp.dtype(out_dtype) not in OUT_DTYPES:
    raise ValueError(f'out_dtype must be bfloat16 or float32: {out_dtype}.')
  cfg = config or DEFAULT_CONFIG
  cfg.validate(jnp.dtype(out_dtype).itemsize)
  jt, _ = _import_jax_triton()
  kernel_lib = importlib.import_module(
      'pallas_kernels.fp8_matmul.triton_peer_kernel')
  m, k = a.shape
  n = b.shape[0]
  num_tiles = _cdiv(m, cfg.block_m) * _cdiv(n, cfg.block_n)
  grid = min(_num_sms(), num_tiles)
  s = jnp.reshape(jnp.asarray(scale, jnp.float32), (1,))
  return jt.triton_call(
      a, b, s,
      kernel=kernel_lib.fp8_matmul_kernel,
      out_shape=jax.ShapeDtypeStruct((m, n), out_dtype),
      grid=(grid,),
      name='coat_fp8_matmul_triton',
      num_warps=cfg.num_warps,
      num_stages=cfg.num_stages,
      M=m, N=n, K=k,
      BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
      GROUP_M=cfg.group_m, NUM_PROGRAMS=grid,
      FAST_ACCUM=cfg.promote_every is None,
      PROMOTE_EVERY=cfg.promote_every or 0,
      EVEN_K=k % cfg.block_k == 0,
      EVEN_MN=m % cfg.block_m == 0 and n % cfg.block_n == 0,
      INT64=max(m * k, n * k, m * n) >= 2**31,
      FLATTEN=cfg.flatten,
  )
