"""Test setup: 8 fake CPU devices (set before jax is imported), GPU marks,
the `seed` of randomized tests and the `pick_pallas` fixture."""

import os

os.environ['XLA_FLAGS'] = (
    os.environ.get('XLA_FLAGS', '')
    + ' --xla_force_host_platform_device_count=8').strip()

import contextlib  # noqa: E402
import tempfile  # noqa: E402

# Many tests build the same small programs; a persistent cache shared by the
# test workers compiles each once. Set for jax (read when it is imported) and
# for the train.py processes the tests start, which then keep it rather than
# train.compilation_cache_dir's default in the home directory.
os.environ['JAX_COMPILATION_CACHE_DIR'] = os.path.join(
    tempfile.gettempdir(), 'coat_jax_test_compilation_cache')

import jax  # noqa: E402
import pytest  # noqa: E402

import pallas_kernels  # noqa: E402
from pallas_kernels import _device  # noqa: E402

jax.config.update('jax_persistent_cache_min_compile_time_secs', 0.5)

SEED_VARIABLE = 'COAT_TEST_SEED'


def _seed() -> int:
  """COAT_TEST_SEED from the environment (an integer), 0 if unset."""
  value = os.environ.get(SEED_VARIABLE, '0')
  try:
    return int(value)
  except ValueError:
    raise pytest.UsageError(
        f'{SEED_VARIABLE}={value!r}: expected an integer (the seed of the'
        ' randomized tests), e.g. COAT_TEST_SEED=1.') from None


def pytest_report_header(config):
  del config
  return (f'{SEED_VARIABLE}={_seed()}: the seed of every randomized test'
          ' (set it to draw other inputs; a failure reports it)')


@pytest.fixture(scope='session')
def seed() -> int:
  """The seed of a randomized test's inputs: COAT_TEST_SEED (default 0).

  Every test that draws random inputs derives them from it, so that a run
  is reproducible and another seed draws other inputs. A failing test that
  used it reports it (`pytest_runtest_makereport` below).
  """
  return _seed()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
  del call
  report = yield
  if report.failed and 'seed' in getattr(item, 'fixturenames', ()):
    report.sections.append((
        'random seed', f'{SEED_VARIABLE}={_seed()} reproduces this'
        " test's inputs"))
  return report


@pytest.fixture
def pick_pallas():
  """Call it to make every kernel call with implementation=None, for the
  rest of the test, run its Pallas kernel interpreted (the path the
  defaults take on one Hopper GPU): `pallas_kernels.use_implementation`."""
  with contextlib.ExitStack() as stack:
    yield lambda: stack.enter_context(
        pallas_kernels.use_implementation('pallas', interpret=True))


def pytest_collection_modifyitems(config, items):
  del config
  if _device.is_hopper():
    return
  skip = pytest.mark.skip(reason='needs a Hopper (H100/H200) GPU')
  for item in items:
    if 'gpu' in item.keywords:
      item.add_marker(skip)
