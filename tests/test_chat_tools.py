"""Tool-calling conversations as TRL's SFTTrainer takes them (`jaxpar/data/messages.py`, `jaxpar/data/chat.py`):
`tool` messages, an assistant's `tool_calls`, a record's `tools` column given to the chat template; the loss on the
assistant's calls and replies, never on a tool's result. The reference is transformers' `apply_chat_template(...,
tools=..., return_assistant_tokens_mask=True)` on the released templates as TRL's wheel ships them."""
import json

import pytest

transformers = pytest.importorskip("transformers")

from helpers import released_template  # noqa: E402
from jaxpar.data import DataError  # noqa: E402
from jaxpar.data.chat import ChatFormat, example  # noqa: E402
from jaxpar.data.special import encode_prompt  # noqa: E402

pytestmark = pytest.mark.xdist_group("test_chat")

SPECIAL = ("<|im_start|>", "<|im_end|>", "<|endoftext|>", "<|begin_of_text|>", "<|start_header_id|>",  # Qwen's and
           "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>")  # Llama's; `<tool_call>`, `<think>`: text, as in
TOOLS = [{"type": "function", "function": {  # Qwen's tokenizers (added tokens that are not special)
    "name": "multiply", "description": "Multiply two integers.",
    "parameters": {"type": "object", "properties": {"a": {"type": "integer", "description": "A number."},
                                                    "b": {"type": "integer", "description": "Another."}},
                   "required": ["a", "b"]}}}]
CALL = {"type": "function", "function": {"name": "multiply", "arguments": {"a": 12, "b": 34}}}
CONVERSATIONS = {
    "one call": [{"role": "user", "content": "What is 12 times 34?"},
                 {"role": "assistant", "content": "", "tool_calls": [CALL]},
                 {"role": "tool", "name": "multiply", "content": "408"},
                 {"role": "assistant", "content": "It is 408."}],
    "two calls, two results, no content": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "12 x 34 and 2 x 3?"},
        {"role": "assistant", "tool_calls": [CALL, {"function": {"name": "multiply", "arguments": '{"a": 2, "b": 3}'}}]},
        {"role": "tool", "content": "408"}, {"role": "tool", "content": "6"},
        {"role": "assistant", "content": "408 and 6."}, {"role": "user", "content": "Thanks"},
        {"role": "assistant", "content": "You are welcome."}],
}


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    from jaxpar.data import BPETokenizer

    d = tmp_path_factory.mktemp("qwen_tok")
    BPETokenizer.train(["What is 12 times 34? It is 408. multiply tool_call name arguments\n" * 4,
                        "system user assistant: be brief, thanks, you are welcome"], 400, SPECIAL).save(d)
    return d


def directory(root, tok_dir, name: str):
    d = root / name
    d.mkdir()
    (d / "tokenizer.json").write_text((tok_dir / "tokenizer.json").read_text())
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": released_template(name),
              "eos_token": "<|eot_id|>" if name.startswith("llama") else "<|im_end|>"}
    config |= {"bos_token": "<|begin_of_text|>"} if name.startswith("llama") else {}
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    return d


@pytest.mark.parametrize("name", ["qwen3_training", "qwen2_5_training"])
def test_tool_calls_render_and_mask_as_transformers_does(tmp_path, tok_dir, name):
    """TRL's training templates (with `{% generation %}`): ids and assistant masks equal transformers' for records
    whose `tools` column is a list or its JSON string (as TRL reads it); the masked text holds the calls and the
    replies, and no tool result."""
    d = directory(tmp_path, tok_dir, name)
    fmt, hf = ChatFormat.from_dir(d), transformers.AutoTokenizer.from_pretrained(str(d))
    for case, messages in CONVERSATIONS.items():
        for tools in (TOOLS, json.dumps(TOOLS)):
            ids, mask = example({"messages": messages, "tools": tools}, "x", fmt, "auto")
            out = hf.apply_chat_template(messages, tools=TOOLS, tokenize=True, return_dict=True,
                                         return_assistant_tokens_mask=True)
            assert ids.tolist() == list(out["input_ids"]), case
            assert mask.tolist() == list(out["assistant_masks"]), case
        trained = fmt.hf.decode(ids[mask == 1].tolist(), skip_special_tokens=False)
        assert '"name": "multiply"' in trained and "tool_response" not in trained, trained
        assert '"description": "Multiply two integers."' in fmt.hf.decode(ids.tolist())  # the schema was rendered


@pytest.mark.parametrize("name", ["qwen3", "qwen2_5"])
def test_templates_without_markers_mask_each_reply_with_its_calls(tmp_path, tok_dir, name):
    """The released templates without markers: ids equal transformers' (the tools in the system prompt); the loss
    covers each assistant reply, its tool calls and its end-of-turn token, and nothing of the tool results, the
    prompt or the schemas."""
    d = directory(tmp_path, tok_dir, name)
    fmt, hf = ChatFormat.from_dir(d), transformers.AutoTokenizer.from_pretrained(str(d))
    messages = CONVERSATIONS["one call"]
    ids, mask = example({"messages": messages, "tools": TOOLS}, "x", fmt, "auto")
    assert ids.tolist() == list(hf.apply_chat_template(messages, tools=TOOLS, tokenize=True, return_dict=True)
                                ["input_ids"])
    trained = fmt.hf.decode(ids[mask == 1].tolist(), skip_special_tokens=False)
    call = '<tool_call>\n{"name": "multiply", "arguments": {"a": 12, "b": 34}}\n</tool_call><|im_end|>'
    reply = "It is 408.<|im_end|>"
    assert trained.replace("<think>\n\n</think>\n\n", "") in (call + reply, "\n" + call + reply), trained


def test_a_prompt_with_tools_is_the_templates_generation_prompt(tmp_path, tok_dir):
    """`python -m jaxpar.generate` and RL prompt records with `tools`: the ids `apply_chat_template(prompt,
    tools=..., add_generation_prompt=True)` gives."""
    d = directory(tmp_path, tok_dir, "qwen3")
    fmt, hf = ChatFormat.from_dir(d), transformers.AutoTokenizer.from_pretrained(str(d))
    prompt = CONVERSATIONS["one call"][:3]
    want = hf.apply_chat_template(prompt, tools=TOOLS, tokenize=True, add_generation_prompt=True,
                                  return_dict=True)["input_ids"]
    assert encode_prompt(prompt, fmt.hf, fmt, "x", TOOLS) == list(want)


@pytest.mark.parametrize("record, says", [
    ({"messages": [{"role": "user", "content": "hi", "tool_calls": [CALL]}]}, "only an assistant message calls"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": [{"function": {}}]}]},
     r"tool_calls\[0\] is not"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "tool_calls": []}]}, "non-empty list"),
    ({"messages": [{"role": "tool"}]}, r"messages\[0\] \(tool\) has no string `content`"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": "{not json"}, "`tools` is a string that is not JSON"),
    ({"messages": [{"role": "user", "content": "hi"}], "tools": {"name": "f"}}, "`tools` must be a list"),
    ({"messages": [{"role": "function", "content": "hi"}]}, "unknown role 'function'"),
])
def test_malformed_tool_records_are_refused_in_one_line(tmp_path, tok_dir, record, says):
    fmt = ChatFormat.from_dir(directory(tmp_path, tok_dir, "qwen3_training"))
    with pytest.raises(DataError, match=says) as e:
        example(record, "data.jsonl:3", fmt, "auto")
    assert str(e.value).startswith("data.jsonl:3") and "\n" not in str(e.value)


@pytest.mark.parametrize("name", ["qwen3", "qwen2_5", "qwen3_training", "llama3_1"])
def test_a_tool_results_ids_are_trls(tmp_path, tok_dir, name):
    """`ChatFormat.tool_suffix`: the ids a row that called tools continues with (its results, then the generation
    prompt) equal TRL 1.16's own `GRPOTrainer._get_tool_suffix_ids` on the same tokenizer and template, for one
    result and for two; where the template rewrites the turn before them (Qwen3's released one drops an earlier
    reasoning block: TRL swaps in its training template), both refuse."""
    from types import SimpleNamespace

    from trl import GRPOTrainer

    from jaxpar.data.chat import TemplateFailure

    d = directory(tmp_path, tok_dir, name)
    fmt, hf = ChatFormat.from_dir(d), transformers.AutoTokenizer.from_pretrained(str(d))
    trainer = SimpleNamespace(processing_class=hf, chat_template=None, chat_template_kwargs={}, _is_vlm=False,
                              _tokenizer=hf)
    for results in ([{"role": "tool", "name": "multiply", "content": "408"}],
                    [{"role": "tool", "name": "multiply", "content": "408"},
                     {"role": "tool", "name": "multiply", "content": '{"error": "Tool add not found."}'}]):
        try:
            want = GRPOTrainer._get_tool_suffix_ids(trainer, results)
        except ValueError:
            with pytest.raises(TemplateFailure, match="renders a tool's result so that the turn before it changes"):
                fmt.tool_suffix(results)
            assert name == "qwen3"
            continue
        got = fmt.tool_suffix(results).tolist()
        assert got == list(want) and "408" in fmt.hf.decode(got), (name, fmt.hf.decode(got))
        assert fmt.with_tools(TOOLS).tool_suffix(results).tolist() == got  # (rendered without the tools, as TRL)


TOOL_FILE = '''
import asyncio


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: A number.
        b: Another.
    """
    return a * b


async def lookup(key: str) -> str:
    """Look a key up.

    Args:
        key: What to look up.
    """
    await asyncio.sleep(0)
    if key == "missing":
        raise KeyError(key)
    return key.upper()


def divide(a: int, b: int) -> float:
    """Divide a by b.

    Args:
        a: The dividend.
        b: The divisor.
    """
    return a / b


def parts(n: int) -> list:
    """Content blocks.

    Args:
        n: How many.
    """
    return [{"type": "text", "text": str(i)} for i in range(n)]


def undocumented(x):
    return x
'''


def test_tools_run_with_trls_contract(tmp_path, tok_dir):
    """`grpo.tools`' functions (`rl/tools.py`): their schemas are transformers' (the ids a template renders with them
    equal `apply_chat_template(..., tools=[functions])`'s); a turn's calls run as TRL runs them: results in order, the
    awaited ones after the others, an unknown name, a raising tool, an awaited one that raises or a call of another
    type giving TRL's `{"error": ...}` result and counting as a failure; a list of content blocks kept whole."""
    from jaxpar.rl import tools

    (tmp_path / "tools.py").write_text(TOOL_FILE)
    fns = tools.load(",".join(f"{tmp_path}/tools.py:{n}" for n in ("multiply", "lookup", "divide", "parts")))
    d = directory(tmp_path, tok_dir, "qwen3_training")
    fmt, hf = ChatFormat.from_dir(d), transformers.AutoTokenizer.from_pretrained(str(d))
    messages = CONVERSATIONS["one call"]
    ids, _ = example({"messages": messages, "tools": tools.schemas(fns)}, "x", fmt, "auto")
    assert ids.tolist() == list(hf.apply_chat_template(messages, tools=fns, tokenize=True, return_dict=True)
                                ["input_ids"])

    call = lambda name, **args: {"type": "function", "function": {"name": name, "arguments": args}}  # noqa: E731
    got, failed = tools.ToolBox(fns).run([
        call("lookup", key="abc"), call("multiply", a=12, b=34), call("nope", x=1), call("divide", a=1, b=0),
        call("lookup", key="missing"), {"type": "code", "name": "exec"}, call("parts", n=2)])
    assert got == [
        {"role": "tool", "name": "multiply", "content": "408"},
        {"role": "tool", "name": "nope", "content": "{'error': 'Tool nope not found.'}"},
        {"role": "tool", "name": "divide", "content": "{'error': 'division by zero'}"},
        {"role": "tool", "name": "exec", "content": "{'error': 'Unsupported tool call type: code'}"},
        {"role": "tool", "name": "parts", "content": [{"type": "text", "text": "0"}, {"type": "text", "text": "1"}]},
        {"role": "tool", "name": "lookup", "content": "ABC"},
        {"role": "tool", "name": "lookup", "content": "{'error': \"'missing'\"}"}]
    assert failed == 4

    with pytest.raises(ValueError, match="two tools are named 'multiply'"):
        tools.load(f"{tmp_path}/tools.py:multiply,{tmp_path}/tools.py:multiply")
    with pytest.raises(ValueError, match="the tool 'undocumented' has no schema"):
        tools.schemas(tools.load(f"{tmp_path}/tools.py:undocumented"))
