"""What the default test run (CI's `tools/test.sh`) leaves to `tools/test.sh --full`.

Note [The default run and --full]
CI runs tools/test.sh on a clean 2-core machine in a fixed time, and on the AMD EPYC machines of
2026-11 the whole pytest suite alone took 38 minutes (each rank process of a multi-process test
spends ~7 s of CPU importing torch and patrickstar). The default run therefore takes
`-m "not slow"`, and this module marks as slow what it leaves to `--full`, which runs every test:

- a test function named in FULL_ONLY, whole, or all its parametrizations but the ids kept;
- in a function named in EACH_CHOICE, the parametrizations beyond an each-choice cover: every
  value of every parameter appears in at least one test the default run takes (the first in
  collection order that brings a value not yet covered), not every combination of them.

What is left out is what another default test already takes through the same code: the other
parametrizations of a scenario, a second launch of the same multi-process path, a random-moment
kill beside the every-stage one. A name here that no collected test has is an error, so the
list cannot go stale silently. tests/python/test_run_selection.py checks the rules.
"""
from __future__ import annotations

from collections.abc import Sequence

WHOLE = ()

# "file.py::test_function" -> WHOLE, or the parametrization ids the default run keeps.
FULL_ONLY: dict[str, Sequence[str]] = {
    # Builds the sdist and then the wheel from it: the whole C++ build a second time (~6 min).
    "test_packaging.py::test_wheel_built_from_the_sdist_holds_the_whole_package": WHOLE,
    # Every boundary run on two ranks in one launch (~2 min); test_lowp_boundaries' two-rank
    # reshard and test_data_parallel's boundary scenarios take the same path by default.
    "test_boundary_sizes.py::test_two_ranks_train_resume_and_reshard_at_every_boundary": WHOLE,
    # One launch per read; the default keeps the save.
    "test_data_parallel.py::test_reads_on_one_rank_are_served_by_the_others_as_with_ddp":
        ("save",),
    "test_data_parallel.py::test_optimizer_state_dict_saved_by_one_rank_resumes_every_rank":
        ("bf16-no-master",),
    "test_data_parallel.py::test_zero_grad_in_the_middle_of_an_accumulation_drops_it_on_every_rank":
        ("sharded",),
    "test_data_parallel.py::test_steps_without_gradients_are_pytorchs_no_op_on_every_rank":
        ("key",),
    "test_data_parallel.py::test_accelerate_loop_trains_as_torch_on_the_global_batch": ("2",),
    # test_generate_on_one_rank_is_served_by_the_others takes the served generate by default.
    "test_data_parallel.py::"
    "test_an_encoder_decoder_generates_on_every_rank_also_when_told_not_to_sync":
        WHOLE,
    "test_data_parallel.py::"
    "test_module_generate_of_different_lengths_is_served_by_the_rank_done_first":
        WHOLE,
    "test_data_parallel.py::test_generate_of_different_lengths_on_each_rank_runs_as_under_zero3":
        WHOLE,
    "test_data_parallel.py::"
    "test_evaluation_on_one_rank_before_the_scripts_own_collective_is_served":
        ("--lonely-eval-broadcast",),
    "test_buffers_data_parallel.py::test_batchnorm_statistics_follow_ddp_on_every_rank": ("1",),
    "test_ddp_recipes.py::test_a_rank_failing_mid_epoch_fails_the_other_at_once": ("backward",),
    "test_two_engines.py::test_a_gan_of_two_engines_trains_as_ddp_with_reads_on_one_rank":
        ("model",),
    # The same Trainer path on one process stays (test_load_best_model_at_end_loads_...).
    "test_hf_trainer_features.py::test_load_best_model_at_end_under_data_parallelism": WHOLE,
    "test_hf_trainer_features.py::test_gradient_accumulation_in_training_arguments": ("True",),
    "test_hf_families_more.py::test_buffers_computing_as_weights_train_in_bf16_as_pytorchs":
        ("detr",),
    "test_canonical_scripts.py::"
    "test_run_clm_no_trainer_with_accelerate_trains_resumes_and_saves_as_the_plain_script":
        ("engine",),
    "test_deepspeed_schedulers.py::"
    "test_training_equals_pytorch_with_lambda_lr_of_the_same_schedule":
        ("WarmupLR-0", "OneCycle-6"),
    # A process per parametrization; one of each stays.
    "test_engine_lifetime.py::test_process_exit_removes_swap_files": ("exit",),
    "test_engine_lifetime.py::test_an_exit_function_registered_before_initialize_reads_the_model":
        ("1",),
    "test_engine_lifetime.py::test_twenty_cycles_keep_rss_flat_and_leave_no_file": ("1",),
    "test_engine_lifetime.py::"
    "test_a_forked_child_refuses_the_engine_and_its_exit_leaves_the_parent_alone":
        ("0",),
    "test_profile.py::test_a_config_profile_written_at_exit_says_whether_the_script_failed":
        ("config-fail",),
    # test_cli_entry_point_is_installed runs the same command line through its entry point.
    "test_profile.py::test_cli_runs_as_a_module": WHOLE,
    # Two-rank variants of paths a kept test takes: test_full_grad and the averaged-gradient
    # scenarios; test_steps_without_gradients_...; the raise guard; the Trainer's final save;
    # reads_on_one_rank[save]; test_ddp_accumulation_without_the_key_matches_pytorch.
    "test_data_parallel.py::test_full_gradients_are_the_averaged_gradients_on_every_rank": WHOLE,
    "test_data_parallel.py::test_model_steps_without_backward_are_micro_steps_on_every_rank": WHOLE,
    "test_data_parallel.py::"
    "test_a_default_group_that_takes_no_host_tensors_trains_over_gloo_groups":
        WHOLE,
    "test_data_parallel.py::test_ddp_accumulation_without_the_key_reads_clips_and_steps_as_pytorch":
        WHOLE,
    "test_guards_data_parallel.py::test_skip_on_one_rank_skips_the_step_on_every_rank": WHOLE,
    "test_hf_training.py::test_a_final_save_after_the_other_rank_stopped_waiting_names_the_barrier":
        WHOLE,
    "test_canonical_scripts.py::test_one_rank_saving_the_module_under_data_parallelism_is_served":
        WHOLE,
    "test_parallelism.py::test_pipeline_stages_with_data_parallelism_checkpoint_and_resume": WHOLE,
    # A process per driver or SIMD level; one stays.
    "test_bench_arguments.py::test_drivers_refuse_bad_sizes_before_any_work":
        ("train_cpu.py-argv0-argument --steps: must be >= 1 (got -3)",),
    "test_adam.py::test_ps_adam_simd_environment_variable": ("scalar", "bogus"),
    # More two-rank (or four-rank) launches of paths a kept test takes: the served reads
    # (reads_on_one_rank[save], generate_on_one_rank), torchrun (test_ddp_recipes), a stalled
    # peer (test_a_stalled_rank_is_a_timeout_naming_the_collective), a kill during a save (the
    # one-process every-stage kill and the two-rank resume), the engine's own errors; the MoE
    # families train one process each in test_hf_families_more::test_family_trains_as_pytorch.
    "test_data_parallel.py::"
    "test_forwards_of_the_module_itself_run_on_every_rank_as_through_the_engine":
        WHOLE,
    "test_data_parallel.py::test_four_ranks_through_torchrun_match_pytorch": WHOLE,
    "test_data_parallel.py::test_wrapping_the_engine_in_torch_ddp_says_the_engine_is_data_parallel":
        WHOLE,
    "test_parallelism.py::test_a_stalled_stage_is_a_timeout_naming_it": WHOLE,
    "test_dp_checkpoint.py::test_sigkill_of_one_rank_at_every_stage_of_a_two_rank_save": WHOLE,
    "test_hf_families_more.py::"
    "test_two_ranks_routing_their_own_batches_match_pytorchs_averaged_gradients": WHOLE,
    "test_initialize.py::"
    "test_torch_compile_of_the_engine_trains_as_the_engine_without_recompiling_its_hooks":
        ("None",),
    # The bench drivers' argument errors: test_bench_arguments keeps one driver's.
    "test_adam_bench.py::test_bad_arguments_are_named": WHOLE,
    # test_cli_entry_point_is_installed keeps a run of the command line.
    "test_profile.py::test_cli_piped_into_head_regenerates_the_page_without_a_traceback": WHOLE,
    # The every-stage kills are deterministic and stay; the random moments add more moments.
    "test_checkpoint.py::test_sigkill_at_random_moments_never_breaks_latest": WHOLE,
    "test_dp_checkpoint.py::test_sigkill_at_random_moments_of_two_rank_saves_never_breaks_latest":
        WHOLE,
}

# "file.py::test_function" whose parametrizations the default run covers value by value.
EACH_CHOICE: tuple[str, ...] = (
    "test_boundary_sizes.py::test_one_rank_trains_like_the_reference_and_resumes_exactly",
    "test_boundary_sizes.py::"
    "test_one_rank_accumulating_gradients_trains_like_the_reference_and_resumes_exactly",
    "test_boundary_sizes.py::"
    "test_estimate_and_memory_stats_equal_the_layout_of_small_and_unaligned_tensors",
    "test_boundary_sizes.py::test_estimate_memory_equals_the_layout_at_every_boundary",
    "test_lowp_boundaries.py::"
    "test_a_tied_odd_vocabulary_trains_like_the_reference_and_resumes_exactly",
)


def function_key(nodeid: str) -> str:
    """'tests/python/test_x.py::test_y[ids]' -> 'test_x.py::test_y'."""
    path, _, name = nodeid.partition("::")
    return f"{path.rsplit('/', 1)[-1]}::{name.split('[', 1)[0]}"


def each_choice_cover(params: Sequence[dict]) -> set[int]:
    """Indices of a subset of `params` in which every (name, value) of the whole appears."""
    covered: set[tuple[str, str]] = set()
    kept: set[int] = set()
    for index, values in enumerate(params):
        pairs = {(name, repr(value)) for name, value in values.items()}
        if not pairs <= covered:
            kept.add(index)
            covered |= pairs
    return kept


def deferred(nodeids: Sequence[str], params: Sequence[dict],
             ids: Sequence[str | None]) -> tuple[set[int], set[str]]:
    """Which of the collected tests the default run leaves to --full (their indices), and which
    names of FULL_ONLY or EACH_CHOICE matched a collected file but none of its tests."""
    by_function: dict[str, list[int]] = {}
    for index, nodeid in enumerate(nodeids):
        by_function.setdefault(function_key(nodeid), []).append(index)
    later: set[int] = set()
    for key, keep in FULL_ONLY.items():
        for index in by_function.get(key, []):
            if keep is WHOLE or ids[index] not in keep:
                later.add(index)
    for key in EACH_CHOICE:
        indices = by_function.get(key, [])
        kept = each_choice_cover([params[i] for i in indices])
        later.update(i for n, i in enumerate(indices) if n not in kept)
    files = {key.split("::")[0] for key in by_function}
    unmatched = {key for key in (*FULL_ONLY, *EACH_CHOICE)
                 if key.split("::")[0] in files and key not in by_function}
    unmatched |= {f"{key}[{keep_id}]" for key, keep in FULL_ONLY.items() if keep is not WHOLE
                  for keep_id in keep if key in by_function
                  and keep_id not in {ids[i] for i in by_function[key]}}
    return later, unmatched
