"""The fused COAT AdamW step as one Pallas kernel (Triton lowering).

One pass per leaf: each program reads a (block_rows, block_cols) tile of the
param, the gradient and the FP8 codes of m and v with their per-group scale
and exponent, and writes the new param, codes and metadata in place
(`coat_adam_step`); without the param, it writes the Adam direction to a new
array and the moments in place (`coat_adam_update`, the optax path)
(`input_output_aliases`: under `jax.jit` with donated state nothing is
copied). block_cols is a multiple of the group size, so a tile holds whole
groups. The arithmetic is `reference.update` and the group math of
`quantize_per_group.reference`; compiled with `approx` (the default), the
group math runs in the log2 domain on the GPU's approximate lg2/ex2
(`quantize_per_group.log2_math`, see `kernel_ops`) and Adam divides by a
reciprocal, so the FP8 moments are held to tolerances of the reference, not
its bits.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from pallas_kernels import _common
from pallas_kernels._common import pl
from pallas_kernels._common import pltriton
from pallas_kernels.coat_adam_step import reference
from pallas_kernels.quantize_per_group import pallas_triton as group_pallas

_HP_NAMES = ('c1', 'b1', 'c2', 'b2', 'bc1', 'bc2', 'eps', 'wd', 'neg_lr',
             'gscale')
_APPLY = len(_HP_NAMES)  # hp_vec[_APPLY] == 0: write nothing (skipped step)


@dataclasses.dataclass(frozen=True)
class BlockSizes(_common.GroupBlockSizes):
  """Tiles of the Adam kernels: target elements per program and warps."""

  target: int = 1024
  num_warps: int = 2


# The tiles of each op when none are given (read when traced, so that
# benchmarks/optimizer.py --sweep can time others). The update moves 12 bytes
# per element, the step 16. With the log2 math, 2048 elements on 4 warps
# were the fastest of the sweep for both (RESULTS.md "Optimizer step").
STEP_BLOCK_SIZES = BlockSizes(target=2048, num_warps=4)
UPDATE_BLOCK_SIZES = BlockSizes(target=2048, num_warps=4)


def _layer_tiles(layer, ncb, block, group_size):
  """Maps whole stacks (L, rows, n) to this program's tile of `layer`: the
  (br, bc) tile of a param or of codes, (br, bc // group_size) of scales
  and exponents. Rows past the layer's end are masked (`group_tile`)."""
  pid = pl.program_id(0)
  i, j = pid // ncb, pid % ncb
  br, bc = block

  def tile(ref, width):
    return ref.at[layer, pl.ds(i * br, br), pl.ds(j * width, width)]

  param = lambda ref: tile(ref, bc)
  moment = lambda refs: (tile(refs[0], bc),
                         *(tile(r, bc // group_size) for r in refs[1:]))
  return param, moment


def _kernel(hp_ref, *refs, rows, cols, ncb, group_size, expansion,
            apply_weight_decay, mu_meta, nu_meta, ops, with_param, stacked):
  if stacked:
    layer_ref, *refs = refs
  k = 3 if expansion else 2  # refs per moment: values, scale[, exponent]
  n_in = (2 if with_param else 1) + 2 * k
  ins, outs = refs[:n_in], refs[n_in:]
  p_ref = ins[0] if with_param else None
  g_ref, moment_refs = ins[n_in - 2 * k - 1], ins[n_in - 2 * k:]
  mu_in, nu_in = moment_refs[:k], moment_refs[k:]
  x_out, mu_out, nu_out = outs[0], outs[1:1 + k], outs[1 + k:]
  if stacked:  # param and moments are whole stacks: index this layer's tiles
    param, moment = _layer_tiles(layer_ref[0], ncb, g_ref.shape, group_size)
    p_ref, x_out = param(p_ref), param(x_out)
    mu_in, nu_in, mu_out, nu_out = map(moment, (mu_in, nu_in, mu_out, nu_out))
  _, mask, gmask = _common.group_tile(
      g_ref.shape, ncb, rows, cols, group_size)
  hp = {name: hp_ref[n] for n, name in enumerate(_HP_NAMES)}

  def encode(x, q_refs, meta):
    dtype, scale_dtype = meta
    if mask is not None:  # the group max must not see lanes past the edge
      x = jnp.where(mask, x, 0.0)
    group_pallas.store_groups(x, q_refs, mask, gmask, group_size, dtype,
                              expansion, scale_dtype, ops)

  def step():
    g = _common.masked_load(g_ref, mask, 0.0)
    load_moment = lambda q_refs, meta: group_pallas.load_groups(
        q_refs, mask, gmask, group_size, meta[0], ops)
    m, v = load_moment(mu_in, mu_meta), load_moment(nu_in, nu_meta)
    if with_param:  # the new param
      p = _common.masked_load(p_ref, mask, 0.0)
      x, m, v = reference.update(p, g, m, v, hp, apply_weight_decay, ops)
    else:  # the Adam direction m_hat / (sqrt(v_hat) + eps)
      x, m, v = reference.direction(g, m, v, hp, ops)
    pltriton.store(x_out, x.astype(x_out.dtype), mask=mask)
    encode(m, mu_out, mu_meta)
    encode(v, nu_out, nu_meta)

  if with_param:
    # A skipped step writes nothing: the aliased outputs keep the inputs.
    pl.when(hp_ref[_APPLY] != 0)(step)
  else:
    step()


def kernel_ops(interpret: bool, approx: bool) -> _common.Ops:
  """The kernels' ops: compiled with `approx`, the group math in the log2
  domain on the GPU's approximate lg2/ex2 (`log2_math`: fewer operations per
  element than the reference's expressions, RESULTS.md "Optimizer step");
  interpreted or without `approx`, the reference's own ops."""
  ops = _common.kernel_ops(interpret)
  if interpret or not approx:
    return ops
  return _common.approx_log2_domain(ops)


def _fused_call(param, grad, mu, nu, hp, apply, *, group_size, expansion,
                apply_weight_decay, block_sizes, interpret, approx,
                layer=None):
  """The pallas_call of both ops: with `param` the step (param, moments
  updated in place), with param None the update (the Adam direction as a new
  float32 array, moments in place). With `layer` (an int32 scalar array),
  param and moments are a stack (L, *grad.shape) of which only that layer
  is visited and written. The layer is an operand, not part of the kernel,
  so that the L layers of unrolled models share one kernel: one lowering
  and one Triton compile, not L."""
  shape = grad.shape
  rows, cols = _common.as_2d(shape)
  ngt = pl.cdiv(cols, group_size)
  br, bc = block_sizes.resolve(rows, cols, group_size)
  ncb = pl.cdiv(cols, bc)
  grid = (pl.cdiv(rows, br) * ncb,)
  index = lambda p: (p // ncb, p % ncb)
  tile = pl.BlockSpec((br, bc), index)
  gtile = pl.BlockSpec((br, bc // group_size), index)
  stacked = layer is not None
  if not stacked:
    view = lambda a, n: a.reshape(rows, n)
    state_tile, state_gtile = tile, gtile
  else:  # whole stacks; the kernel indexes the layer's tiles (_layer_tiles)
    num_layers = param.shape[0]
    view = lambda a, n: a.reshape(num_layers, rows, n)
    whole = lambda n: pl.BlockSpec((num_layers, rows, n), lambda p: (0, 0, 0))
    state_tile, state_gtile = whole(cols), whole(ngt)

  def flat(q):
    leaves = [view(q.values, cols), view(q.scale, ngt)]
    if expansion:
      leaves.append(view(q.exponent, ngt))
    return leaves

  with_param = param is not None
  lead = [view(param, cols)] if with_param else []
  args = [*lead, grad.reshape(rows, cols), *flat(mu), *flat(nu)]
  moment_specs = [state_tile, state_gtile] + (
      [state_gtile] if expansion else [])
  in_specs = [state_tile] * len(lead) + [tile, *moment_specs, *moment_specs]
  hp_vec = jnp.stack([hp[n] for n in _HP_NAMES]
                     + [jnp.asarray(apply, jnp.float32)]
                     + [jnp.float32(0)] * (15 - len(_HP_NAMES)))
  kernel = functools.partial(
      _kernel, rows=rows, cols=cols, ncb=ncb, group_size=group_size,
      expansion=expansion, apply_weight_decay=apply_weight_decay,
      mu_meta=(mu.values.dtype, mu.scale.dtype),
      nu_meta=(nu.values.dtype, nu.scale.dtype),
      ops=kernel_ops(interpret, approx), with_param=with_param,
      stacked=stacked)
  # Operands: hp, [layer], [param], grad, moments.
  head = [hp_vec] + ([jnp.reshape(layer, (1,))] if stacked else [])
  head_specs = [pl.BlockSpec((16,), lambda p: (0,))] + (
      [pl.BlockSpec((1,), lambda p: (0,))] if stacked else [])
  first = len(head) + len(lead) + 1  # operand of the first moment leaf
  n_moment = 2 * len(moment_specs)
  # Moments (and the param) are updated in place; the direction is new.
  aliases = {first + n: 1 + n for n in range(n_moment)}
  if with_param:
    aliases[len(head)] = 0
  x_dtype = param.dtype if with_param else jnp.float32
  outs = pl.pallas_call(
      kernel, grid=grid,
      in_specs=[*head_specs, *in_specs],
      out_specs=[state_tile if with_param else tile, *moment_specs,
                 *moment_specs],
      out_shape=[jax.ShapeDtypeStruct(args[0].shape if with_param
                                      else (rows, cols), x_dtype)]
      + [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in args[-n_moment:]],
      input_output_aliases=aliases,
      interpret=interpret,
      compiler_params=_common.compiler_params(block_sizes.num_warps, 1),
      name='coat_adam_step' if with_param else 'coat_adam_update',
  )(*head, *args)
  k = len(moment_specs)

  def unflat(leaves, like):  # the shapes of the moment given
    return reference.Moment(
        leaves[0].reshape(like.values.shape),
        leaves[1].reshape(like.scale.shape),
        leaves[2].reshape(like.exponent.shape) if expansion else None)

  x_shape = param.shape if with_param else shape
  return (outs[0].reshape(x_shape), unflat(outs[1:1 + k], mu),
          unflat(outs[1 + k:], nu))


@functools.partial(
    jax.jit,
    static_argnames=('group_size', 'expansion', 'apply_weight_decay',
                     'block_sizes', 'interpret', 'approx'))
def coat_adam_step(
    param: jax.Array, grad: jax.Array, mu: reference.Moment,
    nu: reference.Moment, hp: dict[str, jax.Array],
    apply: jax.Array | bool = True, *, group_size: int,
    expansion: bool, apply_weight_decay: bool,
    block_sizes: BlockSizes | None = None, interpret: bool = False,
    approx: bool = True, layer: jax.Array | None = None
) -> tuple[jax.Array, reference.Moment, reference.Moment]:
  """Pallas version of `reference.coat_adam_step` given its hyperparams.

  With `apply` False (a bool scalar) no program writes: param and moments
  come back as given, in place. `approx`: see `kernel_ops`. `block_sizes`
  None: `STEP_BLOCK_SIZES` (read when traced). With `layer` (an int32
  scalar in [0, L), not checked here), param and moments are stacks
  (L, *grad.shape) and only that layer is read and written (in place; the
  other layers are left as they are); all layers share one kernel.
  """
  return _fused_call(
      param, grad, mu, nu, hp, apply, group_size=group_size,
      expansion=expansion, apply_weight_decay=apply_weight_decay,
      block_sizes=block_sizes or STEP_BLOCK_SIZES, interpret=interpret,
      approx=approx, layer=layer)


@functools.partial(
    jax.jit,
    static_argnames=('group_size', 'expansion', 'block_sizes', 'interpret',
                     'approx'))
def coat_adam_update(
    grad: jax.Array, mu: reference.Moment, nu: reference.Moment,
    hp: dict[str, jax.Array], *, group_size: int, expansion: bool,
    block_sizes: BlockSizes | None = None, interpret: bool = False,
    approx: bool = True
) -> tuple[jax.Array, reference.Moment, reference.Moment]:
  """Pallas version of `coat_adam_update.reference.coat_adam_update` given
  its hyperparams: (float32 direction, new mu, new nu); moments in place.
  `block_sizes` None: `UPDATE_BLOCK_SIZES` (read when traced)."""
  return _fused_call(
      None, grad, mu, nu, hp, True, group_size=group_size,
      expansion=expansion, apply_weight_decay=False,
      block_sizes=block_sizes or UPDATE_BLOCK_SIZES, interpret=interpret,
      approx=approx)
