"""Step-addressed batches over a token file (`grain.MapDataset`) and their assembly into global `jax.Array`s."""
from __future__ import annotations

from typing import Sequence

import numpy as np

from jaxpar.data.cache import DataInfo, open_tokens
from jaxpar.data.common import DataError, check_split


class Batches:
    """Global batches of `[seq_len + 1]`-token rows; row r of batch `step` is a pure function of (step, r).

    split="train": position p = step * global_batch + r of the grain-shuffled sample order, reshuffled each epoch
    (epoch = p // num_samples). split="val": no shuffle; batch i is samples [i*B, (i+1)*B) modulo num_samples.

    After `resume_at(step0, samples0)` (a resume whose checkpoint was written with another global batch size) the
    position is p = samples0 + (step - step0) * global_batch + r: the order continues right after the samples0
    positions already consumed, none repeated or skipped. The default origin (0, 0) gives p = step * global_batch + r.

    Raises (on construction, before anything compiles):
      DataError: token file missing/empty/wrong size, an id >= vocab_size (default: info.vocab_size), or fewer
        than seq_len + 1 tokens in the split.
    """

    def __init__(self, info: DataInfo, split: str, seq_len: int, global_batch: int, seed: int = 0, *,
                 vocab_size: int | None = None):
        import grain

        self.split, self.seq_len, self.global_batch = check_split(split), int(seq_len), int(global_batch)
        if self.seq_len < 1 or self.global_batch < 1:
            raise DataError(f"seq_len={seq_len} and global_batch={global_batch} must be >= 1.")
        n = info.num_tokens(split)
        if n < self.seq_len + 1:
            fix = f"lower model.seq_len to <= {n - 1} or " if n >= 2 else ""
            fix += "raise data.val_fraction or use a bigger corpus" if split == "val" else "use a bigger corpus"
            raise DataError(f"the {split} split has {n} tokens ({info.path(split)}), fewer than one sequence of "
                            f"model.seq_len + 1 = {self.seq_len + 1}; {fix}.")
        self.tokens = open_tokens(info.path(split), info.dtype, vocab_size or info.vocab_size, n)
        self.num_samples = (n - 1) // self.seq_len
        order = grain.MapDataset.range(self.num_samples)
        if self.split == "train":
            order = order.shuffle(seed=int(seed) % 2**32)
        self.order = order.repeat()  # reseeds the shuffle every epoch
        self.dataset = self.order.map(self._window)
        self.origin_step, self.origin_sample = 0, 0  # batch `origin_step` starts at position `origin_sample`

    def resume_at(self, step: int, samples: int) -> None:
        """Make batch `step` start at position `samples` of the order (the samples consumed before it), so batches
        from `step` on continue the order with this global batch size; batches before `step` are then unavailable.

        Raises:
          ValueError: `step` or `samples` < 0.
        """
        step, samples = int(step), int(samples)
        if step < 0 or samples < 0:
            raise ValueError(f"resume_at needs step >= 0 and samples >= 0; got {step=}, {samples=}.")
        self.origin_step, self.origin_sample = step, samples

    def samples_before(self, step: int) -> int:
        """Positions of the order consumed before batch `step` (what a checkpoint of step `step` records)."""
        return self.origin_sample + (int(step) - self.origin_step) * self.global_batch

    def _window(self, i: int) -> np.ndarray:
        return np.asarray(self.tokens[i * self.seq_len:(i + 1) * self.seq_len + 1], np.int32)

    def _positions(self, step: int, start: int, stop: int | None) -> range:
        stop = self.global_batch if stop is None else stop
        if step < self.origin_step or not 0 <= start <= stop <= self.global_batch:
            raise ValueError(f"need step >= {self.origin_step} and 0 <= start <= stop <= {self.global_batch}; got "
                             f"{step=}, {start=}, {stop=}.")
        base = self.samples_before(step)
        return range(base + start, base + stop)

    def indices(self, step: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Sample indices of rows start..stop of batch `step`: int64 [stop - start]."""
        return np.asarray([self.order[p] for p in self._positions(step, start, stop)], np.int64)

    def rows(self, step: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Rows start..stop (default: all) of global batch `step`: int32 [stop - start, seq_len + 1].

        Inputs are `rows[:, :-1]`, targets `rows[:, 1:]`. Reads only these rows from the token file.
        """
        pos = self._positions(step, start, stop)
        if not pos:
            return np.zeros((0, self.seq_len + 1), np.int32)
        return np.stack([self.dataset[p] for p in pos])

    def val_batch(self, i: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Fixed validation batch i (wraps around a small val split): int32 [stop - start, seq_len + 1]."""
        if self.split != "val":
            raise ValueError("val_batch needs Batches(..., split='val').")
        return self.rows(i, start, stop)

    def epoch(self, step: int) -> float:
        """Epochs completed at the start of batch `step` (fractional)."""
        return self.samples_before(step) / self.num_samples


def process_rows(sharding, global_batch: int) -> tuple[int, int]:
    """The contiguous range [start, stop) of global-batch rows that this process's devices hold.

    `sharding` is the `jax.sharding.Sharding` of the `[global_batch, seq]` batch; the sequence axis must not be
    split across processes.

    Raises:
      ValueError: the rows held locally are not one contiguous range.
    """
    seq = len(sharding.device_set)  # any sequence length divisible by every split of that axis
    indices = sharding.addressable_devices_indices_map((global_batch, seq)).values()
    return _contiguous_rows([idx[0] if idx else slice(None) for idx in indices], global_batch)


def _contiguous_rows(slices: Sequence[slice], global_batch: int) -> tuple[int, int]:
    spans = sorted(s.indices(global_batch)[:2] for s in slices)
    if not spans:
        raise ValueError("the sharding has no devices on this process.")
    start, stop = spans[0]
    for a, b in spans[1:]:
        if a > stop:
            raise ValueError(f"this process holds rows {spans} of the global batch of {global_batch}: not one "
                             f"contiguous range; order the mesh so each process's devices hold neighbouring rows.")
        stop = max(stop, b)
    return start, stop


def to_global(local_rows: np.ndarray, sharding, global_batch: int):
    """Assemble the global `jax.Array` [global_batch, ...] from this process's rows `process_rows(...)`.

    Raises:
      ValueError: `local_rows` has the wrong number of rows for this process.
    """
    import jax

    start, stop = process_rows(sharding, global_batch)
    if local_rows.shape[0] != stop - start:
        raise ValueError(f"this process holds rows [{start}, {stop}) = {stop - start} rows, got {local_rows.shape[0]}.")
    return jax.make_array_from_process_local_data(sharding, local_rows, (global_batch, *local_rows.shape[1:]))
