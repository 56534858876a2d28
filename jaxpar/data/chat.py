"""Records -> token ids and a loss mask: conversations rendered with the checkpoint's own chat template, token for
token as `transformers`' `apply_chat_template` renders and tokenizes them.

A record is recognised by its fields, as TRL recognises them:
- `messages`: a list of `{"role", "content"}` (roles `system`, `user`, `assistant`, `tool`; an assistant's
  `tool_calls`: `jaxpar/data/messages.py`), rendered with the template, given the record's `tools` (the functions'
  JSON schemas) as `apply_chat_template(..., tools=...)` gives them: a tool's result is never in the loss;
- `prompt` + `completion`: strings (`prompt + completion`, tokenized with the tokenizer's own special tokens, then
  the end-of-sequence token) or lists of messages (`prompt + completion` rendered with the template);
- `text` (`data.text_field`): the document as it is, then the end-of-text token: today's pretraining meaning.

The template runs in Jinja's sandbox with the settings transformers uses (`trim_blocks`, `lstrip_blocks`, loop
controls, its `tojson`, `raise_exception`, `strftime_now`), given the messages, `add_generation_prompt` and the
tokenizer's special tokens (`bos_token`, `eos_token`, ...); the rendered text is tokenized without adding special
tokens (the template writes them), so special tokens are single ids and BOS is never doubled.

The loss mask (`data.loss_on`): `assistant` marks what `apply_chat_template(..., return_assistant_tokens_mask=True)`
marks: every token overlapping an assistant span. A template with `{% generation %}` markers gives the spans (all of
them, as transformers unites them). A template without them (Llama 3's, Qwen3's) gets them by rendering, reply by
reply: the span of assistant message i starts where the conversation up to message i, rendered with the generation
prompt, stops agreeing with the whole conversation (where the model is asked to write from; a generation prompt that
opens a block the reply then writes, as DeepSeek-R1-Distill's `<think>\n`, is followed as far as the reply writes
it), and ends with the end-of-turn token the template writes after that reply, found by rendering the conversation
with that reply's content replaced by a probe (so each position gets its own closing token, gpt-oss's `<|end|>` or its
last reply's `<|return|>`, and the reply's text, end-of-turn strings included, is never searched). A reasoning field
(`reasoning_content`, `thinking` or `reasoning`) reaches the template under all three names, as transformers 5 passes
it. `completion` marks the completion's assistant spans (messages) or the completion's characters and the
end-of-sequence token (strings; appended only when the completion does not already end with it, as TRL does); `all`
every token; `auto` is `assistant` for `messages`, `completion` for `prompt`/`completion` and `all` for `text`.
"""
from __future__ import annotations

import copy
import json
import os
import re
from datetime import datetime
from pathlib import Path

import numpy as np

from jaxpar.data.common import DataError
from jaxpar.data.messages import alias_reasoning, check_messages, check_tools
from jaxpar.data.tokens import REJECTED

LOSS_ON = ("auto", "assistant", "completion", "all")
TEMPLATE_FILE = "chat_template.jinja"  # beside tokenizer.json in a Hugging Face directory (transformers >= 4.43)
CONFIG_FILE = "tokenizer_config.json"
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "pad_token", "sep_token", "cls_token", "mask_token")
_OPEN, _CLOSE = "\ue000", "\ue001"  # private-use characters around each `{% generation %}` block while rendering
_PROBE = "\ue002"  # a reply's content while finding where that reply ends
RULES = 3  # the version of how records are rendered and masked: in the data cache's key (a change re-encodes)


def _environment():
    """Jinja's sandbox as transformers sets it up for chat templates, with `{% generation %}` marking its output."""
    import jinja2
    from jinja2.ext import Extension
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

        def _mark(self, caller):
            return _OPEN + caller() + _CLOSE

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[Generation, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))
    return env


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json spells it: a string, or an AddedToken dict with `content`."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def find_template(tokenizer_dir: str | os.PathLike, given: str = "") -> tuple[str, str] | None:
    """(the chat template's text, where it came from): `given` (data.chat_template, a file), else the tokenizer's
    directory's chat_template.jinja, else its tokenizer_config.json's `chat_template`; None when there is none."""
    if given:
        path = Path(os.path.expanduser(given))
        if not path.is_file():
            raise DataError(f"data.chat_template={given}: no such file; give a Jinja chat template file.")
        return path.read_text(), str(path)
    d = Path(tokenizer_dir)
    if (d / TEMPLATE_FILE).is_file():
        return (d / TEMPLATE_FILE).read_text(), str(d / TEMPLATE_FILE)
    config = _read_config(d)
    template = config.get("chat_template")
    if isinstance(template, list):  # several named templates: the default one
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return (template, str(d / CONFIG_FILE)) if isinstance(template, str) else None


def _read_config(d: Path) -> dict:
    path = d / CONFIG_FILE
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise DataError(f"{path} is not JSON ({e}).") from None


def chat_files(tokenizer_dir) -> dict:
    """What an export carries of a chat tokenizer's directory: `chat_template` and the special tokens (bos_token,
    eos_token, ...) of its tokenizer_config.json; {} when it has no chat template."""
    if tokenizer_dir is None or find_template(tokenizer_dir) is None:
        return {}
    config = _read_config(Path(tokenizer_dir))
    special = {k: t for k in SPECIAL_KEYS if (t := _token_text(config.get(k))) is not None}
    return {"chat_template": find_template(tokenizer_dir)[0], **special}


class ChatFormat:
    """A Hugging Face tokenizer with its chat template and special tokens: conversations -> (ids, loss mask)."""

    def __init__(self, tokenizer, template: str, where: str, special: dict):
        import jinja2

        self.hf, self.source, self.where, self.special = tokenizer, template, where, special
        self.tools = None  # the functions' JSON schemas the template is given (`with_tools`)
        self.markers = "generation" in template and "endgeneration" in template
        try:
            self.template = _environment().from_string(template)
        except jinja2.TemplateSyntaxError as e:
            raise DataError(f"{where}: the chat template does not parse (line {e.lineno}: {e.message}); fix it or "
                            f"give another with data.chat_template.") from None
        added = tokenizer.get_added_tokens_decoder()
        longest = sorted((t.content for t in added.values() if t.special), key=len, reverse=True)  # as split first
        self.special_re = re.compile("|".join(map(re.escape, longest)) or "(?!)")
        eos = special.get("eos_token")
        self.eos_id = tokenizer.token_to_id(eos) if eos else None
        self.end_of_turn = self._end_of_turn()
        self.stop_ids = {i for i in (self.eos_id, tokenizer.token_to_id(self.end_of_turn or "")) if i is not None}

    @classmethod
    def from_dir(cls, tokenizer_dir: str | os.PathLike, given: str = "") -> "ChatFormat":
        """The tokenizer.json of `tokenizer_dir` with its template (see `find_template`) and special tokens."""
        from tokenizers import Tokenizer

        d = Path(tokenizer_dir)
        found = find_template(d, given)
        if found is None:
            raise DataError(f"conversations need a chat template, and {d} has none ({TEMPLATE_FILE} or "
                            f"`chat_template` in {CONFIG_FILE}); give one with --config.data.chat_template=FILE.")
        if not (d / "tokenizer.json").is_file():
            raise DataError(f"conversations need a Hugging Face tokenizer.json; {d} has none: give one with "
                            f"data.tokenizer (or init_from=hf:DIR).")
        config = _read_config(d)
        special = {k: t for k in SPECIAL_KEYS if (t := _token_text(config.get(k))) is not None}
        return cls(Tokenizer.from_file(str(d / "tokenizer.json")), *found, special)

    def with_tools(self, tools: list | None) -> "ChatFormat":
        """This format rendering with `tools` (a record's `tools` column, `messages.check_tools`) given to the
        template, as `apply_chat_template(..., tools=...)` gives them."""
        if tools == self.tools:
            return self
        out = copy.copy(self)
        out.tools = tools
        return out

    def render(self, messages: list, add_generation_prompt: bool = False) -> tuple[str, list]:
        """(the rendered text, the `{% generation %}` spans `[(start, end)]` in it)."""
        import jinja2

        try:
            raw = self.template.render(messages=alias_reasoning(messages), add_generation_prompt=add_generation_prompt,
                                       tools=self.tools, **self.special)
        except jinja2.TemplateError as e:
            raise TemplateFailure(f"the chat template ({self.where}) fails to render it: {e}") from None
        text, spans, n = [], [], 0
        for i, piece in enumerate(raw.replace(_CLOSE, _OPEN).split(_OPEN)):
            if i % 2:
                spans.append((n, n + len(piece)))
            text.append(piece)
            n += len(piece)
        return "".join(text), spans

    def _special_after(self, text: str, k: int) -> tuple[str, int] | None:
        """(the first special token in text[k:], where it ends in `text`), or None."""
        found = self.special_re.search(text, k)
        return (found.group(), found.end()) if found else None

    def _end_of_turn(self) -> str | None:
        """The end-of-turn token: the first special token the template writes after a last reply's content, else after
        an earlier reply's (a template may close only the replies that others follow)."""
        user, reply = {"role": "user", "content": "u"}, {"role": "assistant", "content": _PROBE}
        for conversation in ([user, reply], [user, reply, user, dict(reply, content="a")]):
            try:
                text, _ = self.render(conversation)
            except TemplateFailure:
                continue
            if (found := self._special_after(text, text.find(_PROBE) + len(_PROBE))) is not None:
                return found[0]
        return None

    def _reply_start(self, messages: list, i: int, text: str) -> int:
        """Where assistant message i starts in `text`: where the conversation before it, with the generation prompt,
        stops agreeing with `text` (the generation prompt followed as far as the reply writes it). The conversation
        before it must agree with `text` as far as it agrees with itself with the generation prompt (a template may
        close a conversation differently, as Phi-3's writes EOS, when no generation prompt follows)."""
        before, _ = self.render(messages[:i])
        prompt, _ = self.render(messages[:i], add_generation_prompt=True)
        start = _agreed(prompt, text)
        if start < _agreed(before, prompt):
            raise TemplateFailure(f"the chat template ({self.where}) renders the conversation before assistant "
                                  f"message {i} differently from the whole conversation, so its tokens cannot be "
                                  f"told apart; give a template with {{% generation %}} markers (data.chat_template)")
        return start

    def _reply_end(self, messages: list, i: int, text: str, start: int) -> int:
        """Where assistant message i ends in `text`: after the end-of-turn token the template writes after this reply
        (found with the reply's content replaced by a probe, so text in the content is never taken for it); at the
        content's end for a last reply that the template leaves open."""
        probe, _ = self.render(messages[:i] + [dict(messages[i], content=_PROBE)] + messages[i + 1:])
        if probe.count(_PROBE) != 1:
            raise TemplateFailure(f"the chat template ({self.where}) does not write assistant message {i}'s content "
                                  f"once, so where it ends is unknown; give a template with {{% generation %}} markers "
                                  f"(data.chat_template)")
        k = probe.index(_PROBE) + len(_PROBE)
        found = self._special_after(probe, k)
        if found is None and (self.end_of_turn is None or probe[k:].strip()):
            raise TemplateFailure(f"the chat template ({self.where}) writes no special token after assistant message "
                                  f"{i}'s reply, so where it ends is unknown; give a template with {{% generation %}} "
                                  f"markers (data.chat_template)")
        suffix = probe[found[1] if found else k:]
        if not text.endswith(suffix) or len(text) - len(suffix) < start:
            raise TemplateFailure(f"the chat template ({self.where}) renders what follows assistant message {i} "
                                  f"differently with another reply, so where the reply ends is unknown; give a "
                                  f"template with {{% generation %}} markers (data.chat_template)")
        return len(text) - len(suffix)

    def assistant_spans(self, messages: list, text: str, spans: list, first: int = 0) -> list:
        """The character spans of the assistant messages from index `first` on, in `text` (`messages` rendered):
        the template's `{% generation %}` spans from where message `first` starts (TRL's completion mask and
        assistant mask together), else each reply's span found by rendering."""
        if self.markers:
            cut = self._reply_start(messages, first, text) if first else 0
            return [(max(s, cut), e) for s, e in spans if e > cut]
        out = []
        for i, m in enumerate(messages):
            if m["role"] == "assistant" and i >= first:
                start = self._reply_start(messages, i, text)
                out.append((start, self._reply_end(messages, i, text, start)))
        return out

    def encode(self, text: str, spans: list, add_special_tokens: bool = False) -> tuple[np.ndarray, np.ndarray]:
        """(ids int32, mask uint8): `text` tokenized; a token is 1 when it overlaps one of `spans`."""
        enc = self.hf.encode(text, add_special_tokens=add_special_tokens)
        ids = np.asarray(enc.ids, np.int32)
        a, b = np.asarray(enc.offsets, np.int64).reshape(-1, 2).T
        mask = np.zeros(len(ids), bool)
        for s, e in spans:
            mask |= (b > s) & (a < e)
        return ids, (mask & (b > a)).astype(np.uint8)

    def conversation(self, messages: list, loss_on: str, first: int = 0) -> tuple[np.ndarray, np.ndarray]:
        """A conversation's (ids, mask): the assistant messages from index `first` on (`assistant`, `completion`),
        or every token (`all`)."""
        text, spans = self.render(messages)
        ids, mask = self.encode(text, [] if loss_on == "all" else self.assistant_spans(messages, text, spans, first))
        return ids, (np.ones_like(mask) if loss_on == "all" else mask)

    def prompt(self, messages: list) -> np.ndarray:
        """The ids that ask for the next assistant message (the conversation with the generation prompt)."""
        text, _ = self.render(messages, add_generation_prompt=True)
        return self.encode(text, [])[0]

    def tool_suffix(self, tool_messages: list) -> np.ndarray:
        """The ids that follow an assistant turn that called tools: the template's rendering of `tool_messages` (each
        `{"role": "tool", "name", "content"}`) and the generation prompt after them, as TRL 1.16's GRPOTrainer takes
        them (`_get_tool_suffix_ids`): from a conversation of a user turn and an empty call of the first tool's name,
        rendered without and then with them, cut after the last end-of-sequence id of the first. What a row that
        paused on its calls is continued with, never a re-encoding of its own ids."""
        name = tool_messages[0].get("name", "")
        call = [{"role": "user", "content": "dummy"}, {"role": "assistant", "content": "", "tool_calls": [
            {"type": "function", "function": {"name": name, "arguments": {}}}]}]
        plain = self.with_tools(None)  # (TRL renders these without the tools)
        before = plain.encode(plain.render(call)[0], [])[0]
        full = plain.prompt(call + list(tool_messages))
        ends = np.flatnonzero(before == self.eos_id) if self.eos_id is not None else []
        before = before[:ends[-1] + 1] if len(ends) else before
        if not np.array_equal(full[:before.size], before):
            raise TemplateFailure(f"the chat template ({self.where}) renders a tool's result so that the turn before "
                                  f"it changes, so the result's ids cannot follow a row's own")
        return full[before.size:]

    def plain(self, prompt: str, completion: str, loss_on: str) -> tuple[np.ndarray, np.ndarray]:
        """A string prompt and completion: `prompt + completion` with the tokenizer's special tokens, then the
        end-of-sequence token unless the completion ends with it (TRL's rule); the completion's tokens (and that
        token) in the mask (`all`: every token)."""
        ids, mask = self.encode(prompt + completion, [(len(prompt), len(prompt) + len(completion))], True)
        if self.eos_id is not None and not completion.endswith(self.special["eos_token"]):
            ids, mask = np.append(ids, np.int32(self.eos_id)), np.append(mask, np.uint8(1))
        return ids, (np.ones_like(mask) if loss_on == "all" else mask)


def _agreed(a: str, b: str) -> int:
    """The length of the longest common prefix of `a` and `b` (bisected with slice comparisons)."""
    lo, hi = 0, min(len(a), len(b)) + 1  # a[:lo] == b[:lo]; a[:hi] != b[:hi] (or hi past the shorter one)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if a[:mid] == b[:mid] else (lo, mid)
    return lo


class TemplateFailure(Exception):
    """A conversation the template cannot render or split (the record's place is added by the caller)."""


def record_kind(obj) -> str | None:
    """`messages`, `prompt` (prompt + completion), `preference` (a prompt, `chosen` and `rejected`: TRL's preference
    records) or None (text, or nothing) for a record (a field set to null, as a Parquet row of another kind has it,
    is absent)."""
    if isinstance(obj, dict) and (obj.get("chosen") is not None or obj.get("rejected") is not None):
        return "preference"
    if isinstance(obj, dict) and obj.get("messages") is not None:
        return "messages"
    if isinstance(obj, dict) and obj.get("prompt") is not None:
        return "prompt"
    return None


def example(obj, where: str, chat: ChatFormat | None, loss_on: str) -> tuple[np.ndarray, np.ndarray]:
    """A `messages` or `prompt`/`completion` record -> (ids int32, loss mask uint8).

    Raises:
      DataError: a malformed record, a loss_on its kind has no tokens for, a template that fails (naming `where`).
    """
    kind = record_kind(obj)
    if kind == "preference":
        return preference(obj, where, chat, loss_on)
    loss_on = {"messages": "assistant", "prompt": "completion"}[kind] if loss_on == "auto" else loss_on
    if chat is None:
        raise DataError(f"{where}: a {kind} record needs a chat tokenizer; give data.tokenizer a Hugging Face "
                        f"tokenizer.json (or init_from=hf:DIR).")
    chat = chat.with_tools(check_tools(obj.get("tools"), where))
    try:
        if kind == "messages":
            if loss_on == "completion":
                raise DataError(f"{where}: data.loss_on='completion' needs prompt/completion records; this one has "
                                f"`messages` (use assistant, all or auto).")
            return chat.conversation(check_messages(obj["messages"], "messages", where), loss_on)
        if obj.get("completion") is None:
            raise DataError(f"{where}: a `prompt` record needs a `completion` too.")
        prompt, completion = obj["prompt"], obj["completion"]
        if isinstance(prompt, str) and isinstance(completion, str):
            if loss_on == "assistant":
                raise DataError(f"{where}: data.loss_on='assistant' needs messages; this record's prompt and "
                                f"completion are strings (use completion, all or auto).")
            return chat.plain(prompt, completion, loss_on)
        if isinstance(prompt, list) and isinstance(completion, list):
            p, c = check_messages(prompt, "prompt", where), check_messages(completion, "completion", where)
            return chat.conversation(p + c, loss_on, first=0 if loss_on == "assistant" else len(p))
        raise DataError(f"{where}: `prompt` and `completion` must both be strings or both lists of messages.")
    except TemplateFailure as e:
        raise DataError(f"{where}: {e}; fix the record or the template (data.chat_template).") from None


def preference(obj, where: str, chat: ChatFormat | None, loss_on: str) -> tuple[np.ndarray, np.ndarray]:
    """A preference record (`prompt`, `chosen`, `rejected`: strings, or lists of messages, TRL's conversational form)
    -> one document: the prompt with the chosen reply, then the prompt with the rejected one, each rendered as a
    prompt/completion record; the rejected sequence's mask values carry `tokens.REJECTED`."""
    for field in ("chosen", "rejected"):
        if obj.get(field) is None:
            raise DataError(f"{where}: a preference record needs `chosen` and `rejected`; `{field}` is missing: add "
                            f"it (the {'preferred' if field == 'chosen' else 'dispreferred'} reply) or drop the record.")
    if obj.get("prompt") is None:
        raise DataError(f"{where}: a preference record needs its `prompt` (TRL's explicit-prompt form: `prompt`, "
                        f"`chosen`, `rejected`).")
    c, r = (example({"prompt": obj["prompt"], "completion": obj[f], "tools": obj.get("tools")}, where, chat, loss_on)
            for f in ("chosen", "rejected"))
    return np.concatenate([c[0], r[0]]), np.concatenate([c[1], r[1] | REJECTED]).astype(np.uint8)
