"""FP8-saving drop-ins for `jax.nn` activations: silu, gelu, swiglu, geglu.

Each is a `jax.custom_vjp` whose forward computes the activation in float32
from the exact inputs (cast back to their dtype) and saves only the inputs,
as E4M3 groups along the last axis with power-of-two E8M0 scales (COAT's
1x16 mixed granularity); backward dequantizes them and recomputes what it
needs (no activation output is kept). A user's model switches one line:

  h = jax.nn.silu(gate) * up          ->  h = coat_jax.nn.swiglu(gate, up)

`swiglu` runs the one-pass Pallas kernels on Hopper GPUs where the last
axis is a multiple of 16 (`fp8_swiglu`, which also hands max |h| to the
down projection in `coat_jax.nn.CoatMLP`); the others, and every shape
elsewhere, are jnp that XLA fuses into the producer and the consumer. Any
last-axis size works (a partial last group is zero-padded); inputs that are
not floating arrays fall back to the `jax.nn` function.
"""

from collections.abc import Callable
import functools

import jax
import jax.numpy as jnp

from coat_jax import quant
from coat_jax import recipes
from coat_jax.nn import fsdp
from coat_jax.nn.residuals import after_grads
from coat_jax.nn.residuals import with_residuals
from coat_jax.quant import QuantizedArray
from pallas_kernels.swiglu_fp8 import api as swiglu_fp8_api


def _silu(x):
  return x * jax.nn.sigmoid(x)


def _gelu_exact(x):
  return jax.nn.gelu(x, approximate=False)


def _gelu_tanh(x):
  return jax.nn.gelu(x, approximate=True)


def _glu(act: Callable) -> Callable:
  return lambda gate, up: act(gate) * up


_SWIGLU = _glu(_silu)
_GEGLU_EXACT = _glu(_gelu_exact)
_GEGLU_TANH = _glu(_gelu_tanh)


@functools.cache
def _saved_as_fp8(fn: Callable, group_size: int, dtypes: tuple) -> Callable:
  """fn(*xs) of floating arrays (of `dtypes`) as a custom_vjp that saves
  each x as E4M3 groups of `group_size` and recomputes fn's vjp from them."""

  def forward(*xs):
    y = fn(*(x.astype(jnp.float32) for x in xs))
    return y.astype(xs[0].dtype)

  @jax.custom_vjp
  def apply(*xs):
    return forward(*xs)

  def fwd(*xs):
    codes = tuple(quant.quantize_per_group(
        x, group_size, 'e4m3', scale_dtype=recipes.ACTIVATION_SCALE_DTYPE)
                  for x in xs)
    return with_residuals(forward(*xs), codes)

  def bwd(codes, g):
    codes, g = after_grads(codes, g)
    xs = [quant.dequantize(q) for q in codes]
    _, vjp = jax.vjp(fn, *xs)
    return tuple(d.astype(dtype) for d, dtype in
                 zip(vjp(g.astype(jnp.float32)), dtypes, strict=True))

  apply.defvjp(fwd, bwd)
  return apply


def _apply(fn: Callable, fallback: Callable, group_size: int, *xs):
  if not all(isinstance(x, jax.Array)
             and jnp.issubdtype(x.dtype, jnp.floating) and x.ndim >= 1
             for x in xs):
    return fallback(*xs)
  recipes.Recipe(activation_group_size=group_size)  # validates it
  dtypes = tuple(jnp.dtype(x.dtype) for x in xs)
  return _saved_as_fp8(fn, group_size, dtypes)(*xs)


def silu(x: jax.Array, *, group_size: int = 16) -> jax.Array:
  """`jax.nn.silu(x)`, saving x as E4M3 groups of `group_size` for backward.

  Args:
    x: (..., N) floating array.
    group_size: elements per FP8 group along the last axis (a power of two).

  Returns:
    (..., N) in x.dtype, computed in float32. Saved: N bytes + N/group_size
    one-byte scales per row.
  """
  return _apply(_silu, jax.nn.silu, group_size, x)


def gelu(x: jax.Array, approximate: bool = True, *,
         group_size: int = 16) -> jax.Array:
  """`jax.nn.gelu(x, approximate)` (tanh approximation by default, as
  jax.nn's; approximate=False is the exact erf form), saving x as E4M3
  groups for backward. Shapes and bytes as `silu`."""
  fn = _gelu_tanh if approximate else _gelu_exact
  return _apply(fn, functools.partial(jax.nn.gelu, approximate=approximate),
                group_size, x)


def swiglu(gate: jax.Array, up: jax.Array, *,
           group_size: int = 16) -> jax.Array:
  """`jax.nn.silu(gate) * up`, saving gate and up as E4M3 groups.

  Args:
    gate, up: (..., N) floating arrays of one shape and dtype.
    group_size: elements per FP8 group along the last axis.

  Returns:
    (..., N) in gate.dtype, computed in float32. With N a multiple of 16,
    `fp8_swiglu` (the one-pass Pallas kernels on a Hopper GPU).
  """
  _check_pair(gate, up)
  if (isinstance(gate, jax.Array) and gate.ndim >= 1
      and gate.shape[-1] % recipes.FP8_MULTIPLE == 0
      and jnp.dtype(gate.dtype) in (jnp.dtype(jnp.bfloat16),
                                    jnp.dtype(jnp.float32))):
    return fp8_swiglu(gate, up, group_size=group_size)
  return _apply(_SWIGLU, lambda g, u: jax.nn.silu(g) * u, group_size, gate,
                up)


def geglu(gate: jax.Array, up: jax.Array, approximate: bool = True, *,
          group_size: int = 16) -> jax.Array:
  """`jax.nn.gelu(gate, approximate) * up` (Gemma's MLP with the tanh
  approximation), saving gate and up as E4M3 groups. Shapes as `swiglu`."""
  _check_pair(gate, up)
  fn = _GEGLU_TANH if approximate else _GEGLU_EXACT
  return _apply(
      fn, lambda g, u: jax.nn.gelu(g, approximate=approximate) * u,
      group_size, gate, up)


def _check_pair(gate, up) -> None:
  if (getattr(gate, 'shape', None) != getattr(up, 'shape', None)
      or getattr(gate, 'dtype', None) != getattr(up, 'dtype', None)):
    raise ValueError(
        f'gate {getattr(gate, "shape", None)} {getattr(gate, "dtype", None)}'
        f' and up {getattr(up, "shape", None)} {getattr(up, "dtype", None)}'
        ' must have the same shape and dtype.')


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _fp8_swiglu(gate, up, group_size):
  return fp8_swiglu_fwd(gate, up, group_size)[0]


def fp8_swiglu_fwd(gate, up, group_size):
  """((h, max |h|), residuals) of silu(gate) * up by the SwiGLU kernels:
  the max, a statistic without gradient, is the down projection's
  per-tensor scale (`coat_jax.nn.mlp`)."""
  def kernel(gate, up, *, implementation):
    h, gate_q, up_q, h_amax = swiglu_fp8_api.swiglu_fp8_fwd(
        gate, up, group_size=group_size,
        scale_dtype=recipes.ACTIVATION_SCALE_DTYPE,
        implementation=implementation)
    return h, *gate_q, *up_q, h_amax
  rows = fsdp.ROWS
  h, *groups, h_amax = fsdp.row_wise(kernel, (gate, up), (rows, rows),
                                     (rows,) * 5 + (fsdp.MAX,))
  gate_q, up_q = (QuantizedArray(*q, None, group_size)
                  for q in (groups[:2], groups[2:]))
  return with_residuals((h, h_amax), (gate_q, up_q))


def fp8_swiglu_grads(residuals, grads):
  """(dgate, dup, max |dgate|, max |dup|) from `fp8_swiglu_fwd`'s
  residuals and the gradients of (h, max |h|) (the max has none)."""
  dh, _ = grads
  (gate_q, up_q), dh = after_grads(residuals, dh)

  def kernel(gate_codes, gate_scales, up_codes, up_scales, dh, *,
             implementation):
    return swiglu_fp8_api.swiglu_fp8_bwd(
        (gate_codes, gate_scales), (up_codes, up_scales), dh,
        group_size=gate_q.group_size, implementation=implementation)
  rows = fsdp.ROWS
  return fsdp.row_wise(
      kernel, (gate_q.values, gate_q.scale, up_q.values, up_q.scale, dh),
      (rows,) * 5, (rows, rows, fsdp.MAX, fsdp.MAX))


def _fp8_swiglu_bwd(group_size, residuals, grads):
  del group_size  # the residuals carry it
  return fp8_swiglu_grads(residuals, grads)[:2]


_fp8_swiglu.defvjp(fp8_swiglu_fwd, _fp8_swiglu_bwd)


def fp8_swiglu(gate: jax.Array, up: jax.Array, *,
               group_size: int = 16) -> jax.Array:
  """silu(gate) * up by the SwiGLU kernels, saving gate and up as FP8
  groups.

  Args:
    gate: (..., I) bfloat16 (or float32), I a multiple of 16.
    up: same shape and dtype as gate.
    group_size: elements per FP8 group (a power of two).

  Returns:
    (..., I) in gate.dtype, computed in float32 from the exact inputs.
    Saved: 2 x (I bytes + I/group_size one-byte scales) per row; silu is
    recomputed.
  """
  return fp8_swiglu_with_amax(gate, up, group_size=group_size)[0]


def fp8_swiglu_with_amax(gate: jax.Array, up: jax.Array, *,
                         group_size: int = 16
                         ) -> tuple[jax.Array, jax.Array]:
  """(`fp8_swiglu(gate, up)`, its max |.| as a float32 scalar without
  gradient, from the same pass: the down projection's `x_amax`)."""
  _check_pair(gate, up)
  if not jnp.issubdtype(gate.dtype, jnp.floating):
    raise TypeError(f'gate has dtype {gate.dtype}; SwiGLU needs floats.')
  recipes.COAT.check_size('gate.shape[-1]', gate.shape[-1],
                          part='activation')
  return _fp8_swiglu(gate, up, group_size)
