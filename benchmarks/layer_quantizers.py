"""The train step with the FP8 layers' quantizers on XLA or the Pallas kernels.

The linear layers quantize their inputs and output gradients per-tensor
with the FP8 transpose in the same pass (`implementation=None`: the Pallas
kernel on one Hopper GPU); RMSNorm and SwiGLU quantize their residuals in
1x16 groups through XLA, which fuses the quantizer into the op producing its
input. This runs `step_profile.py` with either choice switched, to measure
which is faster inside a real step.

  PYTHONPATH=. python benchmarks/layer_quantizers.py --tensor xla \
      --modes coat
"""

import argparse
import functools
import sys

from benchmarks import step_profile
from coat_jax import quant
from coat_jax.nn import mlp
from coat_jax.nn import norm
from pallas_kernels.quantize_per_tensor import api as tensor_api


def choose(tensor: str, group: str) -> None:
  tensor_api.PALLAS_IS_DEFAULT = tensor == 'pallas'
  if group == 'pallas':
    pallas = lambda f: functools.partial(f, implementation='pallas')
    for module in (norm, mlp):
      module.quantize_per_group = pallas(quant.quantize_per_group)
      module.dequantize = pallas(quant.dequantize)


def main():
  parser = argparse.ArgumentParser(add_help=False)
  parser.add_argument('--tensor', choices=('xla', 'pallas'), default='pallas')
  parser.add_argument('--group', choices=('xla', 'pallas'), default='xla')
  args, rest = parser.parse_known_args()
  choose(args.tensor, args.group)
  print(f'per-tensor quantizers: {args.tensor}, per-group: {args.group}')
  sys.argv = [sys.argv[0], *rest]
  step_profile.main()


if __name__ == '__main__':
  main()
