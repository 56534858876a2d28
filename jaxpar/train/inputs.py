"""A run's data, opened for training: the sources prepared once (process 0 first, the others then find them in the
cache) and read as the objective's data (`Objective.data_kinds`: images, preference pairs, documents and
conversations; RL's prompt records) into train and validation batches (`open_data`); what packing did, said once (`say_packing`)."""
from __future__ import annotations

import jax

from jaxpar import data
from jaxpar.cluster import distributed
from jaxpar.data import prompts
from jaxpar.train import objectives


def open_data(config) -> tuple:
    """(the prepared data's info, its train and val batches, the model's vocabulary: a ViT's classes): the sources
    prepared once (process 0 first, then the others find them in the cache)."""
    B, T, seed, d = int(config.train.global_batch_size), int(config.model.seq_len), int(config.train.seed), config.data
    kinds = objectives.from_config(config).data_kinds
    if "prompts" in kinds:  # RL: prompt records, sampled from each round (`jaxpar/rl/rounds.py`)
        info, splits = distributed.process_0_first(lambda: prompts.read(config), "jaxpar/prepare")
        return info, splits, data.model_vocab(config, info.vocab_size)
    if "images" in kinds:
        info = distributed.process_0_first(lambda: data.prepare_images(config), "jaxpar/prepare")
        m = config.model
        splits = tuple(data.ImageBatches(info, split, B, seed, image_size=m.image_size, channels=m.channels,
                                         mean=d.image_mean, std=d.image_std, augment=d.augment,
                                         num_classes=m.num_classes) for split in ("train", "val"))
        return info, splits, splits[0].num_classes
    info = distributed.process_0_first(lambda: data.prepare(config), "jaxpar/prepare")
    vocab = data.model_vocab(config, info.vocab_size)
    splits = tuple(data.Batches(info, split, T, B, seed, vocab_size=vocab, packing=d.packing, truncate=d.truncate,
                                pairs="pairs" in kinds) for split in ("train", "val"))
    splits[1].check_loss_tokens(int(config.eval.batches))  # before compiling, not at the first evaluation
    return info, splits, vocab


def say_packing(train_data, val_data) -> None:
    """With `data.packing = "bfd"`: how the sequences went into rows, and how many were cut or left out."""
    if not getattr(train_data, "packed", None) or jax.process_index() != 0:
        return
    for split, d in (("train", train_data), ("val", val_data)):
        c = d.packing_counts()
        what = "preference pairs" if d.packed[0].pairs else "sequences"
        print(f"jaxpar: {split}: {c['sequences']:,} {what} packed into {c['rows']:,} rows of {d.seq_len + 1} "
              f"tokens; {c['truncated']:,} cut to fit (data.truncate='right'), {c['skipped']:,} left out "
              f"(data.truncate='skip')", flush=True)
