"""Generate text from a trained run: `python sample.py --workdir DIR --prompt TEXT [--new_tokens N]`, or chat:
`python sample.py --workdir DIR --chat TEXT [--system TEXT]` (the tokenizer's chat template with the generation
prompt; the reply up to the end-of-turn token).

DIR is a run directory (its config, tokenizer and latest checkpoint are loaded, whatever layout trained it), an
export written by `python -m jaxpar.export` (it holds model_config.json), or `hf:DIR`, a Hugging Face directory
(or `hf:ORG/NAME[@REVISION]`, a Hub model, fetched into the Hugging Face cache)
(GPT-2 or Llama; float32 on one device).

Guide: docs/getting-started.md (sampling), docs/models.md (Hugging Face directories).
"""
import os
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


def prompt_ids(tok, where):
    """(the chat format or None, the prompt's ids): --chat rendered with the tokenizer's template, else --prompt."""
    if _CHAT.value is None:
        return None, tok.encode(_PROMPT.value)
    from jaxpar.data.chat import ChatFormat
    from jaxpar.data.common import DataError

    try:
        chat = ChatFormat.from_dir(getattr(tok, "directory", None) or where)
    except DataError as e:
        sys.exit(f"error: {e}")
    messages = [{"role": "system", "content": _SYSTEM.value}] * (_SYSTEM.value is not None)
    return chat, chat.prompt(messages + [{"role": "user", "content": _CHAT.value}]).tolist()


def main(argv):
    del argv
    logging.set_verbosity(logging.WARNING)
    import jax
    import jax.numpy as jnp

    from jaxpar.export import CONFIG_FILE, load_export
    from jaxpar.model.generate import generate
    from jaxpar.state.runs import load_params

    from jaxpar.formats import hf, hub

    try:
        name = hub.model_name(_WORKDIR.value)  # hf:ORG/NAME[@REVISION]: into the Hugging Face cache
        where = hf.directory_of("hf:" + hub.fetch(name)[0] if name else _WORKDIR.value)
        if where is not None:
            load = hf.load
        else:
            where = _WORKDIR.value
            load = load_export if os.path.isfile(os.path.join(where, CONFIG_FILE)) else load_params
        fwd, params, tok = load(where)
    except (FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    chat, ids = prompt_ids(tok, where)
    room = fwd.cfg.max_positions - len(ids)
    if room < 1:
        sys.exit(f"error: the prompt has {len(ids)} tokens; the model's max_positions is "
                 f"{fwd.cfg.max_positions}.")
    new = min(_NEW.value, room)
    prompt = jnp.asarray([ids] * _NUM.value, jnp.int32)
    stop = tuple(sorted(chat.stop_ids)) if chat else ()
    out = jax.jit(generate, static_argnums=(0, 3, 5, 6, 7))(
        fwd, params, prompt, new, jax.random.key(_SEED.value), _TEMP.value, _TOPK.value, stop)
    for row in jax.device_get(out):
        if chat is None:
            print(tok.decode(row.tolist()))
        else:  # the reply: the new tokens up to the end of the turn
            reply = row[len(ids):].tolist()
            stop = next((k for k, t in enumerate(reply) if t in chat.stop_ids), len(reply))
            print(tok.decode(reply[:stop]))
        print("-" * 40)


if __name__ == "__main__":
    flags.mark_flag_as_required("workdir")
    app.run(main)
