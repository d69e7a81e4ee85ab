"""Trains a Llama with COAT FP8 training. `python train.py` runs the default.

  python train.py
  python train.py --config configs/llama_1b.py --set model.precision=bf16 \
      train.batch_size=16
"""

import argparse
import os
import sys


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
  args = parser.parse_args(argv)
  _maybe_initialize_distributed()

  from coat_jax import training  # noqa: PLC0415 (after distributed init)

  try:
    config = training.apply_overrides(training.load_config(args.config),
                                      args.set)
    summary = training.train(config)
  except (ValueError, TypeError, FileNotFoundError,
          training.NonFiniteError) as e:
    print(f'error: {e}', file=sys.stderr)
    return 2
  mem = summary['peak_memory_bytes']
  print(f"done: step {summary['step']}, train loss {summary['train_loss']:.4f},"
        f" validation loss {summary['val_loss']:.4f},"
        f" {summary['tokens_per_s']:,.0f} tokens/s, peak device memory "
        + (f'{mem / 2**30:.2f} GiB' if mem else 'n/a (not reported here)')
        + f", skipped non-finite steps {summary['nonfinite_steps']};"
        f" run dir {summary['run_dir']}")
  return 130 if summary['interrupted'] else 0


if __name__ == '__main__':
  sys.exit(main())
