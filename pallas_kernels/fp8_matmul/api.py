"""Public FP8 matmul: out = (a @ b.T) * a_scale * b_scale, FP32 accumulation.

Forward passes use E4M3 x E4M3; dgrad and wgrad use E5M2 (gradient) x E4M3.
Both operands are K-major: a is (M, K) and b is (N, K). Scales are either
scalars (per-tensor) or block scales: a per (row, 128 of K), b per (128 of
N, 128 of K) or per (row, 128 of K); each 128-K partial sum is then scaled
by its two scales as it is promoted to FP32.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from pallas_kernels import _common
from pallas_kernels import dispatch
from pallas_kernels.fp8_matmul import mosaic_gpu
from pallas_kernels.fp8_matmul import mosaic_gpu_block
from pallas_kernels.fp8_matmul import reference

E4M3 = jnp.dtype(jnp.float8_e4m3fn)
E5M2 = jnp.dtype(jnp.float8_e5m2)
_ALLOWED_PAIRS = ((E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2))
_OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
_DIMS = (((1,), (1,)), ((), ()))
BLOCK_K = reference.BLOCK_K


def _check_operand(name: str, x) -> None:
  if not hasattr(x, 'dtype') or not hasattr(x, 'shape'):
    raise ValueError(f'{name} must be an array, got {type(x).__name__}.')
  if x.ndim != 2:
    raise ValueError(f'{name} must be 2-D, got shape {x.shape}.')
  if jnp.dtype(x.dtype) not in (E4M3, E5M2):
    raise ValueError(
        f'{name} must be float8_e4m3fn or float8_e5m2, got {x.dtype}; quantize'
        ' it first (clip to the format\'s max, then cast).')
  for axis, dim in zip(('rows', 'K'), x.shape):
    if dim <= 0 or dim % 16:
      raise ValueError(
          f'{name}.shape = {x.shape}: {axis} = {dim} must be a positive'
          ' multiple of 16; pad the operand.')


def _is_block_scale(s) -> bool:
  return getattr(s, 'ndim', 0) == 2


def _check_scale(name: str, s) -> jax.Array:
  if isinstance(s, (int, float)) and not isinstance(s, bool):
    return jnp.asarray(s, jnp.float32)
  if not hasattr(s, 'dtype') or not hasattr(s, 'shape'):
    raise ValueError(f'{name} must be a float32 scalar, got {type(s)}.')
  if s.shape != ():
    raise ValueError(
        f'{name} must be a float32 scalar of shape (), got shape {s.shape};'
        ' block scales are 2-D (see fp8_matmul), and both operands need them.')
  if jnp.dtype(s.dtype) != jnp.float32:
    raise ValueError(f'{name} must be float32, got {s.dtype}.')
  return s


def _xla_matmul(a, b, scale, out_dtype, c=None):
  """XLA path: cuBLASLt FP8 precise accumulation on GPU, exact f32 on CPU.

  The result (a @ b.T) * scale is rounded once to out_dtype. On GPU the
  scale multiplies the GEMM's result in out_dtype, the one form that XLA's
  GEMM rewriter folds whole into cuBLASLt's float32 scale operand (the
  scale's cast is looked through): one GEMM, its result written once. A
  float32 multiply of a BF16 result folds nothing, and a float32 result
  cast to BF16 leaves the cast: a pass over the result wherever no consumer
  fusion takes the multiply in (in the 1b train step, within the noise of
  the step time). `tests/kernels/fp8_matmul_test.py` checks the fold in the
  compiled HLO.
  """
  # Under Explicit mesh axes a sharded K (wgrad's tokens) is summed across
  # its shards; None elsewhere (see `_common.dot_out_sharding`).
  out_sharding = _common.dot_out_sharding(a, b, 0, 0)
  if jax.default_backend() == 'gpu':
    acc = jax.lax.dot_general(
        a, b, _DIMS,
        precision=jax.lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32,
        preferred_element_type=out_dtype, out_sharding=out_sharding)
    out = acc * scale.astype(out_dtype)
    return out if c is None else out + c
  # The FP8 preset is GPU-only; FP8 products are exact in float32.
  acc = jax.lax.dot_general(
      a.astype(jnp.float32), b.astype(jnp.float32), _DIMS,
      precision=jax.lax.Precision.HIGHEST,
      preferred_element_type=jnp.float32, out_sharding=out_sharding)
  return reference.plus_c(acc * scale, c, out_dtype)


def _check_operands(a, b, a_scale, b_scale):
  """Validates fp8_matmul's operands; returns the product of the scales."""
  _check_operand_pair(a, b)
  a_scale = _check_scale('a_scale', a_scale)
  b_scale = _check_scale('b_scale', b_scale)
  return a_scale * b_scale


def _check_operand_pair(a, b) -> None:
  _check_operand('a', a)
  _check_operand('b', b)
  if a.shape[1] != b.shape[1]:
    raise ValueError(
        f'a (M, K) = {a.shape} and b (N, K) = {b.shape} must have the same K'
        ' (b is K-major: pass W, not W.T).')
  if (jnp.dtype(a.dtype), jnp.dtype(b.dtype)) not in _ALLOWED_PAIRS:
    raise ValueError(
        f'a.dtype={a.dtype}, b.dtype={b.dtype}: E5M2 x E5M2 is not'
        ' supported; use E4M3 for at least one operand.')


def _check_block_scales(a, b, a_scale, b_scale) -> None:
  """Validates block scales (see `fp8_matmul`)."""
  m, k = a.shape
  n = b.shape[0]
  kb = -(-k // BLOCK_K)
  nb = -(-n // BLOCK_K)
  for name, s in (('a_scale', a_scale), ('b_scale', b_scale)):
    if not _is_block_scale(s):
      raise ValueError(
          f'{name} has shape {getattr(s, "shape", ())}: with block scales'
          ' both a_scale and b_scale must be 2-D float32 arrays (or both'
          ' scalars for per-tensor scaling).')
    if jnp.dtype(s.dtype) != jnp.float32:
      raise ValueError(f'{name} must be float32, got {s.dtype}.')
  if a_scale.shape != (m, kb):
    raise ValueError(
        f'a_scale has shape {a_scale.shape}; for a {a.shape} it must be'
        f' (M, ceil(K / 128)) = {(m, kb)} (one scale per row per 128 of K).')
  if b_scale.shape not in ((nb, kb), (n, kb)):
    raise ValueError(
        f'b_scale has shape {b_scale.shape}; for b {b.shape} it must be'
        f' (ceil(N / 128), ceil(K / 128)) = {(nb, kb)} (128x128 blocks) or'
        f' (N, ceil(K / 128)) = {(n, kb)} (per row of b).')


def _xla_block_matmul(a, b, a_scale, b_scale, out_dtype, c=None):
  """The block-scaled 'xla' path: one FP8 dot per 128 of K, scaled, summed.

  On a GPU each 128-K dot runs on the FP8 tensor cores with
  DotAlgorithmPreset.ANY_F8_ANY_F8_F32 (exact products, FP32 accumulation
  over 128 terms): an honest FP8 emulation of the block-scaled kernel, never
  a BF16 GEMM, and cheaper in memory than float32 operands. Elsewhere the
  exact float32 reference (FP8 products are exact in float32).
  """
  if jax.default_backend() != 'gpu':
    return reference.fp8_matmul_block_reference(
        a, b, a_scale, b_scale, out_dtype=out_dtype, c=c)
  fp8_dot = lambda ab, bb: jax.lax.dot_general(
      ab, bb, _DIMS, precision=jax.lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32,
      preferred_element_type=jnp.float32)
  return reference.fp8_matmul_block_reference(
      a, b, a_scale, b_scale, out_dtype=out_dtype, block_dot=fp8_dot, c=c)


def _pallas_block_matmul(a, b, a_scale, b_scale, out_dtype, c=None):
  """Calls the Mosaic GPU kernel: K padded to 128 (zero codes, scale 1),
  b's scales per row of b unless N is a multiple of 128 (per 128x128 block
  then, the smaller operand)."""
  k = a.shape[1]
  n = b.shape[0]
  pad = -k % BLOCK_K
  if pad:
    a = jnp.pad(a, ((0, 0), (0, pad)))
    b = jnp.pad(b, ((0, 0), (0, pad)))
  if n % BLOCK_K or n < BLOCK_K:
    b_scale = reference.expand_b_scale(b_scale, n)
  return mosaic_gpu_block.fp8_matmul_block_scaled_mosaic(
      a, b, a_scale, b_scale, out_dtype=out_dtype, c=c)


def fp8_matmul_block_scaled(a: jax.Array, b: jax.Array, a_scale: jax.Array,
                            b_scale: jax.Array, *, out_dtype=jnp.bfloat16,
                            implementation: str | None = None,
                            c: jax.Array | None = None) -> jax.Array:
  """Block-scaled FP8 matmul (see `fp8_matmul`, which dispatches here)."""
  _check_operand_pair(a, b)
  _check_block_scales(a, b, a_scale, b_scale)
  _check_out(out_dtype, c, (a.shape[0], b.shape[0]))
  impl, _ = dispatch.resolve_implementation('fp8_matmul_block_scaled',
                                            implementation)
  if impl == 'pallas':
    return _pallas_block_matmul(a, b, a_scale, b_scale, out_dtype, c)
  return _xla_block_matmul(a, b, a_scale, b_scale, out_dtype, c)


def _check_out(out_dtype, c, shape) -> None:
  """Raises unless out_dtype is allowed and c is None or (M, N) of it."""
  if jnp.dtype(out_dtype) not in _OUT_DTYPES:
    raise ValueError(f'out_dtype must be bfloat16 or float32, got {out_dtype}.')
  if c is not None and (getattr(c, 'shape', None) != shape
                        or jnp.dtype(c.dtype) != jnp.dtype(out_dtype)):
    raise ValueError(
        f'c has shape {getattr(c, "shape", None)} and dtype'
        f' {getattr(c, "dtype", None)}; it must be the output\'s: {shape}'
        f' {jnp.dtype(out_dtype)}.')


def fp8_matmul(a: jax.Array, b: jax.Array, a_scale, b_scale, *,
               out_dtype=jnp.bfloat16,
               implementation: str | None = None,
               c: jax.Array | None = None) -> jax.Array:
  """FP8 matmul out = (a @ b.T) * a_scale * b_scale (+ c).

  With block scales (2-D a_scale and b_scale), out[m, n] = sum_kb
  (sum_{k in kb} a[m, k] b[n, k]) a_scale[m, kb] b_scale[., kb] over the
  128-wide blocks kb of K (K zero-padded to a multiple of 128), where b's
  scale is per 128x128 block, b_scale[n // 128, kb], when b_scale has
  ceil(N / 128) rows, and per row, b_scale[n, kb], when it has N rows (N is
  a multiple of 16, so the two shapes never coincide).

  Args:
    a: (M, K) float8_e4m3fn or float8_e5m2.
    b: (N, K) float8_e4m3fn or float8_e5m2, K-major like a. E5M2 x E5M2 is
      rejected (cuBLASLt has no such kernel).
    a_scale: () float32 dequantization scale of a (a Python float is
      taken), or block scales (M, ceil(K / 128)) float32.
    b_scale: () float32 dequantization scale of b, or block scales
      (ceil(N / 128), ceil(K / 128)) or (N, ceil(K / 128)) float32 (then
      a_scale must be block scales too).
    out_dtype: jnp.bfloat16 (default) or jnp.float32.
    implementation: 'xla' (cuBLASLt FP8 with precise FP32 accumulation on
      GPU, the scale applied in its epilogue, the result rounded once; an
      exact float32 dot elsewhere), 'pallas' (the Mosaic GPU wgmma kernel,
      Hopper only) or None (`pallas_kernels.dispatch`: 'xla', the
      measured-fastest). M, N and K must be multiples of 16. With block
      scales: 'xla' is an exact emulation (one FP8 dot per 128 of K on a
      GPU, exact float32 elsewhere), 'pallas' the Mosaic GPU block-scaled
      kernel, None 'pallas' on one Hopper GPU.
    c: None, or (M, N) out_dtype added to the scaled float32 product before
      its one rounding: in the GEMM's epilogue (cuBLASLt's C operand under
      'xla' on a GPU, the block-scaled Mosaic kernel's), after it with the
      per-tensor 'pallas' kernel.

  Returns:
    (M, N) array of out_dtype.

  Raises:
    ValueError: on a bad dtype, shape, scale, out_dtype or implementation.
  """
  if _is_block_scale(a_scale) or _is_block_scale(b_scale):
    return fp8_matmul_block_scaled(
        a, b, a_scale, b_scale, out_dtype=out_dtype,
        implementation=implementation, c=c)
  scale = _check_operands(a, b, a_scale, b_scale)
  _check_out(out_dtype, c, (a.shape[0], b.shape[0]))
  impl, _ = dispatch.resolve_implementation('fp8_matmul', implementation)
  if impl == 'xla':
    return _xla_matmul(a, b, scale, out_dtype, c)
  out = mosaic_gpu.fp8_matmul_mosaic(a, b, scale, out_dtype=out_dtype)
  return out if c is None else out + c
