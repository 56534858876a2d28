"""Hugging Face in and out for the vision transformer, against `transformers` itself (PyTorch on CPU): a tiny
`ViTForImageClassification` built here (nothing downloaded) with every tensor random, LayerNorms and biases included.

HF -> jaxpar logits within 1e-5 of transformers' (fp32, max abs over the logits' max abs) on 1 device; placed on a
(2, 2, 2) circular pipeline (layers out of canonical order) the params are the 1-device ones and the pipelined loss is
transformers' cross-entropy; HF -> jaxpar -> HF is bitwise and loads in transformers (no missing or unexpected key)
with the same logits and the run's preprocessing; transformers 5's module names read as the Hub's; ViTModel weights,
or another `model.num_classes`, give the blocks and a fresh head (said in one line); other vision models and ViT
variants are refused in one line naming the file."""
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from helpers import steps_for, tiny_config  # noqa: E402
from hf_checks import hf_tensors  # noqa: E402
from jaxpar import model as gpt  # noqa: E402
from jaxpar.model import derived  # noqa: E402
from jaxpar.state.runs import read_classes  # noqa: E402
from jaxpar.formats import hf  # noqa: E402
from jaxpar.formats.hf import HFError, keys  # noqa: E402
from jaxpar.parallel.logical import activation_rules  # noqa: E402
from jaxpar.train.state import fresh_params  # noqa: E402

pytestmark = pytest.mark.xdist_group("test_hf_vit")

SIZE, PATCH, CLASSES = 12, 4, 3
MEAN, STD = [0.485, 0.456, 0.406], [0.229, 0.224, 0.225]
PIXELS = np.random.default_rng(0).normal(size=(4, 3, SIZE, SIZE)).astype(np.float32)  # NCHW, as torch takes them


def hf_vit(cls=None):
    torch.manual_seed(0)
    cfg = transformers.ViTConfig(image_size=SIZE, patch_size=PATCH, num_channels=3, hidden_size=32,
                                 num_hidden_layers=4, num_attention_heads=4, intermediate_size=48,
                                 num_labels=CLASSES)
    model = (cls or transformers.ViTForImageClassification)(cfg)
    with torch.no_grad():  # HF's init zeroes biases and sets LayerNorm scales to 1, which would hide mistakes
        for p in model.parameters():
            p.normal_(0, 0.1)
    return model.eval()


@pytest.fixture(scope="module")
def vit(tmp_path_factory):
    """(transformers model, its directory with a preprocessor_config.json)."""
    model, d = hf_vit(), tmp_path_factory.mktemp("vit") / "cls"
    model.save_pretrained(d)
    with open(d / "preprocessor_config.json", "w") as f:
        json.dump({"image_processor_type": "ViTImageProcessor", "do_normalize": True, "image_mean": MEAN,
                   "image_std": STD, "size": {"height": SIZE, "width": SIZE}}, f)
    return model, d


def hf_logits(model, pixels=PIXELS):
    with torch.no_grad():
        return model(torch.tensor(pixels)).logits.numpy()


def logits_of(fwd, params, pixels=PIXELS):
    x = fwd.layers(params["blocks"], fwd.embed(params, jnp.asarray(pixels.transpose(0, 2, 3, 1))))
    return np.asarray(fwd.class_logits(params, x))


def close(got, want, tol=1e-5):
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err <= tol, err


def flat(params):
    return {k: np.asarray(v) for k, v in gpt.param_items(params)}


def vit_run(directory, **over):
    """A run config starting from DIR, as the trainer resolves it (`hf.apply`, then `derived`)."""
    c = tiny_config(**{"model.arch": "vit", "init_from": f"hf:{directory}", **over})
    return derived(hf.apply(c))


def test_import_gives_transformers_logits_on_one_device(vit):
    model, d = vit
    fwd, params, tok = hf.load(str(d))
    assert tok is None and fwd.cfg.arch == "vit" and fwd.cfg.num_classes == CLASSES and fwd.cfg.seq_len == 10
    assert fwd.cfg.norm_eps == 1e-12 and fwd.cfg.mlp == 48
    close(logits_of(fwd, params), hf_logits(model))
    got = hf.settings(str(d))
    assert got["data.image_mean"] == "0.485,0.456,0.406" and got["data.image_std"] == "0.229,0.224,0.225"
    assert "data.tokenizer" not in got
    mine = vit_run(d, **{"data.image_std": "0.5"})  # the run's own std stays; the checkpoint's mean is taken
    assert (mine.data.image_mean, mine.data.image_std, mine.model.num_classes) == ("0.485,0.456,0.406", "0.5", 3)


def test_classify_py_gives_transformers_probabilities_of_an_image_file(vit, tmp_path):
    """`python classify.py --model hf:DIR IMAGE` (docs/vision.md): the image decoded, normalised and classified as
    transformers' `ViTImageProcessor` and model do."""
    import subprocess
    import sys

    from PIL import Image

    model, d = vit
    path = tmp_path / "img.png"
    Image.fromarray(np.random.default_rng(3).integers(0, 256, (SIZE, SIZE, 3)).astype(np.uint8)).save(path)
    res = subprocess.run([sys.executable, "classify.py", "--model", f"hf:{d}", str(path), "--top", "3"],
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))), capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    got = dict(x.rsplit(" ", 1) for x in res.stdout.strip().split(": ", 1)[1].split(", "))
    pixels = transformers.ViTImageProcessor.from_pretrained(d)(Image.open(path), return_tensors="np")["pixel_values"]
    probs = torch.softmax(torch.tensor(hf_logits(model, pixels)[0]), -1).numpy()
    want = {model.config.id2label[i]: f"{probs[i]:.3f}" for i in np.argsort(-probs)[:3]}
    assert got == want, (got, want)


def test_placed_on_a_circular_pipeline_equals_one_device_and_gives_transformers_loss(vit):
    """(data 2, tensor 2, stage 2, 2 virtual stages): each device reads its slices of its layers, in the pipeline's
    layer order; the pipelined loss is transformers' cross-entropy."""
    model, d = vit
    config = vit_run(d, **{"mesh.data": 2, "mesh.tensor": 2, "mesh.stage": 2, "pipeline.schedule": "circular",
                           "pipeline.virtual_stages": 2, "train.microbatches": 2})
    steps = steps_for(config, CLASSES)
    assert list(steps.layer_order) != sorted(steps.layer_order)
    placed = hf.load_params(str(d), steps.cfg, steps.state_shardings["params"], steps.layer_order)
    one = flat(hf.load(str(d))[1])
    for k, v in flat(placed).items():
        want = one[k][np.asarray(steps.layer_order)] if k.startswith("blocks.") else one[k]
        assert v.tobytes() == want.tobytes(), k
    labels = np.arange(len(PIXELS), dtype=np.int32) % CLASSES
    batch = jax.device_put({"pixels": PIXELS.transpose(0, 2, 3, 1), "labels": labels}, steps.batch_sharding)
    with activation_rules(config.rules, steps.mesh):
        lsum, n = steps.evaluate(placed, batch)
    ref = torch.nn.functional.cross_entropy(torch.tensor(hf_logits(model)), torch.tensor(labels, dtype=torch.long))
    np.testing.assert_allclose(float(lsum) / float(np.asarray(n).reshape(-1)[0]), float(ref), rtol=1e-5)


def test_round_trip_is_bitwise_and_loads_in_transformers(vit, tmp_path):
    model, d = vit
    fwd, params, _ = hf.load(str(d))
    out = tmp_path / "out"
    out.mkdir()
    names = ["cat", "dog", "emu"]
    written = hf.save(jax.device_get(params), fwd.cfg, None, str(out), "float32", 10 ** 9, names,
                      "0.485,0.456,0.406", "")
    assert sorted(written) == ["config.json", "model.safetensors", "preprocessor_config.json"]
    src, dst = hf_tensors(d), hf_tensors(out)
    assert src.keys() == dst.keys()
    for k in src:
        assert src[k].dtype == dst[k].dtype == np.float32 and src[k].shape == dst[k].shape, k
        assert src[k].tobytes() == dst[k].tobytes(), k
    a, b = (json.loads((p / "config.json").read_text()) for p in (d, out))
    shape = ("model_type", "architectures", "hidden_size", "num_hidden_layers", "num_attention_heads",
             "intermediate_size", "image_size", "patch_size", "num_channels", "layer_norm_eps", "hidden_act",
             "qkv_bias")
    assert {k: a[k] for k in shape} == {k: b[k] for k in shape}
    back, info = transformers.ViTForImageClassification.from_pretrained(str(out), output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    close(hf_logits(back.eval()), hf_logits(model), 0)
    assert back.config.id2label == dict(enumerate(names)) and back.config.label2id["emu"] == 2
    proc = transformers.AutoImageProcessor.from_pretrained(str(out))
    assert list(proc.image_mean) == MEAN and list(proc.image_std) == [0.5] * 3
    assert (proc.size["height"], proc.size["width"]) == (SIZE, SIZE)
    assert hf.settings(str(out))["data.image_mean"] == "0.485,0.456,0.406"


def test_export_reads_the_run_class_names(tmp_path):
    assert read_classes(str(tmp_path)) is None
    (tmp_path / "classes.json").write_text('["cat", "dog"]')
    assert read_classes(str(tmp_path)) == ["cat", "dog"]
    (tmp_path / "classes.json").write_text('{"0": "cat"}')
    with pytest.raises(ValueError, match="classes.json: expected a JSON list of class names"):
        read_classes(str(tmp_path))
    cfg = gpt.config_from(derived(tiny_config(**{"model.arch": "vit", "model.image_size": SIZE,
                                                 "model.patch_size": PATCH, "model.num_classes": CLASSES})), CLASSES, 1)
    with pytest.raises(HFError, match=r"2 class names for a classifier of model.num_classes=3"):
        hf.save(jax.device_get(gpt.init_params(cfg, jax.random.key(0))), cfg, None, str(tmp_path), "float32",
                10 ** 9, ["cat", "dog"])


def rename(src, dst, fn):
    """A copy of checkpoint SRC in DST with every tensor name passed through `fn`."""
    from safetensors.numpy import save_file

    shutil.copytree(src, dst)
    tensors = hf_tensors(src)
    save_file({fn(k): v for k, v in tensors.items()}, str(dst / "model.safetensors"), metadata={"format": "pt"})
    return dst


def to_module_names(name: str) -> str:
    """The Hub's (and `save_pretrained`'s) ViT tensor name -> transformers 5's module name (its `state_dict`)."""
    hub, mod = keys.VIT_NAMINGS["hub"], keys.VIT_NAMINGS["modules"]
    name = name.replace("encoder.layer.", "layers.")
    for a, b in zip(hub[2], mod[2]):
        name = name.replace(f"attention.attention.{a}.", f"attention.{b}_proj.")
    for a, b in zip(hub[3:], mod[3:]):
        name = name.replace(f".{a}.", f".{b}.")
    return name


def test_transformers_module_names_load_as_the_hub_names(vit, tmp_path):
    model, d = vit
    assert "vit.encoder.layer.0.attention.attention.query.weight" in hf_tensors(d)  # what save_pretrained writes
    renamed = rename(d, tmp_path / "modules", to_module_names)
    assert set(hf_tensors(renamed)) == set(model.state_dict())  # transformers 5's own names, every one
    a, b = flat(hf.load(str(d))[1]), flat(hf.load(str(renamed))[1])
    assert a.keys() == b.keys() and all(a[k].tobytes() == b[k].tobytes() for k in a)


def test_vit_model_weights_or_other_classes_give_the_blocks_and_a_fresh_head(vit, tmp_path, capsys):
    """Fine-tuning: ViTModel weights (with their pooler, which nothing reads) in transformers 5's module names, and
    the classifier's with another `model.num_classes`: the blocks, embeddings and final norm are the checkpoint's,
    the head the run's fresh one (`train.state.fresh_params`), each said in one line."""
    model, d = vit
    base = hf_vit(transformers.ViTModel)
    base.load_state_dict(model.vit.state_dict(), strict=False)  # the classifier's encoder, a random pooler
    base.save_pretrained(tmp_path / "base")
    renamed = rename(tmp_path / "base", tmp_path / "base_modules", to_module_names)
    want = flat(hf.load(str(d))[1])
    for directory, note in ((tmp_path / "base", "has no classifier (ViTModel)"), (renamed, "has no classifier"),
                            (d, "the checkpoint's classifier has 3 classes")):
        config = vit_run(directory, **{"model.num_classes": 5, "train.seed": 7})
        assert note in capsys.readouterr().out
        cfg = gpt.config_from(config, 5, 1)
        single = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        shard = jax.tree.map(lambda _: single, jax.eval_shape(lambda: gpt.init_params(cfg, jax.random.key(0))))
        got = flat(hf.load_params(str(directory), cfg, shard, seed=7))
        fresh = flat(jax.jit(lambda: fresh_params(cfg, 7))())  # (compiled, as the trainer draws it)
        assert got["head"].shape == (32, 5)
        np.testing.assert_allclose(got["head"], fresh["head"], rtol=1e-6)
        assert np.abs(got["head"]).max() > 0 and not got["head_bias"].any()
        assert all(got[k].tobytes() == want[k].tobytes() for k in got if not k.startswith("head")), directory
    with pytest.raises(HFError, match=r"has no classifier \(ViTModel\), so it classifies nothing"):
        hf.load(str(tmp_path / "base"))


@pytest.mark.parametrize("change,match", [
    ({"model_type": "deit", "architectures": ["DeiTForImageClassificationWithTeacher"]}, r"model_type 'deit' \(DeiT"),
    ({"model_type": "dinov2", "architectures": ["Dinov2Model"]}, r"model_type 'dinov2' \(DINOv2's layer scale\)"),
    ({"model_type": "swin", "architectures": ["SwinForImageClassification"]}, r"model_type 'swin'"),
    ({"model_type": "clip_vision_model", "architectures": ["CLIPVisionModel"]}, r"model_type 'clip_vision_model'"),
    ({"model_type": "deit"}, r"model_type 'deit' .* it reads ViTForImageClassification and ViTModel"),
    ({"architectures": ["ViTForMaskedImageModeling"]}, r"ViTForMaskedImageModeling needs a pixel decoder"),
    ({"qkv_bias": False}, r"qkv_bias=false; jaxpar's vit block has query, key and value biases"),
    ({"hidden_act": "gelu_new"}, r"hidden_act='gelu_new'; jaxpar's vit MLP is the exact \(erf\) GELU"),
    ({"image_size": [12, 16]}, r"image_size=\[12, 16\] is not square"),
    ({"patch_size": 5}, r"image_size=12 is no whole number of patch_size=5 patches"),
])
def test_unsupported_vision_checkpoints_are_refused_in_one_line(vit, tmp_path, change, match):
    bad = tmp_path / "bad"
    shutil.copytree(vit[1], bad)
    path = bad / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **change}))
    with pytest.raises(HFError, match=match) as e:
        hf.settings(str(bad))
    assert str(e.value).startswith(str(path)) and "\n" not in str(e.value)


def test_a_misshapen_or_missing_vit_tensor_is_named(vit, tmp_path):
    _, d = vit
    short = rename(d, tmp_path / "short", lambda k: k.replace("layer.3.attention.attention.key", "layer.3.other"))
    with pytest.raises(HFError, match=r"tensor 'vit.encoder.layer.3.attention.attention.key.weight' \[32, 32\] is "
                                       r"missing"):
        hf.load(str(short))
    wide = tmp_path / "wide"
    shutil.copytree(d, wide)
    (wide / "config.json").write_text(json.dumps({**json.loads((wide / "config.json").read_text()),
                                                  "intermediate_size": 64}))
    with pytest.raises(HFError, match=r"'vit.encoder.layer.0.intermediate.dense.weight' is \[48, 32\], but "
                                       r"config.json implies \[64, 32\]"):
        hf.load(str(wide))


def parquet_images(path, n, size=(20, 16)):
    """n random RGB PNGs of another size than the model's, in Hugging Face datasets' Parquet layout (image struct,
    integer label, the class names in the schema's metadata) -> (the PIL images, their labels)."""
    import io

    import pyarrow as pa
    import pyarrow.parquet as pq
    from PIL import Image

    rng = np.random.default_rng(1)
    images = [Image.fromarray(rng.integers(0, 256, (*size[::-1], 3), dtype=np.uint8)) for _ in range(n)]
    labels = (np.arange(n) % CLASSES).astype(np.int64)
    blobs = []
    for im in images:
        buf = io.BytesIO()
        im.save(buf, format="PNG")
        blobs.append({"bytes": buf.getvalue(), "path": None})
    meta = {"info": {"features": {"image": {"_type": "Image"},
                                  "label": {"names": ["cat", "dog", "fox"], "_type": "ClassLabel"}}}}
    table = pa.table({"image": blobs, "label": labels}).replace_schema_metadata({"huggingface": json.dumps(meta)})
    pq.write_table(table, path)
    return images, labels


def test_training_from_hf_on_parquet_images_starts_at_transformers_loss_and_exports_back(vit, tmp_path):
    """`init_from=hf:DIR` on a Parquet image source, on (2, 2, 2) 1F1B: the step-1 loss is transformers' cross-entropy
    of the same images through its own ViTImageProcessor (DIR's preprocessor_config.json: resize from 20 x 16,
    rescale, normalise); after two steps `--format hf` writes a directory transformers loads, whose logits are the
    trained run's, with the class names of the data."""
    from jaxpar import trainer
    from jaxpar.export import export
    from jaxpar.state.runs import load_run

    model, d = vit
    images, labels = parquet_images(tmp_path / "train.parquet", 8)
    processor = transformers.ViTImageProcessor.from_pretrained(d)
    pixels = processor(images=images, return_tensors="pt")["pixel_values"]
    with torch.no_grad():
        want = float(torch.nn.functional.cross_entropy(model(pixels).logits, torch.tensor(labels)))
    c = tiny_config(**{"model.arch": "vit", "init_from": f"hf:{d}", "mesh.data": 2, "mesh.tensor": 2,
                       "mesh.stage": 2, "train.microbatches": 2, "pipeline.schedule": "1f1b",
                       "train.global_batch_size": 8, "train.steps": 2})
    pq = str(tmp_path / "train.parquet")
    c.data.update(sources=f"parquet:{pq}", val_source=f"parquet:{pq}", cache_dir=str(tmp_path / "cache"))
    c.log.update(every_steps=1, progress=False)
    c.eval.update(every_steps=100, batches=1)
    trainer.run(c, str(tmp_path / "run"))  # the batch is the whole train split: its mean is order-free
    with open(tmp_path / "run" / "metrics.jsonl") as f:
        first = json.loads(f.readline())
    assert abs(first["loss"] - want) <= 1e-5 * want, (first["loss"], want)
    export(str(tmp_path / "run"), str(tmp_path / "out"), fmt="hf")
    back = transformers.ViTForImageClassification.from_pretrained(tmp_path / "out").eval()
    assert back.config.id2label == {0: "cat", 1: "dog", 2: "fox"}
    run = load_run(str(tmp_path / "run"))
    close(hf_logits(back), logits_of(run.fwd, run.params))
    assert np.abs(hf_logits(back) - hf_logits(model)).max() > 1e-4  # it trained: the export is not the import
