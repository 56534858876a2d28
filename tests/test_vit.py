"""The ViT family (`model.arch='vit'`) on the shared engines: its training equals the 1-device run (float64 on both
sides, `helpers.assert_equals_one_device`) on a pipeline with 1F1B, ZeRO 3 with sequence parallelism and a circular
pipeline; the FLOPs of the model spec; validate's one-line refusals. Hugging Face in and out: tests/test_hf_vit.py;
image data: tests/test_images.py; the command line run: tests/test_vision_run.py."""
import numpy as np
import pytest

from helpers import assert_equals_one_device, tiny_config
from jaxpar import model as gpt
from jaxpar.config import ConfigError
from jaxpar.model import derived
from jaxpar.validate import validate

CLASSES = 5


def vit_config(**over):
    """A 12 x 12 RGB image in 4 x 4 patches: 9 patches and the class token, a sequence of 10 (even: sequence
    parallelism over tensor 2 applies)."""
    return derived(tiny_config(**{"model.arch": "vit", "model.image_size": 12, "model.patch_size": 4,
                                  "model.channels": 3, "model.num_classes": CLASSES, "model.norm_eps": 1e-6, **over}))


def images(n, seed):
    r = np.random.default_rng(seed)
    return {"pixels": r.normal(size=(n, 12, 12, 3)).astype(np.float32),
            "labels": r.integers(0, CLASSES, n).astype(np.int32)}


BATCHES = [images(16, i) for i in range(3)]
LAYOUTS = {
    "d2t2s2-1f1b": {"mesh.data": 2, "mesh.tensor": 2, "mesh.stage": 2, "train.microbatches": 4,
                    "pipeline.schedule": "1f1b"},
    "d4t2-zero3-sp": {"mesh.data": 4, "mesh.tensor": 2, "optim.zero_stage": 3, "model.sequence_parallel": True},
    "d2s2v2-circular": {"mesh.data": 2, "mesh.stage": 2, "pipeline.schedule": "circular",
                        "pipeline.virtual_stages": 2, "train.microbatches": 4},
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_vit_training_equals_one_device(name):
    losses, _ = assert_equals_one_device(vit_config(**LAYOUTS[name]), CLASSES, BATCHES)
    assert abs(losses[0] - np.log(CLASSES)) < 0.5  # near the uniform guess at the start: the loss is the classes'


def test_a_padded_row_counts_nowhere():
    """An evaluation batch's padding rows (mask 0) change neither the loss nor the gradients: the step divides by
    the weighted images."""
    c = vit_config(**{"mesh.data": 2})
    pad = {k: np.concatenate([v[:8], v[:8]]) for k, v in BATCHES[0].items()}
    pad["mask"] = np.r_[np.ones(8), np.zeros(8)].astype(np.float32)
    pad["pixels"][8:] = 100.0  # whatever they hold
    pad["labels"][8:] = 0
    half = {k: np.concatenate([v[:8], v[:8]]) for k, v in BATCHES[0].items()}  # the 8 images twice: the same mean
    la, pa = assert_equals_one_device(c, CLASSES, [pad])
    lb, pb = assert_equals_one_device(c, CLASSES, [half])
    np.testing.assert_allclose(la, lb, rtol=1e-12)


def test_flops_count_the_classifier_once_per_image():
    """6 N + 12 L d T per token, N the patch projection and the blocks' weights, plus the classifier's 6 · d · classes
    once per image (its seq_len tokens)."""
    cfg = gpt.config_from(vit_config(), CLASSES, 1)
    d, f, L, T = 32, 64, 4, 10
    blocks = L * (d * 3 * d + d * d + 2 * d * f)
    expect = 6 * (4 * 4 * 3 * d + blocks) + 12 * L * d * T + 6 * d * CLASSES / T
    assert gpt.flops_per_token(cfg) == pytest.approx(expect, rel=1e-12)


@pytest.mark.parametrize("over,words", [
    ({"model.image_size": 14}, "model.image_size=14 is not divisible by model.patch_size=4"),
    ({"mesh.context": 2, "mesh.data": 1}, "model.arch='vit' with mesh.context=2"),
    ({"model.experts": 4}, "model.arch='vit' with model.experts=4"),
    ({"lora.rank": 8}, "model.arch='vit' with lora.rank=8"),
    ({"eval.tasks": "arc_easy"}, "model.arch='vit' with eval.tasks='arc_easy'"),
])
def test_bad_vit_settings_are_refused_in_one_line(over, words):
    with pytest.raises(ConfigError) as e:
        validate(vit_config(**over), 2)
    assert words in str(e.value)
