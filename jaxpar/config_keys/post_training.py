"""The keys of post-training: LoRA adapters, DPO and GRPO (their guides: docs/finetune.md, docs/rl.md)."""
from __future__ import annotations

from jaxpar.config_keys.key import _INF, DTYPES, GRPO_LOSSES, IMPORTANCE_SAMPLING, REWARD_SCALES, K

POST_TRAINING = (
    # lora
    K("lora.rank", 0, int, "LoRA adapters' rank r; 0: off (full fine-tuning): [finetune](finetune.md)",
      lambda v: v >= 0, "an integer >= 0 (0: no adapters)"),
    K("lora.alpha", 16.0, float, "LoRA's alpha: the adapters' output scaled by alpha / r (alpha / sqrt(r) with "
      "`rslora`)", lambda v: 0 < v < _INF, "a finite number > 0"),
    K("lora.dropout", 0.0, float, "dropout on the adapters' input (PEFT's `lora_dropout`)",
      lambda v: 0 <= v < 1, "a number in [0, 1)"),
    K("lora.targets", "auto", str, "the projections that get adapters, by their Hugging Face names, comma-separated "
      "(`q_proj`, ..., `down_proj`, which also name Qwen3-MoE's experts; GPT-2's `c_attn`, `c_proj`, `c_fc`; "
      "Mixtral's experts `w1`, `w2`, `w3`), `all-linear`, or `auto` (PEFT's default: `q_proj,v_proj`; GPT-2 "
      "`c_attn`)"),
    K("lora.rslora", False, bool, "rank-stabilised LoRA: scale alpha / sqrt(r) (PEFT's `use_rslora`)"),
    K("lora.adapter", "", str, "a PEFT adapter directory (or `hf:ORG/NAME[@REVISION]`, a Hub adapter) to start the "
      "adapters from (its `r`, `lora_alpha`, targets "
      "and rslora replace the keys above)"),
    K("lora.base_dtype", "", str, "the frozen base weights' dtype (`bfloat16` halves their memory); `\"\"`: "
      "`train.param_dtype`. The adapters and their AdamW moments keep `train.param_dtype`",
      choices=("",) + DTYPES),
    # dpo
    K("dpo.beta", 0.1, float, "DPO's beta: the implicit reward is beta x (log pi - log pi_ref) of a response; the "
      "strength of the pull to the reference model: [finetune](finetune.md#dpo)", lambda v: 0 < v < _INF,
      "a finite number > 0"),
    K("dpo.loss", "sigmoid", str, "`sigmoid` (DPO: -log sigmoid of the reward margin) or `ipo` ((margin / beta - "
      "1 / (2 beta))^2)", choices=("sigmoid", "ipo")),
    K("dpo.label_smoothing", 0.0, float, "conservative DPO: the probability that a pair's preference is flipped "
      "(sigmoid loss only)", lambda v: 0 <= v < 0.5, "a number in [0, 0.5)"),
    K("dpo.dropout", False, bool, "dropout in DPO's policy and reference passes (the same masks): TRL's default off"),
    K("dpo.precompute_reference", False, bool, "compute the reference model's log-probs of every pair once, before "
      "training, and keep them with the prepared data (TRL's `precompute_ref_log_probs`): no reference weights "
      "during training"),
    # grpo ([rl](rl.md))
    K("grpo.loss_type", "dapo", str, "the policy loss and its normalisation ([rl](rl.md#losses))", choices=GRPO_LOSSES),
    K("grpo.epsilon", 0.2, float, "the ratio's lower clip 1 - epsilon", lambda v: 0 <= v < 1, "a number in [0, 1)"),
    K("grpo.epsilon_high", 0.0, float, "upper clip 1 + epsilon_high (cispo: the cap); 0: epsilon", lambda v: v >= 0),
    K("grpo.beta", 0.0, float, "the k3 KL-to-reference weight; 0: no reference", lambda v: 0 <= v < _INF, ">= 0"),
    K("grpo.use_bias_correction_kl", True, bool, "the KL term's k3 times the importance ratio pi / pi_old (TRL's "
      "`use_bias_correction_kl`): the estimate on the old policy's samples corrected to the policy's "
      "([rl](rl.md#losses))"),
    K("grpo.max_completion_length", 256, int, "tokens per completion at most", lambda v: v >= 1, "an integer >= 1"),
    K("grpo.mask_truncated_completions", False, bool, "completions cut at max_completion_length: out of the loss"),
    K("grpo.num_generations", 8, int, "G: completions per prompt", lambda v: v >= 2, "an integer >= 2"),
    K("grpo.rewards", "", str, "`MODULE:FUNCTION` or `FILE.py:FUNCTION`, comma-separated ([rl](rl.md#rewards))"),
    K("grpo.reward_weights", "", str, "a weight per reward function, comma-separated (`\"\"`: 1 each)"),
    K("grpo.map_records", "", str, "`MODULE:FUNCTION` or `FILE.py:FUNCTION` turning a record into a prompt record "
      "([rl](rl.md#prompts))"),
    K("grpo.num_iterations", 1, int, "μ: optimizer steps on each round's completions", lambda v: v >= 1, "an integer >= 1"),
    K("grpo.temperature", 1.0, float, "sampling temperature of the completions", lambda v: 0 < v < _INF, "a number > 0"),
    K("grpo.top_p", 1.0, float, "sampling: nucleus mass", lambda v: 0 < v <= 1, "a number in (0, 1]"),
    K("grpo.top_k", 0, int, "sampling: the k likeliest tokens; 0: all", lambda v: v >= 0, "an integer >= 0"),
    K("grpo.log_completions", 4, int, "completions written with their rewards per log step (completions.jsonl)",
      lambda v: v >= 0, "an integer >= 0"),
    K("grpo.scale_rewards", "group", str, "advantages / the rewards' std: group, batch or none", choices=REWARD_SCALES),
    K("grpo.importance_sampling", "none", str, "correct for the sampler's log-probs differing from the training "
      "forward's: TRL's `vllm_importance_sampling_mode` ratios (exp(old - sampled), per token or per sequence, "
      "truncated or masked outside [min, max]) times each token's loss; `none`: off ([rl](rl.md#losses))",
      choices=IMPORTANCE_SAMPLING),
    K("grpo.importance_sampling_max", 3.0, float, "the importance ratio's upper bound C_max (TRL's "
      "`vllm_importance_sampling_clip_max`)", lambda v: 0 < v < _INF, "a finite number > 0"),
    K("grpo.importance_sampling_min", 0.0, float, "its lower bound C_min (0: none, TRL's `clip_min=None`)",
      lambda v: 0 <= v < _INF, "a finite number >= 0"),
    K("grpo.shared_prompt", True, bool, "train on rows that hold a prompt once and its completions, each seeing the "
      "prompt and itself, packed to their length (False: a row per completion, padded to model.seq_len + 1) "
      "([rl](rl.md#the-shared-prompt-rows))"),
    K("grpo.kv_block", 16, int, "the rounds' KV cache in blocks of this many positions, reserved as completions "
      "grow (0: a dense row of model.seq_len per completion) ([generate](generate.md#the-paged-kv-cache))",
      lambda v: v >= 0, "an integer >= 0"),
    K("grpo.kv_cache_gib", 0.0, float, "the paged KV cache's GiB on each device; completions that do not fit wait "
      "(0: as much as a dense row per completion)", lambda v: 0 <= v < _INF, "a number >= 0"),
    K("grpo.gather_zero3", True, bool, "under ZeRO-3 a round's decode holds the params whole over ZeRO's group, "
      "gathered once per round (DeepSpeed's hybrid engine); False: each layer's shards gathered at every decode step "
      "(less memory, an all-gather of every layer per token) ([rl](rl.md#larger-runs))"),
    K("grpo.routing_replay", True, bool, "a mixture of experts: every pass over a round routes each token to the "
      "experts it had when sampled ([rl](rl.md#how-a-run-goes))"),
)
