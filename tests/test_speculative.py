"""Speculative decoding (NGRAM, STANDALONE): the same outputs with it as without, in fewer forwards.

The n-gram index against a rescan; verification in-process on the sampler (exactness of the
accepted runs' distribution by chi-square, seeded batch invariance); and the real scheduler over a
real tiny random model, greedy and seeded, alone, in mixed batches with chunked prefill, with
overlap, and with retractions forced by a small KV pool. STANDALONE's draft model is a random
one (its drafts rejected) or the target itself (its drafts all accepted)."""

from __future__ import annotations

import json
import logging
import random
import re
from pathlib import Path

import msgspec
import pytest
import torch
from test_sampler import make_info
from test_scheduler import run_to_completion, tokens_of

from radixserve.model_worker.model_runner import ModelRunner
from radixserve.model_worker.parallel import TPGroup
from radixserve.model_worker.sampler import Sampler
from radixserve.model_worker.spec_verify import draft_tokens, verify, verify_rows
from radixserve.model_worker.tp_worker import TpModelWorker
from radixserve.protocol.internal import ReqStrOut, TokenizedGenerateReq
from radixserve.protocol.wire import SamplingParams
from radixserve.scheduler.config import SchedulerConfig, SpecConfig
from radixserve.scheduler.ngram import NgramIndex
from radixserve.scheduler.scheduler import Scheduler
from radixserve.server_args import (
    ServerArgs,
    build_parser,
    check_server_args,
    check_speculative_args,
    speculative_num_draft_tokens,
)
from radixserve.tokenizer_manager.inflight import InFlightRequest
from radixserve.tokenizer_manager.metrics import Metrics

CPU = torch.device("cpu")
NGRAM = SpecConfig("NGRAM", num_draft_tokens=6, ngram_min=1, ngram_max=4, disable_by_batch_size=64)
STEPS = 4  # the draft model's steps per speculating request
STANDALONE = SpecConfig(
    "STANDALONE", num_draft_tokens=STEPS + 1, ngram_min=1, ngram_max=4, disable_by_batch_size=64
)

# ---- the n-gram index ------------------------------------------------------------------------


def rescan_proposal(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """What the index must propose, by brute force: the longest suffix (max_n down to min_n)
    with an earlier occurrence, its latest one; the tokens after it, repeating with its period."""
    for n in range(min(max_n, len(tokens)), min_n - 1, -1):
        suffix = tokens[-n:]
        for end in range(len(tokens) - 1, n - 1, -1):  # end: where the continuation starts
            if tokens[end - n : end] == suffix:
                period = len(tokens) - end
                return [tokens[end + i % period] for i in range(k)]
    return []


def test_ngram_index_fed_token_by_token_proposes_what_a_rescan_finds() -> None:
    rng = random.Random(3)
    for trial in range(40):
        min_n, max_n = rng.randint(1, 3), rng.randint(3, 5)
        index = NgramIndex(min_n, max_n)
        tokens: list[int] = []
        for _ in range(120):
            new = [rng.randrange(6) for _ in range(rng.randint(1, 3))]  # small alphabet: repeats
            index.extend(new)
            tokens += new
            k = rng.randint(1, 7)
            assert index.propose(k) == rescan_proposal(tokens, k, min_n, max_n), trial


def test_ngram_index_copies_the_prompt_and_loops() -> None:
    index = NgramIndex(2, 3)
    index.extend([5, 6, 7, 8, 9, 1, 2, 6, 7])
    assert index.propose(3) == [8, 9, 1]  # "6 7" followed by "8 9 1"
    index = NgramIndex(1, 3)
    index.extend([4, 3, 4, 3])
    assert index.propose(5) == [4, 3, 4, 3, 4]
    assert NgramIndex(2, 2).propose(3) == []


# ---- verification on the sampler ---------------------------------------------------------------


def run_of(tokens: torch.Tensor, lens: torch.Tensor, i: int) -> list[int]:
    start = int(lens[:i].sum())
    return tokens[start : start + int(lens[i])].tolist()


def test_greedy_accepts_the_longest_agreeing_prefix_and_the_targets_next() -> None:
    vocab = 10
    targets = [[3, 4, 5, 6], [7], [1, 2, 9]]  # each sequence's argmax at its scored rows
    drafts = [[3, 4, 0], [], [1, 2]]
    logits = torch.zeros(sum(map(len, targets)), vocab)
    for row, token in enumerate(t for seq in targets for t in seq):
        logits[row, token] = 5.0
    draft_lens = torch.tensor([3, 0, 2])
    flat = torch.tensor([t for d in drafts for t in d])
    out = verify(logits, flat, draft_lens, make_info(3, temperatures=[0.0] * 3), Sampler(CPU, 0))
    assert out.accept_lens is not None
    assert [run_of(out.next_token_ids, out.accept_lens, i) for i in range(3)] == [
        [3, 4, 5],  # two drafts agree; the target's 5 replaces the third
        [7],
        [1, 2, 9],  # all agree, and the bonus
    ]
    assert out.last_token_ids.tolist() == [5, 7, 9]


def test_rows_and_drafts_are_each_sequences_last_extend_tokens() -> None:
    extend, drafts = torch.tensor([5, 1, 4]), torch.tensor([2, 0, 3])
    assert verify_rows(extend, drafts).tolist() == [2, 3, 4, 5, 6, 7, 8, 9]
    ids = torch.arange(10)
    assert draft_tokens(ids, extend, drafts).tolist() == [3, 4, 7, 8, 9]


# 8 tokens, one row per position: with these the two positions differ
POSITION_LOGITS = torch.tensor(
    [[0.5, 1.0, 2.0, -1.0, 0.0, 1.5, 0.2, -0.5], [1.2, -0.3, 0.0, 2.2, 0.4, 0.1, -1.0, 0.8]]
)
CHI2_999 = {7: 24.3, 14: 36.1}  # 99.9% quantiles of chi-square by degrees of freedom


@pytest.mark.parametrize("seeded", [True, False])
@pytest.mark.parametrize("draft", [2, 6])  # the likeliest token, and an unlikely one
def test_sampled_runs_follow_the_targets_distribution(seeded: bool, draft: int) -> None:
    """One draft token d over n draws: the first new token must follow p0, and when it is d, the
    second (the bonus) p1; Pearson's chi-square over the 15 cells (x != d) or (d, y)."""
    n = 8000
    logits = POSITION_LOGITS.repeat(n, 1)  # each draw's two scored rows
    info = make_info(
        n,
        seeded=[seeded] * n,
        seeds=torch.arange(n),
        output_index=torch.full((n,), 3),
    )
    out = verify(
        logits, torch.full((n,), draft), torch.ones(n, dtype=torch.int64), info, Sampler(CPU, 0)
    )
    assert out.accept_lens is not None
    firsts = out.next_token_ids[torch.cumsum(out.accept_lens, 0) - out.accept_lens]
    assert torch.equal(out.accept_lens == 2, firsts == draft)
    bonus = out.last_token_ids[out.accept_lens == 2]
    p0, p1 = POSITION_LOGITS.double().softmax(-1)
    counts = torch.cat(
        [torch.bincount(firsts, minlength=8).double(), torch.bincount(bonus, minlength=8).double()]
    )
    expected = torch.cat([n * p0, n * p0[draft] * p1])
    cells = torch.arange(16) != draft  # (d, .) is split into the bonus cells
    chi2 = ((counts - expected)[cells] ** 2 / expected[cells]).sum()
    assert chi2 < CHI2_999[14], f"chi-square {chi2:.1f}"


def test_a_seeded_sequence_gets_its_plain_samplers_tokens_alone_and_among_others() -> None:
    """Its run is what the plain sampler draws at output indices o, o + 1, ... (as long as the
    drafts agree), whichever sequences share its batch and wherever it sits."""
    gen = torch.Generator().manual_seed(1)
    vocab, k = 12, 4
    own = torch.randn(k + 1, vocab, generator=gen)
    params = {"temperatures": 0.9, "top_ks": 8, "top_ps": 0.95, "seeded": True, "seeds": 77}
    sampler = Sampler(CPU, 0)
    one_row = {name: [value] * (k + 1) for name, value in params.items()}
    plain = sampler(own, make_info(k + 1, output_index=torch.arange(5, 5 + k + 1), **one_row))
    expected = plain.next_token_ids.tolist()
    drafts = torch.tensor(expected[:2] + [(expected[2] + 1) % vocab, 0])  # two agree
    alone = verify(
        own,
        drafts,
        torch.tensor([k]),
        make_info(1, output_index=[5], **{n: [v] for n, v in params.items()}),
        sampler,
    )
    assert alone.next_token_ids.tolist() == expected[:3]
    for position in range(16):
        draft_lens = torch.randint(0, k + 1, (16,), generator=gen)
        draft_lens[position] = k
        rows = [torch.randn(int(d) + 1, vocab, generator=gen) for d in draft_lens]
        rows[position] = own
        flat = [torch.randint(0, vocab, (int(d),), generator=gen) for d in draft_lens]
        flat[position] = drafts
        info = make_info(
            16,
            temperatures=torch.rand(16, generator=gen) * 2,
            seeded=torch.rand(16, generator=gen) < 0.5,
            seeds=torch.randint(0, 2**62, (16,), generator=gen),
            output_index=torch.randint(0, 100, (16,), generator=gen),
        )
        for name, value in params.items():
            getattr(info, name)[position] = value
        info.output_index[position] = 5
        out = verify(torch.cat(rows), torch.cat(flat), draft_lens, info, sampler)
        assert out.accept_lens is not None
        assert run_of(out.next_token_ids, out.accept_lens, position) == expected[:3], position


# ---- the scheduler over a real tiny model ------------------------------------------------------


def load_runner(model: Path, kernels: str = "auto", draft: Path | None = None) -> ModelRunner:
    return ModelRunner(
        str(model),
        dtype=torch.float32,
        device=CPU,
        max_total_tokens=1024,
        mem_fraction_static=0.0,
        tp=TPGroup(),
        seed=0,
        kernels=kernels,
        draft_model_path=None if draft is None else str(draft),
    )


def load_with_draft(model: Path, draft: Path, kernels: str = "auto") -> ModelRunner:
    runner = load_runner(model, kernels, draft)
    assert runner.draft is not None
    return runner


@pytest.fixture
def runner(tiny_model) -> ModelRunner:
    """One model for a test's schedulers: each writes a KV slot before reading it, and greedy
    and seeded rows do not draw from the runner's generator."""
    return load_runner(tiny_model("qwen3"))


def make_scheduler(
    runner: ModelRunner,
    spec: SpecConfig | None,
    pool: int = 1024,
    overlap: bool = False,
    chunk: int = 256,
) -> Scheduler:
    config = SchedulerConfig(
        max_total_tokens=min(pool, runner.max_total_tokens),
        max_running_requests=64,
        max_prefill_tokens=512,
        chunked_prefill_size=chunk,
        context_len=512,
        eos_token_ids=frozenset({2}),
        check_invariants=True,
        enable_overlap=overlap,
        speculative=spec,
    )
    return Scheduler(config, TpModelWorker(runner))


def repetitive_prompts(n: int, seed: int = 0) -> list[list[int]]:
    """Prompts that repeat phrases, as text to edit does: drafts from them get accepted."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(n):
        phrases = [[rng.randrange(3, 256) for _ in range(rng.randint(3, 8))] for _ in range(3)]
        prompts.append([t for _ in range(rng.randint(2, 5)) for t in rng.choice(phrases)])
    return prompts


def request(rid: str, prompt: list[int], max_new: int, **params: object) -> TokenizedGenerateReq:
    sp = SamplingParams(max_new_tokens=max_new, **{"temperature": 0.0, **params})  # type: ignore[arg-type]
    return TokenizedGenerateReq(rid, prompt, sp, stream=True, return_logprob=rid.endswith("lp"))


def serve(s: Scheduler, requests: list[TokenizedGenerateReq], stagger: int) -> dict[str, list]:
    """Each request's outputs; a new request every `stagger` steps (0: all at once)."""
    pending = list(requests)
    outs: dict[str, list] = {}
    while pending and stagger:
        s.add_request(pending.pop(0))
        for _ in range(stagger):
            s.step()
    for msg in pending:
        s.add_request(msg)
    for out in s.outbox:
        outs.setdefault(out.rid, []).append(out)
    s.outbox = []
    for rid, more in run_to_completion(s).items():
        outs.setdefault(rid, []).extend(more)
    return outs


def greedy_requests() -> list[TokenizedGenerateReq]:
    reqs = [request(f"r{i}", p, 40) for i, p in enumerate(repetitive_prompts(32))]
    reqs[3] = request("r3lp", reqs[3].input_ids, 40)  # logprobs are the target's
    reqs[5] = request("r5pen", reqs[5].input_ids, 40, frequency_penalty=0.5)  # never drafts
    # Never draft either: a bias and a minimum length are rows of one sequence each.
    reqs[7] = request("r7bias", reqs[7].input_ids, 40, logit_bias={5: 3.0, 9: -100.0})
    reqs[9] = request("r9min", reqs[9].input_ids, 40, min_new_tokens=30, ignore_eos=False)
    # Its prompt's logprobs are computed in a step that verifies others' drafts.
    reqs[11] = msgspec.structs.replace(
        request("r11lp", reqs[11].input_ids, 40), logprob_start_len=0
    )
    return reqs


def assert_same_outputs(got: dict[str, list], want: dict[str, list]) -> None:
    assert got.keys() == want.keys()
    for rid in want:
        assert tokens_of(got[rid]) == tokens_of(want[rid]), rid
        assert got[rid][-1].finished_reason == want[rid][-1].finished_reason, rid
        if rid.endswith("lp"):
            lp = [x for o in got[rid] for x, _ in o.output_token_logprobs]
            ref = [x for o in want[rid] for x, _ in o.output_token_logprobs]
            torch.testing.assert_close(lp, ref, atol=1e-4, rtol=0)


@pytest.fixture
def greedy_reference(runner) -> tuple[ModelRunner, dict[str, list]]:
    return runner, serve(make_scheduler(runner, None), greedy_requests(), stagger=0)


@pytest.mark.parametrize("overlap", [False, True])
def test_greedy_outputs_are_token_equal_with_ngram(greedy_reference, overlap: bool, caplog) -> None:
    runner, want = greedy_reference
    caplog.set_level(logging.INFO, logger="radixserve.scheduler")
    stops = sum(o[-1].finished_reason.type == "stop" for o in want.values())
    assert 0 < stops < 32, "some requests should end by EOS, inside an accepted run or not"
    # Arriving while others decode, long prompts in chunks: drafts mix with prefills.
    s = make_scheduler(runner, NGRAM, overlap=overlap, chunk=24)
    assert_same_outputs(serve(s, greedy_requests(), stagger=1), want)
    assert s.drafter is not None and s.drafter.stats.accepted > 0
    assert s.stats.num_mixed_steps > 0
    # The prefill log lines count prompt tokens only, not the drafts mixed into their steps.
    logged = [int(n) for n in re.findall(r"#new-token: (\d+)", caplog.text)]
    assert sum(logged) == s.stats.num_prefill_tokens
    info = s.server_info()  # /metrics' accept length comes from it
    # Idle now: no throughput, whatever the last log interval made (SGLang's idle reset).
    assert info.gen_throughput == 0 < s.stats.gen_throughput
    assert info.spec_accepted_tokens == s.drafter.stats.accepted
    assert 1 < info.spec_accept_length == 1 + info.spec_accepted_tokens / info.spec_verifies
    assert f"radixserve:spec_accept_length {info.spec_accept_length}" in (
        Metrics().expose(info).decode()
    )
    alone = make_scheduler(runner, NGRAM, overlap=overlap)
    for msg in greedy_requests()[:8]:
        assert_same_outputs(serve(alone, [msg], 0), {msg.rid: want[msg.rid]})


def test_an_output_of_several_tokens_is_several_inter_token_gaps() -> None:
    """With speculation one output carries k tokens: the ITL histogram counts k gaps of the
    interval's k-th each, the whole interval in its sum (SGLang's)."""
    metrics = Metrics()
    request = InFlightRequest((b"peer",), "r", stream=True, ids=["0"], open=1)
    first, later = request.created + 0.1, request.created + 0.9
    metrics.on_tokens(request, None, _str_out(1), first)  # the first: TTFT
    metrics.on_tokens(request, first, _str_out(8), later)
    registry = metrics.registry
    assert registry.get_sample_value("radixserve:inter_token_latency_seconds_count") == 8
    assert registry.get_sample_value("radixserve:inter_token_latency_seconds_sum") == (
        pytest.approx(0.8)
    )
    bucket = {"le": "0.15"}  # each gap 0.1 s (0.08 holds none)
    assert registry.get_sample_value("radixserve:inter_token_latency_seconds_bucket", bucket) == 8
    below = {"le": "0.08"}
    assert registry.get_sample_value("radixserve:inter_token_latency_seconds_bucket", below) == 0


def _str_out(tokens: int) -> ReqStrOut:
    return ReqStrOut("0", "t" * tokens, list(range(tokens)), None, 3, tokens, 0)


def test_greedy_outputs_are_token_equal_with_ngram_on_torch_native(tiny_model) -> None:
    """The portable attention backend takes the drafts' extend rows too."""
    runner = load_runner(tiny_model("qwen3"), kernels="torch_native")
    assert runner.kernels_name == "torch_native"
    reqs = greedy_requests()[:12]
    want = serve(make_scheduler(runner, None), reqs, stagger=0)
    s = make_scheduler(runner, NGRAM, chunk=24)
    assert_same_outputs(serve(s, reqs, stagger=1), want)
    assert s.drafter is not None and s.drafter.stats.accepted > 0


def test_greedy_outputs_survive_retractions_with_ngram(runner) -> None:
    reqs = [request(f"r{i}", p, 60, ignore_eos=True) for i, p in enumerate(repetitive_prompts(16))]
    want = serve(make_scheduler(runner, None), reqs, stagger=0)
    s = make_scheduler(runner, NGRAM, pool=400)
    assert_same_outputs(serve(s, reqs, stagger=0), want)
    assert s.stats.num_retractions > 0
    assert s.drafter is not None and s.drafter.stats.accepted > 0


@pytest.fixture(params=["NGRAM", "STANDALONE"])
def speculating(request, tiny_model) -> tuple[ModelRunner, SpecConfig]:
    """A runner and a speculative config: NGRAM, or STANDALONE with the target as its draft."""
    model = tiny_model("qwen3")
    if request.param == "NGRAM":
        return load_runner(model), NGRAM
    return load_with_draft(model, model), STANDALONE


def test_seeded_requests_get_the_same_tokens_speculating_alone_and_among_others(
    speculating,
) -> None:
    """Four seeded requests: each the same tokens as without speculation, alone, and all four
    together among 12 unseeded ones."""
    runner, spec = speculating
    prompts = repetitive_prompts(16, seed=5)
    ours = [
        request(f"s{i}", prompts[i], 32, temperature=0.1, top_k=20, seed=100 + i, ignore_eos=True)
        for i in range(4)
    ]
    want = {m.rid: tokens_of(serve(make_scheduler(runner, None), [m], 0)[m.rid]) for m in ours}
    accepted = 0
    for msg in ours:
        alone = make_scheduler(runner, spec)
        assert tokens_of(serve(alone, [msg], 0)[msg.rid]) == want[msg.rid]
        assert alone.drafter is not None
        accepted += alone.drafter.stats.accepted
    assert accepted > 0
    others = [request(f"o{i}", p, 20, temperature=1.0) for i, p in enumerate(prompts[4:])]
    crowd = make_scheduler(runner, spec)
    outs = serve(crowd, [*others[:6], *ours, *others[6:]], stagger=1)
    assert {rid: tokens_of(outs[rid]) for rid in want} == want


# ---- STANDALONE: a draft model proposes, the same verification accepts --------------------------


@pytest.fixture(params=["random", "self"])
def drafted(request, tiny_model) -> tuple[str, ModelRunner, ModelRunner]:
    """(which draft, the plain target, the target with a draft model): a random one with the
    same vocabulary (another architecture and depth: mostly rejected), or the target itself
    (always accepted)."""
    target = tiny_model("qwen3")
    draft = tiny_model("llama", num_hidden_layers=1) if request.param == "random" else target
    return request.param, load_runner(target), load_with_draft(target, draft)


def assert_acceptance(kind: str, s: Scheduler) -> None:
    """The target drafting for itself: every draft accepted (its KV at each position was
    computed over the same tokens as the target's); a random draft: mostly rejected."""
    stats = s.drafter.stats if s.drafter is not None else None
    assert stats is not None and stats.verifies > 0
    if kind == "self":
        assert stats.accepted == stats.drafts, (stats.accepted, stats.drafts)
        assert stats.drafts > stats.verifies * (STEPS - 1)  # K drafts, where max_new_tokens allows
    else:
        assert stats.accepted < stats.drafts / 2


@pytest.mark.parametrize("overlap", [False, True])
def test_greedy_outputs_are_token_equal_with_standalone(drafted, overlap: bool) -> None:
    kind, plain, runner = drafted
    want = serve(make_scheduler(plain, None), greedy_requests(), stagger=0)
    s = make_scheduler(runner, STANDALONE, overlap=overlap, chunk=24)
    assert_same_outputs(serve(s, greedy_requests(), stagger=1), want)
    assert s.stats.num_mixed_steps > 0
    assert_acceptance(kind, s)
    alone = make_scheduler(runner, STANDALONE, overlap=overlap)
    for msg in greedy_requests()[:4]:
        assert_same_outputs(serve(alone, [msg], 0), {msg.rid: want[msg.rid]})
    assert_acceptance(kind, alone)


def test_greedy_outputs_are_token_equal_with_standalone_on_torch_native(tiny_model) -> None:
    """The portable attention backend runs the draft's one-row passes over cut KV slots too."""
    model = tiny_model("qwen3")
    runner = load_with_draft(model, model, kernels="torch_native")
    reqs = greedy_requests()[:12]
    want = serve(make_scheduler(load_runner(model, "torch_native"), None), reqs, stagger=0)
    s = make_scheduler(runner, STANDALONE, chunk=24)
    assert_same_outputs(serve(s, reqs, stagger=1), want)
    assert_acceptance("self", s)


def test_greedy_outputs_survive_retractions_with_standalone(drafted) -> None:
    kind, plain, runner = drafted
    reqs = [request(f"r{i}", p, 60, ignore_eos=True) for i, p in enumerate(repetitive_prompts(16))]
    want = serve(make_scheduler(plain, None), reqs, stagger=0)
    s = make_scheduler(runner, STANDALONE, pool=400)
    assert_same_outputs(serve(s, reqs, stagger=0), want)
    assert s.stats.num_retractions > 0
    assert_acceptance(kind, s)


def test_a_prefix_hit_reads_the_drafts_kv_written_while_speculating(tiny_model) -> None:
    """A prompt that continues a finished request's prompt and output hits the prefix cache over
    positions that both models computed in verified steps (accepted drafts included): the target
    drafting for itself, every draft after the hit is accepted, so the draft's KV there has no
    hole and holds the same tokens as the target's."""
    model = tiny_model("qwen3")
    plain, runner = load_runner(model), load_with_draft(model, model)
    first = request("first", repetitive_prompts(1, seed=3)[0], 40, ignore_eos=True)
    s = make_scheduler(runner, STANDALONE)
    generated = tokens_of(serve(s, [first], 0)["first"])
    assert s.drafter is not None and s.drafter.stats.accepted > 0
    follow = request("follow", [*first.input_ids, *generated[:-1], 7, 9], 30, ignore_eos=True)
    want = serve(make_scheduler(plain, None), [follow], 0)
    cached = s.stats.cached_tokens
    verifies = s.drafter.stats.verifies
    assert_same_outputs(serve(s, [follow], 0), want)
    assert s.stats.cached_tokens - cached > len(first.input_ids)  # the hit runs into the output
    stats = s.drafter.stats
    assert stats.verifies > verifies and stats.accepted == stats.drafts


def test_a_draft_model_must_share_the_targets_vocabulary(tiny_model) -> None:
    target, draft = tiny_model("qwen3"), tiny_model("qwen3", vocab_size=300)
    with pytest.raises(ValueError, match="vocabulary of 300 tokens, the model .* of 256"):
        load_with_draft(target, draft)
    # A narrower embedding over the same tokenizer (Qwen2.5's 0.5B pads to 151936 rows, its 7B
    # to 152064) is taken: the ids past it that reach the draft (these random prompts hold some,
    # as a client's input_ids may) are no tokens, and the outputs stay the target's.
    narrower = load_with_draft(target, tiny_model("qwen3", vocab_size=240))
    reqs = greedy_requests()[:6]
    assert any(t >= 240 for r in reqs for t in r.input_ids)
    want = serve(make_scheduler(load_runner(target), None), reqs, stagger=0)
    s = make_scheduler(narrower, STANDALONE)
    assert_same_outputs(serve(s, reqs, stagger=0), want)
    assert s.drafter is not None and s.drafter.stats.verifies > 0
    other = tiny_model("qwen3")
    for path, vocab in ((target, {"a": 0, "b": 1}), (other, {"a": 1, "b": 0})):
        (path / "tokenizer.json").write_text(json.dumps({"model": {"vocab": vocab}}))
    with pytest.raises(ValueError, match="another tokenizer"):
        load_with_draft(target, other)


def test_standalone_flags_are_sglangs_and_checked_before_anything_starts() -> None:
    def args(*argv: str) -> ServerArgs:
        return ServerArgs(**vars(build_parser().parse_args(list(argv))))

    draft = ("--speculative-algorithm", "STANDALONE", "--speculative-draft-model-path", "/d")
    assert check_speculative_args(args(*draft)) is None
    assert speculative_num_draft_tokens(args(*draft)) == 4  # SGLang's 3 steps, a chain
    steps = args(*draft, "--speculative-num-steps", "5", "--speculative-num-draft-tokens", "6")
    assert check_speculative_args(steps) is None and speculative_num_draft_tokens(steps) == 6
    wrong = {
        ("--speculative-algorithm", "STANDALONE"): "go together",
        ("--speculative-draft-model-path", "/d"): "go together",
        ("--speculative-algorithm", "NGRAM", "--speculative-num-steps", "3"): "STANDALONE's",
        (*draft, "--speculative-num-steps", "0"): "must be in 1..63",
        (*draft, "--speculative-num-draft-tokens", "6"): "--speculative-num-steps + 1 = 4",
        (*draft, "--tp-size", "2"): "with --tp-size 1 only",
    }
    for argv, message in wrong.items():
        mistake = check_speculative_args(args(*argv))
        assert mistake is not None and message in mistake, argv
    assert check_server_args(args(*draft, "--tp-size", "2")) is not None
