"""Serve encoder-decoders: a tiny T5 on token ids and a tiny Whisper on audio features.

Builds random-weight models from configs (no download) and serves a batch of requests with sources
of different lengths through the paged engine. The engine runs each request's encoder once, when the
request is admitted. It writes the cross-attention K/V into blocks of their own and pages the decoder's
self-attention; T5's bucketed relative bias is served by its own position program. The example checks
the tokens against Hugging Face ``generate``, one request at a time, and prints them.

    python examples/serve_seq2seq.py
"""

import time

import torch
import transformers
from transformers import T5Config, T5ForConditionalGeneration, WhisperConfig, WhisperForConditionalGeneration

import pagedattn

NEW = 12


def t5() -> T5ForConditionalGeneration:
    cfg = T5Config(vocab_size=200, d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4, pad_token_id=0,
                   eos_token_id=1, decoder_start_token_id=0, initializer_factor=4.0)
    torch.manual_seed(0)
    return T5ForConditionalGeneration(cfg).eval()


def whisper() -> WhisperForConditionalGeneration:
    cfg = WhisperConfig(vocab_size=200, d_model=64, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4,
                        decoder_attention_heads=4, encoder_ffn_dim=128, decoder_ffn_dim=128, num_mel_bins=16,
                        max_source_positions=32, max_target_positions=64, pad_token_id=1, bos_token_id=0,
                        eos_token_id=2, decoder_start_token_id=3, suppress_tokens=[], begin_suppress_tokens=[],
                        init_std=0.2)
    torch.manual_seed(0)
    return WhisperForConditionalGeneration(cfg).eval()


def reference(model, request) -> list[int]:
    """Hugging Face ``generate`` for one request: the decoder tokens after the start token (Whisper's
    ``generate`` returns those alone already)."""
    speech = isinstance(request, dict)
    inputs = {"input_features": request["input_features"][None]} if speech else {"input_ids": torch.tensor([request])}
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=NEW, do_sample=False, num_beams=1)[0].tolist()
    return out if speech else out[1:]


def serve(name: str, model, requests: list) -> int:
    t0 = time.perf_counter()
    # compile=False keeps this example quick; the default compiles the encoder and the decoder step first
    engine = pagedattn.PagedEngine(model, block_size=8, num_blocks=256, max_num_tokens=256, compile=False,
                                   progress=False)
    outputs = engine.generate(requests, max_new_tokens=NEW)
    elapsed = time.perf_counter() - t0
    same = 0
    for request, out in zip(requests, outputs):
        ref = reference(model, request)
        same += out == ref
        what = f"{request['input_features'].shape[-1]} frames" if isinstance(request, dict) else \
            f"{len(request)} tokens"
        print(f"{name}: source of {what:>10} -> {out}{'' if out == ref else f'  (HF: {ref})'}")
    print(f"{name}: {same}/{len(requests)} requests generate the same tokens as Hugging Face generate "
          f"({elapsed:.1f} s with start-up; encoder run {engine.stats['encoder_runs']} times for "
          f"{engine.stats['encoder_requests']} requests)")
    return same == len(requests)


def main() -> None:
    transformers.logging.set_verbosity_error()  # generate's notes on its own arguments
    g = torch.Generator().manual_seed(1)
    texts = [torch.randint(2, 200, (n,), generator=g).tolist() for n in (5, 23, 11, 40, 3)]
    audio = [{"input_features": torch.randn(16, 64, generator=g)} for _ in range(3)]  # [mels, 2 * positions]
    ok = serve("t5", t5(), texts) & serve("whisper", whisper(), audio)
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
