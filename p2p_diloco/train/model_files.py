"""A trained model out of p2p-diloco and back in: a Hugging Face folder, safetensors or torch, with what built it.

Every export holds `p2p_diloco.json`: the run's model and data settings (so the built-in GPT and `module:` models
can be rebuilt and `p2p-diloco eval` cuts the same held-out split the islands logged), the tokenizer it was
trained with, and where the weights came from (run, outer step, anchor digest). An `hf` export is a
`save_pretrained` folder that plain transformers loads (`AutoModelForCausalLM.from_pretrained(OUT)`), with the
tokenizer files beside it (`AutoTokenizer.from_pretrained(OUT)`).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import tempfile
from pathlib import Path
from typing import Any

import torch
from torch import nn

from p2p_diloco.config import PeerConfig, load_config
from p2p_diloco.errors import UserError
from p2p_diloco.files import atomic_write
from p2p_diloco.train.model import build_model

SPEC_FILE = "p2p_diloco.json"
FORMATS = ("hf", "safetensors", "torch")
WEIGHTS = {"safetensors": "model.safetensors", "torch": "model.pt"}
"""The weights file of each non-hf format."""


class ExportError(UserError, ValueError):
    """A model that cannot be written or read back; the message says what to fix."""


def describe(config: PeerConfig) -> dict[str, Any]:
    """What rebuilds this run's model and its eval split elsewhere (JSON-able, paths made absolute)."""
    model, data = dataclasses.asdict(config.model), dataclasses.asdict(config.data)
    for section, key in ((model, "config"), (model, "init_from"), (data, "path")):
        if section[key]:
            section[key] = str(Path(section[key]).expanduser().resolve())
    if data["tokenizer"] != "bytes":
        data["tokenizer"] = str(Path(data["tokenizer"]).expanduser().resolve())
    spec = {"model": model, "data": data, "train": {"seed": config.train.seed, "batch_size": config.train.batch_size}}
    spec["tokenizer_vocabulary"] = _vocabulary_of(data["tokenizer"], data["eos_token"])
    if config.model.kind == "hf":
        from p2p_diloco.train.hf_model import load_hf_config

        spec["hf_config"] = load_hf_config(config.model.config).to_dict()
    return spec


@functools.lru_cache(maxsize=4)
def _vocabulary_of(source: str, eos_token: str | None) -> str:
    from p2p_diloco.train.tokenizer import load_tokenizer

    return vocabulary_digest(load_tokenizer(source, eos_token))


def vocabulary_digest(tokenizer: Any) -> str:
    """'bytes', or a short hash of the tokenizer's token-to-id table (the same for a tokenizer.json and its export)."""
    backend = getattr(tokenizer, "backend", None)
    if backend is None:
        return "bytes"
    vocab = backend.get_vocab(with_added_tokens=True) if hasattr(backend, "get_vocab_size") else backend.get_vocab()
    return hashlib.blake2b(json.dumps(sorted(vocab.items())).encode(), digest_size=8).hexdigest()


def spec_config(spec: dict[str, Any], overrides: dict[str, Any] | None = None) -> PeerConfig:
    """The PeerConfig a spec describes (model, data and the fields of train it names), then `overrides`."""
    given = {f"{section}.{key}": value for section in ("model", "data") for key, value in spec[section].items()}
    given |= {f"train.{key}": value for key, value in spec["train"].items()}
    given["model.init_from"] = None  # the weights come from the export or checkpoint, not the run's start
    return load_config(None, given | (overrides or {}))


def default_format(spec: dict[str, Any]) -> str:
    """hf for transformers models, safetensors for the others."""
    return "hf" if spec["model"]["kind"] == "hf" else "safetensors"


def model_from_spec(spec: dict[str, Any]) -> nn.Module:
    """A freshly built model of the spec (weights to be loaded), even where the run's config.json is not."""
    model = dict(spec["model"], init_from=None)
    with tempfile.TemporaryDirectory(prefix="p2p-diloco-config-") as folder:
        if model["kind"] == "hf" and not (model["config"] and Path(model["config"]).exists()):
            (Path(folder) / "config.json").write_text(json.dumps(spec["hf_config"]))
            model["config"] = folder
        # The data need not be on this machine to build the model.
        config = spec_config(
            {**spec, "model": model}, {"data.path": None, "data.tokenizer": "bytes", "data.eos_token": None}
        )
        return build_model(config.model, config.train.seed)


def load_flat(model: nn.Module, flat: torch.Tensor) -> None:
    """Copy a flat vector (an island's anchor) into the model's parameters, in their order."""
    total = sum(parameter.numel() for parameter in model.parameters())
    if flat.numel() != total:
        raise ExportError(f"the state holds {flat.numel()} values but the model has {total} parameters")
    offset = 0
    with torch.no_grad():
        for parameter in model.parameters():
            count = parameter.numel()
            parameter.copy_(flat[offset : offset + count].view_as(parameter))
            offset += count


def write_model(model: nn.Module, spec: dict[str, Any], out: Path, fmt: str, origin: dict[str, Any]) -> Path:
    """Write `model` to the folder `out` in `fmt` with its p2p_diloco.json; returns the folder."""
    if fmt not in FORMATS:
        raise ExportError(f"--format {fmt!r}: use one of {', '.join(FORMATS)}")
    if out.exists() and not out.is_dir():
        raise ExportError(f"--out {out} is a file; give a folder (it is created if missing)")
    out.mkdir(parents=True, exist_ok=True)
    record = {**spec, "format": fmt, "origin": origin}
    if fmt == "hf":
        if spec["model"]["kind"] != "hf":
            raise ExportError(
                f"--format hf needs a transformers model; this is a {spec['model']['kind']!r} model: "
                "use --format safetensors or torch"
            )
        model.model.save_pretrained(str(out), safe_serialization=True)
        record["tokenizer_files"] = _save_tokenizer(spec["data"], out)
    elif fmt == "safetensors":
        from safetensors.torch import save_model

        save_model(model, str(out / WEIGHTS[fmt]))  # save_model keeps tied weights once
    else:
        torch.save(model.state_dict(), out / WEIGHTS[fmt])
    atomic_write(out / SPEC_FILE, (json.dumps(record, indent=2, default=str) + "\n").encode())
    return out


def _save_tokenizer(data: dict[str, Any], out: Path) -> bool:
    """Save the run's tokenizer as transformers tokenizer files in `out` (False for bytes, which needs none)."""
    source = data["tokenizer"]
    if source == "bytes":
        return False
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from p2p_diloco.train.tokenizer import load_tokenizer

    path = Path(source)
    if not path.exists():
        raise ExportError(f"the run's tokenizer {source} is not on this machine; pass --tokenizer PATH to its copy")
    if path.is_dir():
        tokenizer = AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    else:
        ours = load_tokenizer(source, data.get("eos_token"))
        eos = ours.backend.id_to_token(ours.eos_id)
        tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(path), eos_token=eos)
    tokenizer.save_pretrained(str(out))
    return True


def read_spec(folder: Path) -> dict[str, Any] | None:
    """The p2p_diloco.json of an export (None for a plain transformers folder)."""
    path = folder / SPEC_FILE
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as error:
        raise ExportError(f"{path} cannot be read ({error}); export the model again") from None


def read_model(folder: Path) -> tuple[nn.Module, dict[str, Any] | None]:
    """The model of an export or of a plain transformers model folder, and its spec (None when there is none)."""
    if not folder.is_dir():
        raise ExportError(f"--model {folder} is not a folder; give the --out of p2p-diloco export or pull")
    spec = read_spec(folder)
    fmt = spec["format"] if spec else "hf" if (folder / "config.json").is_file() else None
    if fmt is None:
        raise ExportError(f"--model {folder} holds neither {SPEC_FILE} nor config.json; run p2p-diloco export first")
    if fmt == "hf":
        from p2p_diloco.config import ModelConfig
        from p2p_diloco.train.hf_model import build_hf_model

        return build_hf_model(ModelConfig(kind="hf", config=str(folder), init_from=str(folder)), 0), spec
    model = model_from_spec(spec)
    weights = folder / WEIGHTS[fmt]
    try:
        if fmt == "safetensors":
            from safetensors.torch import load_model

            load_model(model, str(weights))
        else:
            model.load_state_dict(torch.load(weights, map_location="cpu", weights_only=True))
    except Exception as error:  # safetensors and torch raise their own types for damaged or foreign files
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ExportError(f"{weights} cannot be loaded into the model {SPEC_FILE} describes ({first})") from None
    return model, spec
