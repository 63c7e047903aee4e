"""Which tests are `slow`: one row per kind of slowness, each with the tests it covers (fnmatch patterns over
`file.py::test_name[params]`). conftest.py marks every test a pattern matches, so `pytest -m "not slow"` is the
quick loop (under 3 minutes on the 2-core box) and the default run still runs everything (tests/README.md).
A row is a reason a test is slow, not a judgement of the test: each of these proves what the quick ones cannot.
tests/test_slow_marker.py fails when a pattern matches no test (a rename left it behind)."""

from __future__ import annotations

from fnmatch import fnmatchcase

SLOW: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("verify: gloo ranks or transformers' own model generate", (
        "test_verify.py::*", "test_config_reading.py::*verif*", "test_config_reading.py::*verify*",
        "test_config_reading.py::test_without_transformers_the_bundled_model_answers_and_says_so",
        "test_dense.py::*verify*", "test_moe.py::*verif*", "test_moe_fp8.py::*verif*",
        "test_mla_types.py::*verif*", "test_multimodal.py::*verif*", "test_deepseek_v4.py::*verif*",
        "test_deepseek_v4.py::test_bfloat16_forward_matches_transformers", "test_deepseek_v4_fp8.py::*verif*",
        "test_deepseek_variants.py::*verif*", "test_llama4.py::*verif*", "test_mimo.py::*verif*",
        "test_minimax_m3.py::*verif*", "test_gpt_oss_pipeline.py::*verif*", "test_gated_deltanet.py::*verif*",
        "test_kimi_linear.py::*verif*", "test_longcat_flash.py::*verif*", "test_mistral_large4.py::*verif*",
        "test_nodes.py::*verif*",
        "test_longcat_flash.py::test_a_published_reference_falls_back_to_the_bundled_model_and_says_why",
        "test_gpt_oss_pipeline.py::test_bf16_export_generates_like_the_mxfp4_original_in_transformers",
        "test_gpt_oss_model.py::*", "test_mp8.py::*", "test_quantize.py::*verify*", "test_mxfp4.py::*generates*",
        "test_newcomer.py::test_convert_verify*", "test_one_spine.py::test_convert_verify*",
        "test_mla_types.py::test_mistral4_query_scaling_is_what_verify_checks")),
    ("the local hub: the real huggingface_hub client against tests/hub_server.py", (
        "test_download.py::*", "test_hub_options.py::*", "test_hub_stream.py::*", "test_hub_transfer_limits.py::*",
        "test_hub_names.py::*", "test_streaming_checkpoint.py::*")),
    ("crashes and signals: SIGKILL, SIGTERM, SIGSTOP, a full or changing disk, at failpoints", (
        "test_crash_safety.py::*", "test_signals_and_liveness.py::*", "test_truncated_input.py::*",
        "test_full_disk.py::*", "test_dst_changed_during_run.py::*", "test_stray_torchrun_env.py::*",
        "test_forked.py::*killed*", "test_one_spine.py::test_merge_killed_anywhere*")),
    ("torchrun: real process groups of several ranks", (
        "test_distributed_convert.py::*", "test_one_spine.py::*torchrun*", "test_dcp_in.py::*torchrun*")),
    ("fuzzing and parser bounds: hypothesis, a million tensors", (
        "test_fuzz_parser.py::*", "test_fuzz_inputs.py::*", "test_header_bounds.py::*")),
    ("packaging: an sdist and wheels built and installed, pytest run inside them", (
        "test_newcomer.py::test_sdist_*", "test_newcomer.py::test_built_wheel_*",
        "test_newcomer.py::test_a_wheel_without_the_c_loops_*",
        "test_newcomer.py::test_reference_script_tests_skip_*")),
    ("memory: peak RSS of conversions at two sizes", ("test_memory.py::*",)),
    ("published dimensions: DeepSeek-V4-Flash planned from sparse files at its real size",
     ("test_deepseek_v4_plan.py::*",)),
    ("fresh interpreters: the real executable, or every module imported, in child processes", (
        "test_settings.py::test_importing_ckpttool_writes_no_environment_variable",
        "test_convert.py::test_cpu_conversion_never_imports_torch",
        "test_convert.py::test_with_the_c_kernels_a_conversion_never_imports_numba",
        "test_newcomer.py::test_core_commands_run_without_torch", "test_newcomer.py::test_what_needs_torch_*",
        "test_no_tracebacks.py::test_the_real_executable_*", "test_api.py::test_importing_the_package_*",
        "test_slow_marker.py::test_not_slow_leaves_out_*")),
    ("the reference pipeline: DeepSeek's convert.py in a child process", (
        "test_convert.py::*reference*",)),
    ("Triton's interpreter running CUDA kernels on the CPU", (
        "test_nan_flag.py::test_cells_in_the_interpreter", "test_mxfp4.py::test_triton_kernel_in_interpreter*")),
)


def category(nodeid: str) -> str | None:
    """The reason `nodeid` (`file.py::test[params]`, any directory part dropped) is slow, or None."""
    nodeid = nodeid.rsplit("/", 1)[-1]
    for reason, patterns in SLOW:
        if any(fnmatchcase(nodeid, p) for p in patterns):
            return reason
    return None
