"""Step-addressed batches over the blended sources (`grain.MapDataset` orders), read ahead in a thread, and their
assembly into global `jax.Array`s."""
from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import numpy as np

from jaxpar.data import tokens
from jaxpar.data.common import DataError, check_split
from jaxpar.data.packing import Packed, pairs_per_row
from jaxpar.data.preprocess import DataInfo


class Blend:
    """Megatron-style deterministic blending: position p of the blended order -> (source k, its position j).

    Each block of P positions holds exactly c_k = round(w_k P) of source k (largest remainders), spread evenly: the
    j-th of them sits where (j + 1/2) / c_k falls in the block. So every prefix is within a few samples of the weights,
    and p -> (k, j) is a pure function."""

    def __init__(self, weights, period: int = 10_000):
        w = np.asarray(weights, np.float64)
        period = 1 if len(w) == 1 else period
        raw = w / w.sum() * period
        counts = np.floor(raw).astype(np.int64)
        counts[np.argsort(counts - raw)[:period - counts.sum()]] += 1  # largest remainders
        if np.any(counts == 0):
            raise DataError(f"blend weights {w.tolist()}: a weight below 1/{period} of the total draws no sample in "
                            f"{period}; raise it or drop that source.")
        times = np.concatenate([(np.arange(c) + 0.5) / c for c in counts])
        src = np.concatenate([np.full(c, k) for k, c in enumerate(counts)])
        rank = np.concatenate([np.arange(c) for c in counts])
        order = np.lexsort((src, times))
        self.period, self.counts, self.src, self.rank = period, counts, src[order], rank[order]
        self.before = np.stack([np.cumsum(self.src == k) - (self.src == k) for k in range(len(w))])  # [K, P]

    def __call__(self, positions):
        """positions int64 `[n]` -> (source int64 `[n]`, position in that source's order int64 `[n]`)."""
        b, o = np.divmod(np.asarray(positions, np.int64), self.period)
        k = self.src[o]
        return k, b * self.counts[k] + self.rank[o]

    def consumed(self, positions: int) -> np.ndarray:
        """Samples of each source among the first `positions` positions: int64 `[K]`."""
        b, o = divmod(int(positions), self.period)
        return b * self.counts + (self.before[:, o] if o else 0)


class Order:
    """The order of a blend of sources' samples, shared by token and image batches: source k's samples (`num_samples`
    of each) in a grain shuffle (seed, k), reshuffled each epoch of k, for split="train"; in order for "val".
    Position p of the blended order (`Blend`, by `weights`) is p = step * global_batch + r, or after
    `resume_at(step0, samples0)` (a resume with another global batch size) p = samples0 + (step - step0) *
    global_batch + r: none repeated or skipped."""

    def __init__(self, num_samples, weights, split: str, seed: int, global_batch: int):
        import grain

        self.num_samples, self.global_batch = list(num_samples), int(global_batch)
        self.orders = []
        for k, n in enumerate(self.num_samples):
            order = grain.MapDataset.range(n)
            if split == "train":
                order = order.shuffle(seed=(int(seed) + 1_000_003 * k) % 2**32)
            self.orders.append(order.repeat())  # reseeds the shuffle every epoch
        self.blend = Blend(weights)
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

    def positions(self, step: int, start: int, stop: int | None) -> np.ndarray:
        """The positions of rows start..stop (default: all) of batch `step`."""
        stop = self.global_batch if stop is None else stop
        if step < self.origin_step or not 0 <= start <= stop <= self.global_batch:
            raise ValueError(f"need step >= {self.origin_step} and 0 <= start <= stop <= {self.global_batch}; got "
                             f"{step=}, {start=}, {stop=}.")
        base = self.samples_before(step)
        return np.arange(base + start, base + stop, dtype=np.int64)

    def samples(self, step: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        """(source, sample index) of rows start..stop of batch `step`: int64 [stop - start, 2]."""
        k, j = self.blend(self.positions(step, start, stop))
        i = [self.orders[a][b] for a, b in zip(k.tolist(), j.tolist())]
        return np.stack([k, np.asarray(i, np.int64)], axis=1).reshape(-1, 2)

    def consumed(self, step: int) -> np.ndarray:
        """Samples drawn from each source before batch `step`."""
        return self.blend.consumed(self.samples_before(step))

    def epoch(self, step: int) -> float:
        """Epochs of the largest-share source completed at the start of batch `step` (fractional)."""
        return float(max(u / n for u, n in zip(self.consumed(step), self.num_samples)))


class Batches:
    """Global batches of `[seq_len + 1]`-token rows from the blended sources; row r of batch `step` is a pure function
    of (step, r).

    Each source's split (train: its first documents; val: its last) is cut into windows: sample i is its tokens
    `[i*L, i*L + L + 1)` (L = seq_len; inputs and targets shifted by one). split="train": source k's samples in a
    grain shuffle (seed, k), reshuffled each epoch of k; val: in order. Position p of the blended order
    (`Blend`) is p = step * global_batch + r, or after `resume_at(step0, samples0)` (a resume with another global
    batch size) p = samples0 + (step - step0) * global_batch + r: none repeated or skipped.

    packing="documents" adds `segments` int32 `[n, seq_len + 1]`: the document of each token, counted from the row's
    first (a document cut by the window's start begins at position 0).

    Raises (on construction, before anything compiles):
      DataError: a source's split with fewer than seq_len + 1 tokens, or an id >= vocab_size.
    """

    def __init__(self, info: DataInfo, split: str, seq_len: int, global_batch: int, seed: int = 0, *,
                 vocab_size: int | None = None, packing: str = "concat", truncate: str = "right",
                 pairs: bool = False):
        self.split, self.seq_len, self.global_batch = check_split(split), int(seq_len), int(global_batch)
        if self.seq_len < 1 or self.global_batch < 1:
            raise DataError(f"seq_len={seq_len} and global_batch={global_batch} must be >= 1.")
        sources, self.parts = info.parts(split)
        names = [s.name for s, _ in sources]
        self.packing = packing
        self.names = [n if names.count(n) == 1 else f"{n}{k}" for k, n in enumerate(names)]  # unique log keys
        for (source, _), part, name in zip(sources, self.parts, self.names):
            if packing != "bfd":
                _check_enough(source, part, split, self.seq_len)
                if part.stream.masks is not None:
                    raise DataError(f"source {name} holds conversations or prompt/completion records: they are "
                                    f"packed whole, never cut into windows; set --config.data.packing=bfd.")
            if source.kind in ("megatron", "tokens"):
                part.stream.check_ids(vocab_size or info.vocab_size)
        self.vocab_size = vocab_size or info.vocab_size
        self.packed = [Packed(p, self.seq_len + 1, truncate, f"{n} ({src.path}, its {split} split)", pairs)
                       for p, n, (src, _) in zip(self.parts, self.names, sources)] if packing == "bfd" else None
        self.num_samples = [p.num_samples for p in self.packed] if self.packed else \
            [(p.num_tokens - 1) // self.seq_len for p in self.parts]
        self.order = Order(self.num_samples, [s.weight for s, _ in sources], self.split, seed, self.global_batch)

    # the order's (`Order`): the same for image batches
    def resume_at(self, step: int, samples: int) -> None:
        self.order.resume_at(step, samples)

    def samples_before(self, step: int) -> int:
        return self.order.samples_before(step)

    def samples(self, step: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        return self.order.samples(step, start, stop)

    def epoch(self, step: int) -> float:
        return self.order.epoch(step)

    def tokens_by_source(self, step: int) -> dict:
        """Training tokens drawn from each source before batch `step`: {source name: tokens}."""
        n = self.order.consumed(step) * self.seq_len
        return {f"tokens/{name}": int(v) for name, v in zip(self.names, n)}

    def rows(self, step: int, start: int = 0, stop: int | None = None) -> dict:
        """Rows start..stop (default: all) of global batch `step`: {"tokens": int32 [n, seq_len + 1]} (+ "segments"
        with packing="documents"). Inputs are `tokens[:, :-1]`, targets `tokens[:, 1:]`. Reads only these rows."""
        L = self.seq_len
        samples = self.samples(step, start, stop)
        if self.packed:
            return self._packed_rows(step, samples)
        tokens = np.zeros((len(samples), L + 1), np.int32)
        seg = np.zeros_like(tokens) if self.packing == "documents" else None
        for k in np.unique(samples[:, 0]):
            rows = np.nonzero(samples[:, 0] == k)[0]
            part = self.parts[k]
            starts = part.start + samples[rows, 1] * L
            window = part.stream.windows(starts, L + 1)
            if window.max() >= self.vocab_size or window.min() < 0:
                raise DataError(f"batch {step}: source {self.names[k]} holds an id outside [0, {self.vocab_size}): "
                                f"it was tokenized with another tokenizer; give that one (data.tokenizer).")
            tokens[rows] = window
            if seg is not None:
                seg[rows] = part.stream.segments(starts, L + 1)
        return {"tokens": tokens} | ({} if seg is None else {"segments": seg})

    def _packed_rows(self, step: int, samples: np.ndarray) -> dict:
        """Packed rows (`data.packing = "bfd"`); the mask per target (`mask[:, 1:]`, what the step reads)."""
        out = {}
        for k in np.unique(samples[:, 0]):
            rows = np.nonzero(samples[:, 0] == k)[0]
            for key, v in self.source_rows(k, samples[rows, 1]).items():
                out.setdefault(key, np.zeros((len(samples), *v.shape[1:]), v.dtype))[rows] = v
        if out["tokens"].max(initial=0) >= self.vocab_size:
            raise DataError(f"batch {step}: a record holds an id outside [0, {self.vocab_size}): it was tokenized "
                            f"with another tokenizer; give that one (data.tokenizer).")
        return out

    def source_rows(self, k: int, indices) -> dict:
        """Packed rows `indices` of source k as a batch holds them (the mask per target, `mask[:, 1:]`)."""
        rows = self.packed[k].rows(indices)
        return {**rows, "mask": rows["mask"][:, 1:]}

    def packing_counts(self) -> dict:
        """{truncated, skipped, sequences, rows} of the packed sources (zeros without `bfd`)."""
        parts = self.packed or []
        return {"truncated": sum(p.truncated for p in parts), "skipped": sum(p.skipped for p in parts),
                "sequences": sum(p.sizes.size for p in parts), "rows": sum(p.num_samples for p in parts)}

    def val_batch(self, i: int, start: int = 0, stop: int | None = None) -> dict:
        """Fixed validation batch i (wraps around a small val split): as `rows`."""
        if self.split != "val":
            raise ValueError("val_batch needs Batches(..., split='val').")
        return self.rows(i, start, stop)

    def check_loss_tokens(self, batches: int) -> None:
        """Refuse validation batches 0 .. `batches` - 1 (`eval.batches`) that hold no token the loss counts (DPO: no
        pair whose chosen and rejected sequences both have one), when the data is prepared rather than at the first
        evaluation; reads the batches until one counts (the first, as a rule). Windows (no `bfd`): every target
        counts.

        Raises:
          DataError: `no_loss_tokens`."""
        if not self.packed:
            return
        if not any(loss_weight(self.val_batch(i), self.packed[0].pairs) > 0 for i in range(int(batches))):
            raise no_loss_tokens(batches)

    def tokens_in(self, rows: dict) -> int:
        """The real tokens of host rows (`real_tokens`): what throughput counts."""
        return real_tokens(rows)



def _check_enough(source, part, split: str, seq_len: int) -> None:
    n = part.num_tokens
    if n >= seq_len + 1:
        return
    label = source.kind if source.kind == "shakespeare" else f"{source.kind}:{source.path}"
    fix = f"lower model.seq_len to <= {n - 1}, or " if n >= 2 else ""
    if split == "val":
        fix += ("raise data.val_fraction, split files into more documents (data.doc_separator), or use more data"
                if n else "raise data.val_fraction or give the source more documents (data.doc_separator)")
    elif n == 0:
        fix += (f"the validation split took all {part.stream.num_docs} of its documents: split its files into more "
                f"documents (e.g. --config.data.doc_separator='\\n\\n'), or add files")
    else:
        fix += "give the source more data, or drop it from data.sources"
    raise DataError(f"data source {label}: its {split} split has {n} tokens ({part.stream.num_docs} documents in "
                    f"all), fewer than one sequence of model.seq_len + 1 = {seq_len + 1}; {fix}.")


class Prefetch:
    """`fn(step, *args)` for the next `depth` steps (before `stop`), computed ahead in one background thread (depth
    0: inline), so reading the next batches overlaps the device's step. `waited_s` sums the time a caller spent blocked."""

    def __init__(self, fn, depth: int, stop: int | None = None):
        self.fn, self.depth, self.stop, self.pending, self.waited_s = fn, int(depth), stop, {}, 0.0
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="jaxpar-data") if self.depth else None

    def __call__(self, step: int, *args):
        t0 = time.perf_counter()
        try:
            if self.pool is None:
                return self.fn(step, *args)
            for s in [s for s in self.pending if s < step]:
                self.pending.pop(s).cancel()
            last = step + self.depth + 1 if self.stop is None else max(min(step + self.depth + 1, self.stop), step + 1)
            for s in range(step, last):
                if s not in self.pending:
                    self.pending[s] = self.pool.submit(self.fn, s, *args)
            return self.pending.pop(step).result()
        finally:
            self.waited_s += time.perf_counter() - t0

    def close(self):
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


def real_tokens(rows: dict) -> int:
    """The input tokens of host rows (`tokens[:, :-1]`) that are not padding: a token with a negative segment id
    belongs to no document (padding); without segments every token is real. What throughput counts."""
    seg = rows.get("segments")
    if seg is None:
        return int(rows["tokens"][:, :-1].size)
    return int(np.count_nonzero(seg[:, :-1] >= 0))


def loss_weight(rows: dict, pairs: bool = False) -> int:
    """What the step divides a batch's loss by, from its host rows: the targets the loss counts (the mask, but for a
    segment's first token, never predicted from the one before: `train/step.split_batch`), or (`pairs`, DPO) the
    preference pairs (segments 2k, 2k + 1 of a row) whose chosen and rejected sequences both have such a target."""
    seg = rows["segments"]
    mask = (rows["mask"] > 0) & (seg[:, 1:] == seg[:, :-1])
    if not pairs:
        return int(mask.sum())
    rows_at, at = np.nonzero(mask)
    counted = np.zeros((seg.shape[0], 2 * pairs_per_row(seg.shape[1] - 1)), np.int64)
    np.add.at(counted, (rows_at, seg[:, :-1][rows_at, at]), 1)
    return int(((counted[:, 0::2] > 0) & (counted[:, 1::2] > 0)).sum())


def no_loss_tokens(batches: int) -> DataError:
    """The error of validation batches whose loss would be a mean over nothing."""
    return DataError(f"the {int(batches)} validation batches (eval.batches) hold no token the loss counts: give more "
                     f"validation data (data.val_fraction) or more batches, or check the data's loss masks.")


def batch_shapes(global_batch: int, seq_len: int, packing: str, ref_dtype=None) -> dict:
    """{name: (shape, dtype)} of a global batch as `Batches.rows` gives it; `ref_dtype`: with DPO's precomputed
    reference sums (`ref`) in that dtype."""
    out = {"tokens": ((global_batch, seq_len + 1), np.int32)}
    if packing != "concat":
        out["segments"] = ((global_batch, seq_len + 1), np.int32)
    if packing == "bfd":
        out["mask"] = ((global_batch, seq_len), np.int32)
    if ref_dtype is not None:
        out["ref"] = ((global_batch, pairs_per_row(seq_len), 2), ref_dtype)
    return out


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
