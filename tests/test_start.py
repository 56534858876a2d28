"""Starting points and the defaults a new user meets: `configs/shakespeare.py` with only `init_from` and
`data.sources` (and `train.objective=dpo` for pairs) trains on a `messages` JSONL and on a preference-pair file, from
`hf:DIR` and from a jaxpar export of an SFT run: the starting point brings its model shape, tokenizer and chat
template, `data.packing=auto` packs the records whole. (The other keys set here only make the run short.)"""
import importlib.util
import json
import math
import shutil

import jax
import numpy as np
import pytest

from helpers import ROOT, chat_tokenizer, random_hf_llama
from jaxpar import data, export, trainer
from jaxpar.formats import start
from jaxpar.train import objectives

pytestmark = [pytest.mark.xdist_group("test_start")]
LAYERS, EMBED = 2, 32  # the checkpoint's shape (the Shakespeare config's is 4 x 128)


def shakespeare(**over):
    """configs/shakespeare.py's config, `over` set (dotted keys), on one device for a 2-step run."""
    spec = importlib.util.spec_from_file_location("shakespeare", ROOT + "/configs/shakespeare.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    c = module.get_config()
    c.train.steps = 2
    c.checkpoint.update(every_steps=2, async_save=False)
    c.log.update(every_steps=1, progress=False)
    c.eval.update(every_steps=2, batches=1)
    for k, v in over.items():
        sect, key = k.split(".") if "." in k else (None, k)
        (c[sect] if sect else c)[key] = v
    return c


def records(rng, n=24):
    words = "the quick brown fox jumps over lazy dog what is it answer be brief hello world".split()
    say = lambda k: " ".join(rng.choice(words, k))  # noqa: E731
    chats = [{"messages": [{"role": "user", "content": say(rng.integers(2, 8))},
                           {"role": "assistant", "content": say(rng.integers(1, 10))}] * int(rng.integers(1, 3))}
             for _ in range(n)]
    pairs = [{"prompt": say(rng.integers(2, 8)), "chosen": say(rng.integers(1, 8)), "rejected": say(rng.integers(1, 8))}
             for _ in range(n)]
    return chats, pairs


@pytest.fixture(scope="module")
def points(tmp_path_factory):
    """{"root", "hf": a random tiny Llama saved as a Hugging Face directory with a chat tokenizer, "chat", "pairs":
    the JSONL files, "sft": the run directory of 2 SFT steps from hf:DIR, "export": its jaxpar export}."""
    root = tmp_path_factory.mktemp("start")
    chats, pairs = records(np.random.default_rng(0))
    for name, rows in (("chat.jsonl", chats), ("pairs.jsonl", pairs)):
        (root / name).write_text("".join(json.dumps(r) + "\n" for r in rows))
    chat_tokenizer(root / "tok")
    random_hf_llama(root / "hf", data.load_tokenizer(root / "tok"), layers=LAYERS, embed=EMBED)
    out = {"root": root, "hf": f"hf:{root / 'hf'}", "chat": str(root / "chat.jsonl"), "pairs": str(root / "pairs.jsonl"),
           "sft": root / "sft", "export": root / "export"}
    train(out, out["hf"], out["chat"], out["sft"])
    assert export.main(["--workdir", str(out["sft"]), "--out", str(out["export"])]) == 0
    return out


def train(points, init_from, sources, workdir, **over) -> list[dict]:
    """2 steps of the Shakespeare config from `init_from` on `sources` (one device); its metrics.jsonl rows, after
    checking what the run adopted: the checkpoint's shape, its tokenizer (with its chat template), whole packing."""
    c = shakespeare(**{"init_from": init_from, "data.sources": sources,
                       "data.cache_dir": str(points["root"] / "cache"), **over})
    trainer.run(c, str(workdir), jax.devices()[:1])
    ran = json.loads((workdir / "config.json").read_text())
    assert (ran["model"]["layers"], ran["model"]["embed"], ran["model"]["seq_len"]) == (LAYERS, EMBED, 128)
    assert ran["data"]["packing"] == "bfd" and ran["data"]["tokenizer"].endswith("tokenizer.json")
    rows = [json.loads(line) for line in (workdir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(math.isfinite(r["loss"]) for r in rows), rows
    assert math.isfinite(rows[-1]["val_loss"])
    return rows


def test_conversations_and_pairs_train_from_hf_dir(points, tmp_path):
    """`hf:DIR`: the SFT run (the fixture's) and a DPO run on pairs, which logs its pairs."""
    assert json.loads((points["sft"] / "config.json").read_text())["init_from"] == points["hf"]
    rows = train(points, points["hf"], points["pairs"], tmp_path / "dpo", **{"train.objective": "dpo"})
    assert all(r["pairs"] > 0 for r in rows) and rows[-1]["val_pairs"] > 0


def test_conversations_and_pairs_train_from_an_export_of_an_sft_run(points, tmp_path):
    """A jaxpar export of the SFT run: its shape and its tokenizer (the chat template beside it) come with it."""
    train(points, str(points["export"]), points["chat"], tmp_path / "sft")
    rows = train(points, str(points["export"]), points["pairs"], tmp_path / "dpo", **{"train.objective": "dpo"})
    assert all(r["pairs"] > 0 for r in rows)
    ran = json.loads((tmp_path / "sft" / "config.json").read_text())
    assert ran["data"]["tokenizer"] == str(points["export"] / "tokenizer" / "tokenizer.json")


def test_a_run_directory_starts_as_its_export(points):
    """A run directory as `init_from`: the same settings as its export (but where the tokenizer lies) and, placed in
    a layout, the export's weights bit for bit."""
    from helpers import steps_for

    c = shakespeare(**{"data.sources": points["chat"]})
    runs_c, export_c = c.copy_and_resolve_references(), c.copy_and_resolve_references()
    runs_c.init_from, export_c.init_from = str(points["sft"]), str(points["export"])
    by_run, by_export = start.apply(runs_c, say=False), start.apply(export_c, say=False)
    assert by_run.model.to_dict() == by_export.model.to_dict()
    assert by_run.data.tokenizer == str(points["sft"] / "tokenizer" / "tokenizer.json")
    steps = steps_for(by_run, int(by_run.model.vocab_size), jax.devices()[:1])
    state = start.place(str(points["sft"]), steps, steps.init(7))
    got = export.flatten(jax.device_get(steps.to_canonical(state)["params"]))
    want = export.flatten(export.load_export(str(points["export"]))[1])
    assert got.keys() == want.keys() and all(np.array_equal(got[k], want[k]) for k in want)


def test_a_validation_set_without_loss_tokens_is_refused_when_the_data_is_prepared(points, tmp_path):
    """Validation conversations whose replies are all cut off (`data.truncate=right`) leave no token in the loss: one
    line when the data is prepared, before anything compiles, not hours later at the first evaluation."""
    long = " ".join(["word"] * 300)  # longer than a row: the reply is cut away
    val = tmp_path / "val.jsonl"
    val.write_text(json.dumps({"messages": [{"role": "user", "content": long},
                                            {"role": "assistant", "content": "yes"}]}) + "\n")
    c = shakespeare(**{"init_from": points["hf"], "data.sources": points["chat"], "data.val_source": str(val),
                       "data.cache_dir": str(points["root"] / "cache")})
    with pytest.raises(data.DataError, match=r"^the 1 validation batches \(eval.batches\) hold no token the loss "
                                             r"counts: [^\n]*$"):
        trainer.run(c, str(tmp_path / "run"), jax.devices()[:1])
    assert not (tmp_path / "run").exists()  # no step ran (step 1 logs before the first evaluation), nothing written


@pytest.mark.parametrize("pairs", [False, True])
def test_the_loss_weight_of_host_rows_is_the_steps(points, pairs):
    """`data.loss_weight` (what the check above counts) equals what the step divides its loss by (the objective's
    `total` of `split_batch`'s mask and segments), on packed conversations and on preference pairs."""
    from jaxpar.train.step import split_batch

    c = objectives.with_packing(start.apply(shakespeare(**{
        "init_from": points["hf"], "data.sources": points["pairs" if pairs else "chat"],
        "data.cache_dir": str(points["root"] / "cache"), "train.objective": "dpo" if pairs else "lm"}), say=False))
    b = data.Batches(data.prepare(c), "train", 128, 32, packing=c.data.packing, pairs=pairs)
    obj = objectives.DPO(0.1, "sigmoid", 0.0) if pairs else objectives.LM()
    for i in range(2):
        rows = b.rows(i)
        _, _, mask, seg = split_batch(rows)
        assert data.loss_weight(rows, pairs) == int(obj.total(mask, seg, rows)) > 0


def first_dpo_step(points, init_from, workdir, **over) -> dict:
    """Step 1's logged metrics of a DPO run on the pairs from `init_from` (the Shakespeare config, one device), in
    float64: the policy's pass (under `jax.grad`) and the reference's (forward only) are two compiled programs, whose
    sums of the same weights agree to their rounding (float32: about 1e-9 relative; float64: about 1e-16)."""
    c = shakespeare(**{"init_from": init_from, "data.sources": points["pairs"], "train.objective": "dpo",
                       "train.param_dtype": "float64", "train.compute_dtype": "float64",
                       "train.steps": 1, "checkpoint.every_steps": 1, "eval.every_steps": 1,
                       "data.cache_dir": str(points["root"] / "cache"), **over})
    with jax.enable_x64(True):
        trainer.run(c, str(workdir), jax.devices()[:1])
    return json.loads((workdir / "metrics.jsonl").read_text().splitlines()[0])


def assert_at_the_reference(row):
    """Before any update the policy is the reference: every implicit reward 0, to float64 rounding of the sequences'
    log-probs (about 50 nats here: 1e-12 of them; a wrong reference is off by about 0.1 to 1)."""
    assert row["pairs"] > 0
    bound = 1e-12 * abs(row["logps/chosen"])
    assert all(abs(row[k]) <= bound for k in ("rewards/chosen", "rewards/rejected", "rewards/margins")), row


@pytest.mark.parametrize("where", ["hf", "export", "run"])
def test_dpo_starts_at_its_reference_from_every_starting_point(points, tmp_path, where):
    """The reference is the model the run starts from (`hf:DIR`, a jaxpar export, a run directory), not the random
    draw the state was built around: step 1's rewards are exactly 0."""
    init_from = {"hf": points["hf"], "export": str(points["export"]), "run": str(points["sft"])}[where]
    assert_at_the_reference(first_dpo_step(points, init_from, tmp_path / "dpo"))


@pytest.fixture(scope="module")
def adapter(points, tmp_path_factory):
    """A PEFT adapter of 2 LoRA SFT steps from hf:DIR (`--format peft`): its B matrices are no longer zero."""
    root = tmp_path_factory.mktemp("lora")
    train(points, points["hf"], points["chat"], root / "run", **{"lora.rank": 4, "optim.lr": 1e-2})
    assert export.main(["--workdir", str(root / "run"), "--out", str(root / "adapter"), "--format", "peft"]) == 0
    return root / "adapter"


def test_dpo_from_a_lora_adapter_keeps_it_in_the_reference(points, adapter, tmp_path):
    """`lora.adapter`: the reference is the base with that adapter (frozen), not the base alone, as TRL keeps the
    starting adapter; step 1's rewards are exactly 0."""
    assert_at_the_reference(first_dpo_step(points, points["hf"], tmp_path / "dpo", **{"lora.adapter": str(adapter)}))


@pytest.mark.parametrize("dropout", [False, True])
def test_dpo_with_dropout_runs_it_alike_in_policy_and_reference(points, tmp_path, dropout):
    """A model with dropout: off in both passes by default (`dpo.dropout=false`, TRL's `disable_dropout`), or on in
    both with the same masks: either way step 1 is at the reference."""
    row = first_dpo_step(points, points["hf"], tmp_path / "dpo", **{"model.dropout_resid": 0.3,
                                                                   "dpo.dropout": dropout})
    assert_at_the_reference(row)


def test_a_precomputed_reference_from_other_starting_weights_is_refused(points, tmp_path):
    """`dpo.precompute_reference`: the tables record what made them; tables of other starting weights are refused in
    one line (and kept), never reused."""
    first_dpo_step(points, str(points["export"]), tmp_path / "a", **{"dpo.precompute_reference": True})
    made_by = json.loads((tmp_path / "a" / "reference_logps" / "made_by.json").read_text())
    assert made_by["init_from"] == str(points["export"]) and len(made_by["weights"]) == 16
    (tmp_path / "b").mkdir()
    shutil.copytree(tmp_path / "a" / "reference_logps", tmp_path / "b" / "reference_logps")
    with pytest.raises(data.DataError, match=r"reference log-probs \(dpo.precompute_reference\) made from other "
                                             r"starting weights[^\n]*init_from[^\n]*weights[^\n]*new run directory"):
        first_dpo_step(points, points["hf"], tmp_path / "b", **{"dpo.precompute_reference": True})
    assert sorted(p.name for p in (tmp_path / "b" / "reference_logps").iterdir()) == \
        ["made_by.json", "train-0.npy", "val-0.npy"]
