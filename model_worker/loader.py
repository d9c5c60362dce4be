"""Fill a model's weights from the safetensors files of a HF model directory, a file at a time.

Each checkpoint tensor is read with pread into a temporary holding just the rows this rank keeps,
copied where it belongs, and dropped. The files are not memory-mapped: safetensors' safe_open
maps a whole shard, and the pages read through that mapping count in this process's RSS until
the shard is closed (4-5 GB at a time for an 8B model's shards); read with pread they stay in the
page cache, which the kernel reclaims as it needs.
"""

from __future__ import annotations

import itertools
import json
import logging
import math
import os
import struct
import time
from pathlib import Path
from typing import Any

import torch

from radixserve.model_worker.host_memory import release_freed_memory
from radixserve.model_worker.layers import LoadableModule, ParallelLMHead
from radixserve.model_worker.models.base import CausalLM

logger = logging.getLogger(__name__)

_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
    "I8": torch.int8,
    "U8": torch.uint8,
    "I16": torch.int16,
    "I32": torch.int32,
    "I64": torch.int64,
    "BOOL": torch.bool,
}
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit


class WeightLoadError(RuntimeError):
    pass


def loadable_modules(model: CausalLM) -> dict[str, LoadableModule]:
    return {name: m for name, m in model.named_modules() if isinstance(m, LoadableModule)}


def load_weights(model: CausalLM, model_dir: str) -> None:
    """Copy every checkpoint tensor into this rank's shard of the weights it maps to, logging a
    line per file.

    Fails, naming the weights, when a checkpoint tensor maps to no weight or when a weight (or a
    piece of a fused one) is never filled.
    """
    modules = loadable_modules(model)
    pending = {
        (f"{module_name}.{name}", piece)
        for module_name, module in modules.items()
        for name in module.loadable_names()
        for piece in range(module.num_pieces)
    }
    weight_names = {name for name, _ in pending}
    unexpected: list[str] = []
    files = safetensors_files(Path(model_dir))
    found_in: dict[str, str] = {}  # checkpoint name -> its file: a second copy is refused
    started = time.monotonic()

    def loads_head(ckpt_name: str) -> bool:
        return any(
            isinstance(modules.get(name.rpartition(".")[0]), ParallelLMHead)
            for name, _ in model.checkpoint_targets(ckpt_name)
        )

    # The LM head first, from whichever file holds it: the plain copy oneDNN reorders it from
    # then lies beside little else. Loaded last (an 8B's is in its last file), it was the load's
    # peak: +1.2 GB over the 8B's weights.
    for head_pass, (number, path) in itertools.product((True, False), enumerate(files, 1)):
        with SafetensorsFile(path) as file:
            tensors = [(n, t) for n, t in file.tensors() if loads_head(n) == head_pass]
            if not tensors:
                continue
            logger.info(
                "Loading weights%s: file %d/%d (%s, %.2f GB)",
                " (the LM head first)" if head_pass else "",
                number,
                len(files),
                path.name,
                file.nbytes / 1e9,
            )
            for ckpt_name, tensor in tensors:
                first = found_in.setdefault(ckpt_name, path.name)
                if first != path.name:
                    raise WeightLoadError(
                        f"checkpoint weight {ckpt_name} is in two files: {first} and {path.name}"
                    )
                for name, piece in model.checkpoint_targets(ckpt_name):
                    if name not in weight_names:
                        unexpected.append(ckpt_name)
                        continue
                    module_name, _, weight_name = name.rpartition(".")
                    try:
                        modules[module_name].load_weight(weight_name, tensor, piece)
                    except (ValueError, WeightLoadError) as e:
                        raise WeightLoadError(
                            f"checkpoint weight {ckpt_name} ({path.name}): {e}"
                        ) from e
                    pending.discard((name, piece))
                release_freed_memory()  # this tensor's temporaries, before the next one's
    if unexpected:
        raise WeightLoadError(f"checkpoint weights the model has no place for: {unexpected}")
    if pending:
        missing = sorted({model.checkpoint_name(name, piece) for name, piece in pending})
        raise WeightLoadError(f"weights missing from the checkpoint in {model_dir}: {missing}")
    logger.info("Loaded %d weight files in %.1f s", len(files), time.monotonic() - started)


class SafetensorsFile:
    """A safetensors file: an 8-byte little-endian header size, a JSON header naming each
    tensor's dtype, shape and byte range, then the data."""

    def __init__(self, path: Path):
        self.path = path
        self._fd = os.open(path, os.O_RDONLY)
        try:
            self._header, self._data_start = _read_header(self._fd)
        except BaseException as e:
            os.close(self._fd)
            if isinstance(e, WeightLoadError):
                raise WeightLoadError(f"{path}: {e}") from None
            raise
        self.nbytes = sum(
            end - begin for begin, end in (t["data_offsets"] for t in self._header.values())
        )

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        os.close(self._fd)

    def tensor(self, name: str) -> FileTensor | None:
        return next((t for n, t in self.tensors() if n == name), None)

    def tensors(self) -> list[tuple[str, FileTensor]]:
        """Every tensor, lazily, in the order of the file."""
        entries = sorted(self._header.items(), key=lambda item: item[1]["data_offsets"][0])
        tensors = []
        for name, entry in entries:
            begin, _ = entry["data_offsets"]
            dtype, shape = _DTYPES[entry["dtype"]], tuple(entry["shape"])
            tensors.append((name, FileTensor(self._fd, self._data_start + begin, dtype, shape)))
        return tensors


def _read_header(fd: int) -> tuple[dict[str, dict[str, Any]], int]:
    """The header's tensors by name, and where the data begins. Each tensor has a known dtype,
    and a byte range the size its shape and dtype take, inside the file's data and apart from
    the others' (what safetensors' own reader checks): else a truncated or corrupt file would
    load wrong numbers."""
    try:
        (header_size,) = struct.unpack("<Q", os.pread(fd, 8, 0))
        if header_size > _MAX_HEADER_BYTES:
            raise WeightLoadError(f"a header of {header_size} bytes")
        header = json.loads(os.pread(fd, header_size, 8))
    except (struct.error, ValueError) as e:
        raise WeightLoadError(f"not a safetensors file: {e}") from None
    if not isinstance(header, dict):
        raise WeightLoadError("not a safetensors file: its header is not a JSON object")
    header.pop("__metadata__", None)
    data_bytes = os.fstat(fd).st_size - 8 - header_size
    end_so_far, ordered = 0, []
    for name, entry in header.items():
        try:
            dtype, shape = _DTYPES[entry["dtype"]], entry["shape"]
            begin, end = entry["data_offsets"]
            sizes = [*shape, begin, end]
        except (KeyError, TypeError, ValueError):
            message = f"{name}'s entry is not a known dtype, shape and data_offsets: {entry}"
            raise WeightLoadError(message) from None
        if not all(type(n) is int and n >= 0 for n in sizes):
            raise WeightLoadError(f"{name}: shape and data_offsets must be counts: {entry}")
        if end - begin != math.prod(shape) * dtype.itemsize:
            raise WeightLoadError(f"{name}: {end - begin} bytes for {entry['dtype']} {shape}")
        if end > data_bytes:
            raise WeightLoadError(f"{name} ends past the end of the file (truncated?)")
        ordered.append((begin, end, name))
    for begin, end, name in sorted(ordered):
        if begin < end_so_far:
            raise WeightLoadError(f"{name} overlaps the tensor before it")
        end_so_far = end
    return header, 8 + header_size


class FileTensor:
    """A checkpoint tensor read from its file only where indexed: `t[a:b]` reads rows a to b,
    `t[:, a:b]` reads every row (then keeps columns a to b)."""

    def __init__(self, fd: int, offset: int, dtype: torch.dtype, shape: tuple[int, ...]):
        self._fd = fd
        self._offset = offset
        self.dtype = dtype
        self.shape = shape

    def __getitem__(self, index: Any) -> torch.Tensor:
        rows, rest = (index[0], index[1:]) if isinstance(index, tuple) else (index, ())
        if not self.shape:  # a scalar
            return self._read(0, 1).reshape(())[rest]
        if not isinstance(rows, slice):
            raise TypeError(f"rows of a checkpoint tensor are read by slice, not {rows!r}")
        start, stop, step = rows.indices(self.shape[0])
        if step != 1:
            raise TypeError("rows of a checkpoint tensor are read in one run")
        count = max(0, stop - start)
        row_elements = math.prod(self.shape[1:])
        tensor = self._read(start * row_elements, count * row_elements)
        tensor = tensor.reshape(count, *self.shape[1:])
        return tensor[(slice(None),) + tuple(rest)] if rest else tensor

    def _read(self, first: int, count: int) -> torch.Tensor:
        """Elements first..first+count of the flat tensor."""
        out = torch.empty(count, dtype=self.dtype)
        buffer = memoryview(out.view(torch.uint8).numpy())  # type: ignore[arg-type]
        position = self._offset + first * self.dtype.itemsize
        done = 0
        while done < len(buffer):  # one pread returns at most ~2 GB
            got = os.preadv(self._fd, [buffer[done:]], position + done)
            if got == 0:
                raise WeightLoadError("a checkpoint file ends inside a tensor")
            done += got
        return out


def stored_dtype(model_dir: str, name: str) -> torch.dtype | None:
    """The dtype checkpoint tensor `name` is stored in (headers only): what config.json's
    `torch_dtype` says of it, where that is not mislabelled; None if no file holds it."""
    try:
        files = safetensors_files(Path(model_dir))
    except WeightLoadError:
        return None  # load_weights says why, after the check that the weights fit
    for path in files:
        with SafetensorsFile(path) as file:
            tensor = file.tensor(name)
            if tensor is not None:
                return tensor.dtype
    return None


def safetensors_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [model_dir / name for name in sorted(set(weight_map.values()))]
        missing = [path.name for path in files if not path.is_file()]
        if missing:
            raise WeightLoadError(f"{index.name} names files not in {model_dir}: {missing}")
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise WeightLoadError(f"no .safetensors files in {model_dir}")
    return files
