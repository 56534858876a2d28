"""Tiny checkpoints shaped like released ones (random weights, nothing downloaded): what a Qwen2.5/Qwen3 or a Llama 3.1
directory carries beyond our other fixtures: a `generation_config.json` declaring several end ids, the released chat
template (TRL's wheel ships them), a tokenizer_config.json with the model's EOS and, for Llama, a tokenizer.json whose
post-processor adds BOS to a string.

The weights are random, and random models seldom pick an end id; so the head's rows of one end id that only
`generation_config.json` declares (Qwen: `<|endoftext|>`, Llama: `<|eom_id|>`) and of the token that greedy decoding of
probe prompts picks most often are swapped: greedy rows then stop there (wherever they would have picked that token),
and a reader of only the tokenizer's EOS and the template would run past it."""
import collections
import json
import os

from helpers import chat_tokenizer, released_template

STYLES = {  # eos (tokenizer_config), generation_config's eos list, the swapped end id, template, BOS the string gets
    "qwen": dict(eos="<|im_end|>", ends=("<|im_end|>", "<|endoftext|>"), swap="<|endoftext|>", template="qwen2_5",
                 bos=None),
    "llama": dict(eos="<|eot_id|>", ends=("<|endoftext|>", "<|eom_id|>", "<|eot_id|>"), swap="<|eom_id|>",
                  template="llama3_1", bos="<|begin_of_text|>"),
}
PROBES = ["What is 2+2?", "The quick brown fox", "hello world, the answer is", "be brief: system user",
          "lazy dog jumps", "It is 4."]


def _tokenizer(directory, style):
    """The BPE tokenizer with the style's special tokens, config and (Llama) a BOS-adding post-processor."""
    from tokenizers.processors import TemplateProcessing

    s = STYLES[style]
    tok = chat_tokenizer(directory, released_template(s["template"]), bos=s["bos"], eos=s["eos"])
    if s["bos"]:
        bos = tok.hf.token_to_id(s["bos"])
        tok.hf.post_processor = TemplateProcessing(single=f"{s['bos']} $A", pair=f"{s['bos']} $A {s['bos']} $B",
                                                   special_tokens=[(s["bos"], bos)])
        tok.save(directory)
    return tok


def build(directory, style: str):
    """A `style` checkpoint in `directory` -> (the transformers model (float32, eval), {token: id} of its end ids)."""
    import torch
    import transformers

    s = STYLES[style]
    tok = _tokenizer(directory, style)
    ids = {t: tok.hf.token_to_id(t) for t in s["ends"]}
    common = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=tok.vocab_size, max_position_embeddings=128,
                  tie_word_embeddings=False, eos_token_id=ids[s["eos"]],
                  bos_token_id=tok.hf.token_to_id(s["bos"] or "<|endoftext|>"))
    if style == "qwen":
        model = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**common, head_dim=16))
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    torch.manual_seed(0)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(torch.randn_like(p) * (0.3 if p.ndim == 1 else 0.1) + (1.0 if "norm" in name else 0.0))
    model.eval()
    _swap_in_an_end(model, tok, ids[s["swap"]])
    model.save_pretrained(directory)
    with open(os.path.join(directory, "generation_config.json"), "w") as f:
        json.dump({"bos_token_id": common["bos_token_id"], "eos_token_id": list(ids.values()),
                   "do_sample": False}, f)
    return model, ids


def _swap_in_an_end(model, tok, end: int) -> None:
    """Swap the head's rows of `end` and of the token greedy decoding of the probes picks most often (past the
    first two tokens of each)."""
    import torch

    seen = collections.Counter()
    for text in PROBES:
        ids = tok.encode(text, add_special_tokens=True)
        with torch.no_grad():
            for _ in range(20):  # greedy, stopping nowhere
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
        seen.update(ids[-18:])
    common = next(t for t, _ in seen.most_common() if t != end)
    with torch.no_grad():
        w = model.lm_head.weight
        w[[common, end]] = w[[end, common]].clone()
