"""Reading ``.pt2`` archives (``torch.export.save``) without running code from the file.

``torch.export.load`` unpickles what an archive asks it to: example inputs (retried with
``weights_only=False`` when the safe load fails), weights and constants marked as pickled, custom
and opaque objects. Parsing the graph evaluates its symbolic size expressions with ``sympy.sympify``
(``eval`` underneath), and rebuilding pytree specs imports the modules they name. This module reads
the same archives but refuses, with a message naming the entry, anything that would run code:

- pickled weights, constants, custom or opaque objects, and the legacy pickled formats;
- a size expression that is not plain arithmetic over size symbols and torch's sympy functions;
- a pytree spec naming a type that is not registered already, unless it is a Hugging Face output
  class (``transformers.modeling_outputs`` or ``transformers.models.<name>.modeling_<name>``,
  imported from the installed transformers), or naming enums / ``defaultdict`` factories;
- example inputs are read with ``torch.load(weights_only=True)`` only, and only when asked for.
"""

from __future__ import annotations

import importlib
import io
import json
import re
import warnings
import zipfile
from typing import Any, Iterator, Optional

import torch
from torch.utils import _pytree as pytree

__all__ = ["UnsafeArchive", "read_exported_program", "check_treespec", "load_treespec"]

_MODEL = "model"


class UnsafeArchive(ValueError):
    """An archive that cannot be read without running code from it (or is not one at all)."""


# ----------------------------------------------------------------------- pytree specs

# modules a spec may name for its output classes (imported from the installed package to register them)
_OUTPUT_MODULES = re.compile(r"transformers\.(modeling_outputs|models\.[a-z0-9_]+\.modeling_[a-z0-9_]+)")


def _registered_types() -> set[str]:
    return set(pytree.SERIALIZED_TYPE_TO_PYTHON_TYPE)


def _output_class(type_name: str) -> Optional[type]:
    """A Hugging Face output class named by a spec, imported from the installed transformers."""
    module, _, cls = type_name.rpartition(".")
    if not _OUTPUT_MODULES.fullmatch(module) or not cls.isidentifier():
        return None
    try:
        from transformers.utils import ModelOutput

        obj = getattr(importlib.import_module(module), cls, None)
    except ImportError:
        return None
    return obj if isinstance(obj, type) and issubclass(obj, ModelOutput) else None


def _walk_contexts(obj: Any) -> Iterator[dict]:
    if isinstance(obj, dict):
        yield obj
        for v in obj.values():
            yield from _walk_contexts(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _walk_contexts(v)


def check_treespec(serialized: str, where: str) -> None:
    """Refuse a serialized pytree spec whose loading would import or evaluate anything but
    registered types and Hugging Face output classes (which this registers)."""
    try:
        protocol, root = json.loads(serialized)
    except (ValueError, TypeError) as e:
        raise UnsafeArchive(f"{where}: the pytree spec is not valid JSON ({e})") from e
    if protocol != 1:
        raise UnsafeArchive(f"{where}: pytree spec protocol {protocol!r} is not supported")
    stack = [root]
    while stack:
        node = stack.pop()
        if not isinstance(node, dict) or not {"type", "context", "children_spec"} <= set(node):
            raise UnsafeArchive(f"{where}: malformed pytree spec")
        t = node["type"]
        if t is not None and t not in _registered_types() and _output_class(str(t)) is None:
            raise UnsafeArchive(f"{where}: the spec names type {t!r}, which is neither registered with pytree nor "
                                "a Hugging Face output class; loading it would import code named by the file "
                                "(import and register that class first if you trust it)")
        if t == "collections.defaultdict":
            ctx = json.loads(node["context"]) if isinstance(node["context"], str) else node["context"]
            if not isinstance(ctx, dict) or ctx.get("default_factory_module") != "builtins":
                raise UnsafeArchive(f"{where}: a defaultdict in the spec names a factory outside builtins")
        ctx = node["context"]
        if isinstance(ctx, str):
            try:
                parsed = json.loads(ctx)
            except ValueError:
                parsed = None
            if any("__enum__" in d for d in _walk_contexts(parsed)):
                raise UnsafeArchive(f"{where}: the spec's context names an enum class (loading it imports its module)")
        stack.extend(node["children_spec"])


def load_treespec(serialized: Optional[str], where: str):
    """``treespec_loads`` after :func:`check_treespec`; ``None`` for no spec."""
    if not serialized:
        return None
    check_treespec(serialized, where)
    return pytree.treespec_loads(serialized)


# -------------------------------------------------------------------- size expressions

_TOKEN = re.compile(r"\s*(?:(\d+\.\d*(?:e[+-]?\d+)?|\d+)|([A-Za-z_][A-Za-z_0-9]*)|'([a-z]+\d+)'|(\*\*|//|[-+*/%(),<>=!]=?))")
# sympy names a torch size expression may use besides torch's own sympy functions
_SYMPY_NAMES = {"Max", "Min", "Eq", "Ne", "Lt", "Le", "Gt", "Ge", "And", "Or", "Not", "Abs", "floor", "ceiling",
                "oo", "zoo", "nan", "True", "False", "Integer", "Rational", "Float", "sqrt", "Piecewise", "Mul",
                "Add", "Pow", "int_oo", "Xor", "ITE", "Symbol",
                # assumptions in sympy's srepr of a symbol: Symbol('s0', positive=True, integer=True)
                "positive", "negative", "nonnegative", "nonpositive", "integer", "real", "finite", "zero",
                "nonzero", "even", "odd", "rational", "commutative", "infinite", "extended_real"}
_SYMBOL = re.compile(r"[a-z]+\d+")


def _torch_sympy_functions() -> set[str]:
    import torch.utils._sympy.functions as f

    return {n for n in dir(f) if n[:1].isupper()}


def check_expression(expr: str, where: str, allowed: Optional[set[str]] = None) -> None:
    """Refuse a size expression that is not arithmetic over size symbols (``s0``, ``u3``, also as
    ``Symbol('s0', integer=True)``) and known functions: sympy evaluates it with ``eval``."""
    allowed = allowed if allowed is not None else _SYMPY_NAMES | _torch_sympy_functions()
    pos = 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if not m or m.end() == pos:
            if expr[pos:].strip() == "":
                return
            raise UnsafeArchive(f"{where}: size expression {expr[:80]!r} holds {expr[pos:pos + 10]!r}, "
                                "which is not arithmetic")
        name = m.group(2)
        if name is not None and name not in allowed and not _SYMBOL.fullmatch(name):
            raise UnsafeArchive(f"{where}: size expression {expr[:80]!r} names {name!r}")
        pos = m.end()


def _expressions(obj: Any) -> Iterator[str]:
    """Every ``expr_str`` in a deserialized JSON document."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k == "expr_str" and isinstance(v, str):
                yield v
            else:
                yield from _expressions(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _expressions(v)


def _specs(obj: Any) -> Iterator[tuple[str, str]]:
    """Every serialized pytree spec (``in_spec`` / ``out_spec``) in a deserialized JSON document."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k in ("in_spec", "out_spec") and isinstance(v, str):
                yield k, v
            else:
                yield from _specs(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _specs(v)


# -------------------------------------------------------------------------- the archive


def _payloads(config: dict, kind: str, where: str) -> None:
    """Refuse pickled entries of a weights or constants config."""
    from torch.export.pt2_archive.constants import TENSOR_CONSTANT_FILENAME_PREFIX, WEIGHT_FILENAME_PREFIX

    prefix = WEIGHT_FILENAME_PREFIX if kind == "weights" else TENSOR_CONSTANT_FILENAME_PREFIX
    for fqn, meta in (config.get("config") or {}).items():
        if not isinstance(meta, dict) or meta.get("use_pickle", True) or meta.get("tensor_meta") is None:
            raise UnsafeArchive(f"{where}: {kind[:-1]} {fqn!r} is stored pickled (loading it would run pickle)")
        if not str(meta.get("path_name", "")).startswith(prefix):
            raise UnsafeArchive(f"{where}: {kind[:-1]} {fqn!r} is a {meta.get('path_name')!r} object, not a tensor "
                                "(custom and opaque objects are unpickled on load)")


def read_exported_program(path: str, *, example_inputs: bool = False,
                          extra_files: tuple[str, ...] = ()) -> tuple[torch.export.ExportedProgram, dict[str, str]]:
    """Read a ``torch.export.save`` archive without running code from it.

    Returns the program and the requested extra files (missing ones as ``""``). ``example_inputs``:
    read the stored example inputs too (``torch.load(weights_only=True)``, nothing else); otherwise
    the program carries none. Raises :class:`UnsafeArchive` naming what it refuses.
    """
    from torch._export.serde import schema
    from torch._export.serde.serialize import ExportedProgramDeserializer, _bytes_to_dataclass
    from torch.export.pt2_archive import _package as pkg
    from torch.export.pt2_archive.constants import (
        ARCHIVE_VERSION_PATH,
        ARCHIVE_VERSION_VALUE,
        CONSTANTS_CONFIG_FILENAME_FORMAT,
        CONSTANTS_DIR,
        EXTRA_DIR,
        MODELS_FILENAME_FORMAT,
        SAMPLE_INPUTS_FILENAME_FORMAT,
        WEIGHTS_CONFIG_FILENAME_FORMAT,
        WEIGHTS_DIR,
    )

    if not zipfile.is_zipfile(path):
        raise UnsafeArchive(f"{path} is not a .pt2 archive (not a zip file)")
    with pkg.PT2ArchiveReader(path) as reader:
        names = set(reader.get_file_names())
        if ARCHIVE_VERSION_PATH not in names or reader.read_string(ARCHIVE_VERSION_PATH) != ARCHIVE_VERSION_VALUE:
            raise UnsafeArchive(f"{path} is not a torch.export archive of this torch's version "
                                f"(save it again with torch {torch.__version__.split('+')[0]})")
        for legacy in (f"{WEIGHTS_DIR}{_MODEL}.pt", f"{CONSTANTS_DIR}{_MODEL}.pt"):
            if legacy in names:
                raise UnsafeArchive(f"{path}: {legacy} is a pickle (torch's legacy format); save the program again")
        model_file = MODELS_FILENAME_FORMAT.format(_MODEL)
        if model_file not in names:
            raise UnsafeArchive(f"{path} holds no program named {_MODEL!r}")
        doc = json.loads(reader.read_string(model_file))
        allowed = _SYMPY_NAMES | _torch_sympy_functions()
        for expr in _expressions(doc):
            check_expression(expr, path, allowed)
        for key in (doc.get("range_constraints") or {}):
            check_expression(str(key), path, allowed)
        for which, spec in _specs(doc):
            check_treespec(spec, f"{path} ({which})")
        configs = {}
        for kind, fmt in (("weights", WEIGHTS_CONFIG_FILENAME_FORMAT), ("constants", CONSTANTS_CONFIG_FILENAME_FORMAT)):
            cfg_file = fmt.format(_MODEL)
            configs[kind] = json.loads(reader.read_string(cfg_file)) if cfg_file in names else {"config": {}}
            _payloads(configs[kind], kind, path)
        # every entry checked: what remains are raw tensor payloads
        state_dict = pkg._load_state_dict(reader, _MODEL)
        constants = pkg._load_constants(reader, _MODEL)
        inputs = None
        if example_inputs:
            inputs = _example_inputs(reader, SAMPLE_INPUTS_FILENAME_FORMAT.format(_MODEL), names, path)
        serialized = _bytes_to_dataclass(schema.ExportedProgram, reader.read_bytes(model_file))
        extra = {}
        for name in extra_files:
            record = f"{EXTRA_DIR}{name}"
            extra[name] = reader.read_string(record) if record in names else ""
    ep = ExportedProgramDeserializer().deserialize(serialized, state_dict, constants, inputs)
    return ep, extra


def _example_inputs(reader, record: str, names: set[str], path: str):
    if record not in names:
        return None
    try:
        # torch's notes on a pickle it may not read (another protocol) would only precede the one line below
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            inputs = torch.load(io.BytesIO(reader.read_bytes(record)), weights_only=True)
    except Exception as e:
        raise UnsafeArchive(f"{path}: its example inputs are not plain tensors and values "
                            f"(torch.load(weights_only=True) refused them: {str(e).splitlines()[0][:200]})") from e
    if not (isinstance(inputs, tuple) and len(inputs) == 2):
        raise UnsafeArchive(f"{path}: its example inputs are not an (args, kwargs) pair")
    return inputs

