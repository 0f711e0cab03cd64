"""Tiny random-weight Hugging Face causal LMs built from configs (no hub access)."""

from __future__ import annotations

import torch

VOCAB = 128

# architecture -> config overrides; each keeps the feature it is here for
TINY = {
    "llama": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
    "mistral": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                    sliding_window=6),
    "qwen2": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
    "gpt2": dict(n_embd=32, n_layer=2, n_head=4, n_positions=256),
    "gpt_neox": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, rotary_pct=0.5),
    "phi": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, partial_rotary_factor=0.5),
    "opt": dict(hidden_size=32, ffn_dim=64, num_hidden_layers=2, num_attention_heads=4, word_embed_proj_dim=32,
                max_position_embeddings=256),
    "falcon": dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, new_decoder_architecture=False,
                   multi_query=True, alibi=False),
    "bloom": dict(hidden_size=32, n_layer=2, n_head=4),
    "gemma2": dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                   head_dim=8, sliding_window=5, attn_logit_softcapping=50.0, final_logit_softcapping=30.0,
                   query_pre_attn_scalar=8),
    "mpt": dict(d_model=32, n_layers=2, n_heads=4, expansion_ratio=2, max_seq_len=256),
}


def tiny_model(arch: str, attn_implementation: str = "eager", seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = dict(TINY[arch])
    kw.setdefault("vocab_size", VOCAB)
    if arch not in ("gpt2", "opt", "mpt", "bloom"):
        kw.setdefault("max_position_embeddings", 256)
    cfg = AutoConfig.for_model(arch, **kw)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attn_implementation)
    return model.eval()


def example_inputs(batch=2, seq=8, left_pad=(), seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    for row, n in enumerate(left_pad):
        mask[row, :n] = 0
    return ids, mask
