"""GRPO's rounds, as the train loop takes its batches (`Rounds`, a `train.feed.Feed`).

Round r (steps r mu .. r mu + mu - 1, mu = `grpo.num_iterations`) takes the next `train.global_batch_size` prompts of
the epochs' orders (`data.prompts.Prompts.take`), samples `grpo.num_generations` (G) completions of each with the
generation engine on the training state's params in place (`rollout.sample`: prompt p of the round samples with the
seed (train.seed, r, p), so its random numbers depend on neither the layout nor a restart), scores them with
`grpo.rewards`, and trains on them mu times: with mu = 1 the old policy is the policy itself (no `old` in the batch:
the ratio is exactly 1), with mu > 1 the old policy's per-token log-probs come from the training forward before the
first pass (`rollout.with_old_logps`). A mixture of experts replays the engine's routing in every pass over the
round (`grpo.routing_replay`: the batch's `routes`, `Forward.block`). A checkpoint inside a round keeps the round's batch beside it
(`rollouts/step-S.npz`), so a resume continues the same round exactly; at a round's start nothing is kept: the round
is sampled again, the same.

Metrics under TRL's names, averaged over the rounds since the last log: `reward`, `reward_std`,
`rewards/<function>/mean|std`, `frac_reward_zero_std`, `completions/mean_length|min_length|max_length`,
`completions/clipped_ratio`, `completions/mean_terminated_length|min_terminated_length|max_terminated_length`; with
`grpo.importance_sampling`, the sampler's ratios' `sampling/*` (`importance.py`: the ratios ride in the batch);
`num_tokens` (prompt and completion tokens sampled since the run began). Where a step's time goes: `time/generate_s`
and `time/score_s` (a round's sampling and its reward functions, seconds), `rollout_tokens_per_s` (completion tokens
per second of generation), `time/train_s` (per step: the log interval's wall time without its rounds' sampling and
scoring: the training passes, and any checkpoint save in it); `tokens/prefill` (prompt tokens the engine prefilled
per round: each prompt once) and `tokens/train` (the positions a training pass over the round runs: rows x their
length, `rows.py`). What reward functions log with `log_metric`
(each round's mean, averaged over the rounds, under its name, TRL's rule). `grpo.log_completions` completions of each
log step's round go to WORKDIR/completions.jsonl (prompt, completion, rewards, the columns reward functions logged with
`log_extra`, advantage), and to a W&B table when W&B is on. Reward functions are called as TRL calls them
(`rewards.py`): the completions decoded without special tokens, `trainer_state` (`Rounds.trainer_state`), `log_extra`,
`log_metric`. Evaluation: the held-out prompts' greedy completions, `val_reward`, `val_rewards/<function>/mean`, and
`val_<name>` for each `log_metric` of the evaluation's call (its `log_extra` columns are dropped: no evaluation
completions are logged).
"""
from __future__ import annotations

import collections
import json
import os
import time

import jax
import numpy as np

from jaxpar import data
from jaxpar.cluster import exchange, watchdog
from jaxpar.dtypes import at_least_f32
from jaxpar.data.prompts import stop_ids
from jaxpar.generate import cache as kv
from jaxpar.generate.engine import Engine, Request
from jaxpar.rl import advantages as adv
from jaxpar.rl import importance, rewards, rollout, rows
from jaxpar.train.feed import Feed

DIR = "rollouts"
COMPLETIONS = "completions.jsonl"


def _round_seed(seed: int, r: int, p: int) -> int:
    return int(np.random.SeedSequence([seed, r, p]).generate_state(1)[0] >> 1)  # an int32 seed


def _shown(records, done, tokenizer) -> list:
    """Each completion as the reward functions see it (`records[i]`: completion i's record): its tokens decoded
    without special tokens, or that text as an assistant message after a conversational prompt (TRL's form)."""
    texts = [tokenizer.decode(c.tokens, skip_special_tokens=True) for c in done]
    return [[{"role": "assistant", "content": t}] if isinstance(r.get("prompt"), list) else t
            for r, t in zip(records, texts)]


def _std(x) -> float:
    return adv.nanstd(np.asarray(x, np.float64)).item()


class Rounds(Feed):
    def __init__(self, config, steps, info, prompts, workdir: str, is_main: bool):
        g = config.grpo
        self.config, self.steps, self.train, self.val = config, steps, prompts[0], prompts[1]
        self.workdir, self.is_main = workdir, is_main
        self.fns, self.weights = rewards.load(g.rewards, g.reward_weights)
        self.G, self.mu, self.B = int(g.num_generations), int(g.num_iterations), int(config.train.global_batch_size)
        self.T, self.seed, self.room = int(config.model.seq_len), int(config.train.seed), int(g.max_completion_length)
        self.sampling = {"temperature": float(g.temperature), "top_p": float(g.top_p), "top_k": int(g.top_k)}
        self.float = np.dtype(at_least_f32(config.train.compute_dtype))
        self.importance = str(g.importance_sampling)
        obj, lay = steps.objective, steps.layout  # shared-prompt rows of K completions (`rows.py`), or one each
        self.shared = obj.shared_prompt
        self.per_row = obj.per_row(self.B, lay.batch_split * lay.microbatches, self.T)
        self.longest = obj.longest_row(self.T, self.per_row, lay.context)
        self.tokenizer, self.stops = data.load_tokenizer(info.tokenizer_dir), stop_ids(info, config)
        self.round, self.host, self.placed, self.num_tokens = -1, None, None, 0
        self.seen, self.shown = collections.defaultdict(list), []
        self.logged_at, self.sampling_s = time.perf_counter(), 0.0  # (the log interval's clock: `time/*` metrics)

    @staticmethod
    def check(config) -> None:
        """The reward functions found and their weights matched, before anything compiles (`rewards.RewardError`)."""
        rewards.load(config.grpo.rewards, config.grpo.reward_weights)

    # ---- the rounds --------------------------------------------------------------------------------------------

    def batch(self, step: int, state) -> dict:
        r = step // self.mu
        if r != self.round:
            with watchdog.part("sampling"):  # (its own bound: the step watchdog's `part`)
                self.host, stats = self.sample(r, state["params"])
            self.round, self.placed = r, self.place(self.host)
            if self.steps.objective.old_policy_pass:  # the old policy: these params, before the round's first pass
                self.placed, more = self.old_policy(state["params"])
                stats |= more
            for k, v in stats.items():
                self.seen[k].append(float(v))
        self.tokens = int(self.host["tokens_counted"])
        return self.placed

    def old_policy(self, params) -> tuple[dict, dict]:
        """(the placed round with the old policy's per-token log-probs (mu > 1) and the sampler's importance ratios
        (`grpo.importance_sampling`: `rl/importance.py`, their metrics))."""
        placed = rollout.with_old_logps(self.steps, params, self.placed)
        stats = {}
        if self.importance != "none":
            g = self.config.grpo
            ratio, stats = importance.ratios(exchange.fetch(placed["old"]), self.host["sampled"], self.host["mask"],
                                             self.importance, float(g.importance_sampling_min),
                                             float(g.importance_sampling_max), rows.members(self.host), self.per_row)
            self.host["is_ratio"] = ratio
            placed["is_ratio"] = jax.device_put(ratio.astype(self.float), self.steps.batch_sharding)
        return (placed if self.mu > 1 else {k: v for k, v in placed.items() if k != "old"}), stats

    def place(self, host: dict) -> dict:
        keys = ("tokens", "mask", "advantages") + (("old",) if "old" in host and self.mu > 1 else ()) + \
            tuple(k for k in ("routes", "is_ratio", "segments", "positions") if k in host)
        rows = {k: host[k].astype(self.float) if host[k].dtype.kind == "f" else host[k] for k in keys}
        return jax.device_put(rows, self.steps.batch_sharding)

    def sample(self, r: int, params) -> tuple[dict, dict]:
        """Round r's batch (host arrays) and its metrics."""
        picked = self.train.take(r * self.B, self.B, self.seed)
        recs, prompts = [self.train.records[i] for i in picked], [self.train.ids[i] for i in picked]
        t0 = time.perf_counter()
        done = self.generate(params, prompts, r)
        t1 = time.perf_counter()
        shown = _shown([recs[k // self.G] for k in range(len(done))], done, self.tokenizer)
        lengths = np.array([len(c.tokens) for c in done])
        counted = int(sum(len(p) for p in prompts) * self.G + lengths.sum())
        self.num_tokens += counted  # (before scoring: TRL's trainer_state counts the round's tokens)
        g, log = self.config.grpo, rewards.RewardLog(len(done), self.trainer_state(r * self.mu), self.G)
        rnd = rollout.round_batch(prompts, recs, done, self.fns, self.weights, self.G, g.scale_rewards,
                                  self.longest, texts=shown, mask_truncated=bool(g.mask_truncated_completions),
                                  max_completion_length=self.room, replay=self.steps.objective.routing_replay,
                                  per_row=self.per_row, shared=self.shared, log=log)
        self.keep_shown(r, recs, shown, rnd.per_function, rnd.advantages, log.extra)
        batch = {k: v for k, v in rnd.batch.items() if k != "old"}  # (the engine's: the training forward replaces)
        if self.importance != "none":  # the engine's sampling log-probs, for the importance ratios
            batch["sampled"] = rows.place(rnd.rows, [c.logprobs for c in done])
        took = {"time/generate_s": t1 - t0, "time/score_s": time.perf_counter() - t1}
        self.sampling_s += sum(took.values())
        took |= {"tokens/prefill": self.prefilled, "tokens/train": batch["mask"].size}
        took["rollout_tokens_per_s"] = lengths.sum() / max(took["time/generate_s"], 1e-9)
        return batch | {"tokens_counted": np.asarray(counted)}, log.means() | self.stats(rnd, lengths, done) | took

    def trainer_state(self, global_step: int) -> rewards.TrainerState:
        """What reward functions get as `trainer_state` after `global_step` optimizer steps."""
        c = self.config
        return rewards.TrainerState(global_step, int(c.train.steps), global_step * self.B / (self.mu * len(self.train)),
                                    self.num_tokens, int(c.log.every_steps), int(c.eval.every_steps),
                                    int(c.checkpoint.every_steps), self.is_main, self.is_main)

    def generate(self, params, prompts, r: int) -> list:
        engine = Engine.on_steps(self.steps, params, self.config, tokenizer=self.tokenizer,
                                 slots=len(prompts) * self.G, prompt_experts=self.steps.objective.routing_replay,
                                 **kv.engine_options(self.config.grpo))
        seeds = [_round_seed(self.seed, r, k) for k in range(len(prompts))]
        done = rollout.sample(engine, prompts, self.G, self.room, seeds, self.stops, **self.sampling)
        self.prefilled = engine.stats["prefill_tokens"]
        return done

    def stats(self, rnd, lengths, done) -> dict:
        per_fn, total, zero_std = rnd.per_function, rnd.rewards, rnd.zero_std
        with np.errstate(invalid="ignore"):
            out = {"reward": np.nanmean(total), "reward_std": _std(total),
                   "frac_reward_zero_std": float(np.mean(zero_std))}
            for j, (name, _) in enumerate(self.fns):
                out[f"rewards/{name}/mean"], out[f"rewards/{name}/std"] = np.nanmean(per_fn[:, j]), _std(per_fn[:, j])
        cut = np.array([c.finish_reason == "length" for c in done])
        ended = lengths[~cut] if (~cut).any() else np.zeros(1)
        return out | {"completions/mean_length": lengths.mean(), "completions/min_length": lengths.min(),
                      "completions/max_length": lengths.max(), "completions/clipped_ratio": cut.mean(),
                      "completions/mean_terminated_length": ended.mean(),
                      "completions/min_terminated_length": ended.min(),
                      "completions/max_terminated_length": ended.max()}

    def keep_shown(self, r: int, recs, shown, per_fn, a, extra=None) -> None:
        """The first `grpo.log_completions` completions of the round, for the log, with the `extra` columns
        ({column: a value per completion}: `log_extra`'s) between the rewards and the advantage (TRL's table)."""
        n = min(int(self.config.grpo.log_completions), len(shown))
        names, extra = [name for name, _ in self.fns], extra or {}
        self.shown = [{"round": r, "prompt": recs[k // self.G].get("prompt"), "completion": shown[k],
                       "rewards": {f: (None if np.isnan(v) else float(v)) for f, v in zip(names, per_fn[k])},
                       **{col: vals[k] for col, vals in extra.items()}, "advantage": float(a[k])} for k in range(n)]

    # ---- the loop's asks ---------------------------------------------------------------------------------------

    def log(self, done: int, steps: int, writer=None) -> dict:
        out = {k: float(np.mean(v)) for k, v in self.seen.items()} | {"num_tokens": self.num_tokens}
        now = time.perf_counter()  # the interval's time without its rounds' sampling: its steps (and any save)
        out["time/train_s"] = max(now - self.logged_at - self.sampling_s, 0.0) / max(steps, 1)
        self.seen.clear()
        self.logged_at, self.sampling_s = now, 0.0
        if self.is_main and self.shown:
            rows = [{"step": done, **row} for row in self.shown]
            with open(os.path.join(self.workdir, COMPLETIONS), "a") as f:
                f.writelines(json.dumps(row) + "\n" for row in rows)
            if writer is not None:
                writer.table("completions", rows, done)
        return out

    def evaluate(self, state) -> dict:
        """The held-out prompts' greedy completions (the first `eval.batches` x `train.global_batch_size`): their
        mean reward and each function's."""
        n = min(len(self.val), int(self.config.eval.batches) * self.B)
        if n == 0:
            return {}
        recs, ids = self.val.records[:n], self.val.ids[:n]
        engine = Engine.on_steps(self.steps, state["params"], self.config, tokenizer=self.tokenizer, slots=min(n, 64))
        with watchdog.part("evaluation sampling"):
            done = engine.generate([Request(prompt=list(p), max_new_tokens=self.room, stop_ids=self.stops)
                                    for p in ids])
        shown = _shown(recs, done, self.tokenizer)
        log = rewards.RewardLog(len(done), self.trainer_state(int(exchange.fetch(state["step"]))))
        per_fn = rewards.score(self.fns, [r.get("prompt") for r in recs], shown, [c.tokens for c in done], recs,
                               log, max_completion_length=self.room)
        with np.errstate(invalid="ignore"):
            out = {f"val_{k}": v for k, v in log.means().items()}  # (log_extra's columns: dropped)
            out |= {"val_reward": float(np.nanmean(adv.rewards_of(per_fn, self.weights)))}
            return out | {f"val_rewards/{name}/mean": float(np.nanmean(per_fn[:, j]))
                          for j, (name, _) in enumerate(self.fns)}

    def save(self, done: int) -> dict:
        """The round's batch beside a checkpoint inside it (and the tokens counted so far, always)."""
        kept = self.host if done % self.mu and self.host is not None else {}
        if kept and "old" in self.placed:  # (fetched from the devices, by every process, only inside a round)
            kept = {**kept, "old": np.asarray(exchange.fetch(self.placed["old"]))}
        if self.is_main:
            os.makedirs(os.path.join(self.workdir, DIR), exist_ok=True)
            path = os.path.join(self.workdir, DIR, f"step-{done}.npz")
            pending = json.dumps({"seen": self.seen, "shown": self.shown})  # (metrics not logged yet)
            np.savez(path + ".tmp.npz", num_tokens=self.num_tokens, round=self.round, pending=pending, **kept)
            os.replace(path + ".tmp.npz", path)
            self.prune(int(self.config.checkpoint.keep))
        return {"samples": (self.round + 1) * self.B}

    def prune(self, keep: int) -> None:
        folder = os.path.join(self.workdir, DIR)
        steps = sorted(int(f[5:-4]) for f in os.listdir(folder) if f.startswith("step-") and f.endswith(".npz"))
        for s in steps[:-max(keep, 1) - 1]:
            os.remove(os.path.join(folder, f"step-{s}.npz"))

    def resume_at(self, start: int, samples: int) -> None:
        """Continue from the checkpoint of step `start`: its tokens counted and, inside a round, the round's batch.

        Raises:
          DataError: the round's batch of a checkpoint inside a round is missing (one line, the fix)."""
        path = os.path.join(self.workdir, DIR, f"step-{start}.npz")
        if not os.path.isfile(path):
            if start % self.mu:
                raise data.DataError(f"{path} is missing: the checkpoint of step {start} lies inside a round of "
                                        f"grpo.num_iterations={self.mu} steps and its sampled batch was kept there; "
                                        f"restore the file, or resume from a checkpoint at a round's start.")
            return
        with np.load(path) as f:
            kept = {k: f[k] for k in f.files}
        self.num_tokens = int(kept.pop("num_tokens"))
        r = int(kept.pop("round"))
        pending = json.loads(str(kept.pop("pending")))
        self.seen.update({k: list(v) for k, v in pending["seen"].items()})
        self.shown = pending["shown"]
        if start % self.mu and kept:
            self.round, self.host = r, kept
            self.placed = self.place(kept)

