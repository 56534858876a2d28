"""ViT-H/14 at 224 px (Dosovitskiy et al. 2021: 32 layers, width 1280, 16 heads, MLP 5120; 632 M parameters), an
ImageNet-1k classifier, on one 8-GPU server: data 8 with ZeRO 3 (parameters, gradients and AdamW's moments
sharded 8 ways), bfloat16 compute, selective recompute. 256 patches of 14 x 14 pixels and the class token: a sequence
of 257. `--dry_run` prints the per-device bytes (docs/vision.md); fine-tune Google's weights with
`--config.init_from=hf:google/vit-huge-patch14-224-in21k` (a `ViTModel`: the classifier starts fresh with
`model.num_classes` outputs) and `--config.data.sources=imagefolder:/data/imagenet/train` (or `hfds:ORG/NAME`).
"""
from jaxpar.config import base_config


def get_config():
    c = base_config()
    c.name = "vit_huge"
    c.mesh.update(data=8, tensor=1, stage=1)
    c.model.update(arch="vit", image_size=224, patch_size=14, channels=3, num_classes=1000, layers=32, embed=1280,
                   heads=16, mlp=5120, norm_eps=1e-12, remat="selective")
    c.train.update(steps=100_000, global_batch_size=1024, microbatches=4, seed=0,
                   param_dtype="float32", compute_dtype="bfloat16")
    c.optim.update(lr=1e-3, min_lr_ratio=0.01, warmup_steps=10_000, decay_steps=100_000, weight_decay=0.05,
                   b1=0.9, b2=0.999, clip_norm=1.0, zero_stage=3)
    c.data.update(sources="imagefolder:/data/imagenet/train", val_source="imagefolder:/data/imagenet/val",
                  augment="crop,flip", workers=16, image_mean="0.5,0.5,0.5", image_std="0.5,0.5,0.5")
    c.checkpoint.update(every_steps=1000, keep=3)
    c.log.update(every_steps=10)
    c.eval.update(every_steps=2000, batches=49)
    return c
