"""The optimizer step per 2^28 float32 params: coat_jax's optimizers
against optax.adamw (RESULTS.md "optimizer").

  PYTHONPATH=. python benchmarks/optimizer.py [--quick] [--only NAME ...]
      [--out results.jsonl]

In one run, on 16 leaves of 4096 x 4096 float32 params (2^28), each variant
jitted with params and state donated: optax.adamw + apply_updates (the
baseline), the same in optax.chain(clip_by_global_norm, .), coat_adamw +
apply_updates with implementation='xla' (the jnp reference) and None (one
Pallas pass per leaf on a Hopper GPU), both alone and after clipping,
fused_coat_adamw (params updated in place by the kernel), and fp8_states
around optax.lion and optax.adam. Prints ms per step
(`kernels.time_call`), the ratio to optax.adamw's time, the state's bytes
per param, and a correctness column: after 3 steps from the same params and
gradients, max |p - p_ref| / max |p_ref - p0| against the variant's
reference (the 'xla' coat_adamw for the COAT rows, the float32 inner
optimizer for fp8_states), so a broken kernel cannot post a good time.
"""

import argparse
import json
import os

import jax
import jax.numpy as jnp
import optax

from benchmarks.kernels import time_call
import coat_jax

LEAVES = 16
SIDE = int(os.environ.get('BENCH_SIDE', 4096))  # 2^28 params; smaller: dry runs
LR, WD = 1e-3, 0.1
CHECK_STEPS = 3


def _params(leaves, side):
  keys = jax.random.split(jax.random.key(0), leaves)
  return {f'w{i:02d}': jax.random.normal(k, (side, side), jnp.float32) * 0.02
          for i, k in enumerate(keys)}


def _grads(params):
  return jax.tree.map(
      lambda p: jax.random.normal(jax.random.key(1), p.shape) * 1e-3, params)


def _optax_step(tx):
  """(step(carry, g) -> carry, init(params) -> carry) for an optax tx."""

  def step(carry, g):
    p, s = carry
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s

  return step, lambda p: (p, tx.init(p))


def _fused_step(implementation):
  apply = coat_jax.optim.fused_coat_adamw(
      LR, weight_decay=WD, implementation=implementation)
  init = coat_jax.coat_adamw(LR, weight_decay=WD).init

  def step(carry, g):
    p, s = carry
    return apply(g, s, p)

  return step, lambda p: (p, init(p))


def _clip(tx):
  return optax.chain(optax.clip_by_global_norm(1.0), tx)


def _coat(implementation):
  return coat_jax.coat_adamw(LR, weight_decay=WD,
                             implementation=implementation)


# name -> (make (step, init), reference name or None)
VARIANTS = {
    'optax.adamw': (lambda: _optax_step(optax.adamw(LR, weight_decay=WD)),
                    None),
    'chain(clip, optax.adamw)': (
        lambda: _optax_step(_clip(optax.adamw(LR, weight_decay=WD))), None),
    'coat_adamw xla': (lambda: _optax_step(_coat('xla')), None),
    'coat_adamw kernel (None)': (lambda: _optax_step(_coat(None)),
                                 'coat_adamw xla'),
    'chain(clip, coat_adamw) xla': (lambda: _optax_step(_clip(_coat('xla'))),
                                    None),
    'chain(clip, coat_adamw) kernel': (
        lambda: _optax_step(_clip(_coat(None))),
        'chain(clip, coat_adamw) xla'),
    'fused_coat_adamw (in place)': (lambda: _fused_step(None),
                                    'coat_adamw xla'),
    'optax.lion': (lambda: _optax_step(optax.lion(LR * 0.1, weight_decay=WD)),
                   None),
    'fp8_states(optax.lion)': (
        lambda: _optax_step(coat_jax.fp8_states(
            optax.lion(LR * 0.1, weight_decay=WD))), 'optax.lion'),
    'optax.adam': (lambda: _optax_step(optax.adam(LR)), None),
    'fp8_states(optax.adam)': (
        lambda: _optax_step(coat_jax.fp8_states(optax.adam(LR))),
        'optax.adam'),
}


def _run_steps(step, init, params, g, steps):
  """Params after `steps` un-donated steps (the check, not timed)."""
  carry = init(params)
  jitted = jax.jit(step)
  for _ in range(steps):
    carry = jitted(carry, g)
  return carry[0]


def _rel_diff(p, ref, p0):
  num = max(float(jnp.max(jnp.abs(a - b)))
            for a, b in zip(jax.tree.leaves(p), jax.tree.leaves(ref)))
  den = max(float(jnp.max(jnp.abs(b - c)))
            for b, c in zip(jax.tree.leaves(ref), jax.tree.leaves(p0)))
  return num / den if den else float('inf')


def main():
  parser = argparse.ArgumentParser(description=__doc__.split('\n\n')[0])
  parser.add_argument('--quick', action='store_true',
                      help='fewer timed runs (same sizes, same warm-up)')
  parser.add_argument('--out', help='append the results as JSON lines')
  parser.add_argument('--only', nargs='*', help='variant names to run')
  args = parser.parse_args()
  unknown = set(args.only or ()) - set(VARIANTS)
  if unknown:
    parser.error(f'--only: {sorted(unknown)} are not among {list(VARIANTS)}.')
  print(f'jax {jax.__version__}, {jax.devices()[0].device_kind}, '
        f'{LEAVES} x {SIDE}x{SIDE} float32 params')
  timing = dict(warm_s=2.0, iters=5, repeats=5) if args.quick else dict(
      warm_s=3.0, iters=10, repeats=21)
  params = _params(LEAVES, SIDE)
  n = sum(p.size for p in jax.tree.leaves(params))
  g = _grads(params)
  finals = {}
  results = []
  for name in args.only or VARIANTS:
    _measure(name, VARIANTS[name], params, g, n, finals, results, timing)
  _report(results, args)


def _measure(name, variant, params, g, n, finals, results, timing):
  """Checks the variant against its reference, then times it."""
  make, ref_name = variant
  step, init = make()
  # Correctness first, on the same shapes as the timed step.
  finals[name] = _run_steps(step, init, params, g, CHECK_STEPS)
  err = None
  if ref_name is not None:
    if ref_name not in finals:
      ref_step, ref_init = VARIANTS[ref_name][0]()
      finals[ref_name] = _run_steps(ref_step, ref_init, params, g,
                                    CHECK_STEPS)
    err = _rel_diff(finals[name], finals[ref_name], params)
  carry = init(jax.tree.map(jnp.copy, params))
  state_bytes = sum(x.nbytes for x in jax.tree.leaves(carry[1])) / n
  s = time_call(jax.jit(step, donate_argnums=0), None, carry=(carry, g),
                **timing)
  del carry
  results.append(dict(name=name, ms=s * 1e3, state_bytes_per_param=(
      state_bytes), check_vs=ref_name, rel_diff=err))
  print(f'  {name:38s} {s * 1e3:8.3f} ms', flush=True)


def _report(results, args):
  base = next((r['ms'] for r in results if r['name'] == 'optax.adamw'), None)
  print(f'\n{"variant":38s} {"ms":>8s} {"x adamw":>8s} {"B/param":>8s}'
        f'  check (max |p - ref| / max |ref - p0| after {CHECK_STEPS} steps)')
  for r in results:
    ratio = f'{r["ms"] / base:8.3f}' if base else f'{"-":>8s}'
    check = ('' if r['rel_diff'] is None
             else f'{r["rel_diff"]:.2e} vs {r["check_vs"]}')
    print(f'{r["name"]:38s} {r["ms"]:8.3f} {ratio} '
          f'{r["state_bytes_per_param"]:8.3f}  {check}')
  if args.out:
    with open(args.out, 'a') as f:
      for r in results:
        f.write(json.dumps(dict(r, device=jax.devices()[0].device_kind,
                                quick=args.quick)) + '\n')


if __name__ == '__main__':
  main()
