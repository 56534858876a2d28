"""What jaxpar reads of a released checkpoint beyond its weights (`tests/released.py`: Qwen-style and Llama-style
directories with a generation_config.json of several end ids, the released chat templates, Llama's BOS-adding
tokenizer), against transformers: `python -m jaxpar.generate` equals `generate` token for token and stops where it
stops; GRPO's prompts are encoded as TRL encodes them and its completions end at the first declared end id; an export
declares the same end ids; the per-row placement of log-probs is exact whatever the matmul unit."""
import json
import os
import re
import sys

import jax
import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

sys.path.insert(0, os.path.dirname(__file__))
import released  # noqa: E402
from helpers import tiny_config  # noqa: E402
from jaxpar.data import special  # noqa: E402

pytestmark = pytest.mark.xdist_group("test_released")
NEW = 24
MESSAGES = [[{"role": "user", "content": "What is 2+2?"}],
            [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]]


@pytest.fixture(scope="module", params=list(released.STYLES))
def checkpoint(request, tmp_path_factory):
    """(style, directory, transformers model read back from it, its tokenizer, {end token: id})."""
    d = tmp_path_factory.mktemp(request.param)
    _, ends = released.build(d, request.param)
    model = transformers.AutoModelForCausalLM.from_pretrained(d).eval()
    return request.param, d, model, transformers.AutoTokenizer.from_pretrained(d), ends


def hf_generate(model, ids):
    """transformers' greedy `generate` (its generation_config.json: every end id) -> the new ids."""
    with torch.no_grad():
        out = model.generate(torch.tensor([ids]), max_new_tokens=NEW, do_sample=False)
    return out[0, len(ids):].tolist()


def test_generate_cli_equals_transformers_and_stops_at_the_declared_ends(checkpoint, tmp_path):
    from jaxpar.generate.__main__ import main

    style, d, model, tok, ends = checkpoint
    records = [{"prompt": p} for p in released.PROBES] + [{"messages": m} for m in MESSAGES]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert main(["--model", f"hf:{d}", "--prompts", str(tmp_path / "in.jsonl"), "--out", str(tmp_path / "out.jsonl"),
                 f"--max_new_tokens={NEW}", "--progress=0"]) == 0
    got = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    only_declared = set(ends.values()) - {tok.eos_token_id}  # ends that neither the tokenizer's EOS nor ... say
    stopped_there = 0
    for rec, out in zip(records, got):
        ids = (tok(rec["prompt"])["input_ids"] if "prompt" in rec else
               tok.apply_chat_template(rec["messages"], add_generation_prompt=True, tokenize=True,
                                       return_dict=True)["input_ids"])
        want = hf_generate(model, ids)
        assert out["completion_ids"] == want, (style, rec)
        assert out["finish_reason"] == ("stop" if want[-1] in ends.values() else "length")
        stopped_there += out["finish_reason"] == "stop" and want[-1] in only_declared
        np.testing.assert_allclose(out["logprobs"], model_logprobs(model, ids, want), atol=1e-4)  # greedy: the model's
    assert stopped_there, "no completion ended at an end id only generation_config.json declares"
    if style == "llama":  # the string prompt got the tokenizer's BOS, as transformers and TRL add it
        assert tok("x")["input_ids"][0] == tok.bos_token_id


def model_logprobs(model, ids, new):
    with torch.no_grad():
        logits = model(torch.tensor([ids + new])).logits[0, len(ids) - 1:-1]
    return torch.log_softmax(logits.double(), -1).gather(-1, torch.tensor(new)[:, None])[:, 0].numpy()


def test_grpo_prompts_are_encoded_as_trl_and_completions_end_at_the_first_end_id(checkpoint, tmp_path):
    """`data.prompts`: string prompts with the tokenizer's special tokens (TRL: `processing_class(text=prompts)`),
    conversations as `apply_chat_template` renders them; the round's stop set is every declared end id, so a greedy
    round equals transformers' `generate` and no completion runs past an end id."""
    from jaxpar.data import prompts as prompt_data
    from jaxpar.formats import hf
    from jaxpar.generate.engine import Engine
    from jaxpar.rl import rollout

    style, d, model, tok, ends = checkpoint
    rows = [{"prompt": p, "solution": "4"} for p in released.PROBES[:3]] + [{"prompt": m} for m in MESSAGES]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    c = tiny_config(**{"train.objective": "grpo", "model.seq_len": 120, "grpo.max_completion_length": NEW,
                       "data.sources": str(tmp_path / "prompts.jsonl"), "data.cache_dir": str(tmp_path / "cache"),
                       "data.val_fraction": 0.0})
    c.init_from = f"hf:{d}"
    c = hf.apply(c, say=False)
    info, (train, _) = prompt_data.read(c)
    for rec, ids in zip(train.records, train.ids):
        want = (tok(rec["prompt"])["input_ids"] if isinstance(rec["prompt"], str) else
                tok.apply_chat_template(rec["prompt"], add_generation_prompt=True, tokenize=True,
                                        return_dict=True)["input_ids"])
        assert ids.tolist() == want
    stops = prompt_data.stop_ids(info, c)
    assert set(ends.values()) <= set(stops)
    fwd, params, jtok = hf.load(str(d))
    done = rollout.sample(Engine(fwd, params, tokenizer=jtok, slots=16), train.ids, 2, NEW, 0, stops,
                          temperature=0.0)
    for k, c_ in enumerate(done):
        ids = train.ids[k // 2].tolist()
        assert c_.tokens == hf_generate(model, ids)
        assert not set(c_.tokens[:-1]) & set(stops)


def test_an_export_declares_the_checkpoints_end_ids(checkpoint, tmp_path):
    """`hf.save` (what `python -m jaxpar.export --format hf` writes) carries generation_config.json: the union of the
    checkpoint's end ids, as transformers reads it back."""
    from jaxpar.formats import hf

    style, d, _, tok, ends = checkpoint
    fwd, params, jtok = hf.load(str(d))
    hf.save(jax.device_get(params), fwd.cfg, jtok, str(tmp_path), "float32", 10 ** 9)
    read = transformers.GenerationConfig.from_pretrained(tmp_path)
    assert sorted(np.atleast_1d(read.eos_token_id).tolist()) == sorted(special.end_ids(jtok, special.chat_format(jtok)))
    assert set(ends.values()) <= set(np.atleast_1d(read.eos_token_id).tolist())


def test_row_placement_is_exact_at_any_matmul_precision():
    """The one-hot products that place each row's log-probs or sums (`kernels.cross_entropy.place_rows`: GRPO's
    old/reference log-probs, DPO's reference sums, evaluation's scores) ask for full float32 precision: every such dot
    in the lowered heads says HIGHEST (a GPU's default TF32 would round each log-prob to 11 significant bits)."""
    from jaxpar import model as gpt
    from jaxpar.evaluate.scores import Scores
    from jaxpar.train.objectives import TokenLogps
    from jaxpar.train.objectives.dpo import ReferenceSums

    rows = 7  # a size nothing else in the heads has: the placement's [microbatch rows, rows] one-hot
    c = gpt.derived(tiny_config(**{"model.seq_len": 16}))
    fwd = gpt.Forward(gpt.config_from(c, 64, 1))
    params = gpt.init_params(fwd.cfg, jax.random.key(0))
    x = jax.numpy.zeros((rows, 16, fwd.cfg.embed))
    mb = {"y": jax.numpy.zeros((rows, 16), jax.numpy.int32), "w": jax.numpy.ones((rows, 16)),
          "seg": jax.numpy.ones((rows, 16), jax.numpy.int32), "ids": jax.numpy.arange(rows)}
    for head in (TokenLogps(rows), Scores(rows, 16), ReferenceSums(rows)):
        text = jax.jit(lambda p, x, mb: head.head(fwd, p, x, mb)).lower(params, x, mb).as_text()
        dots = [line for line in text.splitlines() if "dot_general" in line and f"tensor<{rows}x{rows}xf32>" in line]
        assert dots and all(re.search(r"precision = \[HIGHEST, HIGHEST\]", d) for d in dots), (type(head), dots)


def test_a_model_without_a_template_ends_at_its_eos_and_one_without_any_end_is_said_once(tmp_path, capsys):
    """A bare tokenizer.json (a BPE trained by jaxpar: no tokenizer_config.json, no template) ends at its end-of-text
    token; a byte tokenizer declares no end, said once on stderr however often it is asked."""
    from jaxpar.data import BPETokenizer, ByteTokenizer, load_tokenizer

    BPETokenizer.train(["the quick brown fox " * 20], 300).save(tmp_path)
    tok = load_tokenizer(tmp_path)
    assert special.end_ids(tok, special.chat_format(tok)) == (tok.eot_id,) and tok.eot_id is not None
    capsys.readouterr()
    assert special.end_ids(ByteTokenizer()) == special.end_ids(ByteTokenizer()) == ()
    err = capsys.readouterr().err
    assert err.count("declares no end of sequence") == 1, err
