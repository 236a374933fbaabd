"""The README's test command's time budget: tests that run only in the ``long`` tier, each beside its quick twin.

The default run (``python -m pytest``) must stay under 450 s on a 2-core
machine; CI runs ``-m long`` after it. Each entry below is a variant whose
mechanism another test of the default run exercises (named in the comment):
another transport, another model of the same schedule sweep, another
placement, a larger sweep. conftest.py marks them ``long`` at collection, and
refuses an entry that names no test (a renamed test would otherwise come back
into the default run unnoticed, or drop out of both).

Node ids are relative to ``tests/``, as pytest prints them after ``tests/``.
"""
from __future__ import annotations

LONG: dict[str, str] = {
    # every schedule against the unsplit model: gloo-blocks-4 and shm-mlp-4 stay
    "stages/test_distributed.py::test_every_schedule_matches_unsplit_model[shm-blocks-4]": "gloo-blocks-4",
    "stages/test_distributed.py::test_every_schedule_matches_unsplit_model[gloo-tuple-4]": "shm-tuple-2",
    "stages/test_distributed.py::test_every_schedule_matches_unsplit_model[gloo-mlp-4]": "shm-mlp-4",
    "stages/test_distributed.py::test_every_schedule_matches_unsplit_model[shm-tuple-4]": "shm-tuple-2",
    "stages/test_distributed.py::test_every_schedule_matches_unsplit_model[gloo-blocks-2]": "gloo-blocks-4",
    "stages/test_distributed.py::test_every_schedule_matches_unsplit_model[shm-blocks-2]": "gloo-blocks-4",
    "stages/test_distributed.py::test_every_schedule_matches_unsplit_model[gloo-mlp-2]": "shm-mlp-4",
    "stages/test_distributed.py::test_eval_then_step_every_schedule[shm]": "[gloo]",
    "stages/test_variable_microbatches.py::test_every_schedule_is_exact_with_microbatches_of_different_lengths[4-8]":
        "[2-4]",
    "stages/test_compiled_stages.py::test_compiled_stages_exact_under_every_schedule":
        "test_split_compiled_stages_exact_without_fallback, the composition matrix's compiled cases",
    # the entry points a tensor kind reaches: DTensor's single-process sweep (30 s of DTensor start-up in a child)
    "runtime/test_tensor_kinds.py::test_every_single_process_entry_point_handles_or_names_a_tensor_the_core_cannot_read"
    "[dtensor]": "test_a_dtensor_stage_output_is_refused_by_name_in_one_child_process and the other kinds",
    "runtime/test_tensor_kinds.py::test_pp2_tp2_rowwise_parallel_dtensor_output_without_a_receiving_mesh_raises_by_name"
    "[shm]": "[gloo]",
    "runtime/test_tensor_kinds.py::test_a_dtensor_between_stages_raises_by_name_and_kills_no_process[shm-stage]":
        "[gloo-stage]",
    "runtime/test_tensor_kinds.py::test_a_dtensor_between_stages_raises_by_name_and_kills_no_process[shm-channel]":
        "[gloo-stage]",
    "runtime/test_tensor_kinds.py::test_a_dtensor_between_stages_raises_by_name_and_kills_no_process[gloo-channel]":
        "[gloo-stage]",
    "runtime/test_custom_ops.py::test_gradients_through_ops_under_compile_equal_eager[inductor]": "[aot_eager] etc.",
    "runtime/test_split_regions.py::test_zero_bubble_schedules_train_exactly_on_four_ranks[pool_checkpoint]":
        "[sac], [attention], [gated], the single-process regions",
    "runtime/test_split_regions.py::test_zero_bubble_schedules_train_exactly_on_four_ranks[offload_checkpoint]":
        "[sac], [attention], [gated], the single-process regions",
    "runtime/test_split_regions.py::test_zero_bubble_schedules_train_exactly_on_four_ranks[checkpoint]":
        "[sac], the single-process [checkpoint]",
    "runtime/test_split_regions.py::test_zero_bubble_schedules_train_exactly_on_four_ranks[tied]":
        "the single-process [tied]",
    "runtime/test_split_regions.py::test_zero_bubble_schedules_train_exactly_on_four_ranks[reentrant]":
        "the single-process [reentrant]",
    "runtime/test_split_regions.py::test_zero_bubble_schedules_train_exactly_on_four_ranks[offload]":
        "the single-process [offload]",
    "runtime/test_overlap.py::test_a_half_that_raises_fails_the_step_on_every_rank_naming_the_pair[F]": "[B]",
    "runtime/test_overlap.py::test_moe_with_expert_all_to_all_overlapped_equals_sequential_and_unsplit[c10d]":
        "[functional]",
    # pp x tp: the replicate placement stays for each of these; local and sequence run in the tier
    "parallel/test_tensor_parallel.py::test_torch_pipeline_stage_on_the_same_case_for_reference[sequence]": "[replicate]",
    "parallel/test_tensor_parallel.py::test_pp_x_fsdp_x_tp_2x1x2_matches_the_unsplit_model[sequence]": "[replicate]",
    "parallel/test_tensor_parallel.py::test_pp_x_tp_v_schedules_match_the_unsplit_model[sequence]": "[replicate]",
    "parallel/test_tensor_parallel.py::test_pp_x_tp_matches_the_unsplit_model[local]": "[replicate], [sequence]",
    "parallel/test_tensor_parallel_training.py::"
    "test_dcp_save_and_load_of_pp_x_tp_stages_resumes_bitwise_and_the_unsplit_model_loads_it":
        "test_training_tools' DCP resume, the 8-rank tier's DCP case",
    # the Pipe: every schedule on the blocks model stays
    "pipe/test_pipe.py::test_step_matches_unsplit_model_for_every_schedule[tuple]": "[blocks]",
    "pipe/test_pipe.py::test_step_matches_unsplit_model_for_every_schedule[mlp]": "[blocks]",
    "pipe/test_pipe_parity.py::test_users_checkpoint_with_dropout_matches_unsplit_model_bitwise[sac-schedules1]":
        "[plain-schedules0], [sac-schedules0]",
    # failures named within the timeout: one variant per mechanism stays
    "robustness/test_robustness.py::test_single_process_200_steps_no_memory_growth":
        "test_multi_process_200_steps_no_memory_growth_and_1f1b_bound",
    "robustness/test_robustness.py::test_multi_process_peer_failure_makes_others_raise_within_timeout[gloo-sigstop]":
        "[shm-sigstop]",
    "robustness/test_robustness.py::test_multi_process_peer_failure_makes_others_raise_within_timeout[shm-stall]":
        "[gloo-stall]",
    "robustness/test_clean_exit.py::test_a_two_rank_job_on_fresh_interpreters_exits_0_without_destroy_process_group[2]":
        "[0], [1]",
    "robustness/test_signal_storm.py::test_a_signal_storm_under_load_never_ends_a_wait_and_ctrl_c_still_does[shm]":
        "[gloo]",
    "comm/test_step_agreement.py::test_a_stopped_peer_during_the_discovery_step_is_named_within_the_timeout[shm]":
        "[gloo]",
    "comm/test_message_identity.py::test_a_failed_steps_messages_are_never_taken_by_a_later_step_even_at_1025[gloo]":
        "[shm]",
    "comm/test_message_identity.py::test_another_schedule_on_the_group_never_takes_a_failed_steps_messages"
    "[gloo-rebuilt-schedule]": "[gloo-two-schedules-one-group]",
    "comm/test_launch.py::test_a_script_that_raises_in_the_fork_server_still_runs_in_each_rank":
        "test_ranks_do_not_run_the_callers_script_again",
    "comm/test_startup.py::test_a_step_loads_neither_torch_pipelining_nor_fsdp_and_torch_parity_still_holds"
    "[torch-first]": "[pipeline_ext-only]",
    # schedules: the largest sweeps
    "schedules/test_schedules_builtin.py::test_every_builtin_valid_and_deadlock_free[dualpipev]":
        "the other builtins' sweeps, test_nccl_order's quick grid",
    "schedules/test_schedules_builtin.py::test_every_builtin_valid_and_deadlock_free[v_half-p6..8]": "[v_half]",
    "schedules/test_schedules_builtin.py::test_every_builtin_valid_and_deadlock_free[v_min-p6..8]": "[v_min]",
    "schedules/test_schedules_auto.py::test_auto_vs_zb_h1[16-64-costs1]": "the smaller cases",
    "schedules/test_schedules_select.py::test_the_choice_flips_where_the_split_overhead_crosses_the_bubble[4-16]":
        "[4-8]",
    # round two of the budget (the first of each pair stays)
    "stages/test_distributed.py::test_every_schedule_matches_unsplit_model[shm-mlp-4]": "shm-mlp-2, gloo-blocks-4",
    "stages/test_compiled_stages.py::test_split_backend_on_dtensors_splits_after_a_whole_backward":
        "the composition matrix's split_backend x tp=replicate cases (its tier), "
        "test_split_backend_i_computes_no_weight_grad_and_w_completes_it",
    "comm/test_edge_transport.py::test_a_two_by_two_job_shares_memory_inside_each_host_and_is_exact":
        "the hosts tier's two-host jobs, the single-host edge tests",
    "comm/test_channels.py::test_dist_recv_times_out_naming_what[shm]": "[gloo]",
    "runtime/test_split_regions.py::test_zero_bubble_schedules_train_exactly_on_four_ranks[attention]":
        "[sac], the single-process [attention]",
    "runtime/test_split_regions.py::test_zero_bubble_schedules_train_exactly_on_four_ranks[gated]":
        "[sac], the single-process [gated]",
    "parallel/test_tensor_parallel.py::test_torch_pipeline_stage_on_the_same_case_for_reference[replicate]":
        "benchmarks/bench_tensor_parallel.py runs torch beside us; the pp x tp tests against the unsplit model",
    "robustness/test_robustness.py::test_multi_process_peer_failure_makes_others_raise_within_timeout[shm-sigstop]":
        "[gloo-stall], [gloo-exit], [shm-exit]",
    "tools/test_rank_pool.py::test_a_rank_that_fails_is_named_and_the_next_run_gets_a_new_pool[hang]": "[raise], [exit]",
    "tools/test_gpu_check_plan.py::test_the_tests_the_script_names_exist": "the dry-run plan tests",
    "examples/test_example_llama.py::test_llama_example_with_sequence_pieces_passes_check[1f1b-4-cost]":
        "test_llama_pieces_of_microbatches_of_different_lengths_match_the_unsplit_model (HF Llama, masks, in the pool)",
    "runtime/test_tensor_kinds.py::test_every_single_process_entry_point_handles_or_names_a_tensor_the_core_cannot_read"
    "[sparse_csr]": "[sparse_coo], [wrapper], [fake], [nested], [jagged]",
    "runtime/test_tensor_kinds.py::test_every_single_process_entry_point_handles_or_names_a_tensor_the_core_cannot_read"
    "[quantized]": "[sparse_coo], [wrapper], [fake], [nested], [jagged]",
    "runtime/test_tensor_kinds.py::test_every_single_process_entry_point_handles_or_names_a_tensor_the_core_cannot_read"
    "[mkldnn]": "[sparse_coo], [wrapper], [fake], [nested], [jagged]",
    "runtime/test_tensor_kinds.py::test_every_single_process_entry_point_handles_or_names_a_tensor_the_core_cannot_read"
    "[meta]": "[sparse_coo], [wrapper], [fake], [nested], [jagged]",
    # sequence pieces on the Hugging Face Llama (the step_microbatches case in the pool stays)
    "examples/test_example_llama.py::test_llama_example_with_sequence_pieces_passes_check[zb_h1-2-equal]":
        "[1f1b-4-cost]",
    "examples/test_example_llama.py::test_llama_example_with_sequence_pieces_passes_check[interleaved_1f1b-2-equal]":
        "[1f1b-4-cost], tests/seqchunks/test_seq1f1b_pipeline.py's interleaved case",
    # the examples: the pp2 x dp2 run with --check stays
    "examples/test_example_llama.py::test_llama_example_balance_on_4_stages_prints_a_valid_split_and_passes_check":
        "test_llama_example_pp2_dp2_prints_layout_passes_check_and_trains, tests/pipe/test_balance.py",
}
