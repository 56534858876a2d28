"""lm-evaluation-harness's model interface over jaxpar (`lm_eval --model jaxpar` once this module is imported;
`python -m jaxpar.evaluate` always): lm-eval owns the prompts and the scoring, jaxpar the batching and the mesh.

`JaxparLM(model=SRC, batch_size=B, max_gen_toks=N, add_bos_token=..., prefix_token_id=..., **{"config.KEY": V})`,
or `JaxparLM(source=Source)` for a model already on its mesh (evaluation during training). As lm-eval's `hf`
backend does:
- tokenization: the model's own tokenizer through `transformers` (`AutoTokenizer`), BOS as the tokenizer adds it,
  the context/continuation split of `TemplateLM._encode_pair`, an empty context conditioned on `prefix_token_id`
  (BOS, else EOS);
- `loglikelihood`: requests sorted longest first into batches, each one row (context + continuation, the last
  `max_length + 1` tokens), the continuation's log-prob summed and `is_greedy` = every continuation token is the
  argmax; computed by the layout's engine (`scores.Scores`), the params where training keeps them; an empty
  continuation scores (0.0, True), nothing computed;
- `loglikelihood_rolling`: lm-eval's disjoint rolling windows of `max_length` tokens, summed per document;
- `generate_until`: greedy decoding by the generation engine on the training mesh (`jaxpar/generate/engine.py`: KV
  cache, slots refilled as rows finish), a row stopping at any of the checkpoint's end ids (`special.end_ids`:
  generation_config.json's `eos_token_id` list, the tokenizer's EOS, the chat template's end of turn; where
  transformers' `generate` stops), at any `until` string in its decoded text, or after `max_gen_toks` tokens; the
  end ids dropped, the text cut at the first stop string;
- chat: `apply_chat_template`, `tokenizer_name`, `chat_template` as lm-eval's API asks (`--apply_chat_template`,
  `--system_instruction`, `--fewshot_as_multiturn` are lm-eval's own over these).
"""
from __future__ import annotations

import jinja2
from lm_eval import utils as lm_utils
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, has_bos_prefix, normalize_gen_kwargs, \
    postprocess_generated_text
from tqdm import tqdm

from jaxpar.data import special
from jaxpar.evaluate.scores import score
from jaxpar.evaluate.tokens import hf_tokenizer_of
from jaxpar.generate.engine import Engine, Request
from jaxpar.generate.source import on_layout


@register_model("jaxpar")
class JaxparLM(TemplateLM):
    """lm-eval's `LM` over a jaxpar model on its mesh (module docstring)."""

    def __init__(self, model: str | None = None, batch_size: int | str = 8, max_gen_toks: int = 256,
                 add_bos_token: bool | None = None, prefix_token_id: int | None = None, source=None, **config):
        super().__init__()
        bad = sorted(k for k in config if not k.startswith("config."))
        if bad:
            raise ValueError(f"jaxpar model_args: unknown {bad}; give model=SRC, batch_size, max_gen_toks, "
                             f"add_bos_token, prefix_token_id or config.KEY=VALUE.")
        self.batch = 8 if str(batch_size).startswith("auto") else int(batch_size)
        if source is None:
            if model is None:
                raise ValueError("jaxpar model_args: give model=SRC (a run directory, an export, hf:DIR or "
                                 "hf:ORG/NAME).")
            source = on_layout(model, [f"--{k}={v}" for k, v in config.items()], self.batch)
        self.source, self.steps, self.engine = source, source.steps, None
        self.tokenizer = hf_tokenizer_of(source.tokenizer)
        self._max_gen_toks, self.add_bos_token = int(max_gen_toks), add_bos_token
        self.custom_prefix_token_id = prefix_token_id
        self.chat_template_args = {}
        self.end_ids = special.end_ids(source.tokenizer, source.chat or special.chat_format(source.tokenizer))  # where generations end (dropped)

    # ------------------------------------------------------------------------------------------ tokens

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:
        if self.custom_prefix_token_id is not None:
            return int(self.custom_prefix_token_id)
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return int(self.steps.cfg.max_positions)

    @property
    def max_gen_toks(self) -> int:
        return self._max_gen_toks

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def _special(self, add_special_tokens: bool | None) -> dict:
        flag = add_special_tokens if add_special_tokens is not None else self.add_bos_token
        return {} if flag is None else {"add_special_tokens": flag}

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, left_truncate_len=None, **kw):
        special = self._special(add_special_tokens)
        if add_special_tokens is None and has_bos_prefix(string, self.tokenizer.decode(self.prefix_token_id)):
            special["add_special_tokens"] = False  # the text already starts with BOS
        ids = self.tokenizer.encode(string, **special)
        return ids[-left_truncate_len:] if left_truncate_len else ids

    def _context_ids(self, context: str, keep: int) -> list[int]:
        """A generation context's ids as the hf backend's batch encoding makes them, the last `keep` kept."""
        special = {"add_special_tokens": False} if has_bos_prefix(context, self.tokenizer.bos_token) \
            else self._special(None)
        return self.tokenizer(context, **special)["input_ids"][-keep:]

    def tok_decode(self, tokens, skip_special_tokens: bool = True) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """The tokenizer's chat template over the messages (as the hf backend: a template that refuses a system
        message gets the conversation without it)."""
        render = lambda msgs: self.tokenizer.apply_chat_template(  # noqa: E731
            msgs, tokenize=False, add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt, **self.chat_template_args)
        try:
            return render(chat_history)
        except jinja2.exceptions.TemplateError:
            return render([m for m in chat_history if m["role"] != "system"])

    # ------------------------------------------------------------------------------------------ scoring

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kw) -> list[tuple[float, bool]]:
        """requests: (key, context ids, continuation ids) -> (log-prob of the continuation, is_greedy), longest
        first in batches of `batch_size` rows."""
        rows, out = [], [None] * len(requests)
        for _, ctx, cont in requests:
            whole = (ctx + cont)[-(self.max_length + 1):]
            rows.append((whole, len(whole) - len(cont)))
        for i, (key, _, cont) in enumerate(requests):  # nothing to score: the hf backend's (0.0, True)
            if not cont:
                out[i] = (0.0, True)
                if key is not None:
                    self.cache_hook.add_partial("loglikelihood", key, out[i])
        order = sorted((i for i in range(len(rows)) if out[i] is None),
                       key=lambda i: (-len(rows[i][0]), tuple(rows[i][0])))
        bar = tqdm(total=len(order), disable=disable_tqdm, desc="Running loglikelihood requests")
        for s in range(0, len(order), self.batch):
            idx = order[s:s + self.batch]
            res = score(self.steps, self.source.params, [rows[i] for i in idx], self.batch)
            for i, (lp, misses, _) in zip(idx, res):
                out[i] = (float(lp), bool(misses == 0))
                if requests[i][0] is not None:
                    self.cache_hook.add_partial("loglikelihood", requests[i][0], out[i])
            bar.update(len(idx))
        bar.close()
        return out

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Each document's log-likelihood: lm-eval's disjoint windows of `max_length` tokens, the first conditioned
        on `prefix_token_id`, summed."""
        windows, owner = [], []
        for k, (string,) in enumerate(tqdm([r.args for r in requests], disable=disable_tqdm)):
            for w in map(lm_utils.make_disjoint_window, lm_utils.get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, *w))
                owner.append(k)
        sums = [0.0] * len(requests)
        for k, (lp, _) in zip(owner, self._loglikelihood_tokens(windows, disable_tqdm)):
            sums[k] += lp
        for r, s in zip(requests, sums):
            self.cache_hook.add_partial("loglikelihood_rolling", r.args, s)
        return sums

    # ------------------------------------------------------------------------------------------ generation

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        """Greedy continuations up to the first end id or stop string (`until`, and EOS's text), at most
        `max_gen_toks` tokens."""
        eos = self.tok_decode(self.eot_token_id, skip_special_tokens=False)
        jobs = []
        for context, gen_kwargs in (r.args for r in requests):
            kwargs = normalize_gen_kwargs(gen_kwargs, self.max_gen_toks)
            if kwargs.get("do_sample") or float(kwargs.get("temperature") or 0.0) > 0:
                raise ValueError(f"generate_until with {gen_kwargs}: jaxpar's lm-eval backend decodes greedily; "
                                 f"set do_sample=false / temperature=0 (--gen_kwargs) for this task.")
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos)
            n = int(kwargs.pop("max_gen_toks"))
            if n >= self.max_length:
                raise ValueError(f"max_gen_toks={n} leaves no room for the context in max_length={self.max_length}.")
            jobs.append([self._context_ids(context, self.max_length - n), [], until, n])
        if self.engine is None:  # (built once: with stages, the decode layout gathers them)
            self.engine = Engine.on_steps(self.steps, self.source.params, self.source.config, slots=self.batch,
                                          tokenizer=self.tokenizer)
        bar = tqdm(total=sum(j[3] for j in jobs), disable=disable_tqdm, unit="tok",
                   desc=f"Running {len(jobs)} generate_until requests (tokens, at most)")
        done = self.engine.generate([Request(prompt=ctx, max_new_tokens=n, stop_ids=self.end_ids,
                                             stop=tuple(u for u in until if u)) for ctx, _, until, n in jobs],
                                    progress=bar.update)
        bar.close()
        for job, c in zip(jobs, done):
            job[1].extend(t for t in c.tokens if t not in self.end_ids)
        out = []
        for r, (_, new, until, _) in zip(requests, jobs):
            text = postprocess_generated_text(self.tok_decode(new), until, None)
            self.cache_hook.add_partial("generate_until", r.args, text)
            out.append(text)
        return out
