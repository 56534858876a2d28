"""CPU quickstart for vision: a small ViT on scikit-learn's 8x8 handwritten digits (1,797 images, 10 classes; nothing
downloaded), on 8 fake CPU devices as (data 2, tensor 2, stage 2) with the 1F1B schedule:

    XLA_FLAGS=--xla_force_host_platform_device_count=8 python train.py --config configs/vit_digits.py

Patches of 2 x 2 pixels: 16 patches and the class token, a sequence of 17. The last 20 % of a fixed shuffle of the
images is held out (359 images); each evaluation covers all of them once (6 batches of 64, the last padded with weight-0
rows) and logs `val_loss` and `val_accuracy`. docs/vision.md shows the curve (top-1 >= 0.95 in about a minute on
2 cores).
"""
from jaxpar.config import base_config


def get_config():
    c = base_config()
    c.name = "vit_digits"
    c.mesh.update(data=2, tensor=2, stage=2)
    c.pipeline.update(schedule="1f1b")
    c.model.update(arch="vit", image_size=8, patch_size=2, channels=1, num_classes=10, layers=4, embed=64, heads=4,
                   mlp=128, norm_eps=1e-12)
    c.train.update(steps=600, global_batch_size=64, microbatches=4, seed=0,
                   param_dtype="float32", compute_dtype="float32")
    c.optim.update(lr=1e-3, min_lr_ratio=0.1, warmup_steps=60, decay_steps=600, weight_decay=0.05,
                   b1=0.9, b2=0.999, clip_norm=1.0)
    c.data.update(sources="digits", val_fraction=0.2)
    c.checkpoint.update(every_steps=200, keep=2)
    c.log.update(every_steps=25)
    c.eval.update(every_steps=100, batches=6)
    return c
