"""Generate text from a trained run: `python sample.py --workdir DIR --prompt TEXT [--new_tokens N]`, or chat:
`python sample.py --workdir DIR --chat TEXT [--system TEXT]` (the tokenizer's chat template with the generation
prompt; the reply up to the end-of-turn token). A completion ends at the checkpoint's end ids (generation_config.json,
the tokenizer's EOS, the template's end of turn).

DIR is a run directory (its config, tokenizer and latest checkpoint are loaded onto one device), an export
written by `python -m jaxpar.export` (it holds model_config.json), or `hf:DIR`, a Hugging Face directory (or
`hf:ORG/NAME[@REVISION]`, a Hub model, fetched into the Hugging Face cache). A thin caller of the generation engine
(`jaxpar/generate`); for files of prompts use `python -m jaxpar.generate`.

Guide: docs/getting-started.md (sampling), docs/generate.md, docs/models.md (Hugging Face directories).
"""
import sys

from absl import app, flags, logging

_WORKDIR = flags.DEFINE_string("workdir", None, "Run directory written by train.py, an export, hf:DIR or hf:ORG/NAME.")
_PROMPT = flags.DEFINE_string("prompt", "\n", "Text to continue.")
_NEW = flags.DEFINE_integer("new_tokens", 200, "Tokens to generate (prompt + new <= the model's max_positions).")
_TEMP = flags.DEFINE_float("temperature", 0.8, "Sampling temperature; 0 = greedy.")
_TOPK = flags.DEFINE_integer("top_k", 40, "Keep the k most likely tokens; 0 = all.")
_SEED = flags.DEFINE_integer("seed", 0, "Sampling seed.")
_NUM = flags.DEFINE_integer("num_samples", 1, "Samples to draw (a batch).")
_CHAT = flags.DEFINE_string("chat", None, "A user message: print the reply (the chat template; docs/finetune.md).")
_SYSTEM = flags.DEFINE_string("system", None, "With --chat: a system message before it.")


ONE_DEVICE = {"data": 1, "tensor": 1, "stage": 1, "expert": 1, "context": 1}  # a run's params, gathered onto one


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    from jaxpar.data import special
    from jaxpar.generate import source
    from jaxpar.generate.engine import Engine, Request

    try:
        src = source.load(_WORKDIR.value, ONE_DEVICE)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    if _CHAT.value is not None and src.chat is None:
        sys.exit(f"error: {_WORKDIR.value} has no chat template (docs/finetune.md).")
    messages = [{"role": "system", "content": _SYSTEM.value}] * (_SYSTEM.value is not None)
    prompt = _PROMPT.value if _CHAT.value is None else messages + [{"role": "user", "content": _CHAT.value}]
    ids, stops = special.encode_prompt(prompt, src.tokenizer, src.chat), special.end_ids(src.tokenizer, src.chat)
    room = src.fwd.cfg.max_positions + 1 - len(ids)  # (the last token needs no position of its own)
    if room < 1:
        sys.exit(f"error: the prompt has {len(ids)} tokens; the model's max_positions is {src.fwd.cfg.max_positions}.")
    engine = Engine.of_source(src, slots=_NUM.value)
    reqs = [Request(ids, max_new_tokens=min(_NEW.value, room), temperature=_TEMP.value, top_k=_TOPK.value,
                    seed=_SEED.value, stream=j, stop_ids=stops) for j in range(_NUM.value)]
    for c in engine.generate(reqs):
        print(c.text if _CHAT.value is not None else src.tokenizer.decode(list(ids) + c.tokens))
        print("-" * 40)


if __name__ == "__main__":
    flags.mark_flag_as_required("workdir")
    app.run(main)
