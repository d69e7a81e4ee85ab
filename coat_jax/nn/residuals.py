"""What a function keeps for its backward pass: the leaves of jax.vjp."""

from collections.abc import Callable
import math
from typing import Any

import jax
from jax.ad_checkpoint import checkpoint_name
import numpy as np

from pallas_kernels import dispatch

# The checkpoint_name of every array the FP8 custom_vjps keep for backward:
# a remat policy that saves this name keeps exactly COAT's FP8 residuals
# (and their small scales) and recomputes nothing else they need.
FP8_RESIDUAL = 'fp8_residual'
# The checkpoint_name of the weights' FP8 codes (and scales) that the FP8
# linear layers quantize once in forward and keep for their dgrad. A remat
# policy may recompute them from the weight instead (coat_jax.models.remat
# does under the layer scan, where keeping them would stack a copy).
FP8_WEIGHT = 'fp8_weight'


def name_fp8_residuals(tree: Any, name: str = FP8_RESIDUAL) -> Any:
  """`tree` with each array leaf tagged `name` (FP8_RESIDUAL or FP8_WEIGHT;
  an identity)."""
  return jax.tree.map(lambda x: checkpoint_name(x, name), tree)


def after_grads(residuals: Any, grads: Any) -> tuple[Any, Any]:
  """(residuals, grads) through one `jax.lax.optimization_barrier`.

  A custom_vjp backward calls this first, so that nothing it computes from
  its FP8 residuals can run before its output gradients exist. Without it
  XLA fuses the forward's quantization into the backward's dequantization
  (the codes never reach memory: the bfloat16 input stays alive across the
  layers instead) and schedules float32 dequantized copies early, in the
  forward pass, where they live across every later layer (unrolled layers,
  no remat: 2.4-2.9x the bytes of the residuals per layer, 1.14x with the
  barrier). XLA:GPU keeps barriers through fusion and scheduling; XLA:CPU
  drops them before fusion (`tests/models/fp8_memory_test.py` keeps them).
  """
  return jax.lax.optimization_barrier((residuals, grads))


def with_residuals(outputs: Any, residuals: Any) -> tuple[Any, Any]:
  """(outputs, residuals named `FP8_RESIDUAL`), through one
  `jax.lax.optimization_barrier` where XLA quantizes (`xla_quantizes`).

  A custom_vjp forward returns its outputs this way, so that its FP8
  residuals exist before anything reads its outputs: under SPMD
  partitioning (FSDP) XLA's scheduler otherwise puts off the quantization
  until backward and keeps the bfloat16 GEMM outputs alive across the
  later layers instead (docs/decisions.md#comment-figures). Not where the
  Pallas kernels quantize (one Hopper GPU): they write their codes in
  forward anyway, and there the barrier slowed the step.
  """
  if xla_quantizes():
    outputs, residuals = jax.lax.optimization_barrier((outputs, residuals))
  return outputs, name_fp8_residuals(residuals)


def reduced_now(grads: Any) -> Any:
  """`grads` through one `jax.lax.optimization_barrier` where XLA quantizes
  (`xla_quantizes`).

  A custom_vjp backward whose gradients include a sum over the tokens
  returns them this way, so that the sum is taken where its terms are
  computed. Under SPMD partitioning (FSDP) XLA otherwise wrote each RMSNorm
  gain's float32 terms g * x_hat (a whole activation) in backward and
  summed them only at its end, all of them alive at the peak
  (docs/decisions.md#comment-figures). Not on one Hopper GPU, where the
  Pallas kernel sums in its own pass.
  """
  return jax.lax.optimization_barrier(grads) if xla_quantizes() else grads


def xla_quantizes() -> bool:
  """Whether the FP8 layers are laid out for XLA's per-tensor quantizers
  here (several devices, CPU, GPUs before Hopper), not for the Pallas
  kernels of one Hopper GPU: the barriers above, no gradient amax slots.
  (Several Hopper GPUs under FSDP run the kernels too, on each device's
  rows, `coat_jax.nn.fsdp.row_wise`, in this layout: the one-GPU layout is
  not measured there.)"""
  resolved = dispatch.resolve_implementation('quantize_per_tensor', None)
  return resolved.implementation == 'xla'


def saved_residuals(
    fn: Callable[..., Any], *args
) -> list[jax.ShapeDtypeStruct]:
  """Arrays that `jax.vjp(fn, *args)` keeps for backward, as shapes only.

  Traced abstractly (nothing is computed or allocated). Leaves that are
  `fn`'s own arguments (params, inputs) are left out and each residual is
  counted once.

  Args:
    fn: a pure function of arrays.
    *args: its arguments (arrays or ShapeDtypeStructs, any pytrees).

  Returns:
    One ShapeDtypeStruct per distinct saved array.
  """
  def trace(*args):
    _, vjp_fn = jax.vjp(fn, *args)
    arg_ids = {id(a) for a in jax.tree.leaves(args)}
    seen = set()
    out = []
    for leaf in jax.tree.leaves(vjp_fn):
      if not hasattr(leaf, 'shape') or id(leaf) in arg_ids or id(leaf) in seen:
        continue
      seen.add(id(leaf))
      out.append(leaf)
    return out

  return jax.eval_shape(trace, *args)


def nbytes(residuals: list[jax.ShapeDtypeStruct]) -> int:
  """Total bytes of a list of arrays or ShapeDtypeStructs."""
  return sum(math.prod(r.shape) * np.dtype(r.dtype).itemsize
             for r in residuals)


def activation_residuals(
    fn: Callable[..., Any], args: tuple, args_doubled: tuple
) -> list[jax.ShapeDtypeStruct]:
  """The residuals of `fn(*args)` whose size grows with the batch.

  `args_doubled` are the same arguments with twice the batch: residuals whose
  shape changes are activations; those that do not (casts of weights, RoPE
  tables, scalars) are not.

  Returns:
    The activation residuals of `fn(*args)`.
  """
  small = saved_residuals(fn, *args)
  large = saved_residuals(fn, *args_doubled)
  if len(small) != len(large):
    raise ValueError('fn saves a different number of residuals at the two'
                     ' batch sizes; cannot tell activations apart.')
  return [a for a, b in zip(small, large, strict=True) if a.shape != b.shape]
