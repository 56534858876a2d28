"""Conversations -> token ids and loss masks (jaxpar/data/chat.py) against `transformers`' own `apply_chat_template`:
a ChatML template with `{% generation %}` markers (ids and assistant masks); released templates as TRL's wheel ships
them (trl/chat_templates, package data; skipped without trl): Llama 3/3.1/3.2, Qwen2.5/3/3.5/3.6, Gemma 2/3/4 (and
Gemma 4's earlier revisions), Phi-3/3.5, DeepSeek-R1-Distill, gpt-oss, and TRL's `*_training` ones (also DeepSeek-V3's,
Cohere's, GLM-4-MoE's, LFM2's and Nemotron 3 Nano's): ids, and masks equal to transformers' on the same template with
markers around each reply; each reply's own end-of-turn token, the reasoning fields' names, end-of-turn text in a
reply, TRL's training templates as data.chat_template, EOS after a string completion only when missing;
multi-turn with a system message, prompt/completion records. Bad records and templates, and Parquet conversations:
tests/test_chat_records.py."""
import json

import jinja2
import pytest

transformers = pytest.importorskip("transformers")

from helpers import chat_tokenizer, records_config, released_template, write_jsonl  # noqa: E402
from jaxpar.data import DataError  # noqa: E402
from jaxpar.data.chat import ChatFormat, example  # noqa: E402

pytestmark = pytest.mark.xdist_group("test_chat")


G, EG = "{% generation %}", "{% endgeneration %}"
QWEN_END = "        {{- '<|im_end|>\\n' }}\n    {%- elif message.role == \"tool\" %}"
QWEN_MARKED_END = ("        {{- head }}" + G + "{{- body + '<|im_end|>' }}" + EG + "{{- '\\n' }}\n"
                   "    {%- elif message.role == \"tool\" %}")


def qwen3_5_marks(head):
    """Qwen3.5's replies: `head` then the reasoning block and content (after the last question), or the content."""
    return [("{{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content + '\\n</think>\\n\\n' + "
             "content }}",
             "{%- set head = '<|im_start|>' + message.role + '\\n<think>\\n'" + head + " %}{%- set body = "
             "('' if reasoning_content == '' and head.endswith('</think>\\n\\n') else reasoning_content + "
             "'\\n</think>\\n\\n') + content %}", 1),
            ("{{- '<|im_start|>' + message.role + '\\n' + content }}",
             "{%- set head = '<|im_start|>' + message.role + '\\n' %}{%- set body = content %}", 1),
            (QWEN_END, QWEN_MARKED_END, 1)]


def gemma4_marks(name: str):
    """Gemma 4's model turns: the reasoning it writes (not in the first revision, gemma4_v2), the content (written
    directly in the first two revisions, as `captured_content` in later ones) and `<turn|>`, written with the content
    instead of after it."""
    direct = name in ("gemma4_v2", "gemma4_v3")
    content = "{{- strip_thinking(message['content']) -}}" if direct else "{{- captured_content -}}"
    reply = "strip_thinking(message['content'])" if direct else "captured_content"
    is_reply = "role == 'model' and message['content'] is string"
    thought = "{{- '<|channel>thought\\n' + thinking_text + '\\n<channel|>' -}}"
    return [(content, "{%- if " + is_reply + " -%}" + G + "{{- " + reply + " + '<turn|>' -}}" + EG + "{{- '\\n' -}}"
             "{%- else -%}" + content + "{%- endif -%}", 1),
            ("            {{- '<turn|>\\n' -}}\n", "            {%- if not (" + is_reply + ") -%}{{- '<turn|>\\n' -}}"
             "{%- endif -%}\n", 1)] + [(thought, G + thought + EG, 1)] * (name != "gemma4_v2")


# name: (bos, eos, edits that put `{% generation %}` markers into the released template: (old text, new text, count)).
# Each marked span runs from where the generation prompt ends (what the model is given; a generation prompt that
# opens a block, R1-Distill's `<think>\n`, Qwen3.5's, counts as far as the reply writes it) through the reply's
# end-of-turn token: the reasoning the template writes with the reply, its content, its end-of-turn token. Templates
# that ship markers (TRL's `*_training`) are their own reference.
TEMPLATES = {
    "llama3": ("<|begin_of_text|>", "<|eot_id|>", [(
        "{{ content }}", "{% if message['role'] == 'assistant' %}{{ content[:-(message['content'] | trim | length + "
        "10)] }}" + G + "{{ message['content'] | trim + '<|eot_id|>' }}" + EG + "{% else %}{{ content }}{% endif %}",
        1)]),
    **{name: ("<|begin_of_text|>", "<|eot_id|>", [(
        "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim + "
        "'<|eot_id|>' }}",
        "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}{%- if message['role'] == "
        "'assistant' %}" + G + "{{- message['content'] | trim + '<|eot_id|>' }}" + EG + "{%- else %}"
        "{{- message['content'] | trim + '<|eot_id|>' }}{%- endif %}", 1)]) for name in ("llama3_1", "llama3_2")},
    "qwen2_5": (None, "<|im_end|>", [(
        "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}",
        "{{- '<|im_start|>' + message.role + '\\n' }}{% if message.role == 'assistant' %}" + G + "{{- message.content "
        "+ '<|im_end|>' }}" + EG + "{% else %}{{- message.content + '<|im_end|>' }}{% endif %}{{- '\\n' }}", 1)]),
    "qwen3": (None, "<|im_end|>", [
        ("{{- '<|im_start|>' + message.role + '\\n<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + "
         "content.lstrip('\\n') }}", "{%- set head = '<|im_start|>' + message.role + '\\n' %}{%- set body = "
         "'<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') %}", 1),
        ("{{- '<|im_start|>' + message.role + '\\n' + content }}",
         "{%- set head = '<|im_start|>' + message.role + '\\n' %}{%- set body = content %}", 2),
        (QWEN_END, QWEN_MARKED_END, 1)]),
    "qwen3_5_think": (None, "<|im_end|>", qwen3_5_marks("")),
    "qwen3_5_nothink": (None, "<|im_end|>", qwen3_5_marks(" + ('\\n</think>\\n\\n' if reasoning_content == '' "
                                                          "else '')")),
    "qwen3_6": (None, "<|im_end|>", qwen3_5_marks("")),
    "gemma": ("<bos>", "<eos>", [(
        "{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}",
        "{{ '<start_of_turn>' + role + '\n' }}{% if role == 'model' %}" + G + "{{ message['content'] | trim + "
        "'<end_of_turn>' }}" + EG + "{% else %}{{ message['content'] | trim + '<end_of_turn>' }}{% endif %}"
        "{{ '\n' }}", 1)]),
    "gemma3": ("<bos>", "<eos>", [
        ("    {%- if message['content'] is string -%}\n        {{ message['content'] | trim }}",
         "    {%- if message['content'] is string and role == 'model' -%}\n        " + G + "{{ message['content'] | "
         "trim + '<end_of_turn>' }}" + EG + "{{ '\n' }}\n    {%- elif message['content'] is string -%}\n"
         "        {{ message['content'] | trim }}", 1),
        ("    {{ '<end_of_turn>\n' }}", "    {% if role != 'model' %}{{ '<end_of_turn>\n' }}{% endif %}", 1)]),
    **{name: ("<bos>", "<eos>", gemma4_marks(name))
       for name in ("gemma4", "gemma4_v2", "gemma4_v3", "gemma4_v4", "gemma4_v5")},
    **{name: ("<s>", "<|endoftext|>", [(
        "{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}",
        "{{'<|assistant|>\n'}}" + G + "{{ message['content'] + '<|end|>' }}" + EG + "{{ '\n' }}", 1)])
       for name in ("phi3", "phi3_5")},
    "deepseek_r1_distill": ("<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", [(
        "{{'<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>'}}",
        "{{'<｜Assistant｜>'}}" + G + "{{ content + '<｜end▁of▁sentence｜>'}}" + EG, 1)]),
    "gptoss": (None, "<|return|>", [
        ('{%- if "thinking" in message %}\n                {{- "<|start|>assistant<|channel|>analysis<|message|>" + '
         'message.thinking + "<|end|>" }}\n            {%- endif %}',
         '{{- "<|start|>assistant" }}' + G + '{%- if "thinking" in message %}\n                {{- "<|channel|>'
         'analysis<|message|>" + message.thinking + "<|end|><|start|>assistant" }}\n            {%- endif %}', 1),
        ('{{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|return|>" }}',
         '{{- "<|channel|>final<|message|>" + message.content + "<|return|>" }}' + EG, 1),
        ('{{- "<|start|>assistant<|channel|>final<|message|>" + message.content + "<|end|>" }}',
         '{{- "<|start|>assistant" }}' + G + '{{- "<|channel|>final<|message|>" + message.content + "<|end|>" }}' + EG,
         1)]),
    **{f"{name}_training": (bos, eos, []) for name, bos, eos in (
        ("llama3", "<|begin_of_text|>", "<|eot_id|>"), ("qwen2_5", None, "<|im_end|>"), ("qwen3", None, "<|im_end|>"),
        ("qwen3_5_think", None, "<|im_end|>"), ("phi3", "<s>", "<|endoftext|>"), ("phi3_5", "<s>", "<|endoftext|>"),
        ("gptoss", None, "<|return|>"), ("gemma", "<bos>", "<eos>"), ("gemma3", "<bos>", "<eos>"),
        ("qwen3_5_nothink", None, "<|im_end|>"), ("qwen3_6", None, "<|im_end|>"),
        ("deepseek_r1_distill", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
        ("deepseekv3", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"),
        ("cohere", "<BOS_TOKEN>", "<|END_OF_TURN_TOKEN|>"),
        ("glm4moe", None, "<|endoftext|>"), ("lfm2", "<|startoftext|>", "<|im_end|>"),
        ("nemotron_3_nano", None, "<|im_end|>"))},
}
SPECIAL = ("<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>",
           "<|eom_id|>", "<|python_tag|>", "<think>", "</think>", "<bos>", "<eos>", "<start_of_turn>", "<end_of_turn>",
           "<|turn>", "<turn|>", "<|channel>", "<channel|>", "<|think|>", "<|system|>", "<|user|>", "<|assistant|>",
           "<|end|>", "<|start|>", "<|message|>", "<|channel|>", "<|return|>", "<|call|>", "<s>", "</s>", "<｜User｜>",
           "<｜Assistant｜>", "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<BOS_TOKEN>", "<|START_OF_TURN_TOKEN|>",
           "<|END_OF_TURN_TOKEN|>", "<|SYSTEM_TOKEN|>", "<|USER_TOKEN|>", "<|CHATBOT_TOKEN|>", "[gMASK]", "<sop>",
           "<|observation|>", "<|endoftext|>", "<|startoftext|>")  # the templates' tokens


def marked(name: str) -> str:
    """The released template `name` with `{% generation %}` markers around each reply (see TEMPLATES)."""
    template = released_template(name)
    for old, new, count in TEMPLATES[name][2]:
        assert template.count(old) == count, (name, old)
        template = template.replace(old, new)
    return template


@pytest.fixture(scope="module")
def bpe():
    from jaxpar.data import BPETokenizer

    return BPETokenizer.train(["What is 2+2? It is 4. The quick brown fox jumps over the lazy dog.\n" * 4,
                               "system user assistant model: be brief, hello world, the answer is"], 400, SPECIAL)


def template_dir(directory, bpe, template: str, bos, eos):
    """A Hugging Face tokenizer directory: `bpe` (every template's special tokens) and `template`."""
    bpe.save(directory)
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "chat_template": template, "eos_token": eos}
    (directory / "tokenizer_config.json").write_text(json.dumps(config | ({"bos_token": bos} if bos else {})))
    return directory


def conversations(eot: str) -> dict:
    user = [{"role": "user", "content": q} for q in ("What is 2+2?", "And 3+3?", "And 4+4?")]
    return {
        "single": [user[0], {"role": "assistant", "content": "It is 4."}],
        "system, multi-turn": [{"role": "system", "content": "Be brief."}, user[0],
                               {"role": "assistant", "content": "It is 4."}, user[1],
                               {"role": "assistant", "content": " The answer is 6. "}],
        "reasoning fields": [user[0], {"role": "assistant", "content": "4", "reasoning_content": "two and two"},
                             user[1], {"role": "assistant", "content": "6", "reasoning": "three and three"},
                             user[2], {"role": "assistant", "content": "8", "thinking": "four and four"}],
        "end-of-turn text in a reply": [user[0], {"role": "assistant", "content": f"It is 4. {eot} Or so."},
                                        user[1], {"role": "assistant", "content": "6"}],
    }


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_released_templates_give_transformers_ids_and_assistant_masks(tmp_path, bpe, name):
    """Every released template (TRL's copies, trl/chat_templates): jaxpar's ids equal `apply_chat_template`'s, and its
    mask equals transformers' `return_assistant_tokens_mask` on the same template with `{% generation %}` around each
    reply (TEMPLATES says which span: from the end of the generation prompt through the reply's end-of-turn token),
    on single- and multi-turn conversations, a system message, reasoning under each of its names and an end-of-turn
    string inside a reply. A conversation the template refuses (Gemma 2's system messages) is refused,
    in one line, and by transformers too."""
    bos, eos, _ = TEMPLATES[name]
    plain = template_dir(tmp_path / "plain", bpe, released_template(name), bos, eos)
    mark = template_dir(tmp_path / "marked", bpe, marked(name), bos, eos)
    fmt = ChatFormat.from_dir(plain)
    hf_plain, hf_marked = (transformers.AutoTokenizer.from_pretrained(str(d)) for d in (plain, mark))
    for case, messages in conversations(fmt.end_of_turn).items():
        try:
            ref_ids = hf_plain.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
        except jinja2.TemplateError:
            with pytest.raises(DataError, match="fails to render it"):
                example({"messages": messages}, "x", fmt, "auto")
            continue
        ids, mask = example({"messages": messages}, "x", fmt, "auto")
        out = hf_marked.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True)
        assert list(out["input_ids"]) == list(ref_ids) == ids.tolist(), case
        assert mask.tolist() == list(out["assistant_masks"]), (case, fmt.hf.decode(ids[mask == 1].tolist()))
        assert 0 < mask.sum() < mask.size


def released(tmp_path, bpe, name: str) -> ChatFormat:
    bos, eos, _ = TEMPLATES[name]
    return ChatFormat.from_dir(template_dir(tmp_path, bpe, released_template(name), bos, eos))


def trained_text(fmt: ChatFormat, ids, mask) -> str:
    return fmt.hf.decode(ids[mask == 1].tolist(), skip_special_tokens=False)


QUESTION, FOLLOW_UP = {"role": "user", "content": "What is 2+2?"}, {"role": "user", "content": "And 3+3?"}


def test_each_reply_ends_at_its_own_end_of_turn_token(tmp_path, bpe):
    """gpt-oss closes its last reply with `<|return|>` and earlier ones with `<|end|>`: each reply's span ends at the
    token the template writes after that reply, so the user turn between two replies is not trained on."""
    fmt = released(tmp_path, bpe, "gptoss")
    ids, mask = example({"messages": [QUESTION, {"role": "assistant", "content": "It is 4."}, FOLLOW_UP,
                                      {"role": "assistant", "content": "6"}]}, "x", fmt, "auto")
    assert trained_text(fmt, ids, mask) == ("<|channel|>final<|message|>It is 4.<|end|>"
                                            "<|channel|>final<|message|>6<|return|>")


@pytest.mark.parametrize("name,field,expected", [
    ("qwen3", "reasoning_content", "<think>\ntwo and two\n</think>\n\nIt is 4.<|im_end|>"),
    ("qwen3", "reasoning", "<think>\ntwo and two\n</think>\n\nIt is 4.<|im_end|>"),
    ("qwen3", "thinking", "<think>\ntwo and two\n</think>\n\nIt is 4.<|im_end|>"),
    ("gptoss", "reasoning_content", "<|channel|>analysis<|message|>two and two<|end|><|start|>assistant"
                                    "<|channel|>final<|message|>It is 4.<|return|>"),
])
def test_reasoning_reaches_the_template_under_each_name(tmp_path, bpe, name, field, expected):
    """A reply's reasoning under `reasoning_content`, `reasoning` or `thinking` is rendered under the name the template
    reads (Qwen3's `reasoning_content`, gpt-oss's `thinking`), as transformers 5 renders it, and trained on."""
    fmt = released(tmp_path, bpe, name)
    messages = [QUESTION, {"role": "assistant", "content": "It is 4.", field: "two and two"}]
    ids, mask = example({"messages": messages}, "x", fmt, "auto")
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    assert ids.tolist() == list(hf.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])
    assert trained_text(fmt, ids, mask) == expected


def test_end_of_turn_text_inside_a_reply_is_part_of_the_reply(tmp_path, bpe):
    """A reply that writes its template's end-of-turn text (tokenized as that token, as transformers does) is trained
    on whole: its span ends at the end-of-turn token the template writes after it."""
    fmt = released(tmp_path, bpe, "qwen2_5")
    ids, mask = example({"messages": [QUESTION, {"role": "assistant", "content": "Type <|im_end|> to stop. Done."},
                                      FOLLOW_UP, {"role": "assistant", "content": "6"}]}, "x", fmt, "auto")
    assert trained_text(fmt, ids, mask) == "Type <|im_end|> to stop. Done.<|im_end|>6<|im_end|>"


def test_a_last_reply_the_template_leaves_open_ends_with_its_content(tmp_path):
    """A template that closes a turn only when another follows (or the generation prompt does) leaves the last reply
    open: its span is its content; earlier replies end with their `<|im_end|>`. The reference: transformers' mask on
    the same template with `{% generation %}` around each reply's content and the end it writes."""
    close = "{% if not loop.last or add_generation_prompt %}{{ '<|im_end|>' }}{% endif %}"
    head = "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' }}"
    tail = "{% if not loop.last or add_generation_prompt %}{{ '\\n' }}{% endif %}{% endfor %}" \
           "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    plain = head + "{{ m['content'] }}" + close + tail
    mark = head + "{% if m['role'] == 'assistant' %}" + G + "{{ m['content'] }}" + close + EG + \
        "{% else %}{{ m['content'] }}" + close + "{% endif %}" + tail
    messages = [QUESTION, {"role": "assistant", "content": "It is 4."}, FOLLOW_UP,
                {"role": "assistant", "content": "6"}]
    chat_tokenizer(tmp_path / "plain", plain)
    chat_tokenizer(tmp_path / "marked", mark)
    fmt = ChatFormat.from_dir(tmp_path / "plain")
    ids, mask = example({"messages": messages}, "x", fmt, "auto")
    out = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "marked")).apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    assert ids.tolist() == list(out["input_ids"]) and mask.tolist() == list(out["assistant_masks"])
    assert trained_text(fmt, ids, mask) == "It is 4.<|im_end|>6"


def test_trl_training_templates_are_accepted_as_data_chat_template(tmp_path, bpe):
    """TRL's `*_training` templates given as data.chat_template (the fix jaxpar's own refusal suggests) are accepted
    and masked as transformers masks them, though Phi-3's marks one block more than there are replies (the final
    EOS): the prepared store's tokens and masks equal `apply_chat_template`'s, record by record."""
    from jaxpar import data

    bos, eos, _ = TEMPLATES["phi3_training"]
    template_dir(tmp_path / "tok", bpe, released_template("llama3"), bos, eos)  # the checkpoint's own
    conversations_ = [[QUESTION, {"role": "assistant", "content": "It is 4."}],
                      [QUESTION, {"role": "assistant", "content": "4"}, FOLLOW_UP,
                       {"role": "assistant", "content": "6"}]]
    src = write_jsonl(tmp_path / "d.jsonl", [{"messages": m} for m in conversations_] * 4)
    c = records_config(tmp_path, src)
    (tmp_path / "phi3_training.jinja").write_text(released_template("phi3_training"))
    c.data.chat_template = str(tmp_path / "phi3_training.jinja")
    stream = data.prepare(c).streams()[0]
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path / "tok"))
    hf.chat_template = released_template("phi3_training")
    ref = [hf.apply_chat_template(m, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
           for m in conversations_ * 4]
    assert stream.read(0, stream.num_tokens).tolist() == sum((list(r["input_ids"]) for r in ref), [])
    assert stream.read(0, stream.num_tokens, masks=True).tolist() == sum((list(r["assistant_masks"]) for r in ref), [])


@pytest.mark.parametrize("name", ["glm4moe_training", "qwen3_training", "gptoss"])
def test_conversational_completions_are_masked_as_trl_masks_them(tmp_path, bpe, name):
    """A prompt/completion record of messages, its loss on the completion (`auto`): as TRL masks it, the tokens after
    the prompt rendered with the generation prompt, and (with `{% generation %}` markers) inside a marked block: the
    prompt's own replies, which TRL's templates mark too, stay out."""
    fmt = released(tmp_path, bpe, name)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    prompt = [QUESTION, {"role": "assistant", "content": "It is 4."}, FOLLOW_UP]
    completion = [{"role": "assistant", "content": "6"}]
    ids, mask = example({"prompt": prompt, "completion": completion}, "x", fmt, "auto")
    head = hf.apply_chat_template(prompt, tokenize=True, return_dict=True, add_generation_prompt=True)["input_ids"]
    out = hf.apply_chat_template(prompt + completion, tokenize=True, return_dict=True,
                                 return_assistant_tokens_mask=fmt.markers)
    assert ids.tolist() == list(out["input_ids"]) and list(out["input_ids"][:len(head)]) == list(head)
    expected = [0] * len(head) + [1] * (len(ids) - len(head))
    if fmt.markers:
        expected = [a & b for a, b in zip(expected, out["assistant_masks"])]
    assert mask.tolist() == expected, trained_text(fmt, ids, mask)


@pytest.mark.parametrize("completion", [" It is 4.", " It is 4.<|im_end|>"])
def test_prompt_completion_strings_as_trl_tokenizes_them(tmp_path, completion):
    """String prompt and completion: prompt + completion with the tokenizer's special tokens, then EOS unless the
    completion already ends with it (TRL adds it only when missing); the loss on the completion's tokens and EOS
    (TRL's completion mask)."""
    chat_tokenizer(tmp_path)
    fmt = ChatFormat.from_dir(tmp_path)
    hf = transformers.AutoTokenizer.from_pretrained(str(tmp_path))
    prompt = "What is 2+2?"
    ids, mask = example({"prompt": prompt, "completion": completion}, "x", fmt, "auto")
    with_eos = completion if completion.endswith(hf.eos_token) else completion + hf.eos_token
    full, head = hf(prompt + with_eos)["input_ids"], hf(prompt)["input_ids"]
    assert full[:len(head)] == head and full.count(hf.eos_token_id) == 1
    assert ids.tolist() == full
    assert mask.tolist() == [0] * len(head) + [1] * (len(full) - len(head))
