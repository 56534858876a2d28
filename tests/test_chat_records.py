"""Conversation records as a run reads them (jaxpar/data/chat.py, jaxpar/data/records.py): bad records and templates
are one-line errors naming the file and line, with nothing written to the workdir; a Parquet source of conversations
gives the tokens and loss masks of the same records as JSONL."""
import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from helpers import CHATML, chat_tokenizer, records_config, write_jsonl  # noqa: E402
from jaxpar import trainer  # noqa: E402
from jaxpar.data import DataError  # noqa: E402
from jaxpar.data.chat import ChatFormat, example  # noqa: E402

pytestmark = pytest.mark.xdist_group("test_chat")
CONVERSATION = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
                {"role": "assistant", "content": "It is 4."}, {"role": "user", "content": "And 3+3?"},
                {"role": "assistant", "content": " The answer is 6. "}]


GOOD = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


@pytest.mark.parametrize("bad,match", [
    ({"question": "hi"}, r"line 2: a record needs `messages`, `prompt` and `completion`, or the text field 'text'"),
    ({"messages": [{"role": "robot", "content": "x"}]}, r"line 2: messages\[0\] has the unknown role 'robot'"),
    ({"messages": [{"role": "user"}]}, r"line 2: messages\[0\] \(user\) has no string `content`"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b", "reasoning": 3}]},
     r"line 2: messages\[1\] \(assistant\) has a `reasoning` that is not a string"),
    ({"messages": [{"role": "system", "content": "a"}, {"role": "assistant", "content": "b"}]},
     r"line 2: the chat template .* fails to render it: no system turns"),
])
def test_bad_records_are_one_line_errors_naming_file_and_line(tmp_path, bad, match):
    template = "{% if messages[0]['role'] == 'system' %}{{ raise_exception('no system turns') }}{% endif %}" + CHATML
    chat_tokenizer(tmp_path / "tok", template)
    src = write_jsonl(tmp_path / "d.jsonl", [GOOD, bad, GOOD])
    c = records_config(tmp_path, src)
    with pytest.raises(DataError, match=match) as e:
        trainer.run(c, str(tmp_path / "run"))
    assert "\n" not in str(e.value) and str(src) in str(e.value)
    assert not (tmp_path / "run").exists()


def test_no_template_left_empty_and_unpacked_conversations_are_refused(tmp_path):
    src = write_jsonl(tmp_path / "d.jsonl", [GOOD] * 4)
    chat_tokenizer(tmp_path / "tok")
    (tmp_path / "tok" / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|im_end|>"}))
    with pytest.raises(DataError, match=r"conversations need a chat template, and .*tok.* has none .*"
                                         r"--config.data.chat_template=FILE"):
        trainer.run(records_config(tmp_path, src), str(tmp_path / "run"))
    (tmp_path / "t.jinja").write_text(CHATML)
    c = records_config(tmp_path, src, **{"model.seq_len": 8})
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
        info = data.prepare(records_config(tmp_path, tmp_path / f"d.{ext}"))
        stream = info.streams()[0]
        got[ext] = (stream.read(0, stream.num_tokens), stream.read(0, stream.num_tokens, masks=True))
        assert stream.num_docs == len(records)
    assert all(np.array_equal(a, b) for a, b in zip(got["jsonl"], got["parquet"]))


def test_a_template_without_an_end_of_turn_token_and_markers_is_refused(tmp_path):
    """Where no special token follows a reply, where it ends is unknown: one line, naming the record and the fix."""
    chat_tokenizer(tmp_path, "{% for m in messages %}{{ m['role'] + ': ' + m['content'] + '\\n' }}{% endfor %}")
    fmt = ChatFormat.from_dir(tmp_path)
    assert fmt.end_of_turn is None
    with pytest.raises(DataError, match=r"d.jsonl, line 1: the chat template .* writes no special token after "
                                         r"assistant message 1's reply.*generation %\} markers"):
        example(GOOD, "d.jsonl, line 1", fmt, "auto")
