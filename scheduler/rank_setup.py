"""One rank built from the server's flags: its model runner (on its device, in its TP group) and,
on TP rank 0, the scheduler over it with the model as it serves it."""

from __future__ import annotations

import logging

import torch

from radixserve.model_worker.model_config import ModelConfig, resolve_device, resolve_dtype
from radixserve.model_worker.model_runner import ModelRunner
from radixserve.model_worker.parallel import init_tp_group
from radixserve.model_worker.tp_worker import TpModelWorker
from radixserve.protocol.wire import ModelInfoReply
from radixserve.scheduler.config import SchedulerConfig, SpecConfig
from radixserve.scheduler.grammar import GrammarBackend
from radixserve.scheduler.scheduler import Scheduler
from radixserve.server_args import RankPlacement, ServerArgs, speculative_num_draft_tokens

logger = logging.getLogger("radixserve.scheduler")


def _rank_gpu(device: torch.device, args: ServerArgs, placement: RankPlacement) -> torch.device:
    """cuda:N as given, or one GPU per model process of this node in placement order (replicas
    share GPUs when there are fewer, with --mem-fraction-static lowered to fit). NCCL refuses
    two ranks of one TP group on one GPU ("Duplicate GPU detected") and CUDA an ordinal past
    its GPUs: refused here first, in words."""
    count = torch.cuda.device_count()
    ranks_here = args.tp_size // args.nnodes  # this node's ranks of each TP group
    if count == 0:
        raise ValueError(f"--device {args.device}, but no GPU is visible")
    if device.index is not None:
        if device.index >= count:
            raise ValueError(f"--device {args.device}, but GPUs 0 to {count - 1} are visible")
        if ranks_here > 1:
            raise ValueError(
                f"--device {args.device} puts all {ranks_here} TP ranks on one GPU; NCCL needs "
                "one each (--device cuda spreads them)"
            )
        return device
    if ranks_here > count:
        raise ValueError(
            f"--tp-size {args.tp_size} needs {ranks_here} GPUs on this node, one per TP rank; "
            f"{count} {'is' if count == 1 else 'are'} visible"
        )
    local = placement.dp_rank * ranks_here + placement.tp_rank % ranks_here
    return torch.device("cuda", local % count)


def build_model_runner(args: ServerArgs, model_path: str, placement: RankPlacement) -> ModelRunner:
    """This rank's shard of the model and its KV pool, once its TP group has met."""
    device = resolve_device(args.device)
    if device.type == "cuda":
        device = _rank_gpu(device, args, placement)
        # Always, cuda:N too: NCCL and the overlap thread take the current device.
        torch.cuda.set_device(device)
    tp = init_tp_group(placement.tp_rank, args.tp_size, placement.dist_init_addr, device)
    checkpoint_dtype = ModelConfig.from_dir(model_path).dtype
    return ModelRunner(
        model_path,
        dtype=resolve_dtype(args.dtype, device, checkpoint_dtype=checkpoint_dtype),
        device=device,
        max_total_tokens=args.max_total_tokens,
        mem_fraction_static=args.mem_fraction_static,
        tp=tp,
        seed=args.random_seed,
        kernels=args.kernels,
        quantization=args.quantization,
        fused_layers=not args.disable_fused_layers,
        draft_model_path=args.speculative_draft_model_path,
    )


def speculative_config(args: ServerArgs) -> SpecConfig | None:
    if args.speculative_algorithm is None:
        return None
    return SpecConfig(
        algorithm=args.speculative_algorithm,
        num_draft_tokens=speculative_num_draft_tokens(args),
        ngram_min=args.speculative_ngram_min_match_window_size,
        ngram_max=args.speculative_ngram_max_match_window_size,
        disable_by_batch_size=args.speculative_disable_by_batch_size,
    )


def overlap_schedule(args: ServerArgs, device: torch.device) -> bool:
    """Whether steps overlap: as the flags say, else only when a GPU runs the forward.

    Overlap hides the scheduler's CPU work behind a forward that runs elsewhere. On the CPU the
    forward's threads already take every core, and a forward launched from a second thread gets
    a second OpenMP team beside the main thread's: on the idle 2-core machine the same decode
    step took 39 ms there against 27 ms on the main thread, and overlap served 0.64x the
    throughput one request at a time, 0.86x at 64 (benchmarks/RESULTS.md).
    """
    if args.enable_overlap_schedule or args.disable_overlap_schedule:
        return args.enable_overlap_schedule
    return device.type != "cpu"


def build_scheduler(
    args: ServerArgs, model_path: str, worker: TpModelWorker
) -> tuple[Scheduler, ModelInfoReply]:
    """The scheduler over its model worker, and the model as it serves it (for model_info)."""
    runner = worker.runner
    model = runner.model_config
    context_len = args.context_length or model.max_position_embeddings
    max_running = min(
        args.max_running_requests or 256, runner.max_total_tokens, args.max_prefill_tokens
    )
    chunk = args.chunked_prefill_size if args.chunked_prefill_size > 0 else context_len
    config = SchedulerConfig(
        max_total_tokens=runner.max_total_tokens,
        max_running_requests=max_running,
        max_prefill_tokens=args.max_prefill_tokens,
        chunked_prefill_size=min(chunk, args.max_prefill_tokens),
        context_len=context_len,
        eos_token_ids=frozenset(model.eos_token_ids),
        log_interval=args.log_interval,
        check_invariants=args.check_invariants,
        enable_radix_cache=not args.disable_radix_cache,
        page_size=args.page_size,
        schedule_policy=args.schedule_policy,
        enable_overlap=overlap_schedule(args, runner.device),
        speculative=speculative_config(args),
        max_queued_requests=args.max_queued_requests,
    )
    logger.info(
        "Model %s on %s, dtype %s. max_total_tokens=%d, max_running_requests=%d, "
        "context_len=%d, chunked_prefill_size=%d, overlap schedule %s, speculative %s",
        model.architecture,
        runner.device,
        runner.dtype,
        config.max_total_tokens,
        max_running,
        context_len,
        config.chunked_prefill_size,
        "on" if config.enable_overlap else "off",
        config.speculative,
    )
    info = ModelInfoReply(
        model_path=model_path,
        architecture=model.architecture,
        context_length=context_len,
        vocab_size=model.vocab_size,
        dtype=str(runner.dtype).removeprefix("torch."),
        is_generation=True,
        tokenizer_path=model_path,
    )
    return Scheduler(
        config,
        worker,
        GrammarBackend(model_path, model.vocab_size, reasoning_parser=args.reasoning_parser),
    ), info
