"""Every flag changes behaviour, and a named test shows it: a flag that is accepted and does nothing is a defect.

A new RunConfig field fails `test_every_flag_is_audited` until it is listed here with the test that shows its effect.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

from engine.config import RunConfig

TESTS = Path(__file__).parent

FLAG_TESTS = {
    # data
    "hf_checkpoint": "test_doctor.py::test_a_config_json_that_is_not_json",
    "model_name": "test_doctor.py::test_rf04_model_name_mismatch_and_multinode_hint",
    "prompt_data": "test_doctor.py::test_a_prompt_file_that_is_not_utf8",
    "rollout_max_prompt_len": "test_flag_wiring.py::test_rollout_max_prompt_len_drops_the_long_rows_when_the_data_is_loaded",
    "eval_prompt_data": "test_checkpoint_s3.py::test_rf01_on_an_empty_prefix_and_no_secret_anywhere",
    "rollout_max_context_len":
        "test_flag_wiring.py::test_max_context_len_caps_prompts_and_answers_and_the_doctor_counts_the_cap",
    "eval_max_context_len":
        "test_flag_wiring.py::test_max_context_len_caps_prompts_and_answers_and_the_doctor_counts_the_cap",
    "eval_max_samples": "test_flag_wiring.py::test_place_flags",
    "eval_interval": "test_flow.py::test_two_rollouts_end_to_end",
    "n_samples_per_eval_prompt": "test_flow.py::test_two_rollouts_end_to_end",
    "eval_temperature": "test_flag_wiring.py::test_eval_sampling_flags_reach_the_evaluation",
    "eval_top_p": "test_flag_wiring.py::test_eval_sampling_flags_reach_the_evaluation",
    "eval_max_response_len": "test_flag_wiring.py::test_eval_sampling_flags_reach_the_evaluation",
    "eval_min_new_tokens": "test_flag_wiring.py::test_eval_sampling_flags_reach_the_evaluation",
    "input_key": "test_data.py::test_row_without_input_key_names_line",
    "label_key": "test_data.py::test_row_without_input_key_names_line",
    "metadata_key": "test_data.py::test_parquet_with_metadata_and_row_numbers",
    "tool_key": "test_flag_wiring.py::test_tool_key_puts_each_rows_tools_into_its_prompt_and_metadata",
    "eval_tool_key": "test_flag_wiring.py::test_tool_key_puts_each_rows_tools_into_its_prompt_and_metadata",
    "apply_chat_template": "test_doctor.py::test_rf09_templating_twice",
    "apply_chat_template_kwargs":
        "test_flag_wiring.py::test_apply_chat_template_kwargs_reach_every_rendering_of_a_prompt",
    "rollout_shuffle": "test_flag_wiring.py::test_place_flags",
    "rm_type": "test_flag_wiring.py::test_place_flags",
    "custom_rm_path": "test_data.py::test_async_group_and_dict_rewards",
    "rm_url": "test_data.py::test_a_remote_reward_service_scores_each_sample_as_slime_sends_it",
    "reward_key": "test_hooks.py::test_reward_key_picks_the_training_and_the_eval_reward_from_a_dict",
    "log_reward_category": "test_hooks.py::test_log_reward_category_logs_the_share_of_each_reason",
    "eval_reward_key": "test_hooks.py::test_reward_key_picks_the_training_and_the_eval_reward_from_a_dict",
    "eval_config": "test_eval_config.py::test_each_set_is_evaluated_with_its_own_keys_reward_and_sampling",
    "eval_top_k": "test_eval_config.py::test_eval_key_and_top_k_flags_are_every_sets_default",
    "eval_input_key": "test_eval_config.py::test_eval_key_and_top_k_flags_are_every_sets_default",
    "eval_label_key": "test_eval_config.py::test_eval_key_and_top_k_flags_are_every_sets_default",
    "skip_eval_before_train": "test_eval_config.py::test_a_run_with_an_eval_config_that_skips_the_evaluation_before_training",
    "log_passrate": "test_hooks.py::test_log_passrate_logs_pass_at_k_of_the_rollout",
    "eval_max_prompt_len": "test_flag_wiring.py::test_eval_max_prompt_len_drops_long_eval_rows_before_the_eval_max_samples_are_taken",
    "use_tensorboard": "test_tensorboard.py::test_a_run_and_its_resume_write_every_metric_to_tensorboard",
    "tb_project_name": "test_tensorboard.py::test_tensorboard_flags_and_where_the_files_go",
    "tb_experiment_name": "test_tensorboard.py::test_tensorboard_flags_and_where_the_files_go",
    "use_pytorch_profiler": "test_profiling.py::test_the_profiler_records_the_window_and_the_targets_asked_for",
    "profile_step_start": "test_profiling.py::test_the_profiler_records_the_window_and_the_targets_asked_for",
    "profile_step_end": "test_profiling.py::test_the_profiler_records_the_window_and_the_targets_asked_for",
    "profile_target": "test_profiling.py::test_the_profiler_records_the_window_and_the_targets_asked_for",
    "profile_ranks": "test_profiling.py::test_a_rank_outside_profile_ranks_writes_nothing",
    "record_memory_history":
        "test_profiling.py::test_on_cuda_the_trace_has_the_kernels_and_the_memory_snapshot_its_allocations",
    "memory_snapshot_dir":
        "test_profiling.py::test_the_files_go_under_the_work_dir_and_memory_snapshot_dir_as_the_driver_resolves_them",
    "memory_snapshot_num_steps":
        "test_profiling.py::test_on_cuda_the_trace_has_the_kernels_and_the_memory_snapshot_its_allocations",
    "memory_recorder": "test_profiling.py::test_memray_records_the_ranks_host_allocations_until_the_rollout_asked_for",
    "memory_snapshot_path":
        "test_profiling.py::test_on_cuda_the_trace_has_the_kernels_and_the_memory_snapshot_its_allocations",
    "use_wandb": "test_wandb.py::test_a_run_and_its_resume_mirror_every_metric_into_one_wandb_run",
    "wandb_project": "test_wandb.py::test_wandb_flags_need_use_wandb_and_reach_wandb_init",
    "wandb_team": "test_wandb.py::test_wandb_flags_need_use_wandb_and_reach_wandb_init",
    "wandb_group": "test_wandb.py::test_a_run_and_its_resume_mirror_every_metric_into_one_wandb_run",
    "wandb_mode": "test_wandb.py::test_a_run_and_its_resume_mirror_every_metric_into_one_wandb_run",
    "wandb_dir": "test_wandb.py::test_a_run_and_its_resume_mirror_every_metric_into_one_wandb_run",
    "wandb_key": "test_wandb.py::test_a_run_and_its_resume_mirror_every_metric_into_one_wandb_run",
    "wandb_host": "test_wandb.py::test_wandb_flags_need_use_wandb_and_reach_wandb_init",
    "wandb_always_use_train_step":
        "test_wandb.py::test_wandb_always_use_train_step_puts_every_section_on_the_optimizer_steps",
    "disable_wandb_random_suffix": "test_wandb.py::test_wandb_flags_need_use_wandb_and_reach_wandb_init",
    "wandb_run_id": "test_wandb.py::test_wandb_flags_need_use_wandb_and_reach_wandb_init",
    "group_rm": "test_data.py::test_async_group_and_dict_rewards",
    # rollout
    "rollout_batch_size": "test_config.py::test_derived_numbers_are_computed_once",
    "n_samples_per_prompt": "test_advantages.py::test_grpo_with_one_sample_per_prompt_is_zero_not_nan",
    "num_rollout": "test_config.py::test_derived_numbers_are_computed_once",
    "num_epoch": "test_config.py::test_num_epoch_makes_num_rollout_from_the_rows_of_the_data",
    "rollout_seed": "test_hooks.py::test_rollout_seed_seeds_the_sampling_apart_from_seed",
    "rollout_max_response_len": "test_flag_wiring.py::test_sampling_flags_are_what_the_engines_are_asked_for",
    "rollout_temperature": "test_flag_wiring.py::test_sampling_flags_are_what_the_engines_are_asked_for",
    "rollout_top_p": "test_flag_wiring.py::test_sampling_flags_are_what_the_engines_are_asked_for",
    "rollout_top_k": "test_flag_wiring.py::test_sampling_flags_are_what_the_engines_are_asked_for",
    "rollout_stop": "test_flag_wiring.py::test_sampling_flags_are_what_the_engines_are_asked_for",
    "rollout_skip_special_tokens": "test_flag_wiring.py::test_sampling_flags_are_what_the_engines_are_asked_for",
    "rollout_stop_token_ids": "test_flag_wiring.py::test_sampling_flags_are_what_the_engines_are_asked_for",
    "rollout_engine": "test_rollout_units.py::test_tensor_sync_with_sglang_is_a_config_error",
    "rollout_dtype": "test_train_backend.py::test_mismatch_threshold_follows_the_precision",
    "logprob_mismatch_threshold": "test_train_backend.py::test_mismatch_threshold_follows_the_precision",
    "rollout_num_gpus_per_engine": "test_rollout_units.py::test_decoupled_engines_follow_the_train_bundles",
    "rollout_num_engines": "test_rollout_units.py::test_decoupled_without_rollout_gpus_counts_engines_times_tp",
    "rollout_concurrency": "test_flag_wiring.py::test_rollout_flags_reach_the_loop_and_the_truncation_limit",
    "rollout_timeout": "test_rollout_loop.py::test_rollout_deadline",
    "over_sampling_batch_size": "test_flag_wiring.py::test_rollout_flags_reach_the_loop_and_the_truncation_limit",
    "dynamic_sampling_filter_path": "test_flag_wiring.py::test_rollout_flags_reach_the_loop_and_the_truncation_limit",
    "rollout_function_path": "test_hooks.py::test_custom_rollout_function_contract",
    "custom_generate_function_path": "test_hooks.py::test_multi_turn_sample_masks_the_tool_and_keeps_the_engines_logprobs",
    "custom_reward_post_process_path": "test_hooks.py::test_post_processed_rewards_replace_the_group_normalisation",
    "rollout_sample_filter_path": "test_hooks.py::test_removed_samples_stay_out_of_the_loss",
    "data_source_path": "test_hooks.py::test_custom_data_source_feeds_the_rollout_and_is_checkpointed",
    "eval_function_path": "test_hooks.py::test_the_example_eval_function_scores_what_the_built_in_evaluation_scores",
    "rollout_max_truncated_share": "test_flag_wiring.py::test_rollout_flags_reach_the_loop_and_the_truncation_limit",
    "rollout_engine_python": "test_flag_wiring.py::test_engine_spec_flags",
    "rollout_engine_process": "test_flag_wiring.py::test_where_the_engine_runs",
    "rollout_engine_start_timeout": "test_flag_wiring.py::test_engine_spec_flags",
    "rollout_external_engine_addrs":
        "test_external_engines.py::test_a_run_on_an_external_engine_equals_one_on_its_own_engine",
    "use_fault_tolerance": "test_rollout_loop.py::test_without_fault_tolerance_a_dead_engine_fails_the_rollout",
    "rollout_health_check_interval": "test_flag_wiring.py::test_place_flags",
    "rollout_health_check_timeout": "test_flag_wiring.py::test_place_flags",
    "rollout_health_check_first_wait": "test_flag_wiring.py::test_place_flags",
    "weight_sync_method": "test_weight_sync.py::test_disk_sync_through_the_stage_is_versioned_and_deleted_after_use",
    "save_debug_rollout_data": "test_debug_rollout.py::test_a_replayed_run_trains_exactly_what_was_recorded",
    "save_debug_train_data":
        "test_train_backend.py::test_save_debug_train_data_writes_what_each_sample_was_trained_with",
    "load_debug_rollout_data_subsample":
        "test_debug_rollout.py::test_a_subsampled_replay_trains_whole_groups_from_both_ends_and_reports_their_reward",
    "load_debug_rollout_data": "test_debug_rollout.py::test_a_replayed_run_trains_exactly_what_was_recorded",
    "debug_train_only": "test_sft.py::test_sft_through_the_flow_with_no_engine",
    "debug_rollout_only": "test_debug_rollout.py::test_rollout_only_generates_without_a_trainer_and_a_replay_trains_on_it",
    "update_weight_buffer_size": "test_flag_wiring.py::test_sync_flags",
    "weight_sync_timeout": "test_flag_wiring.py::test_sync_flags",
    "sglang_args": "test_doctor.py::test_a_misspelt_sglang_flag_is_an_error_naming_the_nearest",
    # train
    "train_backend": "test_megatron_backend.py::test_cpu_machine_imports_and_gets_the_fix",
    "tensor_model_parallel_size": "test_megatron_backend.py::test_dp_size_counts_replicas_not_gpus",
    "pipeline_model_parallel_size": "test_megatron_backend.py::test_layout_check",
    "expert_model_parallel_size":
        "test_megatron_cpu_backend.py::test_expert_parallel_backend_equals_data_parallel_and_resumes",
    "sequence_parallel":
        "test_megatron_cpu_backend.py::test_sp_and_pp_steps_equal_the_torch_backends_with_the_engines_routing",
    "megatron_cuda_graphs": "test_flag_wiring.py::test_megatron_cuda_graphs_flag_reaches_the_kernels",
    "bf16": "test_train_backend.py::test_bf16_computes_in_bf16_over_fp32_master_weights",
    "model_impl": "test_native_model.py::test_model_impl_reaches_the_trainer_and_the_engine",
    "custom_config_path": "test_hooks.py::test_custom_config_path_arguments_reach_the_hooks_args",
    "custom_config":
        "test_train_backend.py::test_a_rollout_data_postprocess_hook_rewrites_masks_and_advantages_before_the_step",
    "keep_old_actor":
        "test_async.py::test_update_weights_interval_syncs_every_n_rollouts_and_reports_the_staleness",
    "ci_save_grad_norm":
        "test_train_backend.py::test_ci_grad_norms_are_recorded_then_reproduced_and_a_different_one_stops_the_run",
    "ci_load_grad_norm":
        "test_train_backend.py::test_ci_grad_norms_are_recorded_then_reproduced_and_a_different_one_stops_the_run",
    "distributed_timeout_minutes":
        "test_train_backend.py::test_distributed_timeout_minutes_bounds_a_collective_a_rank_never_joins",
    "dump_details": "test_debug_rollout.py::test_a_replayed_run_trains_exactly_what_was_recorded",
    "train_env_vars": "test_dp_invariance.py::test_train_env_vars_reach_every_train_rank_before_torch",
    "deterministic_mode": "test_flag_wiring.py::test_deterministic_mode_reaches_the_train_worker_and_megatron_core",
    "log_probs_max_tokens_per_gpu":
        "test_forward_batching.py::test_the_no_grad_forwards_run_under_their_own_cap_with_the_same_results",
    "recompute_loss_function":
        "test_train_backend.py::"
        "test_recompute_loss_function_keeps_only_the_logits_for_the_backward_and_takes_the_same_step",
    "log_probs_chunk_size":
        "test_train_backend.py::test_log_probs_chunk_size_takes_the_same_step_with_the_head_run_in_chunks",
    "train_share_prefix":
        "test_train_backend.py::test_train_share_prefix_runs_each_prompt_once_and_takes_the_same_step",
    "recompute_activations":
        "test_train_backend.py::test_recompute_activations_reruns_each_layer_in_the_backward_and_changes_nothing",
    "recompute_granularity":
        "test_megatron_cpu_backend.py::test_slimes_recompute_settings_recompute_what_they_name_and_change_no_number",
    "recompute_method":
        "test_megatron_cpu_backend.py::test_slimes_recompute_settings_recompute_what_they_name_and_change_no_number",
    "recompute_num_layers":
        "test_megatron_cpu_backend.py::test_slimes_recompute_settings_recompute_what_they_name_and_change_no_number",
    "offload_train": "test_gpu_flow.py::test_bf16_recompute_and_offload_on_cuda",  # GPU only (preflight: CPU refused)
    "global_batch_size": "test_doctor.py::test_rf06_inconsistent_batch_sizes_with_working_values",
    "num_steps_per_rollout": "test_config.py::test_derived_numbers_are_computed_once",
    "micro_batch_size": "test_packing.py::test_static_mode_by_hand",
    "lr": "test_train_backend.py::test_lr_follows_warmup_across_steps",  # make_cfg lr=1e-3 → 5e-4, 1e-3
    "min_lr": "test_train_backend.py::test_lr_follows_warmup_across_steps",
    "lr_decay_style": "test_train_backend.py::test_lr_follows_warmup_across_steps",
    "lr_warmup_iters": "test_train_backend.py::test_lr_follows_warmup_across_steps",
    "lr_warmup_fraction": "test_train_backend.py::test_lr_follows_warmup_across_steps",
    "weight_decay": "test_flag_wiring.py::test_optimizer_flags",
    "adam_beta1": "test_flag_wiring.py::test_optimizer_flags",
    "adam_beta2": "test_flag_wiring.py::test_optimizer_flags",
    "freeze_params_name_list": "test_flag_wiring.py::test_freeze_and_only_train_params_leave_the_matching_weights_untouched",
    "only_train_params_name_list":
        "test_flag_wiring.py::test_freeze_and_only_train_params_leave_the_matching_weights_untouched",
    "use_stateless_adam":
        "test_flag_wiring.py::test_stateless_adam_keeps_no_state_and_trains_as_adamw_reset_before_every_step",
    "reset_optimizer_states": "test_flag_wiring.py::test_reset_optimizer_states_zeroes_adams_moments_before_each_rollout",
    "clip_grad": "test_train_backend.py::test_clip_grad_bounds_the_gradient_and_reports_the_norm_before_clipping",
    "check_for_nan_in_loss_and_grad": "test_train_backend.py::test_nan_step_is_skipped_and_counted_with_the_flag",
    "train_step_timeout": "test_flag_wiring.py::test_place_flags",
    "seed": "test_flag_wiring.py::test_place_flags",
    "train_threads": "test_flag_wiring.py::test_train_threads_sizes_the_workers",
    # packing
    "use_dynamic_batch_size": "test_packing.py::test_rf03_dynamic_batch_needs_a_cap_and_suggests_response_len_over_cp",
    "max_tokens_per_gpu": "test_packing.py::test_cp_multiplies_the_cap_and_an_oversize_sample_sits_alone",
    "context_parallel_size": "test_packing.py::test_context_parallel_divides_dp_and_is_not_run_by_any_backend",
    "balance_data": "test_packing.py::test_balance_data_evens_out_ranks_that_strided_leaves_unequal",
    "balance_by_flops": "test_packing.py::test_every_schedule_keeps_the_invariants",
    "moe_token_dispatcher_type": "test_packing.py::test_moe_allgather_dispatcher_is_switched_to_alltoall_and_reported",
    # algorithm
    "loss_type": "test_sft.py::test_sft_loss_is_the_answers_negative_log_likelihood",
    "custom_loss_function_path": "test_sft.py::test_a_custom_loss_gets_the_packed_batch_and_its_metrics_are_step_values",
    "disable_compute_advantages_and_returns":
        "test_sft.py::test_disable_compute_advantages_and_returns_runs_no_forward_before_a_custom_loss",
    "custom_pg_loss_reducer_function_path": "test_train_backend.py::test_a_custom_pg_loss_reducer_reaches_the_step",
    "rollout_data_postprocess_path":
        "test_train_backend.py::test_a_rollout_data_postprocess_hook_rewrites_masks_and_advantages_before_the_step",
    "rollout_sample_hook_path":
        "test_hooks.py::test_sample_hooks_run_in_order_before_the_reward_and_in_the_evaluation",
    "rollout_all_samples_process_path":
        "test_hooks.py::test_the_all_samples_hook_sees_the_groups_the_dynamic_filter_dropped",
    "use_rollout_entropy": "test_train_backend.py::test_use_rollout_entropy_hands_the_old_policys_entropy_to_the_hooks",
    "log_multi_turn": "test_hooks.py::test_log_multi_turn_counts_model_and_tool_tokens_and_rounds",
    "log_correct_samples": "test_hooks.py::test_log_correct_samples_describes_the_rollouts_correct_answers",
    "custom_megatron_init_path":
        "test_megatron_backend.py::test_gpu_megatron_has_the_torch_backends_loss_types_opsm_opd_ref_update_and_reset",
    "custom_megatron_before_log_prob_hook_path":
        "test_megatron_backend.py::test_gpu_megatron_has_the_torch_backends_loss_types_opsm_opd_ref_update_and_reset",
    "custom_megatron_before_train_step_hook_path":
        "test_megatron_backend.py::test_gpu_megatron_has_the_torch_backends_loss_types_opsm_opd_ref_update_and_reset",
    "mask_offpolicy_in_partial_rollout":
        "test_rollout_loop.py::test_mask_offpolicy_in_partial_rollout_reaches_the_buffer_and_is_counted",
    "custom_tis_function_path": "test_train_backend.py::test_a_custom_tis_function_weights_the_step_and_logs_its_metrics",
    "get_mismatch_metrics": "test_train_backend.py::test_a_custom_tis_function_weights_the_step_and_logs_its_metrics",
    "custom_advantage_function_path":
        "test_sft.py::test_a_custom_advantage_function_gets_each_samples_response_and_sets_its_advantages",
    "advantage_estimator": "test_train_backend.py::test_each_estimator_trains",
    "eps_clip": "test_losses.py::test_ppo_clip_closed_forms",
    "eps_clip_high": "test_losses.py::test_clip_high_is_asymmetric",
    "eps_clip_c": "test_losses.py::test_dual_clip_bounds_negative_advantages",
    "use_kl_loss": "test_objective.py::test_policy_objective_closed_form_with_every_term",
    "kl_loss_coef": "test_objective.py::test_policy_objective_closed_form_with_every_term",
    "kl_loss_type": "test_objective.py::test_policy_objective_closed_form_with_every_term",
    "use_unbiased_kl": "test_objective.py::test_unbiased_kl_weights_the_kl_loss_by_the_ratio_with_its_gradient",
    "use_opsm": "test_train_backend.py::test_use_opsm_masks_the_drifted_samples_with_negative_advantages",
    "use_routing_replay":
        "test_routing_replay.py::test_the_steps_train_on_the_recorded_experts_with_the_routers_current_weights",
    "use_rollout_routing_replay": "test_rollout_routing_replay.py::test_a_flow_trains_on_the_engine_routing",
    "opsm_delta": "test_objective.py::test_opsm_leaves_drifted_samples_with_negative_advantages_out_of_the_policy_loss",
    "use_opd": "test_opd.py::test_the_penalty_is_the_reverse_kl_to_the_teacher_on_every_trained_token",
    "opd_type": "test_opd.py::test_pure_distillation_moves_the_student_toward_the_teacher",
    "opd_kl_coef": "test_opd.py::test_the_penalty_is_the_reverse_kl_to_the_teacher_on_every_trained_token",
    "opd_teacher_load": "test_opd.py::test_pure_distillation_moves_the_student_toward_the_teacher",
    "opd_teacher_ckpt_step": "test_opd.py::test_a_teacher_from_a_checkpoint_iteration_and_the_errors_that_name_it",
    "custom_rollout_log_function_path":
        "test_hooks_flow.py::test_logging_hooks_see_each_rollout_and_evaluation_and_may_take_over",
    "custom_eval_rollout_log_function_path":
        "test_hooks_flow.py::test_logging_hooks_see_each_rollout_and_evaluation_and_may_take_over",
    "opd_teacher_url": "test_opd.py::test_the_teacher_server_scores_each_response_as_the_teacher_model_does",
    "opd_teacher_api_key": "test_opd.py::test_the_teacher_server_scores_each_response_as_the_teacher_model_does",
    "ref_update_interval":
        "test_train_backend.py::test_ref_update_interval_moves_the_reference_to_the_policy_and_checkpoints_it",
    "kl_coef": "test_advantages.py::test_reinforce_plus_plus_baseline_subtracts_kl",
    "entropy_coef": "test_objective.py::test_policy_objective_closed_form_with_every_term",
    "disable_grpo_std_normalization": "test_flag_wiring.py::test_grpo_std_normalisation_flag_and_advantage_whitening",
    "disable_rewards_normalization": "test_flag_wiring.py::test_grpo_std_normalisation_flag_and_advantage_whitening",
    "normalize_advantages": "test_flag_wiring.py::test_grpo_std_normalisation_flag_and_advantage_whitening",
    "use_tis": "test_objective.py::test_policy_objective_closed_form_with_every_term",
    "use_mis": "test_async.py::test_mis_drops_exactly_the_tokens_out_of_range_in_the_train_step",
    "use_rollout_logprobs": "test_train_backend.py::test_train_stage_skips_the_reference_forward_after_the_first_step_unless_kl_is_used",
    "log_kl": "test_train_backend.py::test_train_stage_skips_the_reference_forward_after_the_first_step_unless_kl_is_used",
    "mis_low": "test_async.py::test_mis_drops_exactly_the_tokens_out_of_range_in_the_train_step",
    "mis_high": "test_async.py::test_mis_drops_exactly_the_tokens_out_of_range_in_the_train_step",
    "tis_clip": "test_objective.py::test_policy_objective_closed_form_with_every_term",
    "tis_clip_low": "test_flag_wiring.py::test_tis_clip_low_bounds_the_importance_weight_from_below",
    "tis_mode": "test_async.py::test_rejection_sampling_veto_and_batch_normalized_tis_in_the_train_step",
    "use_rs": "test_async.py::test_rejection_sampling_veto_and_batch_normalized_tis_in_the_train_step",
    "rs_veto_threshold": "test_async.py::test_rejection_sampling_veto_and_batch_normalized_tis_in_the_train_step",
    "tis_batch_normalize": "test_async.py::test_rejection_sampling_veto_and_batch_normalized_tis_in_the_train_step",
    "rs_level": "test_config.py::test_slimes_mis_example_ported_runs_on_rollflows_built_in_rollout_correction",
    "rs_lower_bound": "test_config.py::test_slimes_mis_example_ported_runs_on_rollflows_built_in_rollout_correction",
    "rs_upper_bound": "test_config.py::test_slimes_mis_example_ported_runs_on_rollflows_built_in_rollout_correction",
    "tis_level": "test_flag_wiring.py::test_tis_level_reaches_the_policy_objective",
    "calculate_per_token_loss": "test_train_backend.py::test_per_token_loss_needs_and_uses_the_global_token_count",
    "gamma": "test_advantages.py::test_gae_closed_form",
    "lambd": "test_advantages.py::test_gae_closed_form",
    "value_clip": "test_losses.py::test_value_loss_clipping",
    "critic_lr": "test_flag_wiring.py::test_optimizer_flags",
    "num_critic_only_steps": "test_train_backend.py::test_num_critic_only_steps_fits_the_critic_before_the_policy_moves",
    # checkpoint
    "save": "test_checkpoint_stages.py::test_save_then_resume_restores_weights_data_and_history",
    "save_interval": "test_orchestration.py::test_an_engine_killed_mid_rollout_the_flow_retry_resumes_without_losing_a_step",
    "load": "test_checkpoint.py::test_save_progress_wins_over_the_load_it_started_from",
    "ckpt_step": "test_checkpoint.py::test_ckpt_step_loads_that_iteration_and_resumes_after_it",
    "ref_load": "test_train_backend.py::test_wrong_reference_fails_the_first_step_with_rf01_before_any_update",
    "ref_ckpt_step": "test_checkpoint.py::test_ref_load_resolves_marker_or_step_and_rejects_unloadable",
    "save_optim": "test_checkpoint_stages.py::test_no_save_optim_and_save_hf",
    "load_optim": "test_checkpoint.py::test_weights_only_checkpoint_needs_no_load_optim",
    "dist_ckpt_optim_fully_reshardable":
        "test_megatron_cpu_backend.py::test_a_checkpoint_saved_at_tp2_resumes_at_tp1_and_pp2",
    "distrib_optim_fully_reshardable_mem_efficient":
        "test_megatron_cpu_backend.py::test_expert_parallel_backend_equals_data_parallel_and_resumes",
    "save_hf": "test_checkpoint_stages.py::test_no_save_optim_and_save_hf",
    "keep_last_n": "test_checkpoint.py::test_keep_last_n_deletes_only_after_the_new_marker",
    "async_save": "test_checkpoint_stages.py::test_async_save_commits_the_state_of_the_save_not_of_the_commit",
    "custom_update_weight_post_write_path":
        "test_weight_sync.py::test_the_post_write_hook_runs_on_rank_0_after_a_disk_syncs_files_and_before_the_engines",
    "check_weight_update_equal":
        "test_weight_sync.py::test_check_weight_update_equal_passes_a_faithful_sync_and_stops_a_wrong_one",
    "wait_for_save_lock": "test_limits.py::test_a_run_waits_for_the_writer_lock_as_long_as_asked",
    "allow_config_change": "test_hostile_inputs.py::test_a_resume_that_changes_kept_settings_fails_listing_them",
    # cluster
    "ray_address": "test_flag_wiring.py::test_the_doctor_reads_the_cluster_ray_address_names",
    "ray_code": "test_multinode.py::test_code_is_shipped_with_the_job_runtime_env",
    "actor_num_nodes": "test_multinode.py::test_dp2_over_two_nodes_matches_one_node_and_resumes",
    "actor_num_gpus_per_node": "test_dp_invariance.py::test_one_step_is_the_same_for_dp_1_2_4",
    "colocate": "test_rollout_units.py::test_colocated_engines_share_the_train_bundles",
    "rollout_num_gpus": "test_rollout_units.py::test_decoupled_engines_follow_the_train_bundles",
    "num_cpus": "test_flag_wiring.py::test_place_flags",
    "ray_services": "test_cluster_units.py::test_a_lean_local_cluster_runs_only_the_gcs_the_raylet_and_its_agents",
    # orchestration
    "placement_timeout": "test_orchestration.py::test_busy_gpus_are_retried_with_backoff_until_the_holder_releases_them",
    "placement_retries": "test_orchestration.py::test_busy_gpus_are_retried_with_backoff_until_the_holder_releases_them",
    "placement_retry_delay":
        "test_orchestration.py::test_busy_gpus_are_retried_with_backoff_until_the_holder_releases_them",
    "rollout_retries": "test_orchestration.py::test_a_hung_engine_request_hits_the_deadline_and_the_rollout_is_retried",
    "flow_retries":
        "test_orchestration.py::test_an_engine_killed_mid_rollout_the_flow_retry_resumes_without_losing_a_step",
    "flow_retry_delay":
        "test_orchestration.py::test_an_engine_killed_mid_rollout_the_flow_retry_resumes_without_losing_a_step",
    "async_mode": "test_async.py::test_one_step_async_flow_overlaps_rollout_and_train",
    "update_weights_interval":
        "test_async.py::test_update_weights_interval_syncs_every_n_rollouts_and_reports_the_staleness",
    "max_staleness": "test_async.py::test_samples_older_than_the_bound_are_never_trained",
    "partial_rollout": "test_resume_faults.py::test_async_sigkill_at_every_boundary_then_every_rollout_trained_once",
    # tracking
    "work_dir": "test_tracking_flow.py::test_a_run_failing_preflight_is_a_failed_mlflow_run_with_the_doctor_report",
    "experiment_name": "test_flow_params.py::test_overrides_win_over_the_file_and_the_file_over_defaults",
    "run_name": "test_orchestration.py::test_a_config_error_is_not_retried_by_the_flow",
    "mlflow_tracking_uri": "test_tracking.py::test_run_params_never_hold_secrets_and_keep_the_rest",
    "mlflow_timeout": "test_tracking_flow.py::test_run_with_mlflow_down_throughout_still_trains_and_says_what_was_lost",
    "mlflow_retry_interval":
        "test_tracking_flow.py::test_run_started_while_mlflow_was_down_trains_and_delivers_everything",
    "mlflow_send_interval": "test_tracking.py::test_mlflow_send_interval_reaches_the_runs_tracker",
    "log_samples_interval": "test_flag_wiring.py::test_log_samples_interval",
    "system_metrics_interval":
        "test_tracking_flow.py::test_run_started_while_mlflow_was_down_trains_and_delivers_everything",
    "summary_json": "test_flag_wiring.py::test_summary_json_is_written_by_rollflow_train",
    "progress": "test_flag_wiring.py::test_progress_flag_turns_the_bar_off",
    "debug": "test_terminal.py::test_a_diagnosed_failure_shows_the_diagnosis_not_tracebacks",
}


def _test_sources() -> dict[str, str]:
    out = {}
    for f in TESTS.glob("test_*.py"):
        text = f.read_text()
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                out[f"{f.name}::{node.name}"] = ast.get_source_segment(text, node)
    return out


def test_every_flag_is_audited():
    assert set(FLAG_TESTS) == set(RunConfig.model_fields), (
        f"unlisted: {sorted(set(RunConfig.model_fields) - set(FLAG_TESTS))}; "
        f"gone: {sorted(set(FLAG_TESTS) - set(RunConfig.model_fields))}")


def test_each_listed_test_exists_and_sets_its_flag():
    sources = _test_sources()
    for flag, ref in FLAG_TESTS.items():
        assert ref in sources, f"{flag}: {ref} does not exist"
        dashed = "--" + flag.replace("_", "-")
        pattern = rf"\b{flag}\b|{re.escape(dashed)}\b"
        assert re.search(pattern, sources[ref]), f"{flag}: {ref} never names the flag"
