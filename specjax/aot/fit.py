"""What fits where: the largest batch at a context that a compiled program fits in.

`largest_batch(lower, target)` searches the batch by compiling for the target
and reading `memory_analysis` (arguments + temporaries + outputs − aliases +
code, per device, against the chip's memory; a TPU compiler that runs out of
memory refuses, which counts as not fitting): two compiles give the bytes per
row (a program's memory is affine in its batch), a third checks the predicted
largest batch, and strides up or a bisection settle it where the prediction
was off. `predicted_batch` makes the first guess cheaply for a deep model:
its memory is affine in the batch and in the depth (plus their product, the
cache), so four compiles at two small depths predict the full depth's
largest batch, which the search then checks at full depth. Nothing runs.
"""

from __future__ import annotations

from specjax.aot import analysis
from specjax.aot.targets import Target


def _bytes(lower, target: Target, batch: int) -> int | None:
  """Per-device bytes of the program at `batch`, or None where it does not compile."""
  result = analysis.compile_for(lambda: lower(batch), target)
  if result["compiled"] is None:
    return None
  total = analysis.memory(result["compiled"], target)["total_bytes"]
  analysis.free(result)
  return total


def predicted_batch(
  lower, target: Target, layers: int, step: int = 1, depths: tuple[int, int] = (1, 2)
) -> int | None:
  """The largest batch (a multiple of `step`) that a `layers`-deep model's program
  is predicted to fit in, from four compiles at two depths (`depths`: a drafter
  may need a few target layers) and batches `step` and `2 * step` (bytes = a +
  b·B + c·L + d·B·L, exact for the weights and caches); None where one does not
  compile. `lower(batch, depth)` lowers the program."""
  at = {}
  for depth in depths:
    for batch in (step, 2 * step):
      total = _bytes(lambda b, depth=depth: lower(b, depth), target, batch)
      if total is None:
        return None
      at[depth, batch] = total

  def extrapolate(values: dict[int, float]) -> float:
    d1, d2 = depths
    return values[d1] + (layers - d1) * (values[d2] - values[d1]) / (d2 - d1)

  row_bytes = extrapolate({d: (at[d, 2 * step] - at[d, step]) / step for d in depths})
  fixed = extrapolate(
    {d: at[d, step] - step * (at[d, 2 * step] - at[d, step]) / step for d in depths}
  )
  if row_bytes <= 0:
    return None
  return int((target.chip.memory_bytes - fixed) // row_bytes) // step * step


def largest_batch(
  lower,
  target: Target,
  step: int = 1,
  limit: int = 4096,
  guess: int | None = None,
  probe: int = 1,
) -> dict:
  """The largest batch (a multiple of `step`, the mesh's data-parallel size, at
  most `limit`) whose program fits one device of `target`.

  Args:
    lower: `batch -> jax.stages.Lowered` (the program at that batch, for target).
    guess: a first guess (`predicted_batch`): checked first, in place of the
      two probes that otherwise predict it.
    probe: the probes' batches are `probe * step` and twice that: a compiler's
      buffer reuse makes the bytes per row at one or two rows overstate them at
      many.

  Returns:
    `{"batch": int (0: not even `step` rows fit), "bytes": per-device bytes at
    that batch, "bytes_per_row", "compiles": how many compiles the search took}`.
  """
  capacity = target.chip.memory_bytes
  compiles = 0

  def fits(b: int) -> int | None:
    """The bytes at batch `b` where it compiles and fits, else None."""
    nonlocal compiles
    compiles += 1
    total = _bytes(lower, target, b)
    return total if total is not None and total <= capacity else None

  per_row = None
  if guess is not None and guess >= step:
    good, good_bytes, bad = 0, None, None
    guess = min(limit, guess // step * step)
  else:
    first = min(limit, probe * step)
    one = fits(first)
    if one is None:  # not even the first probe: search below it
      good, good_bytes = _settle(fits, 0, None, first, step, limit)
      return dict(batch=good, bytes=good_bytes, bytes_per_row=None, compiles=compiles)
    two = fits(2 * first) if 2 * first <= limit else None
    if two is None:
      good, good_bytes = _settle(fits, first, one, 2 * first, step, limit)
      return dict(batch=good, bytes=good_bytes, bytes_per_row=None, compiles=compiles)
    per_row = max(two - one, 1) / first
    good, good_bytes, bad = 2 * first, two, None
    guess = min(limit, (2 * first + int((capacity - two) / per_row)) // step * step)
  if guess > good:
    at = fits(guess)
    if at is None:
      bad = guess
    else:
      good, good_bytes = guess, at
  good, good_bytes = _settle(fits, good, good_bytes, bad, step, limit)
  return dict(batch=good, bytes=good_bytes, bytes_per_row=per_row, compiles=compiles)


def _settle(fits, good: int, good_bytes, bad: int | None, step: int, limit: int):
  """`(batch, bytes)`: the largest batch that fits, from `good` (fits, or 0) and
  `bad` (does not, or None: unknown). Upward from `good` by doubling strides
  until one does not fit or the limit (the prediction may be short), then a
  bisection between the two."""
  stride = step
  while bad is None and good + stride <= limit:
    at = fits(good + stride)
    if at is None:
      bad = good + stride
    else:
      good, good_bytes, stride = good + stride, at, 2 * stride
  while bad is not None and bad - good > step:
    mid = max(step, (good + bad) // 2 // step * step)
    at = fits(mid)
    if at is None:
      bad = mid
    else:
      good, good_bytes = mid, at
  return good, good_bytes
