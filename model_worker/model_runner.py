"""ModelRunner: owns the model, its weights and the KV pool; runs one batch to its next tokens."""

from __future__ import annotations

import logging

import torch

from radixserve.model_worker.batch import ModelWorkerBatch, SampleOutput
from radixserve.model_worker.draft_model import DraftModel
from radixserve.model_worker.host_memory import meminfo_bytes
from radixserve.model_worker.kv_pool import TokenToKVPool
from radixserve.model_worker.loader import loadable_modules
from radixserve.model_worker.model_loading import load_model
from radixserve.model_worker.parallel import TPGroup
from radixserve.model_worker.sampler import Sampler
from radixserve.model_worker.spec_verify import draft_tokens, verify, verify_rows
from radixserve.model_worker.weight_format import tensor_address

logger = logging.getLogger(__name__)

CPU_MAX_KV_TOKENS = 256 * 1024


# Prompt rows whose logits are computed at once: 256 x a 150k vocabulary is 150 MB of float32.
PROMPT_LOGPROB_BLOCK = 256


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
        kernels: str = "auto",
        quantization: str | None = None,
        fused_layers: bool = True,
        draft_model_path: str | None = None,
    ):
        self.loaded = loaded = load_model(
            model_path, dtype, device, tp, kernels, quantization, fused_layers
        )
        self.model_config = config = loaded.config
        self.device = device
        self.dtype = dtype
        self.tp = tp
        self.model = loaded.model
        self.kernels_name = loaded.kernels.name
        self.attn_backend = loaded.kernels.attn_backend
        self.quantization = quantization
        self.fused_layers = loaded.fused_layers
        weight_bytes = loaded.weight_bytes
        num_kv_heads = loaded.num_kv_heads
        # STANDALONE speculation: the draft model's own weights and KV pool, addressed by the
        # same slots as ours (draft_model.py); its KV takes its share of the memory we size.
        self.draft: DraftModel | None = None
        if draft_model_path is not None:
            if tp.size > 1:
                raise ValueError("a draft model runs with --tp-size 1 only")
            self.draft = DraftModel(
                draft_model_path,
                target_path=model_path,
                target=config,
                dtype=dtype,
                device=device,
                kernels=kernels,
                quantization=quantization,
                fused_layers=fused_layers,
            )

        kv_slot_bytes = TokenToKVPool.bytes_per_slot(
            config.num_hidden_layers, num_kv_heads, config.head_dim, dtype
        )
        if self.draft is not None:
            kv_slot_bytes += self.draft.kv_slot_bytes
        if max_total_tokens is None:
            max_total_tokens = self._kv_tokens_that_fit(kv_slot_bytes, mem_fraction_static)
        elif device.type == "cpu":
            max_total_tokens = _within_memory(max_total_tokens, kv_slot_bytes)
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
        if self.draft is not None:
            self.draft.allocate_kv(self.max_total_tokens + 1)
        self.sampler = Sampler(device, seed, argmax=loaded.kernels.ops.argmax)
        logger.info(
            "Loaded %s (%s, %s, kernels %s, quantization %s, fused layers %s, "
            "TP rank %d/%d): weights %.2f GB%s, KV pool of %d tokens, %.2f GB (its pages taken "
            "as they are first written)",
            config.architecture,
            dtype,
            device,
            self.kernels_name,
            quantization,
            self.fused_layers,
            tp.rank,
            tp.size,
            weight_bytes / 1e9,
            "" if self.draft is None else f" (+ a draft's {self.draft.weight_bytes / 1e9:.2f})",
            self.max_total_tokens,
            self.max_total_tokens * kv_slot_bytes / 1e9,
        )

    @torch.inference_mode()
    def forward(self, batch: ModelWorkerBatch) -> SampleOutput:
        """The next token of every sequence of the batch, and logprobs where asked for; on the
        CPU. Keeps each penalised request's token counts for its later steps; a speculating
        batch gets each sequence's accepted run (spec_verify.py). With a draft model, it runs
        first: its KV for the step's rows, and a speculating batch's drafts."""
        if self.draft is not None:
            batch = self.draft.prepare(batch)
        hidden, last_rows = self._forward_hidden(batch)
        draft_lens = batch.draft_lens
        if draft_lens is None:
            out = self.sampler(self.model.compute_logits(hidden[last_rows]), batch.sampling)
        else:
            rows = verify_rows(batch.extend_lens, draft_lens).to(self.device)
            drafts = draft_tokens(batch.input_ids, batch.extend_lens, draft_lens)
            logits = self.model.compute_logits(hidden[rows]).float()
            out = verify(logits, drafts, draft_lens, batch.sampling, self.sampler)
        if batch.prompt_logprob_rows is not None:  # a prefill beside the drafts, maybe
            self._prompt_logprobs(batch, hidden, out)
        return out

    @torch.inference_mode()
    def forward_logits(
        self, batch: ModelWorkerBatch, rows: torch.Tensor | None = None
    ) -> torch.Tensor:
        """float32 logits [N, vocab] of the packed token rows `rows` (default: each sequence's
        last token). Writes the batch's K and V into the pool like `forward` (not into a draft
        model's: for tests and benchmarks of the model alone)."""
        hidden, last_rows = self._forward_hidden(batch)
        rows = last_rows if rows is None else rows.to(self.device)
        return self.model.compute_logits(hidden[rows]).float()

    def _forward_hidden(self, batch: ModelWorkerBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """The final hidden states of every packed row, and the rows of the sequences' last
        tokens."""
        return self.loaded.hidden_states(batch, self.kv_pool, self.device)

    def _prompt_logprobs(
        self, batch: ModelWorkerBatch, hidden: torch.Tensor, out: SampleOutput
    ) -> None:
        """The logprobs of the batch's prompt rows (raw logits, as the outputs'), a block of
        rows at a time: a whole prompt's logits at once could take gigabytes."""
        rows, targets = batch.prompt_logprob_rows, batch.prompt_logprob_targets
        assert rows is not None and targets is not None
        k = batch.prompt_top_logprobs_num
        chosen, top_values, top_ids = [], [], []
        for start in range(0, rows.numel(), PROMPT_LOGPROB_BLOCK):
            block = rows[start : start + PROMPT_LOGPROB_BLOCK].to(self.device)
            logits = self.model.compute_logits(hidden[block]).float()
            logprobs = torch.log_softmax(logits, dim=-1)
            wanted = targets[start : start + PROMPT_LOGPROB_BLOCK].to(self.device)
            chosen.append(logprobs.gather(1, wanted[:, None])[:, 0].cpu())
            top = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
            top_values.append(top.values.cpu())
            top_ids.append(top.indices.cpu())
        out.prompt_logprobs = torch.cat(chosen)
        out.prompt_top_logprobs = torch.cat(top_values)
        out.prompt_top_logprob_ids = torch.cat(top_ids)

    def weight_tensors(self) -> list[torch.Tensor]:
        """One tensor per copy of weights in memory: the model's and its kernels' (a tensor
        held twice, or two views of one buffer, counts once)."""
        unique = {}
        models = [self.model] if self.draft is None else [self.model, self.draft.loaded.model]
        for module in (m for model in models for m in loadable_modules(model).values()):
            for tensor in module.held_tensors():
                unique[tensor_address(tensor)] = tensor
        return list(unique.values())

    def _kv_tokens_that_fit(self, kv_slot_bytes: int, mem_fraction_static: float) -> int:
        if self.device.type == "cuda":
            total = torch.cuda.get_device_properties(self.device).total_memory
            free, _ = torch.cuda.mem_get_info(self.device)
            weights = sum(t.nbytes for t in self.weight_tensors())
            budget = total * mem_fraction_static - weights
            if budget > free:  # another process holds part of the GPU
                raise RuntimeError(
                    f"--mem-fraction-static {mem_fraction_static} asks for a KV cache of "
                    f"{budget / 1e9:.1f} GB, but only {free / 1e9:.1f} GB of {self.device} is "
                    "free: lower --mem-fraction-static or set --max-total-tokens"
                )
            tokens = int(budget // kv_slot_bytes)
        else:
            # The CPU's memory is shared with every other process: the fraction is of what is
            # available now that the weights are in.
            budget = meminfo_bytes("MemAvailable") * mem_fraction_static
            tokens = min(int(budget // kv_slot_bytes), CPU_MAX_KV_TOKENS)
        if tokens < 1:
            raise RuntimeError(
                "no memory left for the KV cache after the weights: raise "
                "--mem-fraction-static or set --max-total-tokens"
            )
        return tokens


def _within_memory(tokens: int, kv_slot_bytes: int) -> int:
    """--max-total-tokens on the CPU, at most what the memory available now holds: the pool's
    pages are taken only as they are written, so a larger one starts, and the OOM killer ends
    it once it fills (SGLang caps the flag at what fits, too)."""
    available = meminfo_bytes("MemAvailable")
    if tokens * kv_slot_bytes <= available:
        return tokens
    fits = max(1, available // kv_slot_bytes)
    logger.warning(
        "--max-total-tokens %d needs %.1f GB of KV, and %.1f GB of memory is available: the "
        "KV pool holds %d tokens",
        tokens,
        tokens * kv_slot_bytes / 1e9,
        available / 1e9,
        fits,
    )
    return fits
