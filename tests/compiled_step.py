"""Compiled train steps for the memory tests: what a step keeps, read from
XLA's buffer assignment (`compiled.memory_analysis()`) and its HLO, without
running anything."""

import re

from flax import nnx
import jax
import jax.numpy as jnp

from coat_jax import models

# XLA:CPU removes optimization barriers (jax.checkpoint's, the FP8 layers')
# before fusion, XLA:GPU only after scheduling: on a CPU, compile with this
# to keep what a GPU step keeps (`gpu_like_options`).
KEEP_BARRIERS = {'xla_disable_hlo_passes': 'cse_barrier_expander'}


def compile_loss_step(cfg, recipe, batch, seq, compiler_options=None):
  """value_and_grad of lm_loss for a Decoder of `cfg` on (batch, seq)
  tokens, compiled ahead of time from shapes only (nothing is allocated)."""
  model = nnx.eval_shape(lambda: models.Decoder(cfg, recipe=recipe,
                                                rngs=nnx.Rngs(0)))
  graph, state = nnx.split(model)
  step = jax.jit(jax.value_and_grad(
      lambda s, t, y: models.lm_loss(nnx.merge(graph, s), t, y)))
  tokens = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
  return step.lower(state, tokens, tokens).compile(compiler_options)


def gpu_like_options() -> dict | None:
  """Compiler options under which this backend keeps optimization barriers
  as XLA:GPU does: KEEP_BARRIERS on CPU, None (the defaults) elsewhere."""
  return KEEP_BARRIERS if jax.default_backend() == 'cpu' else None


def temp_bytes(cfg, recipe, batch, seq, compiler_options=None) -> int:
  return compile_loss_step(cfg, recipe, batch, seq, compiler_options
                           ).memory_analysis().temp_size_in_bytes


_F32_3D = re.compile(r'\s*(?:ROOT )?%\S+ = f32\[(\d+),(\d+),(\d+)\]')
_ENTRY = re.compile(r'^ENTRY .*?^\}', re.M | re.S)


def transposed_weight_stacks(hlo_text: str, num_layers: int) -> list[str]:
  """Instructions of an optimized HLO module that make a float32 array of a
  stacked weight's dims (L, a, b) (an entry parameter, L = num_layers) with
  the layer axis inside: a transposed copy of a stacked weight, which XLA
  lays out for a layer scan's FP8 weight quantizer unless the scan asks for
  the weights row-major (`coat_jax.models.decoder._row_major_weights`)."""
  entry = _ENTRY.search(hlo_text)
  stacks = set()
  for line in (entry[0] if entry else '').splitlines():
    m = _F32_3D.match(line)
    if m and ' parameter(' in line and int(m[1]) == num_layers:
      stacks.add(tuple(sorted((int(m[2]), int(m[3])))))
  copies = []
  for line in hlo_text.splitlines():
    m = _F32_3D.match(line)
    if not m or int(m[1]) == num_layers:
      continue
    dims = [int(d) for d in m.groups()]
    if num_layers in dims:
      dims.remove(num_layers)
      if tuple(sorted(dims)) in stacks:
        copies.append(line.strip()[:200])
  return copies
