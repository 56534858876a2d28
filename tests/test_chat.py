"""Conversations -> token ids and loss masks (jaxpar/data/chat.py) against `transformers`' own `apply_chat_template`:
a ChatML template with `{% generation %}` markers (ids and assistant masks), the real Llama 3, Llama 3.1 and Qwen3
templates (tests/fixtures/chat_templates: ids, and masks derived by rendering against transformers' masks on the same
templates with markers added), multi-turn with a system message, prompt/completion records; bad records and
templates are one-line errors naming the file and line, with nothing written to the workdir."""
import json
import pathlib

import numpy as np
import pytest

transformers = pytest.importorskip("transformers")

from helpers import CHATML, chat_tokenizer, tiny_config  # noqa: E402
from jaxpar import trainer  # noqa: E402
from jaxpar.data import DataError  # noqa: E402
from jaxpar.data.chat import ChatFormat, example  # noqa: E402

pytestmark = pytest.mark.xdist_group("test_chat")
FIXTURES = pathlib.Path(__file__).parent / "fixtures" / "chat_templates"
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
                {"role": "assistant", "content": "It is 4."}, {"role": "user", "content": "And 3+3?"},
                {"role": "assistant", "content": " The answer is 6. "}]


def llama3_marked(t):
    old = "{{ content }}"
    new = ("{% if message['role'] == 'assistant' %}{{ content[:-(message['content'] | trim | length + 10)] }}"
           "{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}{% endgeneration %}"
           "{% else %}{{ content }}{% endif %}")
    assert t.count(old) == 1
    return t.replace(old, new)


def llama3_1_marked(t):
    old = "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + " \
          "'<|eot_id|>' }}"
    new = ("{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
           "{%- if message['role'] == 'assistant' %}{% generation %}{{- message['content'] | trim + '<|eot_id|>' }}"
           "{% endgeneration %}{%- else %}{{- message['content'] | trim + '<|eot_id|>' }}{%- endif %}")
    assert t.count(old) == 1
    return t.replace(old, new)


def qwen3_marked(t):
    think = ("{{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + "
             "'\\n</think>\\n\\n' + content.lstrip('\\n') }}")
    plain = "{{- '<|im_start|>' + message.role + '\\n' + content }}"
    end = "        {{- '<|im_end|>\\n' }}\n    {%- elif message.role == \"tool\" %}"
    assert t.count(think) == 1 and t.count(plain) == 2 and t.count(end) == 1
    t = t.replace(think, "{%- set body = '<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + "
                         "content.lstrip('\\n') %}")
    t = t.replace(plain, "{%- set body = content %}")
    return t.replace(end, "        {{- '<|im_start|>' + message.role + '\\n' }}{% generation %}{{- body + "
                          "'<|im_end|>' }}{% endgeneration %}{{- '\\n' }}\n    {%- elif message.role == \"tool\" %}")


TEMPLATES = {  # name: (template, its version with generation markers, bos, eos)
    "llama3": ((FIXTURES / "llama3.jinja").read_text(), llama3_marked, "<|begin_of_text|>", "<|eot_id|>"),
    "llama3_1": ((FIXTURES / "llama3_1.jinja").read_text(), llama3_1_marked, "<|begin_of_text|>", "<|eot_id|>"),
    "qwen3": ((FIXTURES / "qwen3.jinja").read_text(), qwen3_marked, None, "<|im_end|>"),
}


def reference(directory, messages, marked=True):
    """transformers' ids and assistant mask of `messages` with the template in `directory`."""
    tok = transformers.AutoTokenizer.from_pretrained(str(directory))
    out = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=marked)
    return list(out["input_ids"]), list(out["assistant_masks"]) if marked else None


def test_ids_and_masks_equal_apply_chat_template_with_generation_markers(tmp_path):
    chat_tokenizer(tmp_path)
    fmt = ChatFormat.from_dir(tmp_path)
    assert fmt.markers and fmt.end_of_turn == "<|im_end|>"
    ids, mask = fmt.conversation(CONVERSATION, "assistant")
    ref_ids, ref_mask = reference(tmp_path, CONVERSATION)
    assert ids.tolist() == ref_ids and mask.tolist() == ref_mask and 0 < mask.sum() < mask.size
    record = {"prompt": CONVERSATION[:4], "completion": CONVERSATION[4:]}  # the completion: the last reply only
    ids, mask = example(record, "x", fmt, "auto")
    assert ids.tolist() == ref_ids and mask.sum() < sum(ref_mask)
    assert fmt.hf.decode(ids[mask == 1].tolist(), skip_special_tokens=False) == " The answer is 6. <|im_end|>"
    assert example(record, "x", fmt, "assistant")[1].tolist() == ref_mask  # every assistant turn
    assert example({"messages": CONVERSATION}, "x", fmt, "all")[1].all()


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_real_templates_without_markers_give_transformers_ids_and_assistant_tokens(tmp_path, name):
    """Llama 3's, Llama 3.1's and Qwen3's own templates have no generation markers: jaxpar's ids equal
    transformers', and the assistant tokens it derives by rendering equal the mask transformers gives on the same
    template with markers around each reply (the content and the end-of-turn token; Qwen3's last reply with its
    empty think block, as the template writes it)."""
    template, mark, bos, eos = TEMPLATES[name]
    chat_tokenizer(tmp_path / "plain", template, bos, eos)
    chat_tokenizer(tmp_path / "marked", mark(template), bos, eos)
    fmt = ChatFormat.from_dir(tmp_path / "plain")
    assert not fmt.markers and fmt.end_of_turn == eos
    ids, mask = fmt.conversation(CONVERSATION, "assistant")
    assert ids.tolist() == reference(tmp_path / "plain", CONVERSATION, marked=False)[0]
    ref_ids, ref_mask = reference(tmp_path / "marked", CONVERSATION)
    assert ids.tolist() == ref_ids and mask.tolist() == ref_mask, fmt.hf.decode(ids[mask == 1].tolist())
    if bos:  # the template writes BOS once; tokenizing adds none
        assert ids.tolist().count(fmt.hf.token_to_id(bos)) == 1 and ids[0] == fmt.hf.token_to_id(bos)


def test_prompt_completion_strings_as_trl_tokenizes_them(tmp_path):
    """String prompt and completion: prompt + completion with the tokenizer's special tokens, then EOS; the loss on
    the completion's tokens and EOS (TRL's completion mask)."""
    chat_tokenizer(tmp_path)
    fmt = ChatFormat.from_dir(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    prompt, completion = "What is 2+2?", " It is 4."
    ids, mask = example({"prompt": prompt, "completion": completion}, "x", fmt, "auto")
    full, head = hf(prompt + completion)["input_ids"], hf(prompt)["input_ids"]
    assert full[:len(head)] == head
    assert ids.tolist() == full + [hf.eos_token_id]
    assert mask.tolist() == [0] * len(head) + [1] * (len(full) - len(head) + 1)


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


@pytest.mark.parametrize("bad,match", [
    ({"question": "hi"}, r"line 2: a record needs `messages`, `prompt` and `completion`, or the text field 'text'"),
    ({"messages": [{"role": "robot", "content": "x"}]}, r"line 2: messages\[0\] has the unknown role 'robot'"),
    ({"messages": [{"role": "user"}]}, r"line 2: messages\[0\] \(user\) has no string `content`"),
    ({"messages": [{"role": "system", "content": "a"}, {"role": "assistant", "content": "b"}]},
     r"line 2: the chat template .* fails to render it: no system turns"),
])
def test_bad_records_are_one_line_errors_naming_file_and_line(tmp_path, bad, match):
    template = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system turns') }}{% endif %}" + CHATML
    chat_tokenizer(tmp_path / "tok", template)
    src = write_jsonl(tmp_path / "d.jsonl", [GOOD, bad, GOOD])
    c = sft_config(tmp_path, src)
    with pytest.raises(DataError, match=match) as e:
        trainer.run(c, str(tmp_path / "run"))
    assert "\n" not in str(e.value) and str(src) in str(e.value)
    assert not (tmp_path / "run").exists()


def sft_config(tmp_path, src, **over):
    c = tiny_config(**{"mesh.data": 8, "train.global_batch_size": 8, **over})
    c.data.update(sources=str(src), tokenizer=str(tmp_path / "tok" / "tokenizer.json"), packing="bfd",
                  cache_dir=str(tmp_path / "cache"))
    return c


def test_no_template_left_empty_and_unpacked_conversations_are_refused(tmp_path):
    src = write_jsonl(tmp_path / "d.jsonl", [GOOD] * 4)
    chat_tokenizer(tmp_path / "tok")
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    with pytest.raises(DataError, match=r"conversations need a chat template, and .*tok.* has none .*"
                                         r"--config.data.chat_template=FILE"):
        trainer.run(sft_config(tmp_path, src), str(tmp_path / "run"))
    (tmp_path / "t.jinja").write_text(CHATML)
    c = sft_config(tmp_path, src, **{"model.seq_len": 8})
    c.data.update(chat_template=str(tmp_path / "t.jinja"), truncate="skip")
    with pytest.raises(DataError, match=r"no sequence is left in its split after data.truncate='skip' \(3 of 3 are "
                                         r"longer than model.seq_len \+ 1 = 9\)"):
        trainer.run(c, str(tmp_path / "run"))
    c.data.update(packing="concat", truncate="right")
    with pytest.raises(DataError, match=r"packed whole, never cut into windows; set --config.data.packing=bfd"):
        trainer.run(c, str(tmp_path / "run"))
    assert not (tmp_path / "run").exists()


def test_parquet_conversations_give_the_jsonl_tokens_and_masks(tmp_path):
    """A Parquet source with a `messages` column (Hugging Face datasets' layout) is read record by record, as JSONL."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from jaxpar import data

    chat_tokenizer(tmp_path / "tok")
    records = [GOOD, {"messages": CONVERSATION}, {"prompt": CONVERSATION[:2], "completion": CONVERSATION[2:3]}] * 3
    write_jsonl(tmp_path / "d.jsonl", records)
    pq.write_table(pa.Table.from_pylist([{"messages": r.get("messages"), "prompt": r.get("prompt"),
                                          "completion": r.get("completion")} for r in records]), tmp_path / "d.parquet")
    got = {}
    for ext in ("jsonl", "parquet"):
        info = data.prepare(sft_config(tmp_path, tmp_path / f"d.{ext}"))
        stream = info.streams()[0]
        got[ext] = (stream.read(0, stream.num_tokens), stream.read(0, stream.num_tokens, masks=True))
        assert stream.num_docs == len(records)
    assert all(np.array_equal(a, b) for a, b in zip(got["jsonl"], got["parquet"]))


def test_a_template_without_an_end_of_turn_token_and_markers_is_refused(tmp_path):
    """Where no special token follows a reply, where it ends is unknown: one line, naming the record and the fix."""
    chat_tokenizer(tmp_path, "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}")
    fmt = ChatFormat.from_dir(tmp_path)
    assert fmt.end_of_turn is None
    with pytest.raises(DataError, match=r"d.jsonl, line 1: the chat template .* writes no special token after an "
                                         r"assistant's reply.*generation %\} markers"):
        example(GOOD, "d.jsonl, line 1", fmt, "auto")
