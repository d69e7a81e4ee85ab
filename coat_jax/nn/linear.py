"""Linear layers: BF16, or FP8 GEMMs that save only FP8 codes.

`fp8_dense` is a `jax.custom_vjp` whose forward quantizes the input and each
weight per-tensor to E4M3 just in time and keeps only FP8 codes and their
scales: the input's, and each weight's (quantized once per step, 1 byte a
param; requantizing in backward instead kept the float32 weight slices of
unrolled layers alive until then, 4 bytes a param, in XLA's schedule;
`coat_jax.models.remat` recomputes them under the layer scan). The
backward quantizes each output gradient per-tensor to E5M2 and runs dgrad
(dy . W) and wgrad (x^T . dy) as FP8 GEMMs. `fp8_matmul` needs K-major
operands, so the input and the output gradients are quantized together with
their FP8 transposes, in one pass (`pallas_kernels.quantize_per_tensor`),
and the input is saved transposed.

Several kernels may share one input (Q/K/V, gate/up): the input is then
quantized and saved once, and the parts of its gradient are summed in its
dtype (BF16), as a BF16 model's autodiff sums them. With `fused=True` they
are one projection instead (the Llama's Q/K/V by default): one scale for
the concatenated weights and one for the output gradients, each part of
which is quantized straight into its columns
(`quantize_per_tensor_parts`), so forward, dgrad and wgrad are one GEMM
each.
An input that its producer keeps for backward anyway (flash attention's
output, the out projection's input) is reused (`reuse_input`): the layer
saves it as it is and quantizes its transpose again in backward.

`scaling='block'` (DeepSeek-V3's granularity, docs/design.md) replaces the
per-tensor scales: the input and the output gradients in 1x128 tiles along
the GEMM's K, each with its transposed copy (the wgrad operands) from the
same pass: x^T tiled along the tokens (A: a scale per row per 128 tokens),
g^T in 128x128 blocks (B: the block-scaled kernel runs per-row B scales at
0.6x the speed of per-block ones); the weights in 128x128 blocks (one scale
serves W and W^T). Tokens are padded to a multiple of 128 there. A fused
projection (Q/K/V) keeps each part's own tiles and blocks, so it is one
GEMM each way with the numbers of the parts apart (but dgrad's sum, now in
float32 inside the GEMM; its gradient quantized from the parts in one pass,
`quantize_blockwise_parts`), and the dgrad parts of unfused kernels (gate/up)
are summed in the GEMMs' epilogues; a skip connection (`residual`) is added
in the forward GEMM's epilogue too: no XLA add runs beside the Mosaic
kernels.
"""

from collections.abc import Sequence
import functools
from types import MappingProxyType
from typing import Any

from flax import nnx
import jax
import jax.numpy as jnp
import numpy as np

from coat_jax import recipes
from coat_jax.nn import fsdp
from coat_jax.nn import partitioning
from coat_jax.nn.fp8_matmul import fp8_matmul
from coat_jax.nn.residuals import FP8_WEIGHT
from coat_jax.nn.residuals import after_grads
from coat_jax.nn.residuals import name_fp8_residuals
from coat_jax.nn.residuals import with_residuals
from coat_jax.nn.residuals import xla_quantizes
from pallas_kernels import _common
from pallas_kernels.quantize_blockwise import api as block_quant
from pallas_kernels.quantize_per_tensor import api as tensor_quant

default_kernel_init = nnx.initializers.lecun_normal()
default_bias_init = nnx.initializers.zeros_init()

_OUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7, 8, 9))
def _fp8_dense_2d(x, kernels, x_amax, kernel_dtypes, implementation,
                  gather_axes, reuse_input, fused, grad_amax_slot,
                  grad_dtype):
  """(M, K) x tuple of (K, N_i) -> tuple of (M, N_i); M % 16 == 0.
  x_amax: max |x| (float32 scalar) or None to compute it. kernel_dtypes:
  the kernels' dtypes (their gradients'), as backward keeps their FP8 codes
  only. fused: the kernels are one (K, sum N_i) projection (`fp8_dense`).
  grad_amax_slot (one kernel): a float32 zero follows the output; its
  cotangent is taken as max |g| of the output's gradient
  (`coat_jax.nn.norm`). grad_dtype: the output gradients' FP8 format."""
  return _fp8_dense_2d_fwd(x, kernels, x_amax, kernel_dtypes,
                           implementation, gather_axes, reuse_input, fused,
                           grad_amax_slot, grad_dtype)[0]


def _fp8_dense_2d_fwd(x, kernels, x_amax, kernel_dtypes, implementation,
                      gather_axes, reuse_input, fused, grad_amax_slot,
                      grad_dtype):
  del grad_dtype  # backward's
  outs, residuals = fp8_dense_2d_fwd(x, kernels, x_amax, kernel_dtypes,
                                     implementation, gather_axes,
                                     reuse_input, fused)
  if grad_amax_slot:
    outs += (jnp.zeros((), jnp.float32),)
  return outs, residuals


def _fp8_dense_2d_bwd(kernel_dtypes, implementation, gather_axes,
                      reuse_input, fused, grad_amax_slot, grad_dtype,
                      residuals, grads):
  grad_amaxes = None
  if grad_amax_slot:
    *grads, g_amax = grads
    grads, grad_amaxes = tuple(grads), (g_amax,)
  return fp8_dense_2d_bwd(kernel_dtypes, implementation, gather_axes,
                          reuse_input, fused, residuals, grads, grad_amaxes,
                          grad_dtype)


def _gathered(values, gather_axes, i, transposed=False):
  """Weight i's FP8 codes (K, N), or its transpose (N, K), all-gathered as
  FP8 under an FSDP mesh when gather_axes names its axes."""
  if gather_axes is None:
    return values
  axes = gather_axes[i]
  if transposed and axes is not None:
    axes = tuple(reversed(axes))
  return fsdp.gather_fp8_weight(values, axes)


def _amax(x, amax=None):
  """max |x| as given, else by an XLA reduction, which XLA fuses into the
  fusion that produces x where it can (RMSNorm: x is not read again for
  it)."""
  if amax is not None:
    return amax
  return tensor_quant.tensor_amax(x, implementation='xla')


def _quantize(x, dtype, amax, transpose=False):
  """`quantize_per_tensor(x, dtype, amax=amax, transpose=transpose)` of
  (M, N) rows: the Pallas kernel on Hopper GPUs (each device's rows under
  FSDP, `fsdp.row_wise`; faster in the 1b train step, RESULTS.md), XLA
  else."""
  def kernel(x, amax, *, implementation):
    return tensor_quant.quantize_per_tensor(
        x, dtype, amax=amax, transpose=transpose,
        implementation=implementation)
  return fsdp.row_wise(
      kernel, (x, amax), (fsdp.ROWS, fsdp.WHOLE),
      (fsdp.ROWS, fsdp.WHOLE, fsdp.COLS if transpose else None))


def _quantize_parts(parts, dtype, amaxes=None):
  """`quantize_per_tensor_parts(parts, dtype, transpose=True)` as
  `_quantize`, its amax the max of each part's (given, else `_amax`)."""
  amax = functools.reduce(jnp.maximum, [_amax(x) for x in parts]
                          if amaxes is None else amaxes)

  def kernel(amax, *parts, implementation):
    return tensor_quant.quantize_per_tensor_parts(
        parts, dtype, amax=amax, transpose=True,
        implementation=implementation)
  return fsdp.row_wise(
      kernel, (amax, *parts), (fsdp.WHOLE,) + (fsdp.ROWS,) * len(parts),
      (fsdp.ROWS, fsdp.WHOLE, fsdp.COLS))


def _quantize_with_transpose(x, dtype, amax=None):
  """(values (M, N), scale, values.T (N, M)): max |x| (`_amax`), then one
  pass over x (`_quantize`)."""
  return _quantize(x, dtype, _amax(x, amax), transpose=True)


def _outputs_and_residuals(outs, kept, fp8, weights):
  """(outputs, residuals) of a forward rule: `kept` (its own input, saved
  as it is), the input's FP8 codes `fp8`, computed before anything reads
  the outputs (`with_residuals`), and the `weights`' codes, named for the
  remat policies. The weights stay out of the barrier: under the layer
  scan with remat, FSDP then gathered each weight once more per layer in
  backward (2 GPUs, compiled: 12 all-gathers instead of 10) for no memory
  (the codes of local shards are small)."""
  outs = tuple(outs)
  if fp8:
    outs, fp8 = with_residuals(outs, fp8)
  return outs, (kept + fp8
                + (name_fp8_residuals(tuple(weights), FP8_WEIGHT),))


def _split_columns(a, widths):
  """a (R, sum widths) -> its column blocks (R, width) in order."""
  return tuple(jnp.split(a, np.cumsum(widths)[:-1], axis=1))


def fp8_dense_2d_fwd(x, kernels, x_amax, kernel_dtypes, implementation,
                     gather_axes, reuse_input, fused=False):
  """The forward rule of `fp8_dense` on (M, K) rows, M % 16 == 0: (outputs,
  residuals), for custom_vjps that run more around the GEMMs (the MLP's
  gate/up projections with SwiGLU, `coat_jax.nn.mlp`)."""
  if reuse_input:  # backward quantizes x^T again with this amax: same codes
    x_amax = _amax(x, x_amax)
    x_values, x_scale, _ = _quantize(x, 'e4m3', x_amax)
    kept, fp8 = (x,), (x_amax,)
  else:
    x_values, x_scale, x_t = _quantize_with_transpose(x, 'e4m3', x_amax)
    # x^T (K, M), the K-major operand of wgrad (as many bytes as x).
    kept, fp8 = (), (x_t, x_scale)
  # fused: one scale for all the kernels (their joint amax), one GEMM.
  w_amax = (functools.reduce(jnp.maximum, [
      tensor_quant.tensor_amax(w, implementation='xla') for w in kernels])
            if fused else None)
  outs, weights, w_ts = [], [], []
  for i, w in enumerate(kernels):
    # Quantized once per step: backward multiplies the same codes (local
    # shards under FSDP, gathered again there). XLA's quantizer: the
    # Pallas pass was slower on float32 weights in the 1b step (RESULTS.md
    # "e2e-1b"). Under a layer scan XLA would lay the stacked weights out
    # transposed for it: the scan asks for them row-major
    # (`coat_jax.models.llama._row_major_weights`).
    w_values, w_scale, w_t = tensor_quant.quantize_per_tensor(
        w, 'e4m3', amax=w_amax, transpose=True, implementation='xla')
    w_ts.append(_gathered(w_t, gather_axes, i, transposed=True))
    weights.append((w_values, w_scale))
  if fused:
    out = fp8_matmul(x_values, jnp.concatenate(w_ts, axis=0), x_scale,
                     weights[0][1], out_dtype=x.dtype,
                     implementation=implementation)
    outs = _split_columns(out, [w.shape[1] for w in kernels])
  else:
    outs = [fp8_matmul(x_values, w_t, x_scale, w_scale, out_dtype=x.dtype,
                       implementation=implementation)
            for w_t, (_, w_scale) in zip(w_ts, weights)]
  return _outputs_and_residuals(outs, kept, fp8, weights)


def fp8_dense_2d_bwd(kernel_dtypes, implementation, gather_axes,
                     reuse_input, fused, residuals, grads, grad_amaxes=None,
                     grad_dtype='e5m2'):
  """The backward rule of `fp8_dense` on rows: (dx, dkernels, None).
  grad_amaxes: max |g| of each output gradient if their producer computed
  them (a Pallas kernel, which XLA cannot fuse the reduction into), else
  None. grad_dtype: the FP8 format the output gradients are quantized to."""
  if grad_amaxes is None and not xla_quantizes():
    # Before the barrier, so that XLA can fuse each into the fusion that
    # produces g (the residual stream's gradients: RMSNorm backward and
    # the residual add). Not under FSDP (XLA's quantizer): there XLA then
    # kept more per device (docs/decisions.md#comment-figures).
    grad_amaxes = tuple(_amax(g) for g in grads)
  saved, grads = after_grads(residuals, grads)
  *saved, weights = saved
  if reuse_input:
    x, x_amax = saved
    _, x_scale, x_t = _quantize(x, 'e4m3', x_amax, transpose=True)
  else:
    x_t, x_scale = saved
  dtype = grads[0].dtype
  w_values = [_gathered(values, gather_axes, i)
              for i, (values, _) in enumerate(weights)]
  w_scales = [scale for _, scale in weights]
  if fused:
    # One (M, sum N_i) gradient with one scale, as the forward's weight,
    # each part quantized into its columns (no concatenation written).
    quantized = [_quantize_parts(grads, grad_dtype, grad_amaxes)]
    w_values, w_scales = [jnp.concatenate(w_values, axis=1)], w_scales[:1]
    kernel_dtypes = kernel_dtypes[:1]  # one dtype (`fp8_dense` checks)
  else:
    quantized = [_quantize_with_transpose(
        g, grad_dtype, None if grad_amaxes is None else grad_amaxes[i])
                 for i, g in enumerate(grads)]
  dx = None
  dkernels = []
  for w, w_scale, (g_values, g_scale, g_t), w_dtype in zip(
      w_values, w_scales, quantized, kernel_dtypes, strict=True):
    part = fp8_matmul(g_values, w, g_scale, w_scale, out_dtype=dtype,
                      implementation=implementation)
    # Summed in dtype, as a BF16 model's autodiff sums them: XLA adds most
    # into the next GEMM's C operand (float32 parts and their casts were
    # slower: docs/decisions.md#comment-figures).
    dx = part if dx is None else dx + part
    dkernels.append(_wgrad(x_t, g_t, x_scale, g_scale, w_dtype, dtype,
                           implementation))
  if fused:
    dkernels = _split_columns(dkernels[0], [g.shape[1] for g in grads])
  return dx, tuple(dkernels), None  # x_amax: a statistic, no gradient


def _wgrad(x_t, g_t, x_scale, g_scale, w_dtype, grad_dtype, implementation):
  """The weight gradient x^T g in w_dtype. Where it is summed over several
  devices (`fsdp.grads_summed_across_devices`), the GEMM writes grad_dtype
  (bf16) and the cast follows, so that XLA sums it over the devices in bf16,
  half float32's bytes, as a BF16 model's autodiff does."""
  out_dtype = (grad_dtype if fsdp.grads_summed_across_devices()
               else w_dtype)
  return fp8_matmul(x_t, g_t, x_scale, g_scale, out_dtype=out_dtype,
                    implementation=implementation).astype(w_dtype)


_fp8_dense_2d.defvjp(_fp8_dense_2d_fwd, _fp8_dense_2d_bwd)

# Tokens are padded to whole 1x128 tiles of the wgrad operands.
BLOCK_TOKENS = block_quant.TILE


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7, 8, 9))
def _fp8_dense_block_2d(x, kernels, addend, kernel_dtypes, implementation,
                        gather_axes, reuse_input, fused, has_addend,
                        grad_dtype):
  """Block-scaled `_fp8_dense_2d`: (M, K) x (K, N_i) -> (M, N_i), any M.

  The tokens are zero-padded to a multiple of 128 inside (zero rows add
  nothing to wgrad), so the padding leaves nothing else saved. fused: the
  kernels run as one (K, sum N_i) projection (`block_fusable`). addend:
  None, or (M, N_0) in x.dtype added to the one kernel's output in its
  GEMM's epilogue (`fp8_dense`'s residual); has_addend: addend is not None.
  grad_dtype: the output gradients' FP8 format.
  """
  return _fp8_dense_block_fwd(x, kernels, addend, kernel_dtypes,
                              implementation, gather_axes, reuse_input,
                              fused, has_addend, grad_dtype)[0]


def _pad_tokens(a):
  pad = -a.shape[0] % BLOCK_TOKENS
  return jnp.pad(a, ((0, pad), (0, 0))) if pad else a


def block_fusable(kernels) -> bool:
  """Whether block-scaled kernels can run as one projection with the codes
  and scales they have apart: every part but the last a whole number of
  128x128 weight blocks (and of 1x128 output-gradient tiles) wide, so no
  block or tile straddles two parts, and one dtype."""
  return (len(kernels) > 1
          and len({jnp.dtype(w.dtype) for w in kernels}) == 1
          and all(w.shape[1] % block_quant.TILE == 0 for w in kernels[:-1]))


def _tiles_with_transpose(x, dtype, transpose_block=(1, block_quant.TILE)):
  """(values (M, N), scales (M, N/128), values^T (N, M), scales^T) in one
  pass over x; scales^T (N, M/128) per 1x128 tile along the tokens, or
  (N/128, M/128) per 128x128 block with transpose_block (128, 128)."""
  return block_quant.quantize_blockwise(
      x, (1, block_quant.TILE), dtype, transpose=True,
      transpose_block=transpose_block, implementation=None)


def _weight_blocks(w):
  """W (K, N) in E4M3 128x128 blocks: (values (K, N), scales (K/128, N/128));
  W^T's blocks are the transposed ones.

  XLA's quantizer, not the Pallas kernel: XLA reads the layer's slice of the
  stacked weights inside its own fusions (one reduction, then one pass that
  writes W's and W^T's codes), while a Pallas call needs the slice copied
  out first (docs/decisions.md#comment-figures). The same codes either way.
  """
  values, scales, _, _ = block_quant.quantize_blockwise(
      w, (block_quant.TILE, block_quant.TILE), 'e4m3', implementation='xla')
  return values, scales


def _gemm_blocks(weights, gather_axes, fused):
  """The kernels' (values (K, N_i), scales (K/128, N_i/128)) as the GEMMs
  read them: all-gathered as FP8 under FSDP, and joined along N into one
  (K, sum N_i) projection if fused (the same codes and scales)."""
  blocks = [(_gathered(values, gather_axes, i), scales)
            for i, (values, scales) in enumerate(weights)]
  if fused:
    blocks = [tuple(jnp.concatenate(a, axis=1) for a in zip(*blocks))]
  return blocks


def _fp8_dense_block_fwd(x, kernels, addend, kernel_dtypes, implementation,
                         gather_axes, reuse_input, fused, has_addend,
                         grad_dtype):
  del has_addend, grad_dtype  # addend itself is None or not; backward's
  rows = x.shape[0]
  if reuse_input:  # backward quantizes x^T again, to the same codes
    x_values, x_scales, _, _ = block_quant.quantize_blockwise(
        _pad_tokens(x), (1, block_quant.TILE), 'e4m3', implementation=None)
    kept, fp8 = (x,), ()
  else:
    x_values, x_scales, x_t, x_t_scales = _tiles_with_transpose(
        _pad_tokens(x), 'e4m3')
    # x^T (K, M) tiled along tokens with its scales (K, M / 128).
    kept, fp8 = (), (x_t, x_t_scales)
  # Once per step, as 'tensor'; backward multiplies the same codes.
  weights = [_weight_blocks(w) for w in kernels]
  c = None if addend is None else _pad_tokens(addend)
  outs = [fp8_matmul(x_values, values.T, x_scales, scales.T,
                     out_dtype=x.dtype, implementation=implementation,
                     c=c)[:rows]
          for values, scales in _gemm_blocks(weights, gather_axes, fused)]
  if fused:
    outs = _split_columns(outs[0], [w.shape[1] for w in kernels])
  return _outputs_and_residuals(outs, kept, fp8, weights)


def _fp8_dense_block_bwd(kernel_dtypes, implementation, gather_axes,
                         reuse_input, fused, has_addend, grad_dtype,
                         residuals, grads):
  d_addend = grads[0] if has_addend else None  # the sum's gradient
  saved, grads = after_grads(residuals, grads)
  *saved, weights = saved
  if reuse_input:
    _, _, x_t, x_t_scales = _tiles_with_transpose(
        _pad_tokens(saved[0]), 'e4m3')
  else:
    x_t, x_t_scales = saved
  dtype = grads[0].dtype
  rows = grads[0].shape[0]
  widths = [g.shape[1] for g in grads]
  # g^T, wgrad's B operand, in 128x128 blocks: the block-scaled GEMM runs
  # per-row B scales at 0.6x the speed of per-block ones
  # (docs/fp8_matmul.md).
  g_blocks = (block_quant.TILE, block_quant.TILE)
  if fused:
    # One (M, sum N_i) gradient: its tiles and blocks are the parts' own
    # (`block_fusable`), quantized from the parts in one pass (no joined
    # copy written).
    quantized = [block_quant.quantize_blockwise_parts(
        [_pad_tokens(g) for g in grads], grad_dtype, transpose=True,
        transpose_block=g_blocks)]
    kernel_dtypes = kernel_dtypes[:1]
  else:
    quantized = [_tiles_with_transpose(_pad_tokens(g), grad_dtype, g_blocks)
                 for g in grads]
  dx = None
  dkernels = []
  for (w_values, w_scales), g_quantized, w_dtype in zip(
      _gemm_blocks(weights, gather_axes, fused), quantized, kernel_dtypes,
      strict=True):
    g_values, g_scales, g_t, g_t_scales = g_quantized
    # dgrad: K of the GEMM is N; b = W (K, N) with W's own blocks. The
    # parts are summed in the GEMMs' epilogues, rounded once each.
    dx = fp8_matmul(g_values, w_values, g_scales, w_scales, out_dtype=dtype,
                    implementation=implementation, c=dx)
    # wgrad: K of the GEMM is the tokens; x^T tiled along them (a scale per
    # row per 128 tokens), g^T in 128x128 blocks.
    dkernels.append(_wgrad(x_t, g_t, x_t_scales, g_t_scales, w_dtype,
                           dtype, implementation))
  if fused:
    dkernels = _split_columns(dkernels[0], widths)
  return dx[:rows], tuple(dkernels), d_addend


_fp8_dense_block_2d.defvjp(_fp8_dense_block_fwd, _fp8_dense_block_bwd)


def _check_dense_args(x, kernels) -> None:
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise TypeError(f'x has dtype {x.dtype}; a linear layer needs floating'
                    ' inputs (bfloat16 activations).')
  if x.ndim < 1:
    raise ValueError('x must have at least one axis (the features).')
  for i, w in enumerate(kernels):
    if w.ndim != 2 or w.shape[0] != x.shape[-1]:
      raise ValueError(
          f'kernels[{i}] has shape {w.shape}; it must be (in_features,'
          f' out_features) with in_features = x.shape[-1] = {x.shape[-1]}.')


def check_fp8_dense_args(x, kernels, gather_axes=None) -> None:
  """Raises unless `fp8_dense` can take x, kernels and gather_axes."""
  _check_dense_args(x, kernels)
  if jnp.dtype(x.dtype) not in _OUT_DTYPES:
    raise TypeError(f'x has dtype {x.dtype}; FP8 layers take bfloat16 or'
                    ' float32 inputs.')
  for name, size in [('x.shape[-1]', x.shape[-1])] + [
      (f'kernels[{i}].shape[1]', w.shape[1]) for i, w in enumerate(kernels)]:
    recipes.COAT.check_size(name, size)
  if gather_axes is not None and len(gather_axes) != len(kernels):
    raise ValueError(f'gather_axes names {len(gather_axes)} kernels; there'
                     f' are {len(kernels)} (one tuple of axis names each).')


def given_amax(x_amax: jax.Array | None) -> jax.Array | None:
  """A producer's max |x| as the float32 scalar statistic (no gradient) that
  the FP8 rules take as `x_amax`; None stays None."""
  if x_amax is None:
    return None
  x_amax = jax.lax.stop_gradient(jnp.asarray(x_amax, jnp.float32))
  if x_amax.shape != ():
    raise ValueError(f'x_amax has shape {x_amax.shape}; it must be the'
                     ' scalar max |x| (or None).')
  return x_amax


def fp8_rows(x: jax.Array) -> tuple[jax.Array, int]:
  """(x as (M', K) rows zero-padded to a multiple of 16, M): FP8 GEMMs
  tile M by 16; zero rows add nothing to wgrad."""
  x2 = x.reshape(-1, x.shape[-1])
  rows = x2.shape[0]
  pad = -rows % recipes.FP8_MULTIPLE
  return (jnp.pad(x2, ((0, pad), (0, 0))) if pad else x2), rows


def fp8_dense(
    x: jax.Array, kernels: Sequence[jax.Array], *,
    implementation: str | None = None, scaling: str = 'tensor',
    grad_dtype: str = 'e5m2',
    gather_axes: tuple[tuple[str | None, ...] | None, ...] | None = None,
    reuse_input: bool = False, x_amax: jax.Array | None = None,
    fused: bool = False, residual: jax.Array | None = None,
    grad_amax_slot: bool = False,
) -> tuple[jax.Array, ...]:
  """FP8 linear maps of one input: `x @ w` for each `w`, saving FP8 only.

  Args:
    x: (..., K) bfloat16 or float32 input; K a multiple of 16.
    kernels: one or more (K, N_i) weights (float32 params), N_i multiples of
      16. Their gradients come back in their own dtype.
    implementation: passed to `fp8_matmul` ('xla', 'pallas' or None).
    scaling: 'tensor' (per-tensor current scaling, COAT's paper) or 'block'
      (1x128 tiles for x and the output gradients, 128x128 weight blocks;
      see the module doc).
    grad_dtype: the output gradients' FP8 format, 'e5m2' or 'e4m3'.
    gather_axes: None, or the logical axis names of each kernel: under an
      FSDP mesh, all-gather the kernels' FP8 codes
      (`coat_jax.nn.fsdp.gather_fp8_weight`) instead of float32 shards;
      the results are the same.
    reuse_input: save x itself (and, with 'tensor', its amax) instead of
      its FP8 copy, and quantize x^T again in backward (the same codes, so
      the same gradients). For an x that its producer keeps for backward
      anyway (flash attention keeps its output): then the layer saves no
      activation bytes of its own.
      Ignored where the tokens are padded (scaling 'tensor', M % 16 != 0).
    x_amax: max |x| (float32 scalar, no gradient) when x's producer already
      computed it (a Pallas kernel, into which XLA cannot fuse the
      reduction), else None; scaling 'tensor' only ('block' ignores it).
    fused: the kernels form one projection (Q/K/V): one (K, sum N_i) E4M3
      weight, their output gradients one (M, sum N_i) E5M2 tensor, so
      forward, dgrad and wgrad are one GEMM each (no per-kernel dgrads to
      sum). With 'tensor' the parts share their scales, as a fused
      projection's (Megatron's linear_qkv), and must share one dtype; False
      gives each kernel its own (COAT's paper). With 'block' the parts keep
      their own tiles and blocks, so only dgrad's sum changes (float32 in
      the GEMM instead of the parts' sum in x.dtype); it applies where
      `block_fusable` holds (every part but the last a multiple of 128
      wide, one dtype), elsewhere the kernels run apart. Ignored for one
      kernel.
    residual: None, or (..., N) in x.dtype for one kernel: returns
      (residual + x @ w,) (a pre-norm block's skip connection), the sum
      rounded once: with 'block' in the GEMM's epilogue (the Mosaic kernel
      reads it as its C operand), with 'tensor' by XLA (cuBLASLt's C
      operand). Its gradient is the output's.
    grad_amax_slot: one kernel, scaling 'tensor': also return a slot, a
      float32 zero whose cotangent backward takes as max |g| of the
      output's gradient g instead of reading g for it. Hand it to the one
      function that reads the output and returns that cotangent: the FP8
      norm's grad_amax_slot (`coat_jax.nn.norm`), whose backward kernel
      writes g, else `fill_grad_amax_slot`; a slot left unread gives g a
      wrong scale (its cotangent is 0).

  Returns:
    Tuple of (..., N_i) arrays in x.dtype (then the slot, with
    grad_amax_slot). Saved for backward: the E4M3 input
    (M x K bytes), its float32 scale(s) (one, or M / 128 per 128 of K
    with 'block'), and each kernel's E4M3 codes (K x N_i bytes; local shards
    under FSDP) with their scale(s) (one, or one per 128x128 block),
    named `FP8_WEIGHT`; with reuse_input, x instead of its codes.
  """
  if scaling not in recipes.SCALINGS:
    raise ValueError(f'scaling={scaling!r} must be one of'
                     f' {recipes.SCALINGS}.')
  if grad_dtype not in recipes.GRAD_DTYPES:
    raise ValueError(f'grad_dtype={grad_dtype!r} must be one of'
                     f' {recipes.GRAD_DTYPES}.')
  kernels = tuple(kernels)
  check_fp8_dense_args(x, kernels, gather_axes)
  lead = x.shape[:-1]
  kernel_dtypes = tuple(jnp.dtype(w.dtype) for w in kernels)
  if residual is not None:
    _check_residual(residual, x, kernels)
  if grad_amax_slot and (scaling != 'tensor' or len(kernels) != 1):
    raise ValueError(
        f'grad_amax_slot needs one kernel and scaling=\'tensor\' (got'
        f' {len(kernels)} kernels, scaling={scaling!r}): block scaling'
        ' quantizes gradients in tiles, with no tensor amax.')
  if scaling == 'block':  # pads the tokens itself
    addend = (None if residual is None
              else residual.reshape(-1, residual.shape[-1]))
    outs = _fp8_dense_block_2d(x.reshape(-1, x.shape[-1]), kernels, addend,
                               kernel_dtypes, implementation, gather_axes,
                               reuse_input, fused and block_fusable(kernels),
                               addend is not None, grad_dtype)
    return tuple(y.reshape(lead + (y.shape[1],)) for y in outs)
  x2, rows = fp8_rows(x)
  pad = x2.shape[0] - rows
  x_amax = given_amax(x_amax)
  fused = fused and len(kernels) > 1
  if fused and len(set(kernel_dtypes)) > 1:
    raise ValueError(f'fused=True needs kernels of one dtype; got'
                     f' {[str(d) for d in kernel_dtypes]}.')
  outs = _fp8_dense_2d(x2, kernels, x_amax, kernel_dtypes, implementation,
                       gather_axes, reuse_input and not pad, fused,
                       grad_amax_slot, grad_dtype)
  slot = outs[-1:] if grad_amax_slot else ()
  outs = tuple(y[:rows].reshape(lead + (y.shape[1],))
               for y in outs[:len(kernels)])
  # XLA adds it in cuBLASLt's epilogue (its C operand), as it would outside.
  return (outs if residual is None else (residual + outs[0],)) + slot


@jax.custom_vjp
def fill_grad_amax_slot(x: jax.Array, slot: jax.Array) -> jax.Array:
  """x, unchanged; backward returns max |dx| (float32, NaN if dx holds NaN)
  as the cotangent of `slot`, by an XLA reduction that XLA fuses into the
  fusion producing dx where it can.

  The consumer of an FP8 GEMM's grad_amax_slot (`fp8_dense`) for an output
  that no FP8 norm reads (one that a BF16 norm or XLA code reads)."""
  del slot
  return x


def _fill_grad_amax_slot_fwd(x, slot):
  del slot
  return x, None


def _fill_grad_amax_slot_bwd(_, g):
  return g, _common.tensor_abs_max(g)  # NaN-propagating, as the norm's


fill_grad_amax_slot.defvjp(_fill_grad_amax_slot_fwd, _fill_grad_amax_slot_bwd)


def _check_residual(residual, x, kernels) -> None:
  if len(kernels) != 1:
    raise ValueError(f'residual: {len(kernels)} kernels given; a residual is'
                     ' added to the output of one kernel only.')
  want = x.shape[:-1] + (kernels[0].shape[1],)
  if residual.shape != want or residual.dtype != x.dtype:
    raise ValueError(
        f'residual has shape {residual.shape} and dtype {residual.dtype};'
        f' it must be the output\'s: {want} {x.dtype}.')


def bf16_dense(
    x: jax.Array, kernels: Sequence[jax.Array], *, dtype: Any = jnp.bfloat16,
) -> tuple[jax.Array, ...]:
  """Plain linear maps `x @ w` in `dtype` (autodiff saves what it needs)."""
  kernels = tuple(kernels)
  _check_dense_args(x, kernels)
  x = x.astype(dtype)
  return tuple(jnp.dot(x, w.astype(dtype)) for w in kernels)


def dense(
    x: jax.Array, kernels: Sequence[jax.Array], *,
    recipe: recipes.Recipe | str = recipes.COAT, dtype: Any = jnp.bfloat16,
    implementation: str | None = None, gather_axes: Any = None,
    reuse_input: bool = False, x_amax: jax.Array | None = None,
    fused: bool = False, residual: jax.Array | None = None,
    grad_amax_slot: bool = False,
) -> tuple[jax.Array, ...]:
  """`x @ w` for each kernel, as `recipe` runs linear layers.

  With `recipe.fp8_matmuls`, `fp8_dense` with the recipe's scaling and
  gradient format and `gather_axes`, `reuse_input`, `x_amax`, `fused`,
  `residual` and `grad_amax_slot`; else BF16 matmuls, which ignore all but
  residual (XLA adds it in cuBLAS's epilogue) and take no slot. x is cast
  to `dtype` first; outputs are in `dtype`.
  """
  recipe = recipes.get(recipe)
  x = x.astype(dtype)
  if recipe.fp8_matmuls:
    return fp8_dense(x, kernels, implementation=implementation,
                     scaling=recipe.scaling, grad_dtype=recipe.grad_dtype,
                     gather_axes=gather_axes, reuse_input=reuse_input,
                     x_amax=x_amax, fused=fused, residual=residual,
                     grad_amax_slot=grad_amax_slot)
  if grad_amax_slot:
    raise ValueError('grad_amax_slot needs FP8 matmuls (a recipe with'
                     ' fp8_matmuls=True).')
  outs = bf16_dense(x, kernels, dtype=dtype)
  if residual is None:
    return outs
  _check_residual(residual, x, kernels)
  return (residual + outs[0],)


class CoatLinear(nnx.Module):
  """A linear layer over the last axis; FP8 GEMMs where the recipe says so.

  Mirrors `nnx.Linear`: kernel (in_features, out_features), optional bias
  (out_features,), both `param_dtype` (float32 master weights), so the
  params of an `nnx.Linear` serve it as they are (`coat_jax.convert`).
  With `recipe.fp8_matmuls` the matmuls are FP8 (E4M3 forward, E5M2 x E4M3
  backward) and only the FP8 input and the kernel's FP8 codes are saved
  for backward.

  Args:
    in_features: input size (a multiple of 16 with FP8 matmuls).
    out_features: output size (a multiple of 16 with FP8 matmuls).
    use_bias: add a bias (default True, as nnx.Linear).
    dtype: computation dtype (bfloat16), or None for the promoted dtype of
      the input and the kernel (as nnx.Linear).
    param_dtype: parameter dtype.
    recipe: a `coat_jax.Recipe` or a preset name (default `recipes.COAT`).
    kernel_init: initializer of the kernel.
    bias_init: initializer of the bias.
    kernel_axes: logical axis names of the kernel, e.g. ('embed', 'mlp').
    implementation: `fp8_matmul` implementation ('xla', 'pallas' or None).
    rngs: random number generators.
    kernel_metadata: extra metadata for the kernel Param.
    bias_metadata: extra metadata for the bias Param.
    precision: the older name of `recipe` (a preset name).
  """

  def __init__(
      self,
      in_features: int,
      out_features: int,
      *,
      use_bias: bool = True,
      dtype: Any = jnp.bfloat16,
      param_dtype: Any = jnp.float32,
      recipe: recipes.Recipe | str | None = None,
      kernel_init: Any = default_kernel_init,
      bias_init: Any = default_bias_init,
      kernel_axes: tuple[str | None, ...] | None = None,
      implementation: str | None = None,
      rngs: nnx.Rngs,
      kernel_metadata: Any = MappingProxyType({}),
      bias_metadata: Any = MappingProxyType({}),
      precision: str | None = None,
  ):
    recipe = recipes.from_arguments(recipe, precision)
    recipe.check_size('in_features', in_features)
    recipe.check_size('out_features', out_features)
    self.kernel = partitioning.make_param(
        kernel_init, rngs.params(), (in_features, out_features), param_dtype,
        kernel_axes)
    for k, v in kernel_metadata.items():
      self.kernel.set_metadata(k, v)
    self.bias: nnx.Param | None
    if use_bias:
      bias_axes = None if kernel_axes is None else kernel_axes[-1:]
      self.bias = partitioning.make_param(
          bias_init, rngs.params(), (out_features,), param_dtype, bias_axes)
      for k, v in bias_metadata.items():
        self.bias.set_metadata(k, v)
    else:
      self.bias = nnx.data(None)
    self.in_features = in_features
    self.out_features = out_features
    self.use_bias = use_bias
    self.dtype = dtype
    self.param_dtype = param_dtype
    self.recipe = recipe
    self.implementation = implementation
    self.kernel_axes = kernel_axes

  def __call__(self, x: jax.Array, *, reuse_input: bool = False,
               x_amax: jax.Array | None = None,
               residual: jax.Array | None = None,
               grad_amax_slot: bool = False
               ) -> jax.Array | tuple[jax.Array, jax.Array]:
    """(..., in_features) -> (..., out_features) in the compute dtype.

    reuse_input: x is kept for backward by its producer anyway (see
    `fp8_dense`): save it instead of an FP8 copy. x_amax: max |x| if its
    producer computed it (see `fp8_dense`). residual: None, or (...,
    out_features) in the compute dtype to add (a skip connection):
    residual + x @ w (+ bias), added in the GEMM where the kernel can (see
    `fp8_dense`). grad_amax_slot: return (output, slot) (see `fp8_dense`).
    """
    outs = fanout(x, [self], reuse_input=reuse_input, x_amax=x_amax,
                  residual=residual, grad_amax_slot=grad_amax_slot)
    return outs if grad_amax_slot else outs[0]

  def compute_dtype(self, x: jax.Array) -> Any:
    """The dtype the layer computes in for input x: `dtype`, or where that
    is None the promoted dtype of x and the kernel (as nnx.Linear)."""
    if self.dtype is not None:
      return self.dtype
    return jnp.result_type(x.dtype, self.kernel.dtype)


def layer_kernels(
    layers: Sequence[CoatLinear],
) -> tuple[list[jax.Array], tuple[Any, ...] | None]:
  """(the layers' kernels as their matmuls read them: gathered whole under
  an FSDP mesh, the `gather_axes` of `fp8_dense`: their logical axis names
  with the recipe's fp8_weight_gather, else None)."""
  kernels = [fsdp.gather_weight(layer.kernel[...]) for layer in layers]
  if not layers[0].recipe.fp8_weight_gather:
    return kernels, None
  return kernels, tuple(layer.kernel_axes for layer in layers)


def fanout(
    x: jax.Array, layers: Sequence[CoatLinear], *, reuse_input: bool = False,
    x_amax: jax.Array | None = None, fused: bool = False,
    residual: jax.Array | None = None, grad_amax_slot: bool = False,
) -> tuple[jax.Array, ...]:
  """Applies several CoatLinear layers to one input, saving it only once.

  The layers must share recipe, dtype and implementation (Q/K/V or gate/up
  projections). Returns one output per layer (then the slot, with
  grad_amax_slot). reuse_input, x_amax, fused (one GEMM for all the
  layers' kernels), residual and grad_amax_slot (one layer only): see
  `fp8_dense`.
  """
  first = layers[0]

  def shared(layer):
    return layer.recipe, layer.dtype, layer.implementation

  for layer in layers[1:]:
    if shared(layer) != shared(first):
      raise ValueError('fanout: all layers must share recipe, dtype and'
                       ' implementation.')
  kernels, gather_axes = layer_kernels(layers)
  outs = dense(x, kernels, recipe=first.recipe,
               dtype=first.compute_dtype(x),
               implementation=first.implementation, reuse_input=reuse_input,
               x_amax=x_amax, gather_axes=gather_axes, fused=fused,
               residual=residual, grad_amax_slot=grad_amax_slot)
  slot = outs[len(layers):]
  return tuple(
      y + fsdp.gather_weight(layer.bias[...]).astype(y.dtype)
      if layer.bias is not None else y
      for y, layer in zip(outs[:len(layers)], layers, strict=True)) + slot
