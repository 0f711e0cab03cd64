"""Tiny random-weight encoder-decoders (Hugging Face seq2seq and speech-seq2seq, and a hand-written
``nn.Transformer``) and the references their served tokens are checked against."""

from __future__ import annotations

import math
from typing import Sequence

import torch
from torch import nn

SRC_VOCAB = 96
_LAYERS = dict(encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
               encoder_ffn_dim=64, decoder_ffn_dim=64, d_model=32)
_IDS = dict(pad_token_id=1, bos_token_id=0, eos_token_id=2, decoder_start_token_id=2)

# architecture -> (model class name, config class name, config overrides)
SEQ2SEQ = {
    "bart": ("BartForConditionalGeneration", "BartConfig", dict(**_LAYERS, **_IDS, max_position_embeddings=128,
                                                                  init_std=0.2)),
    "mbart": ("MBartForConditionalGeneration", "MBartConfig", dict(**_LAYERS, **_IDS, max_position_embeddings=128,
                                                                     init_std=0.2)),
    "marian": ("MarianMTModel", "MarianConfig", dict(**_LAYERS, pad_token_id=1, eos_token_id=2,
                                                      decoder_start_token_id=1, decoder_vocab_size=SRC_VOCAB,
                                                      max_position_embeddings=128, init_std=0.2)),
    "pegasus": ("PegasusForConditionalGeneration", "PegasusConfig", dict(**_LAYERS, pad_token_id=0, eos_token_id=1,
                                                                           decoder_start_token_id=0,
                                                                           max_position_embeddings=128, init_std=0.2)),
    "t5": ("T5ForConditionalGeneration", "T5Config", dict(d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4,
                                                           relative_attention_num_buckets=8,
                                                           relative_attention_max_distance=16, pad_token_id=0,
                                                           eos_token_id=1, decoder_start_token_id=0,
                                                           initializer_factor=4.0)),
    "whisper": ("WhisperForConditionalGeneration", "WhisperConfig",
                dict(**_LAYERS, num_mel_bins=16, max_source_positions=12, max_target_positions=64, pad_token_id=1,
                     bos_token_id=0, eos_token_id=2, decoder_start_token_id=3, suppress_tokens=[],
                     begin_suppress_tokens=[], init_std=0.2)),
}


def tiny_seq2seq(arch: str, seed: int = 0, **overrides):
    import transformers

    model_cls, cfg_cls, kw = SEQ2SEQ[arch]
    cfg = getattr(transformers, cfg_cls)(vocab_size=SRC_VOCAB, **{**kw, **overrides})
    torch.manual_seed(seed)
    return getattr(transformers, model_cls)(cfg).eval()


def sources(seed: int = 0, lengths: Sequence[int] = (5, 17, 9, 30, 3, 12)) -> list[list[int]]:
    """Encoder inputs of ragged lengths (ids from 3 up: no special tokens)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, SRC_VOCAB, (n,), generator=g).tolist() for n in lengths]


def features(model, n: int, seed: int = 0) -> list[torch.Tensor]:
    """``n`` Whisper feature windows ``[mels, 2 * max_source_positions]``."""
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    return [torch.randn(cfg.num_mel_bins, 2 * cfg.max_source_positions, generator=g) for _ in range(n)]


def hf_seq2seq_generate(model, inputs: Sequence, new: int) -> list[list[int]]:
    """Hugging Face greedy ``generate`` one request at a time: the decoder tokens after the start token
    (Whisper's ``generate`` returns those alone already)."""
    out = []
    for x in inputs:
        speech = isinstance(x, torch.Tensor) and x.dim() == 2
        kw = {"input_features": x[None]} if speech else {"input_ids": torch.tensor([list(x)])}
        with torch.no_grad():
            g = model.generate(**kw, max_new_tokens=new, do_sample=False, num_beams=1)
        out.append(g[0].tolist() if speech else g[0, 1:].tolist())
    return out


class TinyTransformer(nn.Module):
    """A hand-written encoder-decoder over ``nn.Transformer`` (batch first, learned positions)."""

    def __init__(self, vocab: int = SRC_VOCAB, d: int = 32, heads: int = 4, layers: int = 2, max_len: int = 128):
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(max_len, d)
        self.core = nn.Transformer(d, heads, layers, layers, 64, dropout=0.0, batch_first=True)
        self.head = nn.Linear(d, vocab)
        self.scale = math.sqrt(d)

    def encode(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        x = self.embed(input_ids) * self.scale + self.pos(pos)
        return self.core.encoder(x, src_key_padding_mask=attention_mask == 0)

    def decode(self, input_ids: torch.Tensor, encoder_hidden_states: torch.Tensor,
               position_ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids) * self.scale + self.pos(position_ids)
        T = input_ids.shape[1]
        causal = nn.Transformer.generate_square_subsequent_mask(T, device=input_ids.device)
        return self.head(self.core.decoder(x, encoder_hidden_states, tgt_mask=causal, tgt_is_causal=True))


class EncoderOf(nn.Module):
    def __init__(self, model: TinyTransformer):
        super().__init__()
        self.model = model

    def forward(self, input_ids, attention_mask):
        return self.model.encode(input_ids, attention_mask)


class DecoderOf(nn.Module):
    def __init__(self, model: TinyTransformer):
        super().__init__()
        self.model = model

    def forward(self, input_ids, encoder_hidden_states, position_ids):
        return self.model.decode(input_ids, encoder_hidden_states, position_ids)


def transformer_greedy(model: TinyTransformer, srcs: Sequence[Sequence[int]], new: int, start: int,
                       eos: int) -> list[list[int]]:
    """The hand-written model's own greedy loop (no cache): the reference for its served tokens."""
    out = []
    with torch.no_grad():
        for s in srcs:
            src = torch.tensor([list(s)])
            memory = model.encode(src, torch.ones_like(src))
            ids = [start]
            for _ in range(new):
                t = torch.tensor([ids])
                tok = int(model.decode(t, memory, torch.arange(len(ids))[None])[0, -1].argmax())
                ids.append(tok)
                if tok == eos:
                    break
            out.append(ids[1:])
    return out
