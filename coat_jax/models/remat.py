"""Remat (gradient checkpointing) policies for the decoder layer stack.

A policy decides which values a decoder layer keeps for backward; the rest
is recomputed from the layer's input (always kept) during backward. Names
follow MaxText's `remat_policy`:

- 'none': no `jax.checkpoint`: whatever autodiff and the custom_vjps save.
  Under the layer scan this stacks every residual of the layer body, including
  elementwise ones that XLA would recompute for unrolled layers.
- 'minimal': keeps the projections' outputs (q, k, v, the attention output
  projection with its skip connection added, SwiGLU's gate and up), the
  attention output and the flash attention kernel's outputs, and in
  'fp8_linear' and 'coat' modes the FP8 residuals of the custom_vjps (in
  'coat' those replace the BF16 GEMM outputs) and the weights' FP8 codes;
  recomputes elementwise work (norms, RoPE, SwiGLU, residual adds) and
  never a GEMM.
- 'minimal_offloaded': what 'minimal' keeps, moved to pinned host memory in
  forward and back in backward (GPU only: needs host memory spaces).
- 'full': keeps only each layer's input; backward reruns the layer's whole
  forward (about one extra forward pass of FLOPs).
- 'auto' (the default): for unrolled layers with FP8 activations (COAT)
  'none', whose custom_vjps already keep only FP8 residuals ('minimal'
  keeps the same there and recomputes elementwise work), 'minimal' for the
  other recipes (less than 'none' keeps). For scanned layers 'full', as
  MaxText's default: with 'minimal' the scan's backward stacks every
  layer's weight gradient while every stacked residual is live, more than
  unrolled layers keep at their peak, so a scanned step would need more
  memory than the default unrolled one; 'full' costs one more forward pass
  (docs/decisions.md#scanned). `resolve` names the policy it stands for.

Under the layer scan, 'minimal', 'minimal_offloaded' and 'full' requantize
the weights in backward instead of keeping their FP8 codes: kept, scan
would stack a copy of every layer's codes (1 byte a param) next to the
params it slices each layer from anyway. Unrolled layers keep them:
requantized, the float32 weight slices live until backward instead.
'none' keeps them in both (docs/decisions.md#comment-figures).
"""

from collections.abc import Callable

from flax import nnx
import jax
from jax.ad_checkpoint import Offloadable
from jax.ad_checkpoint import Recompute
from jax.ad_checkpoint import checkpoint_name

from coat_jax import recipes
from coat_jax.nn.mlp import GATE_UP
from coat_jax.nn.residuals import FP8_RESIDUAL
from coat_jax.nn.residuals import FP8_WEIGHT

POLICIES = ('none', 'minimal', 'minimal_offloaded', 'full')
AUTO = 'auto'  # a policy per recipe and layout: `resolve`
DEFAULT = AUTO

# checkpoint_name tags of the decoder's values that 'minimal' keeps.
QKV_PROJ = 'qkv_proj'
ATTENTION = 'attention'
OUT_PROJ = 'out_proj'
MINIMAL_NAMES = (QKV_PROJ, ATTENTION, OUT_PROJ, GATE_UP, FP8_RESIDUAL,
                 FP8_WEIGHT)

name = checkpoint_name


def check_policy(policy: str, setting: str = 'remat') -> None:
  """Raises ValueError naming `setting` unless `policy` is in POLICIES or
  is 'auto'."""
  if policy not in POLICIES + (AUTO,):
    raise ValueError(
        f'{setting}={policy!r} is not a remat policy: use one of {POLICIES}'
        " ('none' saves the most, 'full' the least; see"
        " coat_jax.models.remat) or 'auto' (the default).")


def resolve(policy: str, recipe: recipes.Recipe | str,
            scan_layers: bool) -> str:
  """The policy that `policy` names for a layer stack of `recipe`, scanned
  or unrolled: 'auto' becomes 'full' for scanned layers, 'none' for
  unrolled layers with FP8 activations (COAT) and 'minimal' for the other
  unrolled ones (see the module doc); the others stay as they are."""
  check_policy(policy)
  if policy != AUTO:
    return policy
  if scan_layers:
    return 'full'
  return 'none' if recipes.get(recipe).fp8_activations else 'minimal'


def _minimal(prim, *_, **params) -> bool:
  """Saves the MINIMAL_NAMES values and cuDNN flash attention's outputs (o
  and the softmax statistics: its backward's residuals, on GPU)."""
  if prim.name == 'name':  # checkpoint_name's primitive
    return params['name'] in MINIMAL_NAMES
  return prim.name.startswith('dot_product_attention_fwd')


def _minimal_offloaded(prim, *args, **params):
  if _minimal(prim, *args, **params):
    return Offloadable(src='device', dst='pinned_host')
  return Recompute


def _except_fp8_weights(policy):
  """`policy` recomputing the FP8_WEIGHT values."""
  def saves(prim, *args, **params):
    if prim.name == 'name' and params['name'] == FP8_WEIGHT:
      return False
    return policy(prim, *args, **params)
  return saves


def jax_policy(policy: str, *, in_scan: bool = False
               ) -> Callable[..., object] | None:
  """The `jax.checkpoint` policy of a name (None for 'none': no remat) for
  an unrolled layer or, with in_scan, a scan body ('auto': `resolve` it
  first)."""
  check_policy(policy)
  if policy == AUTO:
    raise ValueError("remat='auto' stands for a policy per recipe and"
                     ' layout: pass resolve(policy, recipe, scan_layers).')
  if policy == 'none':
    return None
  if policy == 'full':
    return jax.checkpoint_policies.nothing_saveable
  if policy == 'minimal':
    jp = _minimal
  elif jax.default_backend() != 'gpu':
    raise ValueError(
        f"remat='{policy}' offloads to pinned host memory, which jax supports"
        f' on GPU; this backend is {jax.default_backend()!r}: use'
        " 'minimal' (same values kept on the device) or 'full'.")
  else:
    jp = _minimal_offloaded
  return _except_fp8_weights(jp) if in_scan else jp


def apply(fn: Callable, policy: str, *, in_scan: bool) -> Callable:
  """`fn` (a layer body, modules allowed) under the remat `policy`.

  in_scan: fn is a scan body (no CSE to prevent: jax's advice); its FP8
  weight codes are recomputed in backward (see the module doc).
  """
  jp = jax_policy(policy, in_scan=in_scan)
  if jp is None:
    return fn
  return nnx.remat(fn, policy=jp, prevent_cse=not in_scan)
