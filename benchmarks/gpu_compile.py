"""The train step compiled for an H100 (or H200) on a machine without one.

XLA compiles for a GPU from a description of it (`gpu_specs/*.txtpb`, XLA's
GpuTargetConfigProto) when jaxlib's CUDA plugin is installed; no GPU,
driver or device time is needed:

  python -m venv /tmp/gpu_venv && /tmp/gpu_venv/bin/pip install \
      'jax[cuda13]' -e .
  PYTHONPATH=. /tmp/gpu_venv/bin/python benchmarks/gpu_compile.py \
      --preset 1b --batch 8 \
      --variants scanned=coat:model.scan_layers=true \
                 unrolled=coat:model.scan_layers=false

For each variant (`benchmarks/e2e.py`'s name=mode:overrides) it compiles
train.py's step ahead of time and prints the memory breakdown: XLA's
compiled temp matches what `e2e.py` measures on the GPU (1b, batch 8, coat:
17.29 GiB here against 17.28 on an H100, scanned, remat minimal; 16.41
against 16.48 unrolled; 13.71 against 13.76 unrolled without remat;
jax 0.10.2 here, 0.11.2 there). `--buffers N` lists the N largest buffers
live at the step's peak (`step_buffers.py`), `--hlo DIR` keeps XLA's dumps.

While this module runs, `jax.default_backend()` says 'gpu' and
`jax.devices()` gives the target's devices with its compute capability and
core count, so that coat_jax picks what it picks on the GPU (Pallas
kernels, cuDNN attention, cuBLASLt FP8). Nothing can be executed. Timings
need the GPU: `e2e.py`.
"""

import argparse
import contextlib
import os
import re
import tempfile
import time

os.environ.setdefault('JAX_PLATFORMS', 'cpu')  # the host runs nothing else

import jax  # noqa: E402 (after JAX_PLATFORMS)
from jax.experimental import topologies  # noqa: E402

SPECS = {'h100': 'h100_sxm.txtpb', 'h200': 'h200_sxm.txtpb'}


class _Described:
  """A topology device with what coat_jax asks of a real H100/H200 device
  that a topology's device lacks."""

  compute_capability = '9.0'
  core_count = 132

  def __init__(self, device):
    self._device = device

  def __getattr__(self, name):
    return getattr(self._device, name)


def use_target(target: str, num_devices: int = 1) -> tuple[list, int]:
  """Makes this process compile for `num_devices` GPUs of kind `target`
  ('h100', 'h200') on one host; returns their devices (for
  `coat_jax.training.build(config, devices)`) and each one's memory in
  bytes."""
  if target not in SPECS:
    raise ValueError(f'target={target!r}: one of {sorted(SPECS)}.')
  path = os.path.join(os.path.dirname(__file__), 'gpu_specs', SPECS[target])
  with open(path) as f:
    spec = f.read()
  try:
    topology = topologies.get_topology_desc(
        'cuda', 'cuda', topology=f'1x1x{num_devices}', target_config=spec)
  except Exception as e:  # noqa: BLE001 (any plugin failure)
    raise RuntimeError(
        "compiling for a GPU needs jaxlib's CUDA plugin: pip install"
        f" 'jax[cuda13]' (no GPU needed). The plugin said: {e}") from e
  devices = list(topology.devices)
  described = [_Described(d) for d in devices]
  jax.default_backend = lambda: 'gpu'
  jax.devices = lambda *_, **__: described
  jax.local_devices = lambda *_, **__: described
  return devices, int(re.search(r'device_memory_size: (\d+)', spec)[1])


def compile_variant(devices, config, dump_dir):
  """(setup, compiled, compile seconds) of train.py's step for `config`,
  with XLA's dumps in dump_dir."""
  from coat_jax.training import memory  # noqa: PLC0415 (after use_target)
  from coat_jax.training import trainer  # noqa: PLC0415

  setup = trainer.build(config, devices)
  start = time.perf_counter()
  compiled = memory.compile_train_step(
      setup, {'xla_dump_to': dump_dir, 'xla_dump_hlo_as_text': True})
  return setup, compiled, time.perf_counter() - start


def main(argv=None) -> int:
  from benchmarks import e2e  # noqa: PLC0415 (jax-free at import)
  from benchmarks import step_buffers  # noqa: PLC0415
  from coat_jax.training import memory  # noqa: PLC0415

  parser = argparse.ArgumentParser(description=__doc__.split('\n')[0])
  parser.add_argument('--target', default='h100', choices=sorted(SPECS))
  parser.add_argument('--preset', default='1b')
  parser.add_argument('--devices', type=int, default=1,
                      help='GPUs of one host (train.py shards over them as'
                      ' its mesh settings say)')
  parser.add_argument('--batch', type=int, default=8)
  parser.add_argument('--seq', type=int, default=2048)
  parser.add_argument('--variants', nargs='+', required=True,
                      help='name=mode:overrides (as benchmarks/e2e.py)')
  parser.add_argument('--buffers', type=int, default=0,
                      help='list the N largest buffers live at the peak'
                      ' (scanned layers: at the forward loop\'s end; the'
                      ' live ranges miss the backward loop\'s body)')
  parser.add_argument('--hlo', default=None,
                      help='keep XLA dumps under this directory')
  args = parser.parse_args(argv)
  devices, device_bytes = use_target(args.target, args.devices)
  runs = e2e.runs_from_args('', args.variants)
  print(f'{len(devices)} x {devices[0].device_kind} ({device_bytes / 2**30:.1f}'
        f' GiB each; compiled here, jax {jax.__version__}), {args.preset},'
        f' batch {args.batch} x {args.seq}; bytes per device')
  print('| variant | compiled temp GiB | params + opt. state GiB |'
        ' step total GiB | compile s |')
  print('|---|---|---|---|---|')
  details = []
  for name, (mode, overrides) in runs.items():
    if mode == 'plain':
      raise ValueError('--variants: the plain baseline runs on a GPU only'
                       ' (benchmarks/e2e.py).')
    with contextlib.ExitStack() as stack:
      # XLA's dump of a 1b step takes ~250 MB: keep it only under --hlo.
      dump = (os.path.join(args.hlo, name) if args.hlo else stack.enter_context(
          tempfile.TemporaryDirectory(prefix='gpu_compile_')))
      config = e2e.train_config(args.preset, args.seq, args.batch, mode,
                                overrides)
      setup, compiled, seconds = compile_variant(devices, config, dump)
      mem = memory.breakdown(setup, compiled, device_bytes)
      temp = compiled.memory_analysis().temp_size_in_bytes
      print(f'| {name} | {temp / 2**30:.2f} |'
            f' {(mem.params + mem.optimizer_state) / 2**30:.2f} |'
            f' {mem.total / 2**30:.2f} | {seconds:.0f} |', flush=True)
      if args.buffers:
        peak, at, buffers = step_buffers.peak_buffers(dump)
        details.append(f'\n{name}: {peak / 2**30:.2f} GiB live at {at}\n'
                       + step_buffers.largest(buffers, args.buffers))
  print('\n'.join(details))
  return 0


if __name__ == '__main__':
  raise SystemExit(main())
