"""Checkpoints the CLI takes: Hugging Face model folders, saved ``torch.export`` programs, built-in demos."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import zipfile
from dataclasses import dataclass
from typing import Any, Optional

import torch

from pagedattn.report import first_line

log = logging.getLogger("pagedattn")

DEMO_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "demo")
DEMOS = {"demo": "zen", "zen": "zen"}  # name -> folder under pagedattn/demo


class CheckpointError(ValueError):
    """A checkpoint that cannot be used; the message says what is wrong and what to do."""


@dataclass
class Checkpoint:
    kind: str  # hf | pt2
    path: str
    model: Optional[torch.nn.Module] = None  # hf
    program: Optional[torch.export.ExportedProgram] = None  # pt2
    tokenizer: Any = None
    config: Any = None

    @property
    def seq2seq(self) -> bool:
        """An encoder-decoder (served with its encoder: ``rewrite-model`` keeps the checkpoint, not a program)."""
        return bool(getattr(self.config, "is_encoder_decoder", False)) and hasattr(self.model, "get_encoder")

    @property
    def architecture(self) -> str:
        if self.config is not None:
            return ",".join(getattr(self.config, "architectures", None) or [type(self.model).__name__])
        return "torch.export program"


def resolve(spec: str) -> tuple[str, str]:
    """(kind, path) for a checkpoint argument: a demo name, a model folder or a ``.pt2`` file."""
    if spec in DEMOS and not os.path.exists(spec):
        path = os.path.join(DEMO_DIR, DEMOS[spec])
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise CheckpointError(f"the built-in demo {spec!r} is missing from this install ({path}); "
                                  "reinstall pagedattn or run examples/train_demo.py")
        return "hf", path
    if not os.path.exists(spec):
        raise CheckpointError(f"checkpoint {spec!r} not found: give a Hugging Face model folder (config.json + "
                              f"safetensors), a .pt2 file saved by torch.export, or a built-in demo ({', '.join(DEMOS)})")
    if os.path.isdir(spec):
        if not os.path.isfile(os.path.join(spec, "config.json")):
            raise CheckpointError(f"{spec} is a folder without config.json: not a Hugging Face model folder "
                                  "(save one with model.save_pretrained(folder))")
        return "hf", spec
    if spec.endswith(".pt2") or zipfile.is_zipfile(spec):
        return "pt2", spec
    raise CheckpointError(f"{spec} is neither a model folder nor a .pt2 program")


def load_checkpoint(spec: str, dtype: Optional[torch.dtype] = None, attn_implementation: Optional[str] = None) -> Checkpoint:
    kind, path = resolve(spec)
    return _load_hf(path, dtype, attn_implementation) if kind == "hf" else _load_pt2(path)


def _load_hf(path: str, dtype: Optional[torch.dtype], attn_implementation: Optional[str]) -> Checkpoint:
    try:
        from transformers import AutoConfig
    except ImportError as e:
        raise CheckpointError("loading a Hugging Face checkpoint needs transformers: pip install 'pagedattn[hf]'") from e
    try:
        with open(os.path.join(path, "config.json")) as f:
            raw = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{path}/config.json is not valid JSON ({e}); re-save the checkpoint") from e
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except (ValueError, KeyError) as e:
        raise CheckpointError(f"unknown architecture {raw.get('model_type')!r} in {path}/config.json: this transformers "
                              "does not know it (upgrade transformers, or export the model with torch.export and pass the "
                              ".pt2)") from e
    if not _has_weights(path):
        raise CheckpointError(f"{path} has no weights (*.safetensors or pytorch_model.bin); save the model with "
                              "save_pretrained(folder)")
    try:
        with quiet_transformers():
            model = _auto_class(config).from_pretrained(path, local_files_only=True, dtype=dtype or "auto",
                                                        attn_implementation=attn_implementation)
    except ValueError as e:
        if "Unrecognized configuration class" in str(e):
            raise CheckpointError(f"{path} holds a {type(config).__name__} model, which has no causal-LM class: "
                                  "rewrite-model serves causal language models") from e
        raise CheckpointError(f"could not load the weights in {path}: {first_line(e)}") from e
    except Exception as e:  # corrupt or truncated weight files surface as many error types
        mismatch = _shape_mismatch(path, config)
        if mismatch:
            raise CheckpointError(f"could not load the weights in {path}: {mismatch}") from e
        raise CheckpointError(f"could not load the weights in {path}: {type(e).__name__}: {first_line(e)}; "
                              "the files may be corrupt or truncated, re-save the checkpoint") from e
    return Checkpoint("hf", path, model=model.eval(), tokenizer=load_tokenizer(path), config=config)


def _auto_class(config):
    """transformers' auto class for a config: speech-seq2seq and seq2seq models (encoder-decoders, served
    with their encoder) before causal LMs (which would load an encoder-decoder's decoder alone)."""
    import transformers
    from transformers.models.auto import modeling_auto as auto

    if getattr(config, "is_encoder_decoder", False):
        if config.model_type in auto.MODEL_FOR_SPEECH_SEQ_2_SEQ_MAPPING_NAMES:
            return transformers.AutoModelForSpeechSeq2Seq
        if config.model_type in auto.MODEL_FOR_SEQ_TO_SEQ_CAUSAL_LM_MAPPING_NAMES:
            return transformers.AutoModelForSeq2SeqLM
    return transformers.AutoModelForCausalLM


@contextlib.contextmanager
def quiet_transformers():
    """transformers' progress bars, load reports and warnings go to pagedattn's debug log."""
    import warnings

    from transformers.utils import logging as hf_logging

    bars = hf_logging.is_progress_bar_enabled()
    verbosity = hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            yield
    finally:
        hf_logging.set_verbosity(verbosity)
        if bars:
            hf_logging.enable_progress_bar()
    for w in caught:
        log.debug("transformers: %s: %s", w.category.__name__, w.message)


def _shape_mismatch(path: str, config) -> Optional[str]:
    """``weight X has shape A, the config expects B`` for the first safetensors weight whose shape differs
    from the model the config describes (read from the files' headers; nothing is loaded)."""
    try:
        from safetensors import safe_open
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            expected = {k: tuple(v.shape) for k, v in AutoModelForCausalLM.from_config(config).state_dict().items()}
        for name in sorted(f for f in os.listdir(path) if f.endswith(".safetensors")):
            with safe_open(os.path.join(path, name), framework="pt") as f:
                for key in f.keys():
                    shape = tuple(f.get_slice(key).get_shape())
                    want = expected.get(key)
                    if want is not None and want != shape:
                        return (f"weight {key} has shape {list(shape)}, the config expects {list(want)} "
                                f"(in {name}); the weights and config.json do not belong together")
    except Exception as e:  # no mismatch could be established: the caller reports the original error
        log.debug("shape check of %s failed: %s", path, e)
    return None


def _has_weights(path: str) -> bool:
    return any(f.endswith((".safetensors", ".bin")) for f in os.listdir(path))


def load_tokenizer(path: str):
    """The tokenizer a checkpoint folder carries (None: it has none, or it does not load; a warning says why)."""
    names = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
    if not any(os.path.exists(os.path.join(path, n)) for n in names):
        return None
    from transformers import AutoTokenizer

    try:
        with quiet_transformers():
            return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except Exception as e:  # a model without a usable tokenizer still rewrites: token ids in and out
        import logging

        logging.getLogger("pagedattn").warning("tokenizer in %s not loaded (%s); token ids only", path, first_line(e))
        return None


def _load_pt2(path: str) -> Checkpoint:
    """A user's ``torch.export`` program, read without running code from it (``pagedattn.safe_archive``);
    its stored example inputs (plain tensors and values only) drive the rewrite."""
    from pagedattn.safe_archive import UnsafeArchive, read_exported_program

    try:
        ep, extra = read_exported_program(path, example_inputs=True, extra_files=("pagedattn.json",))
    except UnsafeArchive as e:
        raise CheckpointError(f"refusing to load {path}: {e}") from e
    except Exception as e:
        raise CheckpointError(f"could not read {path} as a torch.export program: {type(e).__name__}: "
                              f"{first_line(e)}") from e
    if extra["pagedattn.json"]:
        raise CheckpointError(f"{path} is already a pagedattn program: use `rewrite-model run` or `inspect` on its folder")
    return Checkpoint("pt2", path, program=ep)
