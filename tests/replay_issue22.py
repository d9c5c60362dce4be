"""Replays issue 22's regression tests on the code from before its fixes, and on this tree: each
must fail there, for its bug's reason, and pass here.

    python tests/replay_issue22.py [--before 10fe33c] [--only SUBSTRING ...]

How: tests/replay.py. The two kernel-build cases each build the CPU kernels about twice on each
tree (minutes on a loaded machine); `--only regressions/test_kernel_build` runs them alone.
"""

from __future__ import annotations

import sys

from replay import Case, main

BEFORE = "10fe33c"  # main's last commit before any fix of issue 22 (merges of wt/i22a, wt/i22b)

R = "tests/regressions/"
BUILD = R + "test_kernel_build.py::"
FLAGS = R + "test_flags.py::test_a_flag_that_cannot_work_is_one_line_and_exit_2"
OPS = R + "test_operations.py::"
HTTP = R + "test_http_routes.py::"
CHECKS = "tests/test_kernel_checks.py::"

HANG = "a failed first start poisons every later start"
ENVS = "two environments rebuild each other's kernels"
FLAGS_BULLET = "flags are not checked before processes start"
DP = "cache-aware DP routing sends everything to one replica"
MEMORY = "memory before the scheduler is unbounded"
SECURITY = "security and operations"
SHAPES = "the C++ ops trust their shapes"
FIRST_HOUR = "first hour"

CASES = [
    Case(
        HANG,
        BUILD + "test_a_start_killed_mid_build_is_followed_by_one_that_serves_and_says_why",
        "the start hangs",
    ),
    Case(
        ENVS,
        BUILD + "test_two_environments_on_one_cache_do_not_rebuild_each_others_kernels",
        "the other environment's start rebuilt the kernels",
    ),
    Case(
        ENVS,
        "tests/test_kernel_cache.py::"
        "test_an_unwritable_cache_falls_back_to_torch_native_with_one_warning",
        "NotADirectoryError|FileExistsError",
    ),
    Case(FLAGS_BULLET, FLAGS + "[tp-size-3]", "--tp-size 3 was not refused in one line"),
    Case(FLAGS_BULLET, FLAGS + "[page-size-0]", "--page-size 0 was accepted"),
    Case(FLAGS_BULLET, FLAGS + "[max-prefill-tokens-0]", "--max-prefill-tokens 0 was accepted"),
    Case(
        DP,
        R + "test_dp_routing.py::test_cache_aware_routing_keeps_both_replicas_busy",
        "no load term, all to one replica",
    ),
    Case(
        MEMORY,
        OPS + "test_health_answers_in_bounded_time_while_the_scheduler_is_stuck",
        "waited 30 s on a stuck scheduler: no timeout",
    ),
    Case(
        SECURITY,
        "tests/test_launch.py::test_the_api_key_comes_from_the_environment_too",
        "assert None == 'from-env'",  # the server's key is not read from RADIXSERVE_API_KEY
    ),
    Case(
        SECURITY,
        "tests/test_client.py::test_an_api_key_goes_with_every_request",
        "unexpected keyword argument 'api_key'",  # the bug itself: no way to send a key
    ),
    Case(SECURITY, HTTP + "test_flush_cache_is_post_only", "GET /flush_cache flushed the cache"),
    Case(
        SECURITY,
        HTTP + "test_a_body_that_is_not_declared_json_is_refused",
        "a text/plain body was parsed",
    ),
    Case(SECURITY, OPS + "test_sighup_drains_like_sigterm", "SIGHUP not handled"),
    Case(
        SECURITY,
        "tests/test_launch.py::test_a_child_whose_parent_died_before_pdeathsig_was_set_exits",
        r"assert \(True and not True\)",  # it started, and survived its parent
    ),
    Case(
        SECURITY,
        OPS + "test_each_server_process_is_named_by_its_role",
        "not named by role in ps: .*multiprocessing.spawn",
    ),
    Case(
        SHAPES,
        CHECKS + "test_paged_attention_refuses_what_disagrees[v_cache smaller]",
        "DID NOT RAISE",
    ),
    Case(
        SHAPES,
        CHECKS + "test_paged_attention_refuses_what_disagrees[v shorter than k]",
        "DID NOT RAISE",
    ),
    Case(
        SHAPES,
        CHECKS + "test_the_small_ops_refuse_what_disagrees[fused_add_rms_norm: weight short]",
        "DID NOT RAISE",
    ),
    Case(
        SHAPES,
        CHECKS + "test_the_small_ops_refuse_what_disagrees[rotary_embedding: k of other tokens]",
        "DID NOT RAISE",
    ),
    Case(
        FIRST_HOUR,
        "tests/test_commands.py::test_every_readme_example_addresses_the_quick_start_server",
        "30081|30001",  # the old README's ports, not the quick start's
    ),
    Case(
        FIRST_HOUR,
        "tests/test_client.py::test_generate_of_n_completions_is_a_usage_error",
        r"ValueError: generate\(\) returns one completion",
    ),
    Case(FIRST_HOUR, OPS + "test_the_last_log_line_says_stopped", "the last log line is not"),
    Case(
        FIRST_HOUR,
        R + "test_make.py::test_make_serve_installs_no_test_tools",
        "installs the test tools",
    ),
    Case(
        FIRST_HOUR,
        R + "test_make.py::test_without_a_gpu_make_takes_the_cpu_torch",
        r"torch comes from PyPI \(the CUDA build\)",
    ),
]

NOT_REPLAYABLE = [
    (
        "GPU, read only",
        "the overlap thread's torch.cuda.set_device needs two CUDA devices; none here",
    ),
    (
        ENVS + " (ARM)",
        "the key's CPU `Features` matter on ARM only; this machine is x86",
    ),
    (
        SHAPES + " (crashes)",
        "zero KV heads (SIGFPE), a slot past the pool (abort) and a negative slot (SIGSEGV) kill "
        "the old tree's pytest, so they read as errors, not failures; the cases above are the "
        "bad shapes it runs through without a word",
    ),
    (
        SHAPES + " (subnormal int8 scale)",
        "on x86 the infinite 1/scale casts to int8 0, so the old products come out 0 all the same; "
        "only the scale itself differs (test_quantization.py checks it, with names the old tree "
        "lacks)",
    ),
    (
        SHAPES + " (AVX2 -128)",
        "the sign of a -128 weight went wrong on AVX2's path only; this machine runs AVX-512's",
    ),
    (
        MEMORY + " (pending bytes)",
        "the caps on requests and bytes waiting for the tokenizer: a prompt that waits there "
        "long enough to fill them needs a context the tiny model lacks (past it, this tree "
        "refuses it at once, before it waits), and tests/test_admission.py and test_flood.py, "
        "which show them here, import what the old tree lacks; the control queries' timeout, "
        "the bullet's other half, is replayed above",
    ),
]


if __name__ == "__main__":
    sys.exit(main(CASES, BEFORE, 22, __doc__ or "", NOT_REPLAYABLE))
