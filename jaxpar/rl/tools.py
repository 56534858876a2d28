"""Tools as TRL 1.16's GRPOTrainer runs them (`tools=`): typed Python functions with Google-style docstrings, their
JSON schemas as transformers derives them (`transformers.utils.get_json_schema`, what `apply_chat_template(...,
tools=[f])` gives the template), and the calls a completion makes run with TRL's contract:

- a call of `{"type": "function", "function": {"name", "arguments"}}` runs `name(**arguments)`; a function defined
  `async` is awaited, all of a turn's together (`asyncio.gather`, on one event loop in a thread of its own), their
  results after the synchronous ones';
- a call of an unknown name, one whose function raises, or one of another type, is a failure: its result is
  `{"error": "..."}` (TRL's messages: `Tool NAME not found.`, the exception's text, `Unsupported tool call type:
  TYPE`), never a crash of the run;
- each result becomes the message `{"role": "tool", "name": NAME, "content": str(result)}` (a list of content blocks
  stays a list), rendered by the chat template (`ChatFormat.tool_suffix`).

`grpo.tools` names them: `FILE.py:FUNCTION,MODULE:FUNCTION,...`.
"""
from __future__ import annotations

import asyncio
import functools
import inspect
import threading
from typing import Callable

from jaxpar.data.common import user_function


def load(spec: str, key: str = "grpo.tools") -> list[Callable]:
    """The functions `spec` names (comma-separated `FILE.py:FUNCTION` or `MODULE:FUNCTION`); ValueError in one line
    naming `key` and the spec that fails, a name given twice among them."""
    fns = [user_function(s, key, "tools.py:multiply")[1] for s in spec.split(",") if s.strip()]
    names = [f.__name__ for f in fns]
    if len(set(names)) < len(names):
        twice = next(n for n in names if names.count(n) > 1)
        raise ValueError(f"{key}={spec!r}: two tools are named {twice!r}; a call names its tool, so give each "
                         f"function its own name.")
    return fns


def schemas(fns: list[Callable], key: str = "grpo.tools") -> list[dict]:
    """Each function's JSON schema as transformers derives it from its type hints and Google-style docstring; a
    function it cannot describe is a ValueError in one line naming it and transformers' reason."""
    from transformers.utils import get_json_schema

    out = []
    for f in fns:
        try:
            out.append(get_json_schema(f))
        except Exception as e:  # transformers' DocstringParsingException, TypeHintParsingException
            raise ValueError(f"{key}: the tool {f.__name__!r} has no schema transformers can derive ({e}); give it "
                             f"type hints and a Google-style docstring with an Args section.") from None
    return out


@functools.cache
def _loop() -> asyncio.AbstractEventLoop:
    """One event loop for every awaited tool, running in a thread of its own (as TRL keeps one): a tool's
    loop-bound state (a client, a lock) lives across turns, and a caller inside a running loop is not blocked."""
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True, name="jaxpar-tools").start()
    return loop


class ToolBox:
    """The tools of one rollout (`fns`: functions, or an environment's bound methods), by name."""

    def __init__(self, fns: list[Callable]):
        self.sync = {f.__name__: f for f in fns if not inspect.iscoroutinefunction(f)}
        self.awaited = {f.__name__: f for f in fns if inspect.iscoroutinefunction(f)}

    def run(self, calls: list[dict]) -> tuple[list[dict], int]:
        """One assistant turn's `tool_calls` -> (the tool messages, in TRL's order: the synchronous results, then
        the awaited ones; how many calls failed)."""
        results, pending, failed = [], [], 0
        for call in calls:
            if call.get("type") != "function":
                failed += 1
                error = {"error": f"Unsupported tool call type: {call.get('type')}"}
                results.append((call.get("name", "unknown"), error))
                continue
            name = call["function"]["name"]
            try:
                if name in self.sync:
                    results.append((name, self.sync[name](**call["function"]["arguments"])))
                elif name in self.awaited:
                    pending.append((name, self.awaited[name](**call["function"]["arguments"])))
                else:
                    raise ValueError(f"Tool {name} not found.")
            except Exception as e:  # a tool's own failure is the model's to read, as TRL gives it
                failed += 1
                results.append((name, {"error": str(e)}))
        if pending:
            async def gather():
                return await asyncio.gather(*(c for _, c in pending), return_exceptions=True)

            done = asyncio.run_coroutine_threadsafe(gather(), _loop()).result()
            for (name, _), got in zip(pending, done):
                failed += isinstance(got, Exception)
                results.append((name, {"error": str(got)} if isinstance(got, Exception) else got))
        return [{"role": "tool", "name": n, "content": r if isinstance(r, list) else str(r)} for n, r in results], failed
