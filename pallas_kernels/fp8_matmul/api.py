"""Public FP8 matmul: out = (a @ b.T) * a_scale * b_scale, FP32 accumulation.

Forward passes use E4M3 x E4M3; dgrad and wgrad use E5M2 (gradient) x E4M3.
Both operands are K-major: a is (M, K) and b is (N, K). Scales are either
scalars (per-tensor) or block scales: a per (row, 128 of K), b per (128 of
N, 128 of K) or per (row, 128 of K); each 128-K partial sum is then scaled
by its two scales as it is promoted to FP32.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _common
from pallas_kernels.fp8_matmul import mosaic_gpu
from pallas_kernels.fp8_matmul import reference
from pallas_kernels.fp8_matmul import triton_peer
from pallas_kernels.quantize_per_group import reference as group_reference

E4M3 = jnp.dtype(jnp.float8_e4m3fn)
E5M2 = jnp.dtype(jnp.float8_e5m2)
_ALLOWED_PAIRS = ((E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2))
_OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
_IMPLEMENTATIONS = ('xla', 'pallas', 'triton')
_DIMS = (((1,), (1,)), ((), ()))
BLOCK_K = reference.BLOCK_K


@functools.cache
def pallas_available() -> bool:
  """True when the default device is a Hopper GPU and Mosaic GPU imports."""
  try:
    device = jax.devices()[0]
  except RuntimeError:
    return False
  if device.platform != 'gpu':
    return False
  capability = str(getattr(device, 'compute_capability', ''))
  if not capability.startswith('9.'):
    return False
  return mosaic_gpu.plgpu is not None


# implementation=None picks XLA (cuBLASLt FP8, precise accumulation) even on
# Hopper: measured in benchmarks/RESULTS.md (H100, fifth run), the Pallas
# kernel runs at 0.97x of bare cuBLASLt precise per GEMM (geometric mean,
# Llama-2-7B shapes) and faster than this XLA path with the extra scale
# pass it had then (the scale now rides in cuBLASLt's epilogue), but a
# Llama-2-7B layer in coat mode took 26.3 ms with it against 25.8 ms with
# XLA, and the 1b train step 243.6 against 244.3 ms: no gain
# beyond the noise. With overlapped tiles (eleventh run: 1.005x cuBLASLt
# precise per GEMM) the layer still took 25.9 against 25.0 ms and the step
# 238.3 against 239.9 ms. Opt in with 'pallas'.
PALLAS_IS_DEFAULT = False


def resolve_implementation(implementation: str | None, *,
                           pallas_is_default: bool | None = None) -> str:
  """Maps None to the measured-fastest path; checks the name.

  None gives 'pallas' on Hopper if `pallas_is_default` (default:
  PALLAS_IS_DEFAULT, False today), else 'xla'.
  """
  if implementation is None:
    if pallas_is_default is None:
      pallas_is_default = PALLAS_IS_DEFAULT
    return 'pallas' if pallas_is_default and pallas_available() else 'xla'
  if implementation not in _IMPLEMENTATIONS:
    raise ValueError(
        f'implementation must be None, \'xla\', \'pallas\' or \'triton\';'
        f' got {implementation!r}.')
  if implementation == 'pallas' and not pallas_available():
    raise ValueError(
        'implementation=\'pallas\' needs a Hopper (sm_90) GPU and jax\'s'
        ' Mosaic GPU backend; use implementation=\'xla\' or None here.')
  if implementation == 'triton':
    why = triton_peer.unavailable_reason()
    if why is not None:
      raise ValueError(
          f'implementation=\'triton\' cannot run here: {why} Use'
          ' implementation=\'xla\' or None here.')
  return implementation


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


def _block_kernel():
  """Part B's Mosaic GPU block-scaled kernel, or None if it is absent."""
  try:
    from pallas_kernels.fp8_matmul import mosaic_gpu_block  # noqa: PLC0415
  except ImportError:
    return None
  return getattr(mosaic_gpu_block, 'fp8_matmul_block_scaled_mosaic', None)


def _pallas_block_matmul(a, b, a_scale, b_scale, out_dtype, c=None):
  """Calls the Mosaic GPU kernel: K padded to 128 (zero codes, scale 1),
  b's scales per row of b unless N is a multiple of 128 (per 128x128 block
  then, the smaller operand)."""
  kernel = _block_kernel()
  if kernel is None:
    raise ValueError(
        'implementation=\'pallas\' with block scales needs'
        ' pallas_kernels/fp8_matmul/mosaic_gpu_block.py; use'
        ' implementation=\'xla\' or None here.')
  k = a.shape[1]
  n = b.shape[0]
  pad = -k % BLOCK_K
  if pad:
    a = jnp.pad(a, ((0, 0), (0, pad)))
    b = jnp.pad(b, ((0, 0), (0, pad)))
  if n % BLOCK_K or n < BLOCK_K:
    b_scale = reference.expand_b_scale(b_scale, n)
  return kernel(a, b, a_scale, b_scale, out_dtype=out_dtype, c=c)


# implementation=None with block scales: the Mosaic GPU kernel on Hopper
# when present (the 'xla' emulation runs one GEMM per 128 of K). The lead
# confirms it with benchmarks/matmul.py.
BLOCK_PALLAS_IS_DEFAULT = True


def _single_device() -> bool:
  return len(jax.devices()) == 1


def _resolve_block_implementation(implementation: str | None) -> str:
  """'pallas' (the Mosaic GPU kernel) or 'xla' (the emulation) for
  block-scaled GEMMs asked for with `implementation` (None: the default
  here: 'pallas' on one Hopper GPU)."""
  if implementation == 'triton':
    raise ValueError(
        "implementation='triton' has no block-scaled kernel; use 'xla',"
        " 'pallas' or None.")
  if implementation is None:
    # One device only: a pallas_call has no partitioning rule, so under a
    # multi-device jit it would be replicated (use 'pallas' in shard_map).
    use = (BLOCK_PALLAS_IS_DEFAULT and pallas_available()
           and _single_device() and _block_kernel() is not None)
    return 'pallas' if use else 'xla'
  return resolve_implementation(implementation)


def fp8_matmul_block_scaled(a: jax.Array, b: jax.Array, a_scale: jax.Array,
                            b_scale: jax.Array, *, out_dtype=jnp.bfloat16,
                            implementation: str | None = None,
                            c: jax.Array | None = None) -> jax.Array:
  """Block-scaled FP8 matmul (see `fp8_matmul`, which dispatches here)."""
  _check_operand_pair(a, b)
  _check_block_scales(a, b, a_scale, b_scale)
  _check_out(out_dtype, c, (a.shape[0], b.shape[0]))
  impl = _resolve_block_implementation(implementation)
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
      exact float32 dot elsewhere), 'pallas' (the
      Mosaic GPU wgmma kernel, Hopper only), 'triton' (a Triton-language
      kernel through jax_triton, Hopper only; `pip install jax-triton`) or
      None (the measured-fastest: xla). M, N and K must be multiples of 16.
      With block scales: 'xla' is an exact emulation (one FP8 dot per 128
      of K on a GPU, exact float32 elsewhere), 'pallas' the Mosaic GPU
      block-scaled kernel, None 'pallas' on Hopper when present.
    c: None, or (M, N) out_dtype added to the scaled float32 product before
      its one rounding: in the GEMM's epilogue (cuBLASLt's C operand under
      'xla' on a GPU, the block-scaled Mosaic kernel's), after it with the
      per-tensor 'pallas' and 'triton' kernels.

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
  impl = resolve_implementation(implementation)
  if impl == 'xla':
    return _xla_matmul(a, b, scale, out_dtype, c)
  if impl == 'pallas':
    out = mosaic_gpu.fp8_matmul_mosaic(a, b, scale, out_dtype=out_dtype)
  else:
    out = triton_peer.fp8_matmul_triton(a, b, scale, out_dtype=out_dtype)
  return out if c is None else out + c


# implementation=None for the grouped output picks the fused Pallas epilogue
# on Hopper: measured (benchmarks/RESULTS.md, "FP8 matmul with a grouped
# output"), it is 1.00-1.13x the fastest GEMM-then-quantize pair (cuBLASLt
# float32 out + the Pallas quantizer), since the float32 result never
# reaches memory.
GROUPS_PALLAS_IS_DEFAULT = True


def fp8_matmul_groups(a: jax.Array, b: jax.Array, a_scale, b_scale, *,
                      dtype='e4m3', implementation: str | None = None
                      ) -> tuple[jax.Array, jax.Array]:
  """FP8 matmul whose result is written as FP8 1x16 groups.

  y = (a @ b.T) * a_scale * b_scale in float32, returned as
  `quantize_per_group(y, 16, dtype)` would (linear, float32 scales): per 16
  consecutive columns of a row, scale = max |y| / fp8_max (1 for an all-zero
  group, NaN for a group holding NaN or Inf) and values = saturate(y / scale).

  Args:
    a, b, a_scale, b_scale: as `fp8_matmul`.
    dtype: FP8 format of the values, 'e4m3' (default) or 'e5m2'.
    implementation: 'xla' (`fp8_matmul` to float32, then the quantization as
      a separate XLA fusion), 'pallas' (the Mosaic GPU kernel quantizes in its
      epilogue: the float32 result never reaches memory; Hopper only) or None
      ('pallas' on Hopper, where it is the faster; 'xla' elsewhere).

  Returns:
    (values (M, N) FP8, scales (M, N // 16) float32).

  Raises:
    ValueError: on bad operands, dtype or implementation.
  """
  scale = _check_operands(a, b, a_scale, b_scale)
  dt = _common.fp8_dtype(dtype)
  if implementation == 'triton':
    raise ValueError(
        "fp8_matmul_groups has no 'triton' implementation; use 'xla' or"
        " 'pallas'.")
  impl = resolve_implementation(
      implementation, pallas_is_default=GROUPS_PALLAS_IS_DEFAULT)
  if impl == 'pallas':
    return mosaic_gpu.fp8_matmul_mosaic_groups(a, b, scale, dtype=dt)
  y = _xla_matmul(a, b, scale, jnp.float32)
  values, scales, _ = group_reference.quantize_per_group(
      y, mosaic_gpu.GROUP, dt, False, scale_dtype=jnp.float32)
  return values, scales
