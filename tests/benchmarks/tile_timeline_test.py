"""benchmarks/tile_timeline.py: reading Mosaic GPU profiler buffers."""

import numpy as np
import pytest

from benchmarks import tile_timeline

NAMES = {'Init': 0, 'wait': 1, 'issue': 2, 'epilogue': 3, 'load': 4}
EXIT = 1 << 31


def _buffer(ctas, k_steps, tiles, start_clock, capacity=4000):
  """A (ctas, 4, capacity) profiler buffer of a made-up kernel: compute
  warpgroup w starts 7 * w cycles late; each step waits 5 cycles (50 at a
  tile's first step), issues for 10 and lasts 800; a 300-cycle epilogue
  ends each tile; the memory warpgroup loads every 400 cycles."""
  buf = np.zeros((ctas, 4, capacity), np.uint32)
  for cta in range(ctas):
    for wg in range(4):
      events = []
      t = start_clock + (7 * wg if wg < 3 else 0)

      def span(name, start, end):
        events.extend([NAMES[name], start % 2**32,
                       NAMES[name] | EXIT, end % 2**32])
      span('Init', t, t + 20)
      t += 20
      if wg < 3:
        for tile in range(tiles):
          for k in range(k_steps):
            wait = 50 if k == 0 and tile else 5
            span('wait', t, t + wait)
            span('issue', t + wait, t + wait + 10)
            t += 800
          span('epilogue', t, t + 300)
          t += 300
      else:
        for _ in range(2 * k_steps * tiles):
          span('load', t, t + 3)
          t += 400
      events = events[:capacity - 3]
      buf[cta, wg, :3] = (123, cta, len(events))
      buf[cta, wg, 3:3 + len(events)] = events
  return buf


@pytest.mark.parametrize('start_clock', [1000, 2**32 - 5000])  # and a wrap
def test_summary_of_a_known_timeline(start_clock):
  k_steps, tiles = 8, 3
  out = tile_timeline.summarize(
      (_buffer(2, k_steps, tiles, start_clock), NAMES), k_steps)
  assert out['ctas'] == 2
  assert out['tile_period'] == k_steps * 800 + 300
  assert out['epilogue'] == 300
  assert out['step_period'] == 800
  assert out['steady_wait'] == 5
  assert out['first_wait'] == 50
  # Last issue at step start + 5 (its wait); the epilogue at step end.
  assert out['last_step'] == 795
  assert out['boundary'] == 795 + 300 + 50
  assert out['boundary_over_step'] == 795 + 300 + 50 - 800
  assert out['epilogue_to_next_issue'] == 50
  assert out['epilogue_skew'] == 14  # warpgroups 0 and 2
  assert out['tensor_gap'] == 795 + 300 + 50 - 14
  # Tile t + 1's first load (index 2 * k_steps * (t + 1)) against tile t's
  # first epilogue start, for the two tiles followed by one.
  lead = [20 + 2 * k_steps * (t + 1) * 400
          - (20 + (t + 1) * k_steps * 800 + t * 300) for t in range(2)]
  assert out['next_load_vs_epilogue'] == np.median(lead)
  assert out['Init_compute'] == out['Init_memory'] == 20
  # Warpgroup 2's last epilogue ends last: 14 cycles after warpgroup 0's.
  assert out['kernel_cycles'] == 20 + 14 + tiles * (k_steps * 800 + 300)


def test_a_truncated_buffer_drops_the_open_range():
  """Events past the buffer's capacity are dropped (bounds-checked
  profiling): a range whose exit is missing is not reported."""
  k_steps = 8
  buf = _buffer(1, k_steps, 3, 1000, capacity=3 + 4 * 30 + 2)
  spans = tile_timeline.ranges((buf, NAMES))
  for wg in range(4):
    assert all(end >= start for _, start, end in spans[(0, wg)])
  assert len(spans[(0, 0)]) == 30
  out = tile_timeline.summarize((buf, NAMES), k_steps)
  assert 'tile_period' not in out  # one epilogue recorded at most
