"""Classify images with a trained ViT: `python classify.py --model DIR IMAGE [IMAGE ...] [--top 5]` prints each
image's most likely classes with their probabilities.

DIR is a ViT run directory written by train.py (its latest checkpoint, whatever layout trained it; the class names
from its classes.json), a Hugging Face `ViTForImageClassification` directory as `hf:DIR` (an export of
`python -m jaxpar.export --format hf`; the names from config.json's id2label), or `hf:ORG/NAME[@REVISION]`, a Hub
model fetched into the Hugging Face cache. Images are decoded, resized and normalised as in training
(`jaxpar/data/image_batches.py`: the run's `data.image_mean` / `data.image_std`, or the directory's
preprocessor_config.json). Float32 on one device.

Guide: docs/vision.md.
"""
import json
import os
import sys

from absl import app, flags, logging

_MODEL = flags.DEFINE_string("model", None, "A ViT run directory, hf:DIR or hf:ORG/NAME.")
_TOP = flags.DEFINE_integer("top", 5, "Classes to print per image.")


def load(where: str):
    """-> (Forward, params, class names, image mean, image std) of a run directory or an hf: directory."""
    from jaxpar.formats import hf, hub
    from jaxpar.state import runs
    from jaxpar.formats.hf.config import image_settings

    name = hub.model_name(where)  # hf:ORG/NAME[@REVISION]: into the Hugging Face cache
    directory = hf.directory_of("hf:" + hub.fetch(name)[0] if name else where)
    if directory is None:
        run = runs.load_run(where)
        classes = runs.read_classes(where)
        return run.fwd, run.params, classes, run.config.data.image_mean, run.config.data.image_std
    fwd, params, _ = hf.load(directory)
    with open(os.path.join(directory, "config.json")) as f:
        labels = json.load(f).get("id2label") or {}
    pre = image_settings(directory)
    classes = [labels.get(str(i), str(i)) for i in range(fwd.cfg.num_classes)]
    return fwd, params, classes, pre.get("data.image_mean", ""), pre.get("data.image_std", "")


def main(argv):
    logging.set_verbosity(logging.WARNING)
    import jax
    import numpy as np

    from jaxpar.data import DataError
    from jaxpar.data.image_batches import pixel_table
    from jaxpar.data.image_decode import fit

    if not argv[1:]:
        sys.exit("error: name at least one image file: python classify.py --model DIR IMAGE [IMAGE ...]")
    try:
        fwd, params, classes, mean, std = load(_MODEL.value)
        cfg = fwd.cfg
        if cfg.arch != "vit":
            sys.exit(f"error: {_MODEL.value} holds a {cfg.arch} language model; classify.py takes a ViT "
                     f"(sample.py generates text).")
        table = pixel_table(mean, std, cfg.channels)
        images = np.stack([fit(p, p, cfg.image_size, cfg.channels) for p in argv[1:]])
    except (DataError, FileNotFoundError, ValueError) as e:
        sys.exit(f"error: {e}")
    pixels = table[images.astype(np.int64), np.arange(cfg.channels)]  # (v / 255 - mean) / std per channel
    logits = jax.jit(lambda p, x: fwd.class_logits(p, fwd.layers(p["blocks"], fwd.embed(p, x))))(params, pixels)
    probs = np.asarray(jax.nn.softmax(logits, axis=-1))
    names = classes or [str(i) for i in range(cfg.num_classes)]
    for path, p in zip(argv[1:], probs):
        best = np.argsort(-p)[:_TOP.value]
        print(f"{path}: " + ", ".join(f"{names[i]} {p[i]:.3f}" for i in best))


if __name__ == "__main__":
    flags.mark_flag_as_required("model")
    app.run(main)
