"""Group relative policy optimisation (`train.objective='grpo'`, settings `grpo.*`): the policy-gradient loss of the
GRPO family on sampled completions, and the pass that reads a batch's per-token log-probs (`TokenLogps`).

A batch holds one completion per row: `tokens` its prompt then its completion, `mask` 1 on the positions whose
target is a completion token (0 on the prompt, the padding and, with `grpo.mask_truncated_completions`, on a
completion cut at `grpo.max_completion_length`), `old` `[rows, seq]` the old policy's log-prob of each target
(absent with one pass per round, `grpo.num_iterations` = 1: the policy's own, not differentiated, as TRL takes
them), `advantages` `[rows]`, and with `grpo.beta` > 0 `ref` `[rows, seq]` the reference model's (added in the step
from the starting model, `reference_head`). Per completion token, with
pi, pi_old, pi_ref the three log-probs' models, r = pi / pi_old and A the completion's advantage:

    clipped (dapo, grpo, dr_grpo, bnpo):  -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A)
    gspo: the same with r the sequence's ratio exp(mean over its tokens of log r) (GSPO, Zheng et al. 2025)
    cispo: -min(r, epsilon_high) A log pi, the min not differentiated (MiniMax-M1)
    times the importance ratio of the sampler to the old policy with `grpo.importance_sampling` (`rl/importance.py`)
    plus beta k3 r with `grpo.use_bias_correction_kl` (TRL's default), beta k3 without, k3 = exp(pi_ref - pi) -
    (pi_ref - pi) - 1 the k3 estimate of KL(pi || pi_ref) (`grpo.beta` > 0): r (gspo's the sequence's) corrects the
    estimate, taken on pi_old's samples, to pi; it is differentiated, so it changes the gradient even where r is 1.

Normalised over the whole optimizer step (every microbatch and data shard; `total`), whatever the layout:
`dapo`, `bnpo`, `cispo` the step's completion tokens; `grpo`, `gspo` each completion's token mean, then the mean over
the step's completions; `dr_grpo` the step's completions x `grpo.max_completion_length`. TRL normalises `bnpo`,
`grpo` and `dr_grpo` per micro-batch and process (then averages), which equals this only when every micro-batch holds
the same number of tokens (bnpo) or completions; `dapo` and `cispo` are global there too (docs/rl.md).
Metrics as TRL names them: `kl` (the KL term's k3, r times it with the correction), `entropy` (per completion
token), `clip_ratio/low_mean`, `clip_ratio/high_mean`, `clip_ratio/region_mean` (per token; gspo per completion),
`cispo_clip_ratio`; `completion_tokens`.
"""
from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxpar.dtypes import at_least_f32
from jaxpar.kernels import segments
from jaxpar.kernels.cross_entropy import place_rows
from jaxpar.parallel import context, logical
from jaxpar.train.objectives.base import Objective
_CLIPS = ("clip_ratio/low_mean", "clip_ratio/high_mean", "clip_ratio/region_mean")


@dataclasses.dataclass(frozen=True)
class GRPO(Objective):
    loss_type: str = "dapo"
    epsilon: float = 0.2
    epsilon_high: float = 0.2
    beta: float = 0.0
    max_completion_length: int = 256
    num_generations: int = 8  # G: a step's rows are its prompts x G completions
    num_iterations: int = 1  # mu: optimizer passes per round; 1: the old policy is the policy itself (no `old`)
    reference: str = ""  # with beta > 0 the model the run starts from (`Objective.starting_model`)
    temperature: float = 1.0  # the sampling temperature: every log-prob is of softmax(logits / temperature), as TRL
    routing_replay: bool = False  # a MoE model's batches carry `routes`: the experts of each position when sampled
    use_bias_correction_kl: bool = True  # the KL term's k3 times the ratio r (TRL's `use_bias_correction_kl`)
    importance_sampling: bool = False  # batches carry `is_ratio` `[rows, seq]` (`rl/importance.py`) times the loss
    shared_prompt: bool = False  # rows of a prompt once and K completions (`rl/rows.py`, `kernels/segments.py`)
    name = "grpo"
    section = "grpo"
    data_kinds = ("prompts",)
    samples = True
    packing = "bfd"  # a row is one whole prompt and completion, padded (never cut): what `data.packing=auto` becomes
    dropout = False  # the policy's passes and the old policy's are the same model (TRL's `disable_dropout`)

    @property
    def metric_names(self) -> tuple:
        clips = ("cispo_clip_ratio",) if self.loss_type == "cispo" else _CLIPS
        return ("completion_tokens", "entropy") + clips + (("kl",) if self.beta > 0 else ())

    @classmethod
    def from_config(cls, config) -> "GRPO":
        g = config.grpo
        eps, beta = float(g.epsilon), float(g.beta)
        return cls(str(g.loss_type), eps, float(g.epsilon_high) or eps, beta, int(g.max_completion_length),
                   int(g.num_generations), int(g.num_iterations), cls.starting_model(config) if beta > 0 else "",
                   float(g.temperature), bool(g.routing_replay) and int(config.model.experts) > 0,
                   bool(g.use_bias_correction_kl), str(g.importance_sampling) != "none", bool(g.shared_prompt))

    @property
    def old_policy_pass(self) -> bool:
        """Whether a round runs the old policy's training forward before its first pass (mu > 1: the ratio's old
        log-probs; an importance-sampling correction: the sampler's against them)."""
        return self.num_iterations > 1 or self.importance_sampling

    @property
    def shares_prefixes(self) -> bool:
        """Whether its rows' segment ids name shared prefixes (attention through the kernels that read them)."""
        return self.shared_prompt

    def reference_head(self, rows: int):
        return TokenLogps(rows, self.temperature)

    def rows(self, config) -> int:
        """A step's `train.global_batch_size` prompts x G completions, a row each."""
        return int(config.train.global_batch_size) * self.num_generations

    def per_row(self, prompts: int, split: int, seq: int) -> int:
        """Completions a shared-prompt row holds: the most (a divisor of G) whose rows still divide by `split` (data
        shards x microbatches) and whose longest row stays within 2 x `seq` positions (XLA's attention over a row is
        quadratic in its length); 1 without sharing."""
        G = self.num_generations
        if not self.shared_prompt:
            return 1
        return max(k for k in range(1, G + 1) if G % k == 0 and (prompts * G // k) % split == 0
                   and (k == 1 or self.longest_row(seq, k) <= 2 * seq))

    def longest_row(self, seq: int, per_row: int, context: int = 1) -> int:
        """The most input positions a row can need: a shared row's prompt of the most tokens (seq + 1 - room) less
        its last, then `per_row` segments of a whole completion and a copy of the prompt's last token, rounded up to
        a multiple of 2 x `context` (context parallelism's chunks); else seq."""
        room, chunks = self.max_completion_length, 2 * context if context > 1 else 1
        return -(-(seq - room + per_row * (room + 1)) // chunks) * chunks if self.shared_prompt else seq

    def batch_shapes(self, config, default: dict, layout=None) -> dict:
        """A round's batch at its longest: its rows (a completion each, its prompt then itself; or shared-prompt
        rows: `rl/rows.py`), their loss mask, advantages, with mu > 1 the old policy's per-token log-probs and, with
        routing replay, each position's experts in every layer. `layout`: the step's (its data shards and
        microbatches split the rows)."""
        B, m = int(config.train.global_batch_size), config.model
        k = self.per_row(B, 1 if layout is None else layout.batch_split * layout.microbatches, int(m.seq_len))
        rows, T = self.rows(config) // k, self.longest_row(int(m.seq_len), k, 1 if layout is None else layout.context)
        f = np.dtype(at_least_f32(config.train.compute_dtype))
        out = {"tokens": ((rows, T + 1), np.int32), "mask": ((rows, T), f), "advantages": ((rows, k), f)}
        out |= {"segments": ((rows, T + 1), np.int32), "positions": ((rows, T + 1), np.int32)} \
            if self.shared_prompt else {}
        out |= {"old": ((rows, T), f)} if self.num_iterations > 1 else {}
        out |= {"is_ratio": ((rows, T), f)} if self.importance_sampling else {}
        return out | ({"routes": ((rows, T, int(m.layers), int(m.experts_per_token)), np.int32)}
                      if self.routing_replay else {})

    @staticmethod
    def errors(config, lay) -> list[str]:
        """Room for a prompt next to a whole completion; KV blocks the context devices can split."""
        errs, n, T = [], int(config.grpo.max_completion_length), int(config.model.seq_len)
        if n >= T:
            errs.append(f"grpo.max_completion_length={n} with model.seq_len={T}: no room is left for a prompt; "
                        f"lower grpo.max_completion_length below {T} or raise model.seq_len.")
        block, c, gib = int(config.grpo.kv_block), lay.context, float(config.grpo.kv_cache_gib)
        if block and gib and block % c:
            errs.append(f"grpo.kv_block={block} with mesh.context={c} and grpo.kv_cache_gib={gib:g}: a completion "
                        f"that does not fit one device's pool splits its KV blocks' positions over the context "
                        f"devices; use a multiple of {c} (e.g. {-(-block // c) * c}).")
        if config.grpo.shared_prompt and config.model.attention in ("cudnn", "pallas"):
            errs.append(f"model.attention={config.model.attention!r} with grpo.shared_prompt=True: the fused kernel "
                        f"sees a query's own segment only, not its shared prompt; set model.attention='auto' (XLA "
                        f"for these rows) or grpo.shared_prompt=False.")
        return errs

    def per_token(self, lp, mb, own):
        """(per-token loss `[rows, seq]`, the ratio r (gspo: the completion's, `[rows, K]`), its advantage (likewise,
        `[rows, K]` for gspo else per token), the KL term's per-token k3 (times r with the bias correction; None at
        beta 0)). `own`: `_Completions` of the rows."""
        adv = mb["advantages"].astype(lp.dtype).reshape(lp.shape[0], -1)
        old = mb["old"].astype(lp.dtype) if "old" in mb else jax.lax.stop_gradient(lp)  # mu = 1: the policy's own
        log_ratio = lp - old
        if self.loss_type == "gspo":  # one ratio a completion (its tokens on every context device)
            seq_ratio = jnp.exp(logical.sum_context(own.sums(log_ratio)) / own.counts())
            ratio, counted = own.tokens(seq_ratio), (seq_ratio, adv)
        else:
            ratio = jnp.exp(log_ratio)
            counted = (ratio, own.tokens(adv))
        adv = own.tokens(adv)
        if self.loss_type == "cispo":
            loss = -jax.lax.stop_gradient(jnp.minimum(ratio, self.epsilon_high)) * adv * lp
        else:
            clipped = jnp.clip(ratio, 1 - self.epsilon, 1 + self.epsilon_high)
            loss = -jnp.minimum(ratio * adv, clipped * adv)
        if "is_ratio" in mb:  # the sampler's distribution corrected to the old policy's (TRL: before the KL term)
            loss = loss * mb["is_ratio"].astype(lp.dtype)
        kl = None
        if self.beta > 0:
            kl = self.kl(lp, mb) * ratio if self.use_bias_correction_kl else self.kl(lp, mb)
            loss = loss + self.beta * kl
        return loss, *counted, kl

    @staticmethod
    def kl(lp, mb):
        d = mb["ref"].astype(lp.dtype) - lp
        return jnp.exp(d) - d - 1

    def clip_sums(self, ratio, adv, w):
        """Sums of TRL's clip indicators: per completion token, or per completion (gspo's ratio is per sequence)."""
        if self.loss_type == "cispo":
            flags = [(ratio > self.epsilon_high) & (adv > 0)]
        else:
            low, high = (ratio < 1 - self.epsilon) & (adv < 0), (ratio > 1 + self.epsilon_high) & (adv > 0)
            flags = [low, high, low | high]
        weigh = (lambda f: f.sum()) if self.loss_type == "gspo" else (lambda f: (f * w).sum())
        return [weigh(f.astype(w.dtype)) for f in flags]

    def head(self, fwd, params, x, mb):
        lp = fwd.token_logps(params, x, mb["y"], self.temperature)
        entropy = fwd.token_entropy(params, x, self.temperature).astype(lp.dtype)
        w = mb["w"].astype(lp.dtype)
        own = _Completions(mb.get("seg"), w, mb["advantages"].size // w.shape[0])
        loss, ratio, adv, kl = self.per_token(lp, mb, own)
        per_seq = own.sums(loss)  # (under context parallelism: this device's tokens' part of each sum)
        if self.loss_type in ("grpo", "gspo"):
            per_seq = per_seq / own.counts()
        kl = (kl * w).sum() if self.beta > 0 else jnp.zeros((), lp.dtype)
        clips = self.clip_sums(ratio, adv, w)
        cp = logical.context_split()  # (what every context device holds whole is counted once over their sum)
        clips = [c / cp for c in clips] if self.loss_type == "gspo" else clips
        count = jnp.stack([w.sum(), jnp.asarray(per_seq.size / cp, lp.dtype), (entropy * w).sum(), kl, *clips])
        return per_seq.sum(), count

    def total(self, mask, seg, batch):
        completions = batch["advantages"].size  # (shared rows: K a row)
        if self.loss_type in ("grpo", "gspo"):
            return jnp.asarray(completions, mask.dtype)
        if self.loss_type == "dr_grpo":
            return jnp.asarray(completions * self.max_completion_length, mask.dtype)
        return mask.sum()

    def metrics(self, count, total) -> dict:
        tokens = jnp.maximum(count[0], 1)
        clip_over = jnp.maximum(count[1], 1) if self.loss_type == "gspo" else tokens
        clips = ("cispo_clip_ratio",) if self.loss_type == "cispo" else _CLIPS
        out = {"completion_tokens": count[0], "entropy": count[2] / tokens}
        out |= {k: count[4 + i] / clip_over for i, k in enumerate(clips)}
        return out | ({"kl": count[3] / tokens} if self.beta > 0 else {})


class _Completions:
    """Which completion of its row each position's target belongs to: with shared-prompt rows (`seg`: the inputs'
    segment ids, `rl/rows.py`) a row's completions 0 .. K - 1 are its segments' members 1 .. K; else one a row."""

    def __init__(self, seg, w, per_row: int):
        own = jnp.zeros(w.shape, jnp.int32) if seg is None else jnp.clip(segments.member(seg) - 1, 0, per_row - 1)
        self.own, self.w = own, w
        self.one_hot = (own[..., None] == jnp.arange(per_row)).astype(w.dtype)

    def sums(self, x):
        """`[rows, seq]` -> each completion's sum over its masked-in tokens `[rows, K]` (of this device's tokens under
        context parallelism)."""
        return jnp.einsum("rt,rtk->rk", x * self.w, self.one_hot)

    def counts(self):
        """Each completion's masked-in tokens `[rows, K]` (at least 1), over every context device's."""
        return jnp.maximum(logical.sum_context(self.sums(jnp.ones_like(self.w))), 1)

    def tokens(self, x):
        """`[rows, K]` per completion -> each position's `[rows, seq]`."""
        return jnp.take_along_axis(x, self.own, axis=1)


class TokenLogps:
    """A pass that reads each row's per-token log-probs of its targets, `[global rows, seq]` (the old policy's, or the
    reference's): each microbatch writes its rows (`ids`), zeros elsewhere, so summing over microbatches and data
    shards assembles them (as `dpo.ReferenceSums`)."""

    def __init__(self, rows: int, temperature: float = 1.0):
        self.rows, self.temperature = rows, float(temperature)

    def __hash__(self):
        return hash(("TokenLogps", self.rows, self.temperature))

    def __eq__(self, other):
        return isinstance(other, TokenLogps) and (other.rows, other.temperature) == (self.rows, self.temperature)

    def head(self, fwd, params, x, mb):
        lp = fwd.token_logps(params, x, mb["y"], self.temperature)
        cp = logical.context_split()
        if cp > 1:  # this device's piece of the context-parallel order, written at its tokens' own places
            at = context.local_index(lp.shape[1], cp, logical.context_rank())
            lp = jnp.zeros((lp.shape[0], lp.shape[1] * cp), lp.dtype).at[:, at].set(lp)
        place = (mb["ids"][:, None] == jnp.arange(self.rows)).astype(lp.dtype)
        return jnp.zeros((), lp.dtype), place_rows(place, lp)
