"""The keys of the model and its layout (`MODEL`: the top level, mesh, model) and of the run (`RUN`: train, optim,
pipeline, data, xla, checkpoint, log, eval, dist)."""
from __future__ import annotations

from jaxpar.config_keys.key import _INF, _NONEMPTY, DEFAULT_RULES, DTYPES, OFFLOAD, REMAT_POLICIES, ROUTERS, K

MODEL = (
    # top level
    K("name", "jaxpar", str, "the run's name (in messages and the planner's output; the workdir defaults to "
      "`runs/<config file name>`)"),
    K("init_from", "", str, "weights to start from, whose model shape and tokenizer replace the config's: `hf:DIR`, "
      "`hf:ORG/NAME[@REVISION]` (a Hub model), an export (`python -m jaxpar.export`) or a run directory (its latest "
      "checkpoint): [starting points](finetune.md#starting-points)"),
    K("rules", DEFAULT_RULES, None, "logical axis → mesh axis (below): [layouts](layouts.md)"),
    # mesh
    K("mesh.data", -1, int, "data-parallel size; -1: the devices left over by tensor and stage"),
    K("mesh.tensor", 1, int, "tensor-parallel size (Megatron: heads, MLP width and vocabulary split); within a node"),
    K("mesh.stage", 1, int, "pipeline stages: [pipeline](pipeline.md)"),
    K("mesh.expert", 1, int, "expert-parallel size: the routed experts split over it, the batch split over data x "
      "expert: [moe](moe.md)"),
    K("mesh.context", 1, int, "context-parallel size: every sequence split over it, load-balanced, attention gathering "
      "K/V: [long context](context.md)"),
    K("mesh.device", "", str, "the accelerator the run is for, as the planner names it (`h100`, `h200`, `a100-80g`, "
      "`a100-80g-pcie`); `\"\"`: the devices present. `model.moe_impl=auto` is chosen for it: a CPU `--dry_run` "
      "compiles what those GPUs would run: [moe](moe.md#implementations)"),
    # model
    K("model.arch", "gpt2", str, "`gpt2` (LayerNorm, learned positions, GELU MLP, biases), `llama` (RMSNorm, RoPE, "
      "GQA, SwiGLU) or `vit` (a vision transformer: patches in, a classifier out: [vision](vision.md))"),
    K("model.image_size", 224, int, "vit: the images' height and width in pixels (a multiple of `model.patch_size`); "
      "`model.seq_len` is then the patches + 1", lambda v: v >= 1, "an integer >= 1"),
    K("model.patch_size", 16, int, "vit: each patch's height and width in pixels", lambda v: v >= 1,
      "an integer >= 1"),
    K("model.channels", 3, int, "vit: colour channels (3: RGB, 1: grey)", lambda v: v in (1, 3), "1 or 3"),
    K("model.num_classes", 0, int, "vit: the classifier's classes; 0: the data's (or the checkpoint's)",
      lambda v: v >= 0, "an integer >= 0 (0: the data's classes)"),
    K("model.vocab_size", 0, int, "0: the tokenizer's; padded to a multiple of 128 and of `mesh.tensor`",
      lambda v: v >= 0, "an integer >= 0 (0: taken from the tokenizer)"),
    K("model.seq_len", 256, int, "tokens per sequence", lambda v: v >= 1, "an integer >= 1"),
    K("model.layers", 4, int, "transformer blocks", lambda v: v >= 1, "an integer >= 1"),
    K("model.embed", 128, int, "hidden size", lambda v: v >= 1, "an integer >= 1"),
    K("model.heads", 4, int, "attention heads", lambda v: v >= 1, "an integer >= 1"),
    K("model.mlp", 0, int,
      "the MLP's hidden width (llama: SwiGLU's, Hugging Face's `intermediate_size`); 0: 4 × embed",
      lambda v: v >= 0, "an integer >= 0 (0: 4 x model.embed)"),
    K("model.kv_heads", 0, int, "llama: grouped-query KV heads, dividing heads; 0: = heads",
      lambda v: v >= 0, "an integer >= 0 (0: = model.heads)"),
    K("model.head_dim", 0, int, "each attention head's size; 0: embed / heads (Qwen3: 128 whatever the width)",
      lambda v: v >= 0, "an integer >= 0 (0: embed / heads)"),
    K("model.qk_norm", False, bool, "llama: RMSNorm over each head of q and k before RoPE (Qwen3)"),
    K("model.max_positions", 0, int, "gpt2: rows of the position table; llama: the context the model is made for; 0: "
      "= seq_len",
      lambda v: v >= 0, "an integer >= 0 (0: = model.seq_len)"),
    K("model.norm_eps", 1e-05, float, "norm epsilon", lambda v: 0 < v < _INF, "a number > 0"),
    K("model.rope_theta", 10000.0, float, "llama: RoPE base", lambda v: 0 < v < _INF, "a number > 0"),
    K("model.rope_scaling", "none", str, "llama: `none` or `llama3` (Llama 3.1/3.2's frequency scaling with the four "
      "keys below)"),
    K("model.rope_factor", 8.0, float, "llama3 RoPE scaling: factor", lambda v: 1 <= v < _INF, "a number >= 1"),
    K("model.rope_low_freq_factor", 1.0, float, "llama3 RoPE scaling: low-frequency factor",
      lambda v: 0 < v < _INF, "a number > 0"),
    K("model.rope_high_freq_factor", 4.0, float, "llama3 RoPE scaling: high-frequency factor",
      lambda v: 0 < v < _INF, "a number > model.rope_low_freq_factor"),
    K("model.rope_original_max_len", 8192, int, "llama3 RoPE scaling: the original context",
      lambda v: v >= 1, "an integer >= 1"),
    K("model.dropout_embed", 0.0, float, "dropout on the embedding output (masks depend on step, layer and sequence, "
      "not the layout)",
      lambda v: 0 <= v < 1, "a number in [0, 1)"),
    K("model.dropout_resid", 0.0, float, "dropout on each residual branch", lambda v: 0 <= v < 1, "a number in [0, 1)"),
    K("model.tie_embeddings", True, bool, "the LM head is the token embedding"),
    K("model.remat", "none", str, "activation recompute: `none`, `selective` (Korthikanti et al.: the attention "
      "core), `full`, `dots`, `attention`, `offload` (what `selective` keeps goes to pinned host memory): "
      "[gpu](gpu.md), [offload](offload.md)", choices=REMAT_POLICIES),
    K("model.attention", "auto", str, "attention kernel: `auto`, `xla`, `cudnn`, `pallas`: [gpu](gpu.md)"),
    K("model.loss_chunk", 1024, int, "sequence positions per chunk of the LM head + cross-entropy (the float32 "
      "logits are never whole)", lambda v: v >= 1, "an integer >= 1 (sequence positions per chunk of the loss)"),
    K("model.experts", 0, int, "routed experts per MoE layer; 0: a dense model: [moe](moe.md)",
      lambda v: v >= 0, "an integer >= 0 (0: dense)"),
    K("model.experts_per_token", 2, int, "MoE: experts each token is routed to (top-k)",
      lambda v: v >= 1, "an integer >= 1"),
    K("model.expert_mlp", 0, int, "MoE: each expert's SwiGLU hidden width; 0: = model.mlp",
      lambda v: v >= 0, "an integer >= 0 (0: = the MLP width)"),
    K("model.shared_experts", 0, int, "MoE: always-on experts (one MLP of shared_experts × expert_mlp), DeepSeek "
      "style", lambda v: v >= 0, "an integer >= 0"),
    K("model.router", "softmax", str, "MoE: `softmax` (Mixtral, Qwen3) or `sigmoid` (DeepSeek-V3) router scores",
      choices=ROUTERS),
    K("model.router_norm_topk", True, bool, "MoE: renormalise the k chosen weights to sum to 1 (Mixtral, Qwen3's "
      "`norm_topk_prob`)"),
    K("model.capacity_factor", 0.0, float, "MoE: each expert takes at most ceil(factor × seq_len × k / experts) "
      "tokens of a sequence, the rest skip the layer; 0: dropless", lambda v: 0 <= v < _INF, "a number >= 0 "
      "(0: dropless)"),
    K("model.moe_impl", "auto", str, "MoE: `buffers` (fixed slots per expert, one batched matmul), `ragged` (the "
      "choices sorted by expert, grouped matmuls over their counts: the active cost) or `auto` (the one the "
      "planner's cost model prices cheaper on `mesh.device`; `buffers` on CPUs): [moe](moe.md#implementations)", choices=("auto", "buffers", "ragged")),
    K("model.grouped_matmul", "auto", str, "MoE `ragged`: the grouped matmul kernel: `xla` (`jax.lax.ragged_dot`), "
      "`mosaic` (JAX's Hopper kernel, Mosaic GPU; bfloat16/float16) or `auto` (`mosaic` on Hopper GPUs where it "
      "applies): [moe](moe.md#implementations)", choices=("auto", "xla", "mosaic")),
    K("model.expert_buffer_factor", 0.0, float, "MoE `ragged` with expert parallelism: the rows a device sends to "
      "each expert device are at most ceil(factor × its choices / mesh.expert), the rest dropped and counted; 0: "
      "the worst case (all its choices), never dropping", lambda v: 0 <= v < _INF, "a number >= 0 (0: worst case)"),
    K("model.aux_loss", 0.0, float, "MoE: weight of the load-balancing loss (Switch/GShard, per sequence, summed over "
      "layers)", lambda v: 0 <= v < _INF, "a number >= 0"),
    K("model.router_z_loss", 0.0, float, "MoE: weight of the router z-loss (ST-MoE)", lambda v: 0 <= v < _INF,
      "a number >= 0"),
    K("model.router_bias_rate", 0.0, float, "MoE: DeepSeek-V3's aux-loss-free balancing: each step the expert "
      "choice bias moves by this toward even load; 0: off", lambda v: 0 <= v < _INF, "a number >= 0"),
    K("model.first_dense_layers", 0, int, "MoE: the first N layers are dense (DeepSeek)", lambda v: v >= 0,
      "an integer >= 0"),
    K("model.moe_every", 1, int, "MoE: layer i (0-based, over all layers) is MoE when i >= first_dense_layers and "
      "(i + 1) % moe_every == 0 (Qwen's `decoder_sparse_step`)", lambda v: v >= 1, "an integer >= 1"),
    K("model.sequence_parallel", False, bool, "Megatron sequence parallelism: the residual stream split on the "
      "sequence over `tensor`"),
)

RUN = (
    # train
    K("train.objective", "lm", str, "what trains: [finetune](finetune.md), [rl](rl.md)", choices=("lm", "dpo", "grpo")),
    K("train.steps", 1000, int, "optimizer steps to run to", lambda v: v >= 1, "an integer >= 1"),
    K("train.global_batch_size", 32, int, "sequences per optimizer step (= micro batch × microbatches × data)",
      lambda v: v >= 1, "an integer >= 1"),
    K("train.microbatches", 1, int, "gradient-accumulation microbatches; the pipeline's M",
      lambda v: v >= 1, "an integer >= 1"),
    K("train.seed", 0, int, "init, data order, dropout", lambda v: v >= 0, "an integer >= 0"),
    K("train.param_dtype", "float32", str, "master weights: `float32`, `bfloat16`, `float16`, or `float64` for "
      "reference runs (both dtypes, `JAX_ENABLE_X64=1`): "
      "[precision](precision.md)", choices=DTYPES),
    K("train.compute_dtype", "float32", str, "matmul dtype (same choices)", choices=DTYPES),
    K("train.nonfinite", "stop", str, "`stop` or `skip`: what a non-finite loss or gradient does (fp16 overflows go "
      "to the loss scale)", choices=("stop", "skip")),
    K("train.skip_steps", (), None, "steps (as logged: 1 is the first) whose update is skipped, to replay past bad "
      "data (Megatron's `--iterations-to-skip`); their batches are still read, the schedule counts applied updates"),
    K("train.skip_spikes", False, bool, "skip the update of a step whose loss or gradient norm is a spike: above the "
      "mean of the last `spike_window` applied steps by `spike_threshold` standard deviations: "
      "[precision](precision.md#loss-spikes)"),
    K("train.spike_window", 100, int, "applied steps the spike statistics cover (they are part of the train state "
      "and of checkpoints)", lambda v: v >= 1, "an integer >= 1 (applied steps in the window)"),
    K("train.spike_threshold", 6.0, float, "standard deviations above the window's mean that make a spike",
      lambda v: 0 < v < _INF, "a finite number > 0 (standard deviations)"),
    K("train.allow_batch_change", False, bool, "resume a checkpoint written with another `global_batch_size` (the "
      "data order continues)"),
    K("train.loss_scale_initial", 2.0 ** 16, float, "fp16 dynamic loss scaling (DeepSpeed's rule): initial scale"),
    K("train.loss_scale_window", 1000, int, "clean steps before the scale grows"),
    K("train.loss_scale_hysteresis", 2, int, "overflows tolerated before the scale drops"),
    K("train.loss_scale_min", 1.0, float, "the scale's floor"),
    K("train.loss_scale_factor", 2.0, float, "growth and drop factor"),
    K("train.loss_scale_patience", 10, int, "overflows in a row at the minimum scale before the run stops with an "
      "error"),
    K("train.loss_scale_max", 2.0 ** 24, float, "the scale's finite ceiling"),
    # optim
    K("optim.lr", 0.0003, float, "peak learning rate (AdamW)",
      lambda v: 0 <= v < _INF, "a finite number >= 0 (0: the params stay put)"),
    K("optim.min_lr_ratio", 0.1, float, "cosine decay to lr × min_lr_ratio at `decay_steps`, constant after",
      lambda v: 0 <= v <= 1, "a number in [0, 1] (the final LR is lr x min_lr_ratio)"),
    K("optim.warmup_steps", 100, int, "linear warmup"),
    K("optim.decay_steps", 1000, int, "end of the cosine decay"),
    K("optim.weight_decay", 0.1, float, "AdamW's decoupled weight decay, on matmul weights only (not biases, norms, "
      "embedding tables)",
      lambda v: 0 <= v < _INF, "a finite number >= 0"),
    K("optim.b1", 0.9, float, "AdamW β1", lambda v: 0 <= v < 1, "a number in [0, 1)"),
    K("optim.b2", 0.95, float, "AdamW β2", lambda v: 0 <= v < 1, "a number in [0, 1)"),
    K("optim.eps", 1e-08, float, "AdamW ε", lambda v: 0 < v < _INF, "a finite number > 0"),
    K("optim.clip_norm", 1.0, float, "global gradient-norm clip (inf: none)",
      lambda v: v > 0, "a number > 0 (the global-norm clip; inf: no clipping)"),
    K("optim.zero_stage", 0, int, "ZeRO stage 0–3: [layouts](layouts.md)", choices=(0, 1, 2, 3)),
    K("optim.offload", "none", str, "host offload (ZeRO-Offload): `none`, `optimizer` (AdamW's moments live in pinned "
      "host memory between steps), `params` (the parameters too): [offload](offload.md)", choices=OFFLOAD),
    # pipeline
    K("pipeline.schedule", "gpipe", str, "`gpipe`, `circular`, `1f1b` or `zb_h1`: [pipeline](pipeline.md)"),
    K("pipeline.virtual_stages", 1, int, "chunks per stage (circular, interleaved 1f1b)",
      lambda v: v >= 1, "an integer >= 1"),
    K("pipeline.remat", True, bool, "recompute each stage's layers in the backward pass (1f1b with False: keep the "
      "vjp residuals)"),
    K("pipeline.skip_bubbles", True, bool, "skip the compute of bubble slots (False: compute and discard, for "
      "measurements)"),
    # data
    K("data.sources", "shakespeare", str, "a source or a blend `\"0.3 A 0.7 B\"`: `shakespeare`, `text:GLOB`, "
      "`jsonl:GLOB`, `parquet:GLOB`, `megatron:PREFIX`, `tokens:DIR`: "
      "[data](data.md)",
      _NONEMPTY, "a source ('shakespeare', 'data/*.jsonl', ...) or a blend '0.3 A 0.7 B'"),
    K("data.text_field", "text", str, "the JSONL field / Parquet column holding a document's text",
      _NONEMPTY, "the JSONL field / Parquet column holding the text"),
    K("data.doc_separator", "", str,
      "text files: `\"\"` = one document per file; e.g. `\"\\n\\n\"` = split at blank lines"),
    K("data.tokenizer", "byte", str, "`byte`, `bpe` or a path to a `tokenizer.json`",
      _NONEMPTY, "'byte', 'bpe' or a path to a tokenizer.json"),
    K("data.bpe_vocab_size", 4096, int, "with `bpe`: its vocabulary",
      lambda v: v > 257, "an integer > 257 (256 bytes and the end-of-text token)"),
    K("data.bpe_sample_mb", 64, int, "with `bpe`: MB of text it trains on",
      lambda v: v >= 1, "an integer >= 1 (MB of text the BPE tokenizer trains on)"),
    K("data.val_fraction", 0.05, float, "the last fraction of each source's documents is its validation split",
      lambda v: 0 < v < 1, "a number in (0, 1) (that last fraction of the documents is the validation split)"),
    K("data.val_source", "", str, "a source (or blend) read whole as the validation split, e.g. "
      "`hfds:ORG/NAME:test`; `\"\"`: the last `data.val_fraction` of each source (which is then ignored)"),
    K("data.hf_data_files", "", str, "with an `hfds:` source: the glob of its files in the dataset repository (e.g. "
      "`data/train_sft-*.parquet`); `\"\"`: the split's files by the README's `configs` or the usual names"),
    K("data.val_split", "documents", str, "`documents` or `tokens` (the last fraction of the tokens, as older runs "
      "split)",
      choices=('documents', 'tokens')),
    K("data.packing", "auto", str, "`auto` (`bfd` for conversation, prompt/completion and preference records and DPO, "
      "else `concat`), `concat` (windows over the documents back to back), `documents` (the same windows, attention "
      "within each document) or `bfd` (whole sequences packed best-fit decreasing, padded) ([data](data.md#packing))",
      choices=('auto', 'concat', 'documents', 'bfd')),
    K("data.truncate", "right", str, "with `bfd`: a sequence longer than `model.seq_len` + 1 is cut (`right`) or "
      "left out (`skip`), counted in the log",
      choices=('right', 'skip')),
    K("data.loss_on", "auto", str, "the tokens the loss counts: `auto` (the assistant turns of `messages`, the "
      "completion of `prompt`/`completion`, all of `text`), `assistant`, `completion` or `all`",
      choices=('auto', 'assistant', 'completion', 'all')),
    K("data.chat_template", "", str, "a Jinja chat template file for conversations; `\"\"`: the tokenizer's "
      "(`chat_template.jinja` or `tokenizer_config.json` beside its tokenizer.json)"),
    K("data.image_field", "image", str, "vit: the Parquet column holding an image (Hugging Face's `{bytes, path}` "
      "struct, or bytes)", _NONEMPTY, "the Parquet column holding the images"),
    K("data.label_field", "label", str, "vit: the Parquet column holding an image's class (an integer)",
      _NONEMPTY, "the Parquet column holding the labels"),
    K("data.image_mean", "", str, "vit: each channel's mean, subtracted after rescaling to [0, 1], e.g. "
      "`\"0.485,0.456,0.406\"`; `\"\"`: the checkpoint's `preprocessor_config.json`, else 0.5"),
    K("data.image_std", "", str, "vit: each channel's standard deviation, divided by; `\"\"`: the checkpoint's, else "
      "0.5"),
    K("data.augment", "", str, "vit: training augmentation, `\"\"` (none), `crop` (pad by 1/8 of the size, crop a "
      "random window back), `flip` (mirror half the images) or `crop,flip`; the same on every layout",
      choices=("", "crop", "flip", "crop,flip")),
    K("data.workers", 1, int, "tokenizer processes", lambda v: v >= 1, "an integer >= 1 (tokenizer processes)"),
    K("data.unit_mb", 64, int, "MB of one big file per worker task",
      lambda v: v >= 1, "an integer >= 1 (MB of one file per worker task)"),
    K("data.prefetch", 4, int, "batches read ahead in a background thread",
      lambda v: v >= 0, "an integer >= 0 (batches read ahead; 0: none)"),
    K("data.cache_dir", "", str, "prepared data; `\"\"`: `$JAXPAR_CACHE` or `~/.cache/jaxpar`"),
    # xla
    K("xla.compile_cache", True, bool, "JAX's persistent compilation cache"),
    K("xla.compile_cache_dir", "", str, "its directory; `\"\"`: `<cache>/xla`"),
    K("xla.gpu_flags", "default", str,
      "XLA's GPU flags, GPU only: `default` (jaxpar's set), `\"\"` (none) or your own"),
    # checkpoint
    K("checkpoint.every_steps", 200, int, "save every N steps (and at the end, and on SIGTERM)",
      lambda v: v >= 1, "an integer >= 1"),
    K("checkpoint.keep", 3, int, "complete checkpoints kept",
      lambda v: v >= 1, "an integer >= 1 (the newest checkpoint is always kept)"),
    K("checkpoint.async_save", True, bool, "save in the background; a failure still stops the run"),
    # log
    K("log.every_steps", 10, int, "metrics every N steps", lambda v: v >= 1, "an integer >= 1"),
    K("log.profile_steps", (), None, "steps to capture a profiler trace of"),
    K("log.progress", True, bool, "a progress bar on the terminal"),
    K("log.wandb_project", "", str, "a Weights & Biases project to log to (process 0; `pip install 'jaxpar[wandb]'`); "
      "`\"\"`: off"),
    K("log.wandb_entity", "", str, "the W&B entity (user or team); `\"\"`: wandb's default"),
    K("log.wandb_name", "", str, "the W&B run's name; `\"\"`: the workdir's name"),
    K("log.wandb_tags", (), None, "the W&B run's tags (a tuple of strings)"),
    # eval
    K("eval.every_steps", 100, int, "validation every N steps", lambda v: v >= 1, "an integer >= 1"),
    K("eval.batches", 8, int, "validation batches", lambda v: v >= 1, "an integer >= 1"),
    K("eval.tasks", "", str, "lm-eval tasks run during training, comma-separated (`pip install 'jaxpar[eval]'`; "
      "[evaluation](evaluate.md)); `\"\"`: none"),
    K("eval.tasks_every_steps", 0, int, "run `eval.tasks` every N steps and at the last; 0: at the last step only",
      lambda v: v >= 0, "an integer >= 0"),
    K("eval.tasks_limit", 0.0, float, "documents per task (a fraction of each when < 1); 0: all",
      lambda v: v >= 0, "a number >= 0"),
    K("eval.tasks_fewshot", -1, int, "few-shot examples per prompt; -1: each task's own", lambda v: v >= -1,
      "an integer >= -1"),
    K("eval.tasks_include", "", str, "a folder of local task YAMLs for `eval.tasks` (lm-eval's `--include_path`)"),
    K("eval.tasks_chat", False, bool, "render `eval.tasks`' prompts with the checkpoint's chat template (lm-eval's "
      "`--apply_chat_template`)"),
    # dist
    K("dist.heartbeat_timeout_s", 60.0, float, "a process silent this long ends the job (exit 3): "
      "[multi-host](multihost.md)", lambda v: 0 < v < _INF, "a number of seconds > 0"),
    K("dist.step_timeout_s", -1.0, float, "no step boundary within this many seconds ends the job (exit 4); -1: auto "
      "(below); 0: off"),
    K("dist.step_timeout_min_s", 60.0, float, "auto step bound: at least this"),
    K("dist.step_timeout_factor", 20.0, float, "auto step bound: this × the slowest step so far (the first, "
      "compiling step is not timed); a GRPO round's sampling: this × the slowest round's ([multihost](multihost.md))"),
    K("dist.init_timeout_s", 300.0, float, "seconds for every process to join at start-up",
      lambda v: 0 < v < _INF, "a number of seconds > 0"),
)
