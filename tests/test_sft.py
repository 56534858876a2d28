"""Supervised fine-tuning on conversations, against `transformers`: tiny random Llama, Qwen3 and Qwen3-MoE checkpoints
(every tensor random, their own chat templates as TRL's wheel ships them) fine-tuned from `init_from=hf:DIR` on
conversations and prompt/completion records, packed whole (`data.packing=bfd`) with the loss on the assistant tokens.

The step's loss on the checkpoint's weights equals transformers' loss with -100 labels on the masked positions (each
packed conversation run alone through transformers in float64; the mean over the unmasked tokens of the whole
batch), on 1 device and on (2,2,2) 1F1B, (4,2,1) ZeRO 3 and (expert 4, data 2), with gradient accumulation whose
microbatches hold different numbers of unmasked tokens; each layout's gradients equal the 1-device run's (float64)."""
import json
import pathlib
import subprocess
import sys

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from helpers import (assert_params_exact, chat_tokenizer, float64_config, float64_oracle, place,  # noqa: E402
                     released_template, steps_for, tiny_config)
from jaxpar import data, trainer  # noqa: E402
from jaxpar.export import main as export_main  # noqa: E402
from jaxpar.formats import hf  # noqa: E402

pytestmark = [pytest.mark.xdist_group("test_sft"), pytest.mark.slow]
ROOT = pathlib.Path(__file__).resolve().parents[1]
COMMON = dict(hidden_size=32, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=128, tie_word_embeddings=False, rms_norm_eps=1e-6, bos_token_id=0,
              eos_token_id=0)
KINDS = {  # name: (model, its chat template as TRL ships it, bos token, eos token)
    "llama": (lambda v: transformers.LlamaForCausalLM(transformers.LlamaConfig(**COMMON, vocab_size=v,
                                                                               intermediate_size=48)),
              "llama3_1", "<|begin_of_text|>", "<|eot_id|>"),
    "qwen3": (lambda v: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**COMMON, vocab_size=v,
                                                                              intermediate_size=48, head_dim=16)),
              "qwen3", None, "<|im_end|>"),
    "qwen3_moe": (lambda v: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **COMMON, vocab_size=v, intermediate_size=48, head_dim=16, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=24, norm_topk_prob=True)), "qwen3", None, "<|im_end|>"),
}


def records():
    """Conversations of 1 to 3 turns (some with a system message) and prompt/completion records."""
    rng = np.random.default_rng(0)
    words = "the quick brown fox jumps over lazy dog what is it answer be brief hello world".split()
    say = lambda n: " ".join(rng.choice(words, n))  # noqa: E731
    out = []
    for i in range(40):
        turns = [[{"role": "user", "content": say(rng.integers(2, 8))},
                  {"role": "assistant", "content": say(rng.integers(1, 12))}] for _ in range(rng.integers(1, 3))]
        msgs = [{"role": "system", "content": say(3)}] * (i % 3 == 0) + [m for t in turns for m in t]
        out.append({"messages": msgs} if i % 5 else {"prompt": msgs[:-1], "completion": msgs[-1:]})
    return out


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """{kind: (transformers model in float64, its directory)}; the conversations in chat.jsonl."""
    root = tmp_path_factory.mktemp("sft")
    (root / "chat.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records()))
    out = {}
    for kind, (make, template, bos, eos) in KINDS.items():
        d = root / kind
        tok = chat_tokenizer(d, released_template(template), bos, eos)
        torch.manual_seed(0)
        model = make(tok.vocab_size)
        with torch.no_grad():  # norm scales away from 1, every bias and router random
            for name, p in model.named_parameters():
                p.copy_(torch.randn_like(p) * (0.3 if p.ndim == 1 else 0.1) + (1.0 if "norm" in name else 0.0))
        model.save_pretrained(d)
        out[kind] = (float64_oracle(model.double().eval()), d)
    return root, out


def sft_config(root, d, **over):
    c = tiny_config(**{"mesh.data": 1, "train.global_batch_size": 8, "model.seq_len": 128, **over})
    c.init_from = f"hf:{d}"
    c.data.update(sources=str(root / "chat.jsonl"), packing="bfd", cache_dir=str(root / "cache"), val_fraction=0.1)
    return hf.apply(c, say=False)


def packed_batches(config, steps=2):
    info = data.prepare(config)
    b = data.Batches(info, "train", int(config.model.seq_len), int(config.train.global_batch_size), 0,
                     packing="bfd")
    return [b.rows(i) for i in range(steps)], info.vocab_size


def transformers_loss(model, batch) -> float:
    """The mean of transformers' cross-entropy (-100 labels where the mask is 0) over the unmasked tokens of the
    batch, each packed conversation run alone."""
    total, count = 0.0, 0
    for tokens, seg, mask in zip(batch["tokens"], batch["segments"], batch["mask"]):
        for s in np.unique(seg[seg >= 0]):
            at = np.nonzero(seg == s)[0]
            ids = tokens[at]
            labels = np.where(np.concatenate([[0], mask[at[1:] - 1]]) == 1, ids, -100)
            n = int((labels[1:] != -100).sum())
            if n == 0:
                continue
            with torch.no_grad():  # transformers' causal-LM loss (shifted, -100 ignored), kept in float64 (its
                # `ForCausalLMLoss` would cast the logits to float32 first)
                logits = model(input_ids=torch.tensor(ids[None], dtype=torch.long)).logits[0, :-1]
                total += float(torch.nn.functional.cross_entropy(
                    logits, torch.tensor(labels[1:], dtype=torch.long), ignore_index=-100, reduction="sum"))
            count += n
    return total / count


def first_step(config, vocab, batch, directory):
    """(loss, gradients in canonical order) of one float64 step on `config`'s layout from the checkpoint's
    weights."""
    n = config.mesh.data * config.mesh.tensor * config.mesh.stage * config.mesh.expert * config.mesh.context
    with jax.enable_x64(True):
        s = steps_for(float64_config(config), vocab, jax.devices()[:n])
        params = hf.load_params(str(directory), s.cfg, s.state_shardings["params"], s.layer_order)
        _, m, grads = s.train_with_grads(s.init_with(params, 0), place(s, batch))
        return float(m["loss"]), jax.device_get(grads)


LAYOUTS = {
    "llama": [{}, {"mesh.data": 2, "mesh.tensor": 2, "mesh.stage": 2, "train.microbatches": 2,
                   "pipeline.schedule": "1f1b"},
              {"mesh.data": 4, "mesh.tensor": 2, "train.microbatches": 2, "optim.zero_stage": 3}],
    "qwen3": [{}, {"mesh.data": 2, "mesh.tensor": 2, "mesh.stage": 2, "train.microbatches": 2,
                   "pipeline.schedule": "1f1b"}],
    "qwen3_moe": [{}, {"mesh.data": 2, "mesh.expert": 4}],
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_the_masked_loss_equals_transformers_on_every_layout(checkpoints, kind):
    root, models = checkpoints
    model, d = models[kind]
    batches, vocab = packed_batches(sft_config(root, d))
    batch = batches[0]
    want = transformers_loss(model, batch)
    # the microbatches of a data shard hold different numbers of unmasked tokens (accumulation must weigh them)
    per_row = batch["mask"].sum(1) * (batch["segments"][:, 1:] == batch["segments"][:, :-1]).mean(1)
    assert len(set(per_row.tolist())) > 1 and batch["mask"].sum() < batch["mask"].size / 2
    ref_loss, ref_grads = None, None
    for over in LAYOUTS[kind]:
        loss, grads = first_step(sft_config(root, d, **over), vocab, batch, d)
        assert abs(loss - want) <= 1e-9 * abs(want), (over, loss, want)
        if ref_grads is None:
            ref_loss, ref_grads = loss, grads
        else:
            assert_params_exact(grads, ref_grads)
    assert ref_loss is not None


def test_a_fine_tuned_run_exports_a_checkpoint_transformers_chats_with(checkpoints, tmp_path):
    """Two SFT steps from `init_from=hf:DIR` (the Llama 3.1 template), then `--format hf`: the export keeps the chat
    template and `eos_token` = the end-of-turn token, and `sample.py --chat --temperature 0` prints the reply that
    transformers' `generate` gives on the export (stopping at the end of the turn)."""
    root, models = checkpoints
    _, d = models["llama"]
    c = sft_config(root, d, **{"mesh.data": 8, "train.steps": 2})
    c.checkpoint.update(every_steps=2, async_save=False)
    c.log.update(every_steps=1, progress=False)
    wd, out = tmp_path / "run", tmp_path / "export"
    trainer.run(c, str(wd))
    assert export_main(["--workdir", str(wd), "--out", str(out), "--format", "hf", "--dtype", "float32"]) == 0
    config = json.loads((out / "tokenizer_config.json").read_text())
    assert config["chat_template"] == released_template("llama3_1") and config["eos_token"] == "<|eot_id|>"
    tok = transformers.AutoTokenizer.from_pretrained(str(out))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "what is the answer"}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
    with torch.no_grad():
        gen = model.generate(**ids, max_new_tokens=12, do_sample=False)[0, ids["input_ids"].shape[1]:].tolist()
    eot = tok.convert_tokens_to_ids("<|eot_id|>")
    want = tok.decode(gen[:gen.index(eot)] if eot in gen else gen)
    res = subprocess.run([sys.executable, str(ROOT / "sample.py"), "--workdir", str(wd), "--chat", messages[1]["content"],
                          "--system", messages[0]["content"], "--temperature", "0", "--new_tokens", "12"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split("\n" + "-" * 40)[0] == want


def test_a_resumed_fine_tuning_run_continues_the_same_packed_rows(checkpoints, tmp_path):
    """Stopped after 2 steps and rerun to 4, an SFT run logs the uninterrupted run's losses (same layout: bitwise);
    the packed rows continue in order."""
    root, models = checkpoints
    _, d = models["qwen3"]
    losses = {}
    for name, stops in (("whole", (4,)), ("resumed", (2, 4))):
        for steps in stops:
            c = sft_config(root, d, **{"mesh.data": 4, "mesh.tensor": 2, "train.steps": steps})
            c.checkpoint.update(every_steps=2, async_save=False)
            c.log.update(every_steps=1, progress=False)
            trainer.run(c, str(tmp_path / name))
        rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        losses[name] = [r["loss"] for r in rows]
    assert losses["resumed"] == losses["whole"] and len(losses["whole"]) == 4
