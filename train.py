"""Trains a language model (or a VLM) with COAT FP8 training. `python
train.py` runs the default (a tiny Llama on the standard library's Python
files, byte-level).

  python train.py
  python train.py --config configs/llama_1b.py --set model.recipe=bf16 \
      train.batch_size=16
  python train.py --config configs/finetune_hf.py \
      --set model.init_from=path/to/qwen3
  python train.py --config configs/llama2_7b.py --estimate
  python train.py --config configs/llama2_7b.py --find-max-batch
  python train.py --config configs/vlm_tiny.py

On GPU, XLA may use MEM_FRACTION of each device unless
XLA_PYTHON_CLIENT_MEM_FRACTION is set (XLA's own default is 0.75).
"""

import argparse
import os
import shlex
import sys

# What train.py lets XLA preallocate when XLA_PYTHON_CLIENT_MEM_FRACTION is
# not set (XLA's default, 0.75, leaves a quarter of the GPU unused; the
# rest is left to the CUDA context, cuDNN and cuBLAS workspaces).
MEM_FRACTION = '0.95'
MEM_FRACTION_ENV = 'XLA_PYTHON_CLIENT_MEM_FRACTION'


def _maybe_initialize_distributed() -> None:
  """Joins a multi-process run when JAX_COORDINATOR_ADDRESS is set.

  JAX_NUM_PROCESSES and JAX_PROCESS_ID give this process's place; without
  them jax detects the cluster (SLURM, Open MPI, ...).
  """
  if not os.environ.get('JAX_COORDINATOR_ADDRESS'):
    return
  import jax  # noqa: PLC0415 (must precede any other use of jax)

  # CPU processes need a collectives backend to talk to each other.
  jax.config.update('jax_cpu_collectives_implementation', 'gloo')
  env = lambda name: (int(os.environ[name]) if name in os.environ else None)
  jax.distributed.initialize(num_processes=env('JAX_NUM_PROCESSES'),
                             process_id=env('JAX_PROCESS_ID'))


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument('--config', help='a configs/*.py file (default: the'
                      ' embedded tiny run)')
  parser.add_argument('--set', nargs='+', default=[], action='extend',
                      metavar='SECTION.FIELD=VALUE', help='override fields')
  parser.add_argument('--estimate', action='store_true',
                      help='compile the train step ahead of time, print how'
                      ' device memory divides, and exit without training'
                      " (the plan of this machine's compiler: run it on the"
                      " GPU for a GPU's)")
  parser.add_argument('--find-max-batch', action='store_true',
                      help='find the largest train.batch_size that fits, per'
                      ' layer layout (unrolled, scanned) and remat policy (by'
                      ' compiling), and exit')
  parser.add_argument('--policies', default=None, metavar='P1,P2',
                      help='the remat policies --find-max-batch tries'
                      ' (default: all this backend can run)')
  parser.add_argument('--memory-limit-gib', type=float, default=None,
                      metavar='GIB', help="the device memory to plan for"
                      " (default: the device's limit; needed on CPU)")
  args = parser.parse_args(argv)
  # Before jax is imported: it reads the fraction when it starts.
  fraction_given = MEM_FRACTION_ENV in os.environ
  os.environ.setdefault(MEM_FRACTION_ENV, MEM_FRACTION)
  _maybe_initialize_distributed()

  from coat_jax import training  # noqa: PLC0415 (after distributed init)
  from coat_jax.training import memory  # noqa: PLC0415

  limit = (None if args.memory_limit_gib is None
           else int(args.memory_limit_gib * memory.GIB))
  try:
    if args.memory_limit_gib is not None and args.memory_limit_gib <= 0:
      raise ValueError(f'--memory-limit-gib {args.memory_limit_gib} must be'
                       ' positive.')
    config = training.apply_overrides(training.load_config(args.config),
                                      args.set)
    # Before anything compiles: --estimate and --find-max-batch use it too.
    training.use_compilation_cache(config.train.compilation_cache_dir,
                                   config.train.compilation_cache_max_gib)
    print(f'{MEM_FRACTION_ENV}={os.environ[MEM_FRACTION_ENV]} ('
          + ('yours' if fraction_given else "train.py's default; set it to"
             ' change') + '): the share of each GPU that XLA may use.',
          flush=True)
    if args.estimate:
      return _estimate(config, limit)
    if args.find_max_batch:
      return _find_max_batch(config, limit, args.policies)
    summary = training.train(config)
  except (ValueError, TypeError, FileNotFoundError, ImportError,
          training.NonFiniteError) as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  if summary['complete']:
    print(_complete_message(summary, argv))
    return 0
  if summary['sample'] is not None:
    print(f"sample (greedy): {summary['sample']!r}")
  mem = summary['peak_memory_bytes']
  print(f"done: step {summary['step']}, "
        + _recorded(_last_recorded(summary['run_dir']))
        + ', peak device memory '
        + (f'{mem / 2**30:.2f} GiB' if mem else 'n/a (not reported here)')
        + f", skipped non-finite steps {summary['nonfinite_steps']};"
        f" run dir {summary['run_dir']}")
  return 128 + summary['signal'] if summary['interrupted'] else 0


def _last_recorded(run_dir: str) -> dict:
  """{metric: (step, value)} of the last finite record of each metric in
  run_dir's metrics.jsonl ({} without one: processes other than 0 write
  none)."""
  from coat_jax.training import metrics  # noqa: PLC0415

  try:
    return metrics.latest(metrics.read_metrics(run_dir))
  except FileNotFoundError:
    return {}


def _recorded(last: dict) -> str:
  """The last logged train loss, validation loss (and a VLM's answer
  accuracy) and tokens/s, each with its step (`last`: from
  `_last_recorded`)."""
  if 'loss' not in last and 'val_loss' not in last:
    return 'no metrics in metrics.jsonl'
  shown = []
  for key, name, fmt in (('loss', 'train loss', '.4f'),
                         ('val_loss', 'validation loss', '.4f'),
                         ('val_accuracy', 'answer accuracy', '.1%'),
                         ('tokens_per_s', 'tokens/s', ',.0f')):
    if key in last:
      step, value = last[key]
      shown.append(f'{name} {value:{fmt}} (step {step})')
    elif key == 'val_loss':
      shown.append('no evaluation yet')
  return ', '.join(shown)


def _complete_message(summary: dict, argv) -> str:
  """What a rerun of a finished run says: its last metrics, how to go on."""
  step = summary['step']
  args = sys.argv[1:] if argv is None else list(argv)
  command = shlex.join(['python', 'train.py', *args, '--set',
                        f'train.steps={2 * step}'])
  return (f"the run in {summary['run_dir']} is complete: its checkpoint is at"
          f" step {step}, train.steps={summary['train_steps']}; nothing to"
          ' train.\n'
          '  last recorded: ' + _recorded(summary['last_recorded']) + '\n'
          f'  to train further, raise train.steps (the cosine schedule is'
          f' recomputed for the new length): {command}')


def _estimate(config, limit) -> int:
  from coat_jax.training import memory  # noqa: PLC0415
  from coat_jax.training import planning  # noqa: PLC0415

  mem = planning.estimate(config, limit=limit)
  print(mem.format())
  memory.check_fits(mem, config)  # a ValueError names the options
  return 0


def _find_max_batch(config, limit, policies) -> int:
  from coat_jax import recipes  # noqa: PLC0415
  from coat_jax.models import remat  # noqa: PLC0415
  from coat_jax.training import config as config_lib  # noqa: PLC0415
  from coat_jax.training import memory  # noqa: PLC0415
  from coat_jax.training import planning  # noqa: PLC0415

  limit = memory.device_limit() if limit is None else limit
  if limit is None:
    raise ValueError('--find-max-batch needs the device memory: this device'
                     ' reports none (CPU); pass --memory-limit-gib.')
  names = (planning.usable_policies() if policies is None
           else tuple(p for p in policies.split(',') if p))
  for name in names:
    remat.check_policy(name, '--policies')
  recipe = config_lib.recipe(config.model)
  print(f'largest train.batch_size within {limit / memory.GIB:.2f} GiB per'
        f' device (seq_len {config.data.seq_len}, model.recipe='
        f'{recipes.name_of(recipe) or recipe}):')
  # The configured layer layout first, then the other: unrolled layers run
  # faster, scanned ones with remat 'full' keep the least
  # (docs/decisions.md#scanned).
  configured = config_lib.architecture(config.model).scan_layers

  def progress(batch, mem, seconds):
    size = ('out of memory while compiling' if mem is None else
            f'{memory.format_size(mem.total).strip()}, '
            + ('fits' if mem.fits else 'too large'))
    print(f'    batch {batch}: {size} (compiled in {seconds:.1f} s)',
          flush=True)

  for scan in (configured, not configured):
    config.model.scan_layers = scan
    layout = f'model.scan_layers={str(scan).lower()}'
    for name in names:
      config.model.remat = name
      try:
        batch = planning.find_max_batch(config, limit, progress=progress)
      except ValueError as e:  # e.g. unrolled layers under deterministic ops
        if scan == configured:
          raise
        print(f'  {layout}: cannot run here: {e}', flush=True)
        break
      print(f'  {layout} model.remat={name}: '
            + (f'train.batch_size={batch}' if batch else 'does not fit at'
               f' the smallest batch'
               f' ({planning.batch_unit(config, _num_devices())})'),
            flush=True)
  return 0


def _num_devices() -> int:
  import jax  # noqa: PLC0415

  return jax.device_count()


if __name__ == '__main__':
  sys.exit(main())
