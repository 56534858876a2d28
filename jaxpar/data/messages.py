"""What a conversation may hold, checked before a chat template renders it (`jaxpar/data/chat.py`), as TRL's
SFTTrainer and transformers' `apply_chat_template` take conversations:

- messages `{"role", "content"}` with roles `system`, `user`, `assistant` and `tool` (a tool's result, its `content`
  a string; `name` and `tool_call_id` pass through to the template);
- an assistant message may call tools: `tool_calls`, a list of `{"type": "function", "function": {"name",
  "arguments"}}` (or `{"name", "arguments"}`; arguments a JSON object or its string), its `content` then optional;
- a reply's reasoning under `reasoning_content`, `thinking` or `reasoning` (strings);
- a record's `tools` column: the JSON schemas of the functions it may call (a list of objects, or that list as a JSON
  string, as TRL reads it), given to the template as `tools`.

A null field is absent, as transformers drops it. Anything else is a one-line `DataError` naming the record and the
message.
"""
from __future__ import annotations

import json

from jaxpar.data.common import DataError

ROLES = ("system", "user", "assistant", "tool")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # a reply's reasoning, as transformers 5 names it


def check_messages(messages, field: str, where: str) -> list:
    """The messages as plain dicts (None values dropped, as transformers does), or a DataError naming `where`."""
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: `{field}` must be a non-empty list of {{\"role\", \"content\"}} messages.")
    out = []
    for k, m in enumerate(messages):
        if not isinstance(m, dict) or "role" not in m:
            raise DataError(f"{where}: {field}[{k}] is not a message with a `role`; give {{\"role\", \"content\"}}.")
        m = {key: v for key, v in m.items() if v is not None}
        if m["role"] not in ROLES:
            raise DataError(f"{where}: {field}[{k}] has the unknown role {m['role']!r}; use one of "
                            f"{', '.join(ROLES)}.")
        calls = m.get("tool_calls")
        if calls is not None:
            _check_calls(calls, f"{where}: {field}[{k}]", m["role"])
        if not isinstance(m.get("content"), str) and not (calls and "content" not in m):
            raise DataError(f"{where}: {field}[{k}] ({m['role']}) has no string `content`; every message needs one "
                            f"(an assistant message with `tool_calls` may leave it out).")
        if (f := next((f for f in REASONING_FIELDS if f in m and not isinstance(m[f], str)), None)):
            raise DataError(f"{where}: {field}[{k}] ({m['role']}) has a `{f}` that is not a string; give the "
                            f"reasoning as a string (or drop the field).")
        out.append(m)
    return out


def _check_calls(calls, where: str, role: str) -> None:
    """An assistant message's `tool_calls`: each names a function and gives its arguments (an object or its JSON)."""
    if role != "assistant":
        raise DataError(f"{where} ({role}) has `tool_calls`; only an assistant message calls tools.")
    if not isinstance(calls, list) or not calls:
        raise DataError(f"{where}: `tool_calls` must be a non-empty list of {{\"type\": \"function\", \"function\": "
                        f"{{\"name\", \"arguments\"}}}} (or drop the field).")
    for j, call in enumerate(calls):
        fn = call.get("function", call) if isinstance(call, dict) else None
        args = fn.get("arguments", {}) if isinstance(fn, dict) else None
        if not (isinstance(fn, dict) and isinstance(fn.get("name"), str) and fn["name"]) or \
                not isinstance(args, (dict, str)):
            raise DataError(f"{where}: tool_calls[{j}] is not {{\"type\": \"function\", \"function\": {{\"name\": "
                            f"STRING, \"arguments\": OBJECT}}}}; give each call a function name and its arguments.")


def check_tools(tools, where: str) -> list | None:
    """A record's `tools` column: the functions' JSON schemas as a list of objects (a JSON string of one is read, as
    TRL reads it), or None when absent."""
    if tools is None:
        return None
    if isinstance(tools, str):
        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as e:
            raise DataError(f"{where}: `tools` is a string that is not JSON ({e.msg}); give the list of the "
                            f"functions' JSON schemas.") from None
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise DataError(f"{where}: `tools` must be a list of the functions' JSON schemas ({{\"type\": \"function\", "
                        f"\"function\": {{\"name\", \"description\", \"parameters\"}}}}), got "
                        f"{type(tools).__name__}.")
    return tools or None


def alias_reasoning(messages: list) -> list:
    """The messages as transformers 5 gives them to a template: a reply's reasoning, given under any of
    `REASONING_FIELDS`, under `reasoning_content` and `thinking` too (gpt-oss's template reads `thinking`)."""
    out = []
    for m in messages:
        reasoning = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
        out.append(m if reasoning is None else {"thinking": reasoning, **m, "reasoning_content": reasoning})
    return out
