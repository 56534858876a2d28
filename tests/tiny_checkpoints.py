"""The generation tests' tiny random checkpoints (`tests/test_generate.py`, `tests/test_paged.py`): Llama, Qwen3,
GPT-2 and Qwen3-MoE with a 300-token vocabulary and a 64-token context, built with `transformers` and saved with a
byte tokenizer (nothing downloaded)."""
import torch
import transformers

from jaxpar.data import ByteTokenizer

V = 300
COMMON = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=V,
              max_position_embeddings=64, tie_word_embeddings=False, bos_token_id=0, eos_token_id=0)
KINDS = {
    "llama": lambda: transformers.LlamaForCausalLM(transformers.LlamaConfig(  # 4 layers: 2 stages x 2 virtual
        **{**COMMON, "num_hidden_layers": 4}, intermediate_size=48)),
    "qwen3": lambda: transformers.Qwen3ForCausalLM(transformers.Qwen3Config(**COMMON, intermediate_size=48,
                                                                            head_dim=16)),
    "gpt2": lambda: transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_embd=32, n_layer=2, n_head=4, vocab_size=V, n_positions=64, bos_token_id=0, eos_token_id=0)),
    "qwen3_moe": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        **COMMON, intermediate_size=48, head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24,
        norm_topk_prob=True)),
}
SAMPLED = dict(temperature=0.9, top_k=40, top_p=0.95, min_p=0.02)  # every filter on


def save(tmp_path_factory, kinds=tuple(KINDS)) -> dict:
    """{kind: (transformers model, directory)}: every tensor random (norm scales away from 1)."""
    out = {}
    for kind in kinds:
        torch.manual_seed(0)
        model = KINDS[kind]()
        with torch.no_grad():
            for name, p in model.named_parameters():
                p.copy_(torch.randn_like(p) * (0.3 if p.ndim == 1 else 0.1) + (1.0 if "norm" in name or "ln" in name
                                                                                  else 0.0))
        d = tmp_path_factory.mktemp(kind)
        model.eval().save_pretrained(d)
        ByteTokenizer.to_hf().save(str(d / "tokenizer.json"))
        out[kind] = (model, d)
    return out
