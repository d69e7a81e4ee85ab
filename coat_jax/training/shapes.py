"""Image-question-answer data drawn on the host: coloured shapes on a grid.

Each image is black with 1 to `max_objects` shapes (circle, square,
triangle) in six colours, each in its own cell of a 3 x 3 grid (jittered
and sized within it), no (colour, shape) twice. Each image comes with one
question about it and a one-word answer:

  color of triangle?                  red
  shape of blue?                      square
  count circles?                      2
  count green?                        0
  white square left or right?         left      (objects off the middle
  red circle top or bottom?           bottom     column / row)
  red circle left of blue square?     yes       (objects in different
  red circle above blue square?       no         columns / rows)

A referent is always unique in its image ("the triangle" is asked only of
an image with one triangle). Text is bytes (ids < 256): the question,
left-padded with `PAD` to `question_len`, then the answer and `END`,
right-padded to `answer_len`. The loss counts the answer's tokens and its
END (`Batch.loss_mask`), so accuracy is exact match of the answer
(`answer_accuracy`).

A batch is a function of (split, seed, index, batch_size), drawn from
`np.random.default_rng([seed, index, split == 'val'])` as
`coat_jax.training.data.TokenDataset`'s windows are, so the data position
is the step. The splits never share a generator seed, nor a scene layout
(which colour and shape in which cell): one layout in `HELD_OUT` is
held out (`held_out`), so held-out accuracy is measured on scenes never
seen in training. Scenes and pixels are vectorized numpy over the batch
(each object drawn in its own cell's window); only the question strings
are made per image.
"""

import dataclasses
from typing import Any
from typing import ClassVar
from typing import NamedTuple

import numpy as np

from coat_jax.models import vit
from coat_jax.models import vlm

COLORS = {'red': (230, 25, 75), 'green': (60, 180, 75),
          'blue': (0, 130, 200), 'yellow': (255, 225, 25),
          'purple': (145, 30, 180), 'white': (255, 255, 255)}
COLOR_NAMES = tuple(COLORS)
SHAPES = ('circle', 'square', 'triangle')
GRID = 3  # cells per side
# Pixels per cell side at least: below, a small circle can come out as a
# filled square.
MIN_CELL = 10
PAD = 0
END = ord('\n')
BYTE_VOCAB = 256
SPLITS = ('train', 'val')
# One scene layout in HELD_OUT is the held-out split's (`held_out`).
HELD_OUT = 8
# Pixels to [-1, 1]: (x / 255 - 0.5) / 0.5, SigLIP's normalization.

_RGB = np.array(list(COLORS.values()), np.uint8)
# Whether pixels at offsets (dy, dx) from a shape's centre are inside it,
# r its half-extent: SHAPES' circle, square, triangle (apex up).
_INSIDE = (
    lambda dy, dx, r: dy ** 2 + dx ** 2 <= r ** 2,
    lambda dy, dx, r: (np.abs(dy) <= 0.8 * r) & (np.abs(dx) <= 0.8 * r),
    lambda dy, dx, r: (np.abs(dy) <= r) & (np.abs(dx) <= (dy + r) / 2),
)
# The questions, by kind; the answers are `_ask`'s.
_TEMPLATES = {
    'color': 'color of {}?', 'shape': 'shape of {}?',
    'count_shape': 'count {}s?', 'count_color': 'count {}?',
    'side': '{} {} left or right?', 'height': '{} {} top or bottom?',
    'left_of': '{} {} left of {} {}?', 'above': '{} {} above {} {}?'}
_ANSWERS = (COLOR_NAMES + SHAPES + tuple(str(i) for i in range(GRID ** 2 + 1))
            + ('left', 'right', 'top', 'bottom', 'yes', 'no'))


class Scenes(NamedTuple):
  """The objects of B images, K = max_objects slots an image.

  Attributes:
    present: (B, K) bool; the first n of each row are set (n >= 1).
    color: (B, K) int index into COLOR_NAMES.
    shape: (B, K) int index into SHAPES.
    row: (B, K) int grid row (0: top).
    col: (B, K) int grid column (0: left).
    cy: (B, K) float32 centre row, in pixels.
    cx: (B, K) float32 centre column, in pixels.
    size: (B, K) float32 half-extent of the shape, in pixels.
  """

  present: np.ndarray
  color: np.ndarray
  shape: np.ndarray
  row: np.ndarray
  col: np.ndarray
  cy: np.ndarray
  cx: np.ndarray
  size: np.ndarray


class Sample(NamedTuple):
  """B images with their questions and answers, before encoding."""

  scenes: Scenes
  pixels: np.ndarray  # (B, S, S, 3) uint8
  questions: list[str]
  answers: list[str]


class Batch(NamedTuple):
  """A training batch.

  Attributes:
    images: (B, S, S, 3) normalized to [-1, 1], float32 or bfloat16 (or
      the uint8 pixels: `ShapesDataset.encode`).
    tokens: (B, T) int32 text: question (left-padded), answer, END, PAD.
    targets: (B, T) int32 next token of each position (PAD at the last).
    loss_mask: (B, T) bool, True where the target is an answer token or
      its END.
  """

  images: np.ndarray
  tokens: np.ndarray
  targets: np.ndarray
  loss_mask: np.ndarray


@dataclasses.dataclass(frozen=True)
class ShapesDataset:
  """Procedural shapes images with questions; see the module docstring.

  Attributes:
    image_size: height and width S of the images, in pixels (>= 30).
    max_objects: most shapes in an image, 1 to 9.
    text_len: text tokens per example, PAD after the answer (None: the
      fewest, question_len + answer_len); a VLM pads so that its image
      tokens and text fill a length its attention kernels take.
  """

  vocab_size: ClassVar[int] = BYTE_VOCAB

  image_size: int = 32
  max_objects: int = 4
  text_len: int | None = None

  def __post_init__(self):
    if (not isinstance(self.image_size, int)
        or self.image_size < MIN_CELL * GRID):
      raise ValueError(
          f'image_size={self.image_size!r} must be an int >='
          f' {MIN_CELL * GRID} (grid cells of {MIN_CELL} pixels or more).')
    if (not isinstance(self.max_objects, int)
        or not 1 <= self.max_objects <= GRID ** 2):
      raise ValueError(f'max_objects={self.max_objects!r} must be an int in'
                       f' [1, {GRID ** 2}] (one shape a grid cell).')
    fewest = self.question_len + self.answer_len
    if self.text_len is not None and (
        not isinstance(self.text_len, int) or self.text_len < fewest):
      raise ValueError(f'text_len={self.text_len!r} must be an int >='
                       f' {fewest} (the longest question and answer), or'
                       ' None.')

  @property
  def question_len(self) -> int:
    """Bytes of the longest question (questions are left-padded to it)."""
    c = max(COLOR_NAMES, key=len)
    s = max(SHAPES, key=len)
    return max(len(q) for q in (_question('left_of', c, s, c, s),
                                _question('side', c, s),
                                _question('count_color', c)))

  @property
  def answer_len(self) -> int:
    """Bytes of the longest answer and its END."""
    return max(map(len, _ANSWERS)) + 1

  @property
  def seq_len(self) -> int:
    """Text tokens T of a batch: text_len, or question_len + answer_len."""
    return self.text_len or self.question_len + self.answer_len

  @property
  def cell(self) -> int:
    """Pixels per grid cell side."""
    return self.image_size // GRID

  def _scenes(self, split: str, seed: int, index: int,
              batch_size: int) -> tuple[Scenes, np.ndarray]:
    """(The scenes of batch `index` of `split`, (B, 2) uniforms that pick
    each image's question): candidate scenes drawn in blocks, those of the
    other split dropped (`held_out`)."""
    if split not in SPLITS:
      raise ValueError(f'split={split!r} must be one of {SPLITS}.')
    if batch_size < 1:
      raise ValueError(f'batch_size={batch_size} must be >= 1.')
    val = split == 'val'
    rng = np.random.default_rng([seed, index, val])
    blocks, found = [], 0
    while found < batch_size:
      # About 1/HELD_OUT of the candidates are held out.
      scenes = self._candidates(rng, batch_size * (2 * HELD_OUT if val
                                                    else 2))
      keep = held_out(scenes) == val
      blocks.append(Scenes(*(a[keep] for a in scenes)))
      found += int(keep.sum())
    scenes = Scenes(*(np.concatenate(a)[:batch_size] for a in zip(*blocks)))
    return scenes, rng.random((batch_size, 2))

  def _candidates(self, rng: np.random.Generator, b: int) -> Scenes:
    """b random scenes of either split."""
    k, cell = self.max_objects, self.cell
    n = rng.integers(1, k + 1, size=b)
    cells = np.argsort(rng.random((b, GRID ** 2)), axis=1)[:, :k]
    pairs = np.argsort(rng.random((b, len(COLORS) * len(SHAPES))),
                       axis=1)[:, :k]
    size = (cell * rng.uniform(0.32, 0.45, (b, k))).astype(np.float32)
    jitter = rng.uniform(-1, 1, (b, k, 2)).astype(np.float32)
    row, col = cells // GRID, cells % GRID
    offset = (self.image_size - GRID * cell) // 2
    room = cell / 2 - size  # the shape stays inside its cell
    return Scenes(
        present=np.arange(k)[None] < n[:, None],
        color=pairs // len(SHAPES), shape=pairs % len(SHAPES),
        row=row, col=col,
        cy=offset + (row + 0.5) * cell + jitter[..., 0] * room,
        cx=offset + (col + 0.5) * cell + jitter[..., 1] * room,
        size=size)

  def draw(self, scenes: Scenes) -> np.ndarray:
    """(B, S, S, 3) uint8 pixels of the scenes.

    Each object is drawn in its own grid cell's (cell, cell) window, all
    objects of the batch at once.
    """
    b = scenes.present.shape[0]
    s, cell = self.image_size, self.cell
    img, obj = np.nonzero(scenes.present)
    pick = lambda a: a[img, obj]
    row, col, shape = pick(scenes.row), pick(scenes.col), pick(scenes.shape)
    offset = (s - GRID * cell) // 2
    # Pixel centres relative to each object's centre: (N, cell, 1) rows
    # and (N, 1, cell) columns.
    centres = np.arange(cell, dtype=np.float32) + 0.5
    dy = (offset + row * cell)[:, None] + centres - pick(scenes.cy)[:, None]
    dx = (offset + col * cell)[:, None] + centres - pick(scenes.cx)[:, None]
    dy, dx = dy[:, :, None], dx[:, None, :]
    r = pick(scenes.size)[:, None, None]
    inside = np.empty((len(img), cell, cell), bool)
    for i, test in enumerate(_INSIDE):
      sel = shape == i
      inside[sel] = test(dy[sel], dx[sel], r[sel])
    cells = np.zeros((b, GRID, GRID, cell, cell, 3), np.uint8)
    cells[img, row, col] = inside[..., None] * _RGB[pick(scenes.color)][
        :, None, None]
    pixels = np.zeros((b, s, s, 3), np.uint8)
    end = offset + GRID * cell
    pixels[:, offset:end, offset:end] = cells.transpose(
        0, 1, 3, 2, 4, 5).reshape(b, GRID * cell, GRID * cell, 3)
    return pixels

  def sample(self, split: str, seed: int, index: int,
             batch_size: int) -> Sample:
    """Batch `index` of `split` as pixels and strings."""
    scenes, u = self._scenes(split, seed, index, batch_size)
    qa = [_ask(scenes, i, u[i]) for i in range(batch_size)]
    return Sample(scenes, self.draw(scenes), [q for q, _ in qa],
                  [a for _, a in qa])

  def encode(self, sample: Sample, dtype: Any = np.float32) -> Batch:
    """The `Batch` of a `Sample`: images normalized in `dtype` (np.uint8:
    the pixels as they are, to normalize on the device with `vit.normalize`,
    a quarter of float32's bytes to transfer), text as bytes."""
    lq = self.question_len
    rows = b''.join(
        q.encode().rjust(lq, bytes([PAD]))
        + (a.encode() + bytes([END])).ljust(self.seq_len - lq, bytes([PAD]))
        for q, a in zip(sample.questions, sample.answers, strict=True))
    tokens = np.frombuffer(rows, np.uint8).reshape(-1, self.seq_len)
    tokens = tokens.astype(np.int32)
    targets = np.concatenate(
        [tokens[:, 1:], np.full((len(tokens), 1), PAD, np.int32)], axis=1)
    answer = np.array([len(a) for a in sample.answers])
    t = np.arange(self.seq_len)[None]
    # Position t predicts token t + 1: the answer's bytes and END.
    loss_mask = (t >= lq - 1) & (t < lq + answer[:, None])
    images = (sample.pixels if np.dtype(dtype) == np.uint8
              else vit.normalize(sample.pixels, dtype))
    return Batch(images, tokens, targets, loss_mask)

  def batch(self, split: str, seed: int, index: int, batch_size: int,
            dtype: Any = np.float32) -> Batch:
    """Batch `index` of `split` (the step, for 'train'), deterministic in
    (split, seed, index, batch_size)."""
    return self.encode(self.sample(split, seed, index, batch_size), dtype)


def held_out(scenes: Scenes) -> np.ndarray:
  """(B,) bool: whether each scene belongs to the held-out split.

  A scene's layout (which colour and shape in which grid cell, not the
  sizes and jitter) is written as an integer, one base-19 digit a cell (0:
  empty, else 1 + colour * 3 + shape), mixed by splitmix64's finalizer; a
  scene is held out when that is 0 modulo HELD_OUT. So the split of a
  scene depends on its layout alone and no layout occurs in both splits.
  """
  b, k = np.nonzero(scenes.present)
  digits = np.zeros((scenes.present.shape[0], GRID ** 2), np.uint64)
  digits[b, scenes.row[b, k] * GRID + scenes.col[b, k]] = (
      1 + scenes.color[b, k] * len(SHAPES) + scenes.shape[b, k])
  x = digits @ (np.uint64(len(COLORS) * len(SHAPES) + 1)
                ** np.arange(GRID ** 2, dtype=np.uint64))
  x ^= x >> np.uint64(30)
  x *= np.uint64(0xBF58476D1CE4E5B9)
  x ^= x >> np.uint64(27)
  x *= np.uint64(0x94D049BB133111EB)
  x ^= x >> np.uint64(31)
  return x % np.uint64(HELD_OUT) == 0


def _question(kind: str, *names: str) -> str:
  """The question text of `kind` about the named colours and shapes."""
  return _TEMPLATES[kind].format(*names)


def _ask(scenes: Scenes, i: int, u: np.ndarray) -> tuple[str, str]:
  """(question, answer) about image i: u[0] picks the kind among those the
  image can answer, u[1] the objects."""
  n = int(scenes.present[i].sum())
  color, shape = scenes.color[i, :n], scenes.shape[i, :n]
  row, col = scenes.row[i, :n], scenes.col[i, :n]
  objs = range(n)
  pairs = [(a, b) for a in objs for b in objs if a != b]
  unique = lambda values, k: int((values == values[k]).sum()) == 1
  candidates = {
      'color': [k for k in objs if unique(shape, k)],
      'shape': [k for k in objs if unique(color, k)],
      'count_shape': list(range(len(SHAPES))),
      'count_color': list(range(len(COLORS))),
      'side': [k for k in objs if col[k] != GRID // 2],
      'height': [k for k in objs if row[k] != GRID // 2],
      'left_of': [p for p in pairs if col[p[0]] != col[p[1]]],
      'above': [p for p in pairs if row[p[0]] != row[p[1]]],
  }
  kinds = [kind for kind in _TEMPLATES if candidates[kind]]
  kind = kinds[int(u[0] * len(kinds))]
  pick = candidates[kind][int(u[1] * len(candidates[kind]))]
  name = lambda k: (COLOR_NAMES[color[k]], SHAPES[shape[k]])
  if kind == 'color':
    return _question(kind, SHAPES[shape[pick]]), COLOR_NAMES[color[pick]]
  if kind == 'shape':
    return _question(kind, COLOR_NAMES[color[pick]]), SHAPES[shape[pick]]
  if kind == 'count_shape':
    return _question(kind, SHAPES[pick]), str(int((shape == pick).sum()))
  if kind == 'count_color':
    return _question(kind, COLOR_NAMES[pick]), str(int((color == pick).sum()))
  if kind == 'side':
    return (_question(kind, *name(pick)),
            'left' if col[pick] < GRID // 2 else 'right')
  if kind == 'height':
    return (_question(kind, *name(pick)),
            'top' if row[pick] < GRID // 2 else 'bottom')
  a, b = pick
  if kind == 'left_of':
    return _question(kind, *name(a), *name(b)), _yes(col[a] < col[b])
  return _question(kind, *name(a), *name(b)), _yes(row[a] < row[b])


def _yes(value: bool) -> str:
  return 'yes' if value else 'no'


def answer_accuracy(model: vlm.VLM, dataset: ShapesDataset, seed: int, *,
                    num_batches: int, batch_size: int,
                    split: str = 'val') -> float:
  """Exact-match answer accuracy of greedy decoding on batches 0 to
  num_batches - 1 of `split`.

  The model reads each image and question and generates answer_len bytes
  greedily (among the 256 byte ids); an answer is right when its bytes and
  END all match (what follows END is not read).

  Returns:
    The fraction of right answers, in [0, 1].
  """
  if num_batches < 1:
    raise ValueError(f'num_batches={num_batches} must be >= 1.')
  lq, la = dataset.question_len, dataset.answer_len
  right = 0
  for index in range(num_batches):
    batch = dataset.batch(split, seed, index, batch_size)
    got = np.asarray(vlm.greedy_decode(
        model, batch.images, batch.tokens[:, :lq], la,
        vocab_limit=BYTE_VOCAB))
    want = batch.tokens[:, lq:lq + la]
    counted = batch.loss_mask[:, lq - 1:lq - 1 + la]
    right += int(np.all((got == want) | ~counted, axis=1).sum())
  return right / (num_batches * batch_size)
