"""The shapes image-question data: determinism, disjoint splits, the text
layout, and every answer re-derived from the pixels alone."""

import re

import ml_dtypes
import numpy as np
import pytest

from coat_jax.models import vit
from coat_jax.training import shapes

SEED = 7101
BATCH = 64


def _cells(pixels: np.ndarray, ds: shapes.ShapesDataset):
  """{(row, col): (colour, shape)} of one image, read from its pixels: the
  colour of a cell's non-black pixels (one colour a cell), the shape from
  their bounding box (a square fills it; a triangle, apex up, has at least
  twice as many pixels in its lower half as in its upper half; a circle
  neither)."""
  cell = ds.cell
  offset = (ds.image_size - shapes.GRID * cell) // 2
  rgb = {v: k for k, v in shapes.COLORS.items()}
  found = {}
  for row in range(shapes.GRID):
    for col in range(shapes.GRID):
      y, x = offset + row * cell, offset + col * cell
      window = pixels[y:y + cell, x:x + cell]
      on = window.any(-1)
      if not on.any():
        continue
      colours = {tuple(int(c) for c in v) for v in window[on]}
      assert len(colours) == 1, (row, col, colours)
      ys, xs = np.nonzero(on)
      box = on[ys.min():ys.max() + 1, xs.min():xs.max() + 1]
      half = box.shape[0] // 2
      lower, upper = box[-half:].sum(), box[:half].sum()
      shape = ('square' if box.all() else
               'triangle' if lower >= 1.75 * upper else 'circle')
      found[row, col] = (rgb[colours.pop()], shape)
  return found


def _answer_from_pixels(question: str, cells: dict) -> str:
  """The answer to `question` from the objects found in the pixels."""
  objs = [(c, s, row, col) for (row, col), (c, s) in cells.items()]

  def find(colour, shape):
    (obj,) = [o for o in objs if o[:2] == (colour, shape)]
    return obj

  middle = shapes.GRID // 2
  if m := re.fullmatch(r'color of (\w+)\?', question):
    (obj,) = [o for o in objs if o[1] == m[1]]
    return obj[0]
  if m := re.fullmatch(r'shape of (\w+)\?', question):
    (obj,) = [o for o in objs if o[0] == m[1]]
    return obj[1]
  if m := re.fullmatch(r'count (\w+)s\?', question):
    if m[1] in shapes.SHAPES:
      return str(sum(o[1] == m[1] for o in objs))
  if m := re.fullmatch(r'count (\w+)\?', question):
    return str(sum(o[0] == m[1] for o in objs))
  if m := re.fullmatch(r'(\w+) (\w+) left or right\?', question):
    col = find(m[1], m[2])[3]
    assert col != middle
    return 'left' if col < middle else 'right'
  if m := re.fullmatch(r'(\w+) (\w+) top or bottom\?', question):
    row = find(m[1], m[2])[2]
    assert row != middle
    return 'top' if row < middle else 'bottom'
  m = re.fullmatch(r'(\w+) (\w+) (left of|above) (\w+) (\w+)\?', question)
  a, b = find(m[1], m[2]), find(m[4], m[5])
  axis = 3 if m[3] == 'left of' else 2
  assert a[axis] != b[axis]
  return 'yes' if a[axis] < b[axis] else 'no'


@pytest.mark.parametrize('image_size', [32, 224])
def test_answers_follow_from_the_pixels(image_size):
  """Every answer equals the one read off the pixels (colours by value,
  shapes by their outline, positions by grid cell), and every object's
  centre pixel has its colour."""
  ds = shapes.ShapesDataset(image_size=image_size)
  batches = 6 if image_size == 32 else 1
  kinds = set()
  for index in range(batches):
    for split in shapes.SPLITS:
      sample = ds.sample(split, SEED, index, BATCH)
      sc = sample.scenes
      for i in range(BATCH):
        cells = _cells(sample.pixels[i], ds)
        n = int(sc.present[i].sum())
        assert cells == {
            (int(sc.row[i, k]), int(sc.col[i, k])):
                (shapes.COLOR_NAMES[sc.color[i, k]],
                 shapes.SHAPES[sc.shape[i, k]]) for k in range(n)}
        for k in range(n):
          centre = sample.pixels[i, int(sc.cy[i, k]), int(sc.cx[i, k])]
          assert tuple(centre) == shapes.COLORS[
              shapes.COLOR_NAMES[sc.color[i, k]]]
        question, answer = sample.questions[i], sample.answers[i]
        assert _answer_from_pixels(question, cells) == answer, question
        kinds.add(re.sub(r'(red|green|blue|yellow|purple|white|circle|'
                         r'square|triangle)s?', 'X', question))
  if image_size == 32:  # 768 questions: every kind comes up
    assert kinds == {'color of X?', 'shape of X?', 'count X?',
                     'X X left or right?', 'X X top or bottom?',
                     'X X left of X X?', 'X X above X X?'}


def test_answers_vary():
  """Over 1024 questions: each kind's answers take several values (yes and
  no, left and right, counts 0 to 2 at least, every colour and shape)."""
  ds = shapes.ShapesDataset()
  answers = []
  for index in range(16):
    answers += ds.sample('train', SEED, index, BATCH).answers
  counts = {a: answers.count(a) for a in set(answers)}
  for word in (*shapes.COLOR_NAMES, *shapes.SHAPES, 'yes', 'no', 'left',
               'right', 'top', 'bottom', '0', '1', '2'):
    assert counts.get(word, 0) >= 5, (word, counts)


def test_batches_are_deterministic_in_split_seed_and_index():
  ds = shapes.ShapesDataset()
  a = ds.batch('train', SEED, 3, 8)
  b = ds.batch('train', SEED, 3, 8)
  for x, y in zip(a, b, strict=True):
    np.testing.assert_array_equal(x, y)
  for split, seed, index in (('train', SEED, 4), ('train', SEED + 1, 3),
                             ('val', SEED, 3)):
    other = ds.batch(split, seed, index, 8)
    assert not np.array_equal(a.images, other.images)


def test_splits_share_no_scene_layout():
  """No layout (which colour and shape in which cell, read from the
  pixels) of 8 held-out batches occurs in 32 train batches, and about one
  scene layout in HELD_OUT is held out."""
  ds = shapes.ShapesDataset()
  layouts = {
      split: {frozenset(_cells(pixels, ds).items())
              for index in range(batches)
              for pixels in ds.sample(split, SEED, index, BATCH).pixels}
      for split, batches in (('train', 32), ('val', 8))}
  assert len(layouts['train']) > 1200 and len(layouts['val']) > 300
  assert not layouts['train'] & layouts['val']
  candidates = ds._candidates(np.random.default_rng(SEED), 100_000)
  fraction = shapes.held_out(candidates).mean()
  assert abs(fraction - 1 / shapes.HELD_OUT) < 0.01, fraction


def test_text_layout_and_loss_mask():
  """tokens: the question left-padded to question_len, the answer, END,
  PAD; targets: tokens shifted by one; loss_mask: exactly the answer's
  bytes and END among the targets."""
  ds = shapes.ShapesDataset()
  sample = ds.sample('train', SEED, 0, 16)
  batch = ds.encode(sample)
  lq, la = ds.question_len, ds.answer_len
  assert batch.tokens.shape == batch.targets.shape == batch.loss_mask.shape
  assert batch.tokens.shape == (16, ds.seq_len)
  assert batch.tokens.dtype == batch.targets.dtype == np.int32
  assert batch.loss_mask.dtype == bool
  assert 0 <= batch.tokens.min() and batch.tokens.max() < shapes.BYTE_VOCAB
  np.testing.assert_array_equal(batch.targets[:, :-1], batch.tokens[:, 1:])
  assert (batch.targets[:, -1] == shapes.PAD).all()
  for i, (q, a) in enumerate(zip(sample.questions, sample.answers)):
    row = bytes(batch.tokens[i].astype(np.uint8))
    assert row == (q.encode().rjust(lq, b'\0')
                   + (a.encode() + b'\n').ljust(la, b'\0'))
    picked = bytes(batch.targets[i][batch.loss_mask[i]].astype(np.uint8))
    assert picked == a.encode() + b'\n'
    assert np.flatnonzero(batch.loss_mask[i])[0] == lq - 1
  assert max(map(len, sample.questions)) <= lq


def test_images_normalized_in_the_dtype_asked_for():
  ds = shapes.ShapesDataset()
  sample = ds.sample('val', SEED, 0, 4)
  f32 = ds.encode(sample).images
  assert f32.dtype == np.float32 and f32.shape == (4, 32, 32, 3)
  np.testing.assert_allclose(f32, sample.pixels / 127.5 - 1, atol=1e-6)
  assert f32.min() == -1.0  # the black background
  bf16 = ds.encode(sample, ml_dtypes.bfloat16).images
  assert bf16.dtype == ml_dtypes.bfloat16
  np.testing.assert_array_equal(bf16, f32.astype(ml_dtypes.bfloat16))
  raw = ds.encode(sample, np.uint8).images
  np.testing.assert_array_equal(raw, sample.pixels)
  np.testing.assert_array_equal(vit.normalize(raw), f32)


def test_bad_arguments():
  with pytest.raises(ValueError, match='image_size=29 must be an int >= 30'):
    shapes.ShapesDataset(image_size=29)
  with pytest.raises(ValueError, match=r'max_objects=10 must be an int in'):
    shapes.ShapesDataset(max_objects=10)
  ds = shapes.ShapesDataset()
  with pytest.raises(ValueError, match=r"split='test' must be one of"):
    ds.batch('test', SEED, 0, 4)
  with pytest.raises(ValueError, match='batch_size=0 must be >= 1'):
    ds.batch('train', SEED, 0, 0)


def test_text_len_pads_after_the_answer_and_counts_nothing_more():
  plain = shapes.ShapesDataset()
  padded = shapes.ShapesDataset(text_len=plain.seq_len + 7)
  a = plain.batch('train', SEED, 3, 8)
  b = padded.batch('train', SEED, 3, 8)
  assert b.tokens.shape == (8, plain.seq_len + 7) == padded.batch(
      'val', SEED, 0, 8).tokens.shape
  np.testing.assert_array_equal(b.tokens[:, :plain.seq_len], a.tokens)
  assert (b.tokens[:, plain.seq_len:] == shapes.PAD).all()
  np.testing.assert_array_equal(b.loss_mask[:, :plain.seq_len], a.loss_mask)
  assert not b.loss_mask[:, plain.seq_len:].any()
  np.testing.assert_array_equal(b.images, a.images)
  for bad in (plain.seq_len - 1, 60.0):
    with pytest.raises(ValueError, match='text_len'):
      shapes.ShapesDataset(text_len=bad)
