"""ModelRunner: owns the model, its weights and the KV pool; runs one batch to its next tokens."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from radixserve.model_worker.batch import ModelWorkerBatch, SampleOutput
from radixserve.model_worker.forward_batch import ForwardBatch
from radixserve.model_worker.kernel_selection import select_kernels
from radixserve.model_worker.kv_pool import TokenToKVPool
from radixserve.model_worker.loader import load_weights
from radixserve.model_worker.model_config import ModelConfig
from radixserve.model_worker.models import get_model_class
from radixserve.model_worker.parallel import TPGroup
from radixserve.model_worker.quantization import Int8Weight, check_quantization
from radixserve.model_worker.sampler import Sampler
from radixserve.model_worker.spec_verify import draft_tokens, verify, verify_rows

logger = logging.getLogger(__name__)

CPU_KV_MEMORY_FRACTION = 0.10  # of MemTotal: the CPU is shared with the other processes
CPU_MAX_KV_TOKENS = 256 * 1024


class ModelRunner:
    def __init__(
        self,
        model_path: str,
        *,
        dtype: torch.dtype,
        device: torch.device,
        max_total_tokens: int | None,
        mem_fraction_static: float,
        tp: TPGroup,
        seed: int,
        attention_backend: str = "auto",
        quantization: str | None = None,
        fused_layers: bool = True,
    ):
        self.model_config = config = ModelConfig.from_dir(model_path)
        self.device = device
        self.dtype = dtype
        self.tp = tp
        _, num_heads = tp.shard(config.num_attention_heads, "num_attention_heads")
        _, num_kv_heads = tp.shard_heads(config.num_key_value_heads, "num_key_value_heads")
        check_quantization(quantization, device, dtype)
        kernels = select_kernels(attention_backend, num_heads, num_kv_heads, device, dtype)
        self.attention_backend = kernels.name
        self.attn_backend = kernels.attn_backend
        self.model = get_model_class(config.architecture)(
            config,
            tp=tp,
            attn_backend=kernels.attn_backend,
            ops=kernels.ops,
            dtype=dtype,
            device=device,
        )
        load_weights(self.model, model_path)
        self.quantization = quantization
        convert = Int8Weight if quantization == "int8" else kernels.ops.weight_conversion()
        if convert is not None:
            self.model.convert_linear_weights(convert)
        # The fused layers call paged_attention themselves, and have no all-reduce between a
        # layer's matmuls.
        fusable = fused_layers and kernels.name == "cpu_attn" and tp.size == 1
        self.fused_layers = fusable and self.model.fuse_layers()

        kv_slot_bytes = TokenToKVPool.bytes_per_slot(
            config.num_hidden_layers, num_kv_heads, config.head_dim, dtype
        )
        if max_total_tokens is None:
            max_total_tokens = self._kv_tokens_that_fit(kv_slot_bytes, mem_fraction_static)
        # Every rank must agree, or their schedulers would hand out different slots.
        self.max_total_tokens = tp.min_int(max_total_tokens)
        self.kv_pool = TokenToKVPool(
            self.max_total_tokens + 1,  # slot 0 is the reserved padding slot
            config.num_hidden_layers,
            num_kv_heads,
            config.head_dim,
            dtype=dtype,
            device=device,
        )
        self.sampler = Sampler(device, seed)
        logger.info(
            "Loaded %s (%s, %s, attention backend %s, quantization %s, fused layers %s, "
            "TP rank %d/%d): KV pool of %d tokens, %.2f GB",
            config.architecture,
            dtype,
            device,
            self.attention_backend,
            quantization,
            self.fused_layers,
            tp.rank,
            tp.size,
            self.max_total_tokens,
            self.max_total_tokens * kv_slot_bytes / 1e9,
        )

    @torch.inference_mode()
    def forward(self, batch: ModelWorkerBatch) -> SampleOutput:
        """The next token of every sequence of the batch, and logprobs where asked for; on the
        CPU. A speculating batch gets each sequence's accepted run (spec_verify.py)."""
        draft_lens = batch.draft_lens
        if draft_lens is None:
            return self.sampler(self.forward_logits(batch), batch.sampling)
        logits = self.forward_logits(batch, verify_rows(batch.extend_lens, draft_lens))
        drafts = draft_tokens(batch.input_ids, batch.extend_lens, draft_lens)
        return verify(logits, drafts, draft_lens, batch.sampling, self.sampler)

    @torch.inference_mode()
    def forward_logits(
        self, batch: ModelWorkerBatch, rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """float32 logits [N, vocab] of the packed token rows `rows` (default: each sequence's
        last token). Writes the batch's K and V into the pool like `forward`."""
        fb = ForwardBatch.from_worker_batch(batch, self.device, self.kv_pool)
        self.attn_backend.init_forward_metadata(fb)
        hidden = self.model(fb.input_ids, fb.positions, fb)
        rows = fb.last_rows if rows is None else rows.to(self.device)
        return self.model.compute_logits(hidden[rows])

    def _kv_tokens_that_fit(self, kv_slot_bytes: int, mem_fraction_static: float) -> int:
        if self.device.type == "cuda":
            total = torch.cuda.get_device_properties(self.device).total_memory
            free, _ = torch.cuda.mem_get_info(self.device)
            weights = sum(p.numel() * p.element_size() for p in self.model.parameters())
            budget = total * mem_fraction_static - weights
            if budget > free:  # another process holds part of the GPU
                raise RuntimeError(
                    f"--mem-fraction-static {mem_fraction_static} asks for a KV cache of "
                    f"{budget / 1e9:.1f} GB, but only {free / 1e9:.1f} GB of {self.device} is "
                    "free: lower --mem-fraction-static or set --max-total-tokens"
                )
            tokens = int(budget // kv_slot_bytes)
        else:
            tokens = int(_mem_total_bytes() * CPU_KV_MEMORY_FRACTION // kv_slot_bytes)
            tokens = min(tokens, CPU_MAX_KV_TOKENS)
        if tokens < 1:
            raise RuntimeError(
                "no memory left for the KV cache after the weights: raise "
                "--mem-fraction-static or set --max-total-tokens"
            )
        return tokens


def _mem_total_bytes() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemTotal:"):
            return int(line.split()[1]) * 1024  # reported in kB
    raise RuntimeError("MemTotal not found in /proc/meminfo")
