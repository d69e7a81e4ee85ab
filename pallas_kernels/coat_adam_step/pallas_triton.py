"""The fused COAT AdamW step as one Pallas kernel (Triton lowering).

One pass per leaf: each program reads a (block_rows, block_cols) tile of the
param, the gradient and the FP8 codes of m and v with their per-group scale
and exponent, and writes the new param, codes and metadata in place
(`input_output_aliases`: under `jax.jit` with donated state nothing is
copied). block_cols is a multiple of the group size, so a tile holds whole
groups. The arithmetic is `reference.update` and the group math of
`quantize_per_group.reference`, with correctly rounded division and sqrt.
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
from pallas_kernels.quantize_per_group import reference as group_reference

_HP_NAMES = ('c1', 'b1', 'c2', 'b2', 'bc1', 'bc2', 'eps', 'wd', 'neg_lr')
_APPLY = len(_HP_NAMES)  # hp_vec[_APPLY] == 0: write nothing (skipped step)


@dataclasses.dataclass(frozen=True)
class BlockSizes(_common.GroupBlockSizes):
  """Tiles of the fused step: smaller than the quantizers' and 2 warps (on an
  H200, 1.99 ms per 2^28 params vs 2.06 ms with 4 warps, RESULTS.md)."""

  target: int = 1024
  num_warps: int = 2


def _kernel(hp_ref, *refs, rows, cols, ncb, group_size, expansion,
            apply_weight_decay, mu_meta, nu_meta, ops):
  k = 3 if expansion else 2  # refs per moment: values, scale[, exponent]
  ins, outs = refs[:2 + 2 * k], refs[2 + 2 * k:]
  p_ref, g_ref = ins[:2]
  mu_in, nu_in = ins[2:2 + k], ins[2 + k:]
  p_out, mu_out, nu_out = outs[0], outs[1:1 + k], outs[1 + k:]
  _, mask, gmask = _common.group_tile(
      p_ref.shape, ncb, rows, cols, group_size)
  hp = {name: hp_ref[n] for n, name in enumerate(_HP_NAMES)}

  def encode(x, q_refs, meta):
    dtype, scale_dtype = meta
    if mask is not None:  # the group max must not see lanes past the edge
      x = jnp.where(mask, x, 0.0)
    group_pallas.store_groups(x, q_refs, mask, gmask, group_size, dtype,
                              expansion, scale_dtype, ops)

  # A skipped step writes nothing: the aliased outputs keep the inputs.
  @pl.when(hp_ref[_APPLY] != 0)
  def _():
    p = _common.masked_load(p_ref, mask, 0.0)
    g = _common.masked_load(g_ref, mask, 0.0)
    load_moment = lambda q_refs, meta: group_pallas.load_groups(
        q_refs, mask, gmask, group_size, meta[0], ops)
    m, v = load_moment(mu_in, mu_meta), load_moment(nu_in, nu_meta)
    p, m, v = reference.update(p, g, m, v, hp, apply_weight_decay, ops)
    pltriton.store(p_out, p.astype(p_out.dtype), mask=mask)
    encode(m, mu_out, mu_meta)
    encode(v, nu_out, nu_meta)


@functools.partial(
    jax.jit,
    static_argnames=('group_size', 'expansion', 'apply_weight_decay',
                     'block_sizes', 'interpret'))
def coat_adam_step(
    param: jax.Array, grad: jax.Array, mu: reference.Moment,
    nu: reference.Moment, hp: dict[str, jax.Array],
    apply: jax.Array | bool = True, *, group_size: int,
    expansion: bool, apply_weight_decay: bool,
    block_sizes: BlockSizes = BlockSizes(), interpret: bool = False
) -> tuple[jax.Array, reference.Moment, reference.Moment]:
  """Pallas version of `reference.coat_adam_step` given its hyperparams.

  With `apply` False (a bool scalar) no program writes: param and moments
  come back as given, in place.
  """
  shape = param.shape
  rows, cols = _common.as_2d(shape)
  ngt = pl.cdiv(cols, group_size)
  br, bc = block_sizes.resolve(rows, cols, group_size)
  ncb = pl.cdiv(cols, bc)
  grid = (pl.cdiv(rows, br) * ncb,)
  index = lambda p: (p // ncb, p % ncb)
  tile = pl.BlockSpec((br, bc), index)
  gtile = pl.BlockSpec((br, bc // group_size), index)

  def flat(q):
    leaves = [q.values.reshape(rows, cols), q.scale.reshape(rows, ngt)]
    if expansion:
      leaves.append(q.exponent.reshape(rows, ngt))
    return leaves

  args = [param.reshape(rows, cols), grad.reshape(rows, cols),
          *flat(mu), *flat(nu)]
  moment_specs = [tile, gtile] + ([gtile] if expansion else [])
  in_specs = [tile, tile, *moment_specs, *moment_specs]
  hp_vec = jnp.stack([hp[n] for n in _HP_NAMES]
                     + [jnp.asarray(apply, jnp.float32)]
                     + [jnp.float32(0)] * (15 - len(_HP_NAMES)))
  kernel = functools.partial(
      _kernel, rows=rows, cols=cols, ncb=ncb, group_size=group_size,
      expansion=expansion, apply_weight_decay=apply_weight_decay,
      mu_meta=(mu.values.dtype, mu.scale.dtype),
      nu_meta=(nu.values.dtype, nu.scale.dtype),
      ops=_common.kernel_ops(interpret))
  outs = pl.pallas_call(
      kernel, grid=grid,
      in_specs=[pl.BlockSpec((16,), lambda p: (0,)), *in_specs],
      out_specs=[tile, *moment_specs, *moment_specs],
      out_shape=[jax.ShapeDtypeStruct(a.shape, a.dtype)
                 for a in [args[0], *args[2:]]],
      # Operand 0 is hp; params and moments are updated in place.
      input_output_aliases={1: 0, **{3 + n: 1 + n
                                     for n in range(len(args) - 2)}},
      interpret=interpret,
      compiler_params=_common.compiler_params(block_sizes.num_warps, 1),
      name='coat_adam_step',
  )(hp_vec, *args)
  k = len(moment_specs)
  sshape = group_reference.scale_shape(shape, group_size)

  def unflat(leaves):
    return reference.Moment(
        leaves[0].reshape(shape), leaves[1].reshape(sshape),
        leaves[2].reshape(sshape) if expansion else None)

  return outs[0].reshape(shape), unflat(outs[1:1 + k]), unflat(outs[1 + k:])
