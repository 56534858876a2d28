"""What the engine is asked and gives (`jaxpar/generate/engine.py`): a request (a prompt of ids, its sampling
settings, seed and stream, stops, its budget), a completion (its tokens and log-probs, why it ended, experts, text,
which of its tokens were sampled), a row as it runs, the one-line check of a request."""
from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np


@dataclasses.dataclass
class Request:
    prompt: Sequence[int]  # token ids
    max_new_tokens: int = 128
    temperature: float = 0.0  # 0: greedy
    top_k: int = 0  # 0: all
    top_p: float = 1.0  # in (0, 1]
    min_p: float = 0.0  # in [0, 1]
    seed: int = 0
    stream: int = 0  # the n-th sample of one prompt and seed
    stop_ids: Sequence[int] = ()
    stop: Sequence[str] = ()  # stop strings (needs the engine's tokenizer)


@dataclasses.dataclass
class Completion:
    tokens: list
    logprobs: list  # under the sampling distribution
    model_logprobs: list  # under the model, temperature 1
    finish_reason: str  # "stop" | "length"
    experts: np.ndarray | None = None  # [tokens, layers, k] int32 for a mixture of experts
    text: str | None = None
    prompt_experts: np.ndarray | None = None  # [prompt tokens - 1, layers, k] int32 for a mixture of experts
    tool_mask: list | None = None  # with turns (`Engine.generate(turns=)`): 1 a sampled token, 0 one a turn gave


def check(req: Request, where: str, context: int, tokenizer=None) -> None:
    """One line naming `where` for a request the engine cannot run. Raises ValueError."""
    n = len(req.prompt)
    bad = ("an empty prompt" if n == 0 else
           f"a prompt of {n} tokens; the model's context is {context} (shorten it)" if n > context else
           f"top_p={req.top_p}: it must be in (0, 1]" if not 0 < req.top_p <= 1 else
           f"min_p={req.min_p}: it must be in [0, 1]" if not 0 <= req.min_p <= 1 else
           f"top_k={req.top_k}: it must be >= 0" if req.top_k < 0 else
           f"temperature={req.temperature}: it must be >= 0" if req.temperature < 0 else
           f"max_new_tokens={req.max_new_tokens}: it must be >= 1" if req.max_new_tokens < 1 else
           "stop strings without a tokenizer" if req.stop and tokenizer is None else None)
    if bad:
        raise ValueError(f"{where}: {bad}.")


class Row:
    """A slot's request as it runs: what it has made so far."""

    def __init__(self, i: int, req: Request, max_new: int, admitted: int = 0):
        self.i, self.req, self.max_new, self.admitted = i, req, max_new, admitted
        self.tokens, self.lps, self.lpm, self.experts, self.sampled = [], [], [], [], []
        self.finish, self.prompt_experts, self.pending = None, None, None  # pending: given ids to prefill
        self.turn_end = 0  # tokens up to the last turn's ids (a stop string is searched after them)

    def take(self, tok: int, lp: float, lpm: float, experts) -> None:
        """A sampled token."""
        self.tokens.append(tok), self.lps.append(lp), self.lpm.append(lpm), self.experts.append(experts)
        self.sampled.append(1)

    def give(self, ids: list) -> None:
        """Ids a turn gives the row (a tool's result), never sampled: log-probs 0, no experts (-1), mask 0."""
        for i in ids:
            self.take(int(i), 0.0, 0.0, np.full_like(self.experts[-1], -1))
            self.sampled[-1] = 0
        self.turn_end = len(self.tokens)


def cache_length(longest: int, context: int) -> int:
    """The positions of a `generate` call's cache: its longest prompt + completion rounded up to 64 (few
    compilations), at most the model's `context`."""
    return min(context, -(-longest // 64) * 64)
