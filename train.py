"""Trains a Llama with COAT FP8 training. `python train.py` runs the default.

  python train.py
  python train.py --config configs/llama_1b.py --set model.precision=bf16 \
      train.batch_size=16
"""

import argparse
import os
import shlex
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
  print(f"done: step {summary['step']}, train loss {summary['train_loss']:.4f},"
        f" validation loss {summary['val_loss']:.4f},"
        f" {summary['tokens_per_s']:,.0f} tokens/s, peak device memory "
        + (f'{mem / 2**30:.2f} GiB' if mem else 'n/a (not reported here)')
        + f", skipped non-finite steps {summary['nonfinite_steps']};"
        f" run dir {summary['run_dir']}")
  return 130 if summary['interrupted'] else 0


def _complete_message(summary: dict, argv) -> str:
  """What a rerun of a finished run says: its last metrics, how to go on."""
  last = summary['last_recorded']
  shown = []
  for key, name, fmt in (('loss', 'train loss', '.4f'),
                         ('val_loss', 'validation loss', '.4f'),
                         ('tokens_per_s', 'tokens/s', ',.0f')):
    if key in last:
      step, value = last[key]
      shown.append(f'{name} {value:{fmt}} (step {step})')
  step = summary['step']
  args = sys.argv[1:] if argv is None else list(argv)
  command = shlex.join(['python', 'train.py', *args, '--set',
                        f'train.steps={2 * step}'])
  return (f"the run in {summary['run_dir']} is complete: its checkpoint is at"
          f" step {step}, train.steps={summary['train_steps']}; nothing to"
          ' train.\n'
          '  last recorded: ' + (', '.join(shown) or 'no metrics in'
                                 ' metrics.jsonl') + '\n'
          f'  to train further, raise train.steps (the cosine schedule is'
          f' recomputed for the new length): {command}')


if __name__ == '__main__':
  sys.exit(main())
