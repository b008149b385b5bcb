"""Mutation check: break each guarantee in a copy of the code and run whole test
directories against it; it must fail at least two test functions (caught). Not part of
`make test` (`make mutations`).

Each mutation is one anchored text replacement in one file. The script copies the
tracked files to a temporary folder and checks that Python imports the copy (not the
checkout, which is installed editable), that the unmutated copy passes ``DIRS`` (``-m
"not slow"``), then applies one mutation at a time and runs ``DIRS`` with PYTHONPATH at
the copy, stopping once ``MAX_FAILURES`` tests failed. It counts the distinct test
functions that fail (parameters folded) and prints a table: a mutation is caught when at
least 2 fail, one of them on a module written for the tests (``on_own_module``: a reading
of the test's source), not only the project's model (but for a guarantee of that model
itself, ``of_the_demo``); a test running past
``TEST_TIMEOUT_S`` fails by name. It exits 1 if a mutation is missed or the unmutated
copy fails, 2 if an anchor is not found exactly once (re-anchor it). Each row names a
test that should fail (``expect``): the table says when it did not, a hint for the
author, not the verdict.

    python scripts/mutations.py [--only NAME ...] [--list]
"""

from __future__ import annotations

import argparse
import ast
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent

EXACT = "tests/library/callbacks/test_exact_resume.py::"
LR = "tests/library/callbacks/test_lr_scaler.py::"
LOADER = "tests/library/test_loader.py::"
SHARDS = "tests/library/test_loader_shards.py::"
BETWEEN_STEPS = "tests/library/test_between_steps.py::"
BATCH = "tests/library/callbacks/test_batch_skipper.py::"
SKIP = "tests/library/callbacks/test_skip_step.py::"
DETECTOR = "tests/library/callbacks/test_spike_detector.py::"
EPISODES = "tests/library/callbacks/test_spike_episodes.py::"
MARKS = "tests/library/callbacks/test_spike_marks.py::"
INVARIANCE = "tests/library/test_invariance.py::"
RESUMED_EPOCH = "tests/library/test_resumed_epoch.py::"
GENERATORS = "tests/library/test_module_generators.py::"
CHECKPOINTS = "tests/library/test_checkpoints.py::"
RETENTION = "tests/library/callbacks/test_retention.py::"
EVERY_FILE = "tests/library/test_every_file.py::"
CHECK = "tests/library/testing/test_check.py::"
FACTS = "tests/tools/test_tool_facts.py::"
CLASS_PATHS = "tests/tools/test_class_paths.py::"
GUARANTEE_RUNS, GUARANTEE_MODULES = (
    "tests/modules/guarantee_runs.py",
    "tests/modules/guarantee_modules.py",
)


DIRS = ("tests/library", "tests/tools")
"""The test directories every mutation is judged by (their tests not marked slow)."""
TIMEOUT_S = 300
"""A run of ``DIRS`` takes ~90 s here (2 cores): past this it hangs, and is said to."""
TEST_TIMEOUT_S = 100
"""One test past this fails by name (pytest-timeout), so a mutation that makes one test
loop (a rollback to the spike's own file, for one) is counted with the others that
catch it; without it the whole run hung and counted none."""
MAX_FAILURES = 12
"""Stop a mutated run after this many failed tests (enough, as a rule, to count 2
functions: a count under 2 with this many failures says so with a '+')."""


@dataclass(frozen=True)
class Mutation:
    name: str
    file: str
    old: str
    new: str
    tests: tuple[str, ...]
    """Tests that should fail (at least one on a module written for the tests)."""
    of_the_demo: bool = False
    """A guarantee of the project's own model (``lit_spikes/demo``): no module written
    for the tests has it, so 2 failing functions on the demo's catch it."""


MUTATIONS = [
    Mutation(
        "rng_torch_only",  # the per-step seeds set torch's RNG, not Python's or NumPy's
        "lit_spikes/randomness.py",
        "    random.seed(seed64)\n    np.random.seed(high)\n",
        "",
        (
            EXACT + "test_a_resume_draws_from_random_numpy_and_torch_as_the_uninterrupted_run",
            EXACT + "test_a_resume_in_a_new_process_draws_as_the_uninterrupted_run",
            LOADER + "test_augmentation_is_keyed_by_position_and_shard_whoever_reads_it",
        ),
    ),
    Mutation(
        "no_per_step_seed",  # a step draws on from whatever ran before it (issue 53)
        "callbacks/exact_resume.py",
        "        self._seed_for(STEP, step, batch_idx % trainer.accumulate_grad_batches)\n",
        "        pass\n",
        (  # (a StepLoader read in this process keys the state its step starts from too)
            INVARIANCE + "test_watching_a_run_does_not_change_it",
            INVARIANCE + "test_every_file_resumes_the_run_nothing_watched",
        ),
    ),
    Mutation(
        "rows_not_keyed",  # augmentation draws from the reading process's state
        "lit_spikes/loader.py",
        "        seed_all(derive_in(self.seed, ROW, position, shard))\n",
        "",
        (
            LOADER + "test_augmentation_is_keyed_by_position_and_shard_whoever_reads_it",
            INVARIANCE + "test_every_file_resumes_the_run_nothing_watched",
        ),
    ),
    Mutation(
        "between_never_keyed",  # a watcher's draws after a step reach what runs there
        "callbacks/exact_resume.py",
        "        self._between = draws_between_steps(trainer, pl_module, loaders)\n",
        "        self._between = False\n",
        (
            BETWEEN_STEPS
            + "test_a_watcher_drawing_after_a_step_leaves_the_modules_own_draws_there",
            BETWEEN_STEPS + "test_a_watcher_drawing_after_a_step_leaves_a_plain_loaders_next_read",
        ),
    ),
    Mutation(
        "rank_reads_no_lead",  # a rank inside a shard draws from the shard's first key
        "lit_spikes/loader.py",
        "        begin = first - first % size  # the first shard's first slot\n",
        "        begin = first\n",
        (
            SHARDS + "test_every_rank_draws_its_rows_as_one_process_does",
            SHARDS + "test_workers_of_a_rank_draw_as_one_process_does",
        ),
    ),
    Mutation(
        "old_files_taken_as_sharded",  # a file of per-row keys resumed with shard keys
        "lit_spikes/loader.py",
        '    return int(state_dict["batch_size"]) if "batch_size" in state_dict else None\n',
        "    return None\n",
        (
            SHARDS + "test_a_file_from_before_shards_is_refused_unless_its_rows_are_keyed_alike",
            SHARDS + "test_a_file_from_before_shards_resumes_only_with_its_keys",
        ),
    ),
    Mutation(
        "module_generators_not_keyed",
        "callbacks/module_generators.py",
        "            seed_generator(generator, derive(self.seeds[path], domain, *key))\n",
        "            pass\n",
        (
            INVARIANCE + "test_a_modules_own_generator_is_keyed_by_the_step_too",
            "tests/library/testing/test_check.py::"
            "test_a_modules_generator_is_named_and_exact_resume_keys_it",
        ),
    ),
    Mutation(
        "steploader_ignores_saved_step",
        "lit_spikes/loader.py",
        "        self.skip = normalize_skip((*saved, *self.skip))\n        self.next_step = step\n",
        "        self.skip = normalize_skip((*saved, *self.skip))\n",
        (
            LOADER + "test_a_step_loader_resumes_at_the_saved_step_without_exact_resume",
            BATCH + "test_a_batch_skipper_resume_equals_the_uninterrupted_run",
        ),
    ),
    Mutation(
        "exact_resume_seek_does_nothing",
        "callbacks/exact_resume.py",
        "            loader.seek(trainer.global_step)\n",
        "            pass\n",
        (
            LOADER + "test_a_loader_built_anew_each_epoch_goes_on_at_the_global_step",
            EXACT + "test_a_crash_checkpoint_resumes_the_step_that_failed",
        ),
    ),
    Mutation(
        "skipstep_params_not_restored",
        "callbacks/skip_step.py",
        "                param.copy_(torch.where(skip.to(param.device), before, param))\n",
        "                pass\n",
        (
            SKIP + "test_a_skipped_step_leaves_weights_and_optimizer_state_as_before",
            SKIP + "test_state_a_skipped_first_step_created_is_removed",
            SKIP + "test_after_a_skipped_first_step_training_goes_on_as_from_a_fresh_optimizer",
        ),
    ),
    Mutation(
        "skipstep_optimizer_state_not_restored",
        "callbacks/skip_step.py",
        "                    now.copy_(torch.where(skip.to(now.device), old, now))\n",
        "                    pass\n",
        (
            SKIP + "test_a_skipped_step_leaves_weights_and_optimizer_state_as_before",
            SKIP + "test_a_nan_step_is_dropped_at_any_step",
        ),
    ),
    Mutation(
        "skipstep_created_state_kept",  # instead of removed (the docstring's claim)
        "callbacks/skip_step.py",
        "                del optimizer.state[param]  # as before the step: no state at all\n",
        "                pass\n",
        (
            SKIP + "test_state_a_skipped_first_step_created_is_removed",
            SKIP + "test_a_nan_step_is_dropped_at_any_step",
        ),
    ),
    Mutation(
        "detector_mode_all_as_any",
        "callbacks/spike_detector.py",
        'return min(limits) if self.mode == "any" else max(limits)',
        "return min(limits)",
        (
            DETECTOR + "test_the_rules_on_a_negative_metric_a_module_logs",
            DETECTOR + "test_the_rules_on_negative_values_judged_one_by_one",
        ),
    ),
    Mutation(
        "detector_ratio_negative_mean_plain",  # ratio x mean, below a negative mean
        "callbacks/spike_detector.py",
        "limits.append(self.ratio * mean if mean > 0 else mean + (self.ratio - 1) * -mean)",
        "limits.append(self.ratio * mean)",
        (
            DETECTOR + "test_the_rules_on_a_negative_metric_a_module_logs",
            DETECTOR + "test_the_rules_on_negative_values_judged_one_by_one",
        ),
    ),
    Mutation(
        "detector_ratio_negative_mean_dropped",  # no ratio rule below a zero mean
        "callbacks/spike_detector.py",
        "limits.append(self.ratio * mean if mean > 0 else mean + (self.ratio - 1) * -mean)",
        "limits.extend([self.ratio * mean] if mean > 0 else [])",
        (
            DETECTOR + "test_the_rules_on_a_negative_metric_a_module_logs",
            DETECTOR + "test_the_rules_on_negative_values_judged_one_by_one",
        ),
    ),
    Mutation(
        "loader_refuses_only_another_seed",  # batch size, rows, shuffle not compared
        "lit_spikes/loader.py",
        '            for key in ("seed", "batch_size", "rows", "shuffle")\n',
        '            for key in ("seed",)\n',
        (LOADER + "test_a_loader_of_another_size_length_or_shuffle_is_refused_at_a_resume",),
    ),
    Mutation(
        "order_ignores_the_seed",
        "lit_spikes/loader.py",
        "            generator = torch.Generator().manual_seed(mix_seed(self.seed, epoch))\n",
        "            generator = torch.Generator().manual_seed(mix_seed(0, epoch))\n",
        (
            LOADER + "test_the_order_is_a_permutation_per_epoch_seeded_by_the_seed",
            LOADER + "test_each_seed_gives_its_own_order_in_every_epoch",
        ),
    ),
    Mutation(
        "fingerprint_without_threads",
        "callbacks/fingerprint.py",
        '        "num_threads": torch.get_num_threads(),\n',
        "",
        (EXACT + "test_a_users_resume_under_other_threads_or_subnormal_flushing_warns",),
    ),
    Mutation(
        "crc_not_checked",
        "lit_spikes/checkpoints.py",
        "            damaged = _record_failing_crc(archive)\n",
        "            damaged = None\n",
        (CHECKPOINTS + "test_a_users_newest_file_with_one_flipped_byte_is_passed_over",),
    ),
    Mutation(
        "retention_forgets_the_resumed_file",
        "callbacks/retention.py",
        "            kept |= {path for _, path in files if path.resolve() == resumed.resolve()}\n",
        "            pass\n",
        (
            RETENTION + "test_the_resumed_from_file_is_kept_however_old",
            RETENTION + "test_a_users_run_resumed_from_an_old_file_keeps_it",
        ),
    ),
    Mutation(
        "rollback_ignores_the_distance",
        "callbacks/rollback.py",
        "            latest = self.spike_step - self.distance\n",
        "            latest = self.spike_step\n",
        (),
    ),
    Mutation(
        "preemption_saves_nothing",
        "callbacks/preemption.py",
        "            trainer.save_checkpoint(path, weights_only=False)"
        "  # synchronous: on disk now\n",
        "            pass\n",
        (),
    ),
    Mutation(
        "watchers_take_a_stale_value",  # a value logged at an earlier step counts as new
        "callbacks/watch.py",
        "        return not value.is_set_to(old)\n",
        "        return True\n",
        (),
    ),
    Mutation(
        "check_resume_ignores_tensor_values",
        "lit_spikes/testing/verdict.py",
        "            and torch.equal(a, b)\n",
        "",
        (),
    ),
    Mutation(
        "diagnose_ignores_the_earlier_replay",
        "lit_spikes/tools/diagnose/verdict.py",
        "    if earlier is not None and earlier.bit_equal is False:\n",
        "    if False:\n",
        (),
    ),
    Mutation(
        "diagnose_decides_by_flags",
        "lit_spikes/tools/diagnose/verdict.py",
        "    return statistics.median(o.ratio for o in others)\n",
        "    return statistics.median(float(o.spiked) for o in others)\n",
        (
            "tests/tools/test_tools_exact.py::test_recurrence_needs_half_the_spikes_rise_flagged_or_not",
        ),
    ),
    Mutation(
        "diagnose_one_other_window",
        "lit_spikes/tools/diagnose/run.py",
        "    return [(start, end + index * length) for index in range(config.windows)]\n",
        "    return [(start, end)]\n",
        ("tests/tools/diagnose/test_diagnose.py::test_a_poisoned_batch_is_data_caused",),
    ),
    Mutation(
        "recover_accepts_by_flag_alone",
        "lit_spikes/tools/recover/gate.py",
        "        if self.judgement is None or not self.judgement.still_spikes:\n",
        "        if True:\n",
        (
            "tests/tools/recover/test_recover_judgement.py::"
            "test_a_remedy_that_damps_the_spike_under_the_threshold_is_rejected",
        ),
    ),
    Mutation(
        "rise_as_a_difference",
        "lit_spikes/tools/judgement.py",
        "            return math.log(self.value / self.median) if self.value > 0 else -math.inf\n",
        "            return self.value - self.median\n",
        (
            "tests/tools/recover/test_recover_judgement.py::"
            "test_a_remedy_that_damps_the_spike_under_the_threshold_is_rejected",
        ),
    ),
    Mutation(
        "recover_rolls_back_past_the_distance_bound",
        "lit_spikes/tools/recover/rollback.py",
        "    bound = onset - distance\n",
        "    bound = onset\n",
        (),
    ),
    Mutation(
        "step_end_not_replayed",  # a resume skips what its file came before (issue 54)
        "callbacks/step_end.py",
        "    ends.replaying(unfinished)\n",
        "    return\n",
        (
            EVERY_FILE + "test_each_file_of_an_early_stopped_run_stops_where_it_stopped",
            EVERY_FILE + "test_a_sigterm_at_any_step_resumes_the_run_that_got_none",
            CHECK + "test_reduce_lr_on_plateau_resumes_exactly",
        ),
    ),
    Mutation(
        "stop_not_in_the_file",  # a run EarlyStopping ended trains on when requeued
        "callbacks/step_end.py",
        "        return validated and trainer.should_stop and not self._stop_before_validation\n",
        "        return False\n",
        (
            EVERY_FILE
            + "test_a_run_early_stopping_ended_requeued_from_its_final_file_ends_at_once",
            EVERY_FILE + "test_a_resume_from_the_best_file_of_a_run_stopped_there_ends_at_once",
        ),
    ),
    Mutation(
        "logged_metrics_not_restored",  # a plateau replayed with no metric to read
        "callbacks/exact_resume.py",
        "        trainer.callback_metrics.update(self._metrics)\n",
        "        pass\n",
        (CHECK + "test_reduce_lr_on_plateau_resumes_exactly",),
    ),
    Mutation(
        "epoch_plateau_not_made_up",  # Lightning's skip at a resumed fit's first epoch end
        "callbacks/step_end.py",
        "        if skipped is not None:\n",
        "        if False:\n",
        (
            CHECK + "test_reduce_lr_on_plateau_resumes_exactly",
            EVERY_FILE + "test_an_epoch_plateau_scheduler_resumes_from_each_file",
        ),
    ),
    Mutation(
        "final_file_after_validation",  # FinalCheckpoint back in on_train_end only
        "callbacks/final_checkpoint.py",
        "        if ends_at_this_step(trainer):\n            self._save(trainer)\n",
        "        pass\n",
        (EVERY_FILE + "test_extending_a_finished_run_equals_the_longer_run",),
    ),
    Mutation(
        "nan_guard_zeroes_gradients",  # TinyGPTModule's host guard: weight decay still moves
        "lit_spikes/demo/module.py",
        "                        parameter.grad = None  # AdamW then changes nothing\n",
        "                        parameter.grad.zero_()  # type: ignore[union-attr]\n",
        (
            SKIP + "test_nan_gradient_with_finite_loss_skips_the_update",
            SKIP + "test_nan_loss_skips_the_update_counts_as_spike_and_is_never_a_rollback_target",
        ),
        of_the_demo=True,
    ),
    Mutation(
        "failed_fit_start_restores_nothing",  # issue 52: the run directory as it was
        "lit_spikes/tools/fit_start.py",
        "        line = state.restore_under_lock(start.writes)\n",
        '        line = ""\n',
        (
            "tests/tools/test_fit_start.py::test_a_requeue_failing_at_fit_start_leaves_the_run_as_it_was",
        ),
    ),
    Mutation(
        "diagnose_names_no_setting_that_differs",  # issue 55: which setting, both values
        "lit_spikes/tools/diagnose/unlike.py",
        "    return lines\n",
        "    return []\n",
        (
            "tests/tools/diagnose/test_diagnose_any.py::test_a_replay_that_is_not_the_run_names_each_setting_that_differs",
        ),
    ),
    Mutation(
        "recover_measures_across_the_skip",  # issue 55: the same batches in every row
        "lit_spikes/tools/recover/measure.py",
        "            stretch = {}  # a skip window (or a gap): the window lies after it\n",
        "            pass\n",
        (
            "tests/tools/recover/test_measure.py::test_the_train_loss_is_averaged_over_the_same_positions_after_every_skip",
        ),
    ),
    Mutation(
        "handed_over_module_imported",  # issue 61: a file the user did not name runs no code
        "lit_spikes/tools/import_guard.py",
        "    if not module_name or module_name in sys.modules or module_name in _NAMED.get():\n",
        "    if True:\n",
        (
            "tests/tools/test_handed_over.py::test_a_module_beside_a_handed_over_record_is_refused_and_never_runs",
            "tests/tools/test_handed_over.py::test_a_ledger_above_a_branch_names_no_module_that_runs",
        ),
    ),
    Mutation(
        "record_from_any_grandparent",  # issue 61: a record only in the layout fit writes
        "lit_spikes/tools/run_record.py",
        "    return folder.parent / RECORD_NAME if folder.name == CHECKPOINT_DIRNAME else None\n",
        "    return folder.parent / RECORD_NAME\n",
        (
            "tests/tools/test_handed_over.py::test_no_record_is_read_from_a_grandparent_that_is_no_run_directory",
            "tests/tools/test_handed_over.py::test_a_file_outside_a_run_resumes_without_its_grandparents_record",
        ),
    ),
    Mutation(
        "torch_read_tensors_unchecked",  # issue 61: never loaded with other values
        "lit_spikes/file_digest.py",
        "    if unmatched:\n",
        "    if False:\n",
        (
            "tests/library/test_damaged_files.py::test_every_byte_flipped_is_refused_by_name_or_loads_as_saved",
            "tests/library/test_damaged_files.py::test_what_torch_reads_otherwise_than_it_was_saved_is_refused",
        ),
    ),
    Mutation(
        "failed_start_sees_no_write",  # issue 61: a failed start removes only its own
        "lit_spikes/tools/own_writes.py",
        "            _RECORDING[-1].see(path)\n",
        "            pass\n",
        (
            "tests/tools/test_fit_start.py::test_a_failed_start_leaves_what_another_process_wrote_meanwhile",
            "tests/tools/test_fit_start.py::test_a_write_through_a_symlink_out_of_the_run_is_undone_too",
        ),
    ),
    Mutation(
        "validation_draws_reach_the_next_read",  # issue 62, case 1: a plain loader's read
        "callbacks/isolated_validation.py",
        "        with kept_rng_states():\n",
        "        if True:\n",
        (
            "tests/library/test_invariance.py::test_a_validation_does_not_change_a_plain_dataloader_that_augments",
            INVARIANCE
            + "test_a_monitor_checkpoint_does_not_change_a_plain_dataloader_that_augments",
        ),
    ),
    Mutation(
        "resumed_epoch_read_where_lightning_built_it",  # issue 62, case 2
        "callbacks/resumed_epoch.py",
        "            iter(data_fetcher)  # what the run's epoch_loop.on_run_start did here\n",
        "            pass\n",
        (
            RESUMED_EPOCH + "test_a_resume_at_an_epochs_start_is_the_run",
            EXACT + "test_a_shuffled_loader_at_an_epoch_end_resumes_exactly",
        ),
    ),
    Mutation(
        "restart_fast_forward_draws_reach_the_epoch",  # issue 62, case 2: a file before
        "callbacks/isolated_validation.py",  # its step's validation
        'WRAPPED = ("run", "increment_progress_to_evaluation_end")\n',
        'WRAPPED = ("run",)\n',
        (
            RESUMED_EPOCH
            + "test_a_file_before_an_epoch_end_validation_resumes_the_run_nothing_watched",
            RESUMED_EPOCH
            + "test_a_file_of_a_step_validating_mid_epoch_resumes_at_the_next_epoch_as_the_run",
        ),
    ),
    Mutation(
        "loader_generator_unkeyed",  # issue 62, case 2: a DataLoader's own generator
        "callbacks/loader_positions.py",
        "            generator.manual_seed(derive(seed, *key))\n",
        "            pass\n",
        (
            RESUMED_EPOCH + "test_a_resume_at_an_epochs_start_is_the_run",
            EXACT + "test_a_shuffled_loader_at_an_epoch_end_resumes_exactly",
        ),
    ),
    Mutation(
        "files_epoch_trains_a_batch_more",  # issue 62, case 2: Lightning issue 19403
        "callbacks/resumed_epoch.py",
        "    data_fetcher.done = True  # its next fetch ends the epoch\n",
        "    pass\n",
        (
            RESUMED_EPOCH + "test_a_file_of_an_epochs_end_resumes_the_run",
            RESUMED_EPOCH + "test_a_resumed_runs_file_resumes_the_run_again",
        ),
    ),
    Mutation(
        "files_epoch_processed_twice",  # issue 62, case 2: a max_epochs run ended early
        "callbacks/resumed_epoch.py",
        "    if total.processed > total.completed:\n",
        "    if False:\n",
        (
            RESUMED_EPOCH + "test_a_file_of_an_epochs_end_resumes_the_run",
            RESUMED_EPOCH + "test_the_resumed_runs_files_hold_the_runs_epoch_counts",
        ),
    ),
    Mutation(
        "resumed_epoch_never_started",  # issue 62, case 2: the next file's epoch counts
        "callbacks/resumed_epoch.py",
        "    trainer.fit_loop.epoch_progress.increment_started()\n",
        "    pass\n",
        (
            RESUMED_EPOCH + "test_the_resumed_runs_files_hold_the_runs_epoch_counts",
            RESUMED_EPOCH + "test_a_resumed_runs_file_resumes_the_run_again",
        ),
    ),
    Mutation(
        "skipped_epoch_start_hooks_not_run",  # issue 62, case 2: Lightning's restart
        "callbacks/resumed_epoch.py",
        "            callback.on_train_epoch_start(trainer, module)\n",
        "            pass\n",
        (
            RESUMED_EPOCH + "test_a_callbacks_epoch_start_the_restart_skips_runs",
            RESUMED_EPOCH + "test_an_accumulation_schedule_resumes_at_its_epoch",
        ),
    ),
    Mutation(
        "generators_in_containers_unsearched",  # issue 62, case 3
        "lit_spikes/randomness.py",
        "    elif isinstance(value, list | tuple):\n",
        "    elif False:\n",
        (
            GENERATORS + "test_a_generator_held_any_way_is_keyed_by_the_step",
            CHECK + "test_any_generator_of_the_modules_is_named_with_its_fix",
        ),
    ),
    Mutation(
        "numpy_generator_unkeyed",  # issue 62, case 3
        "lit_spikes/randomness.py",
        "        bits.state = type(bits)(seed64).state\n",
        "        pass\n",
        (
            GENERATORS + "test_a_generator_held_any_way_is_keyed_by_the_step",
            CHECK + "test_any_generator_of_the_modules_is_named_with_its_fix",
        ),
    ),
    Mutation(
        "generator_made_in_a_step_unsaid",  # issue 62, case 3
        "callbacks/module_generators.py",
        "        for path, generator in new.items():\n",
        "        for path, generator in {}.items():\n",
        (
            GENERATORS + "test_a_generator_made_in_a_step_is_named_with_the_fix",
            GENERATORS + "test_a_generator_made_later_is_named_where_it_is_found",
        ),
    ),
    Mutation(
        "full_disk_in_torchs_writer_unnamed",  # issue 61: a full disk is one line, exit 74
        "lit_spikes/checkpoints.py",
        "        if written is not None and written.error is not None:\n",
        "        if False:\n",
        (
            "tests/library/test_checkpoints.py::test_a_disk_filling_inside_torchs_zip_writer_is_the_write_error",
            "tests/tools/test_persistence.py::test_a_disk_that_fills_inside_torchs_writer_is_one_line_and_exit_74",
        ),
    ),
    Mutation(
        "module_rule_ignored",  # the tools judge every module by the detector's own rule
        "lit_spikes/tools/detector_config.py",
        "            rule |= {k: v for k, v in facts.detector.items() if rule.get(k) is None}\n",
        "            pass\n",
        (
            FACTS + "test_recover_takes_the_run_length_rule_and_warmup_from_the_modules_facts",
            FACTS + "test_diagnose_judges_by_the_modules_rule_where_none_is_given",
            DETECTOR + "test_recover_and_diagnose_judge_a_users_module_by_the_scale_free_default",
        ),
    ),
    Mutation(
        "demo_columns_for_every_module",  # recover's table shows the demo's columns, n/a
        "lit_spikes/tools/recover/report.py",
        '    if "cells" in row:\n',
        '    if "cells" in row and False:\n',
        (
            FACTS + "test_the_comparison_shows_the_modules_columns_and_direction_only",
            FACTS + "test_a_module_that_states_nothing_gets_no_demo_column_or_rule",
        ),
    ),
    Mutation(
        "class_typo_without_suggestion",  # a mistyped class path names no close class
        "lit_spikes/tools/class_paths.py",
        '        hint = f" (did you mean {module_name}.{close[0]}?)" if close else ""\n',
        '        hint = ""\n',
        (
            CLASS_PATHS + "test_a_class_path_with_a_typo_is_refused_naming_the_closest",
            CLASS_PATHS + "test_the_closest_class_is_one_of_the_kind_asked_for",
        ),
    ),
    Mutation(
        "help_lists_no_given_class",  # --help after --model X lists none of X's options
        "lit_spikes/tools/command_line.py",
        'group.description = options_listing(key, klass, "Given", init_args=True)\n',
        "group.description = None\n",
        (
            CLASS_PATHS + "test_help_after_a_class_path_lists_that_classs_options",
            CLASS_PATHS + "test_recovers_help_lists_the_given_datas_options",
        ),
    ),
    Mutation(
        "fit_ignores_the_stated_length",  # fit without max_steps asks, or runs unbounded
        "lit_spikes/tools/fit_plan.py",
        '        stated = stated_run_steps(config["model"])\n',
        "        stated = None\n",
        (
            FACTS + "test_fit_ends_where_the_module_states_unless_told",
            "tests/tools/test_fit_plan.py::test_the_run_length_is_the_schedules_for_the_demo_only",
        ),
    ),
    Mutation(
        "hparams_metric_not_the_modules",  # a user's fit records no HPARAMS metric
        "lit_spikes/tools/fit_cli.py",
        "            hparams_metric=facts_of(self.model).val_metric,\n",
        "            hparams_metric=None,\n",
        (FACTS + "test_fit_records_the_modules_validation_metric_for_the_hparams_view",),
    ),
    Mutation(
        "restored_spikes_stay_dicts",  # a checkpoint's spike records not read as Spike
        "lit_spikes/callbacks/spike_detector.py",
        '        self.spikes = [Spike.of(s) for s in state_dict["spikes"]][-self.max_records :]\n',
        '        self.spikes = [dict(s) for s in state_dict["spikes"]][-self.max_records :]\n',
        (
            "tests/library/callbacks/test_spike.py::"
            "test_a_flagged_step_is_a_frozen_spike_and_a_plain_record_in_the_file",
            "tests/library/callbacks/test_spike.py::"
            "test_the_records_older_versions_wrote_read_back_as_spikes",
        ),
    ),
    Mutation(
        "ledger_spikes_written_with_nulls",  # the ledger's spike records grow null fields
        "lit_spikes/tools/recover/ledger.py",
        "    if [key for key, _ in pairs] == SPIKE_FIELDS:\n",
        "    if False:\n",
        (
            "tests/tools/recover/test_ledger_spikes.py::"
            "test_a_ledgers_spikes_read_back_as_spikes_and_are_written_as_they_were",
            FACTS
            + "test_the_ledgers_spikes_are_plain_records_and_diagnose_names_the_columns_on_the_"
            "command_line",
        ),
    ),
    Mutation(
        "diagnose_columns_not_the_modules",  # diagnose's table: no column the module states
        "lit_spikes/tools/diagnose/run.py",
        "    verdict.columns = replayer.columns\n",
        "    verdict.columns = ()\n",
        (
            FACTS + "test_diagnose_shows_the_modules_columns_and_no_other",
            FACTS
            + "test_the_ledgers_spikes_are_plain_records_and_diagnose_names_the_columns_on_the_"
            "command_line",
        ),
    ),
    Mutation(
        "logged_columns_not_recorded",  # recover's history: a column the module self.logs
        "lit_spikes/tools/recover/history.py",
        "    for key in columns:\n",
        "    for key in ():\n",
        (
            FACTS + "test_a_column_the_module_logs_itself_is_recorded_and_compared",
            FACTS + "test_the_comparison_shows_the_modules_columns_and_direction_only",
        ),
    ),
    Mutation(
        "diagnose_reads_no_logged_column",  # a replay records only the detector's names
        "lit_spikes/tools/diagnose/replay.py",
        "        recorder = StepRecorder(tuple(names))\n",
        "        recorder = StepRecorder(self.judge.monitors)\n",
        (
            FACTS + "test_diagnose_shows_the_modules_columns_and_no_other",
            FACTS
            + "test_the_ledgers_spikes_are_plain_records_and_diagnose_names_the_columns_on_the_"
            "command_line",
        ),
    ),
    Mutation(
        "module_variants_not_offered",  # --compare: doing nothing alone, whatever the module
        "lit_spikes/tools/recover/config.py",
        "        return (DO_NOTHING, *(v.name for v in self.facts.variants))\n",
        "        return (DO_NOTHING,)\n",
        (
            FACTS + "test_the_modules_variant_is_a_comparison_row_from_scratch",
            FACTS + "test_compare_names_the_modules_variants_and_refuses_others",
        ),
    ),
    Mutation(
        "aftermath_counts_as_spikes",  # episodes: consecutive flags alone, settle ignored
        "lit_spikes/callbacks/spike.py",
        "        if group and spike.step > group[-1].step + settle:\n",
        "        if group and spike.step > group[-1].step + 1:\n",
        (
            EPISODES + "test_the_aftermath_of_a_spike_is_its_episode_not_more_spikes",
            EPISODES + "test_settle_sets_how_long_the_curve_must_stay_in_band",
        ),
    ),
    Mutation(
        "fit_ends_silent_on_spikes",  # no summary line at the end of a fit
        "lit_spikes/callbacks/spike_detector.py",
        "        rank_zero_info(self.summary(trainer.global_step))\n",
        "        pass\n",
        (
            EPISODES + "test_a_fit_ends_with_one_line_on_its_spikes",
            DETECTOR + "test_spike_detector_flags_a_poisoned_batch_and_stops",
        ),
    ),
    Mutation(
        "aftermath_marked",  # TensorBoard marks every flag, an episode's aftermath too
        "lit_spikes/callbacks/spike_detector.py",
        "        return spike.step in self.onsets\n",
        "        return True\n",
        (
            EPISODES + "test_tensorboard_marks_each_episode_once_at_its_onset",
            EPISODES + "test_a_run_resumed_mid_episode_marks_no_new_onset",
        ),
    ),
    Mutation(
        "spikes_kept_unbounded",  # every flag kept: max_records ignored
        "lit_spikes/callbacks/spike_detector.py",
        "        del self.spikes[: -self.max_records]  # the latest kept\n",
        "        pass\n",
        (
            EPISODES + "test_the_spikes_slice_as_the_docstring_shows_and_keep_the_latest",
            DETECTOR + "test_the_detector_state_is_bounded_however_long_the_run",
        ),
    ),
    Mutation(
        "marks_at_the_spikes_height",  # the mark where the default scaling crops it
        "callbacks/spike_detector.py",
        "                self._marks.write(trainer, spike.metric, spike.step, spike.reference)\n",
        "                self._marks.write(trainer, spike.metric, spike.step, spike.value)\n",
        (
            MARKS + "test_marks_of_the_returned_loss_land_on_the_users_train_loss",
            "tests/tools/test_tb.py::"
            "test_a_users_run_shows_spikes_on_their_curve_and_lr_and_grad_norm",
        ),
    ),
    Mutation(
        "marks_miss_the_users_loss_chart",  # the returned loss's own chart, not train_loss
        "callbacks/spike_marks.py",
        "            if not equal:\n",
        "            if True:\n",
        (MARKS + "test_marks_of_the_returned_loss_land_on_the_users_train_loss",),
    ),
    Mutation(
        "stitched_run_ignores_the_branches_charts",  # the accepted run's loss as 'loss'
        "lit_spikes/tools/recover/outcome.py",
        "(b.charts for b in ledger.branches if b.charts), {})",
        "(b.charts for b in ledger.branches if not b), {})",
        (
            "tests/tools/recover/test_recover_tensorboard.py::"
            "test_every_run_of_the_loop_logs_the_same_tags",
        ),
    ),
    Mutation(
        "modules_own_checks_not_run",  # the module's ChecksItsRun never asked (its data's is)
        "lit_spikes/tools/fit_own_data.py",
        "    for owner in (model, datamodule):\n",
        "    for owner in (datamodule,):\n",
        (
            "tests/tools/test_check_run.py::"
            "test_a_check_of_the_module_or_data_refuses_the_run_before_any_file",
            "tests/tools/test_cli_input.py::"
            "test_bad_cli_input_fails_before_training_and_writes_nothing",
        ),
    ),
    Mutation(
        "study_calls_any_resume_exact",  # the comparison of the final tensors never fails
        "lit_spikes/tools/study/cells.py",
        '"params_equal": not differing and set(saved) == set(state),',
        '"params_equal": True,',
        (
            "tests/tools/test_study.py::test_a_resume_that_is_not_exact_fails_the_finding",
            "tests/tools/test_study.py::test_the_comparison_names_each_tensor_that_differs",
        ),
    ),
    Mutation(
        "study_compares_remedies_the_wrong_way",  # a remedy that ends worse counted better
        "lit_spikes/tools/study/report.py",
        'return bool(rung > nothing if config.facts.val_mode == "max" else rung < nothing)',
        'return bool(rung < nothing if config.facts.val_mode == "max" else rung > nothing)',
        (
            "tests/tools/test_study.py::test_a_remedy_is_better_by_the_modules_own_direction",
            "tests/tools/test_study.py::test_findings_count_seeds_with_and_without_a_spike_apart",
        ),
    ),
    Mutation(
        "early_warning_forgets_false_alarms",  # only the crossings a spike followed count
        "lit_spikes/tools/study/early_warning.py",
        "        count.alarms += len(alarms)\n",
        "        count.alarms += sum(map(followed, alarms))\n",
        (
            "tests/tools/test_study.py::"
            "test_alarms_count_against_the_spikes_that_follow_within_the_lead",
            "tests/tools/test_study.py::"
            "test_a_signal_crossing_at_random_warns_no_better_than_chance",
        ),
    ),
    Mutation(
        "forensics_names_the_last_layer_of_a_forward_fault",  # downstream, not where it entered
        "lit_spikes/tools/forensics/verdict.py",
        "        origin = min(forward, key=lambda e: order[e.layer]).layer\n",
        "        origin = max(forward, key=lambda e: order[e.layer]).layer\n",
        (
            "tests/tools/test_forensics.py::test_a_planted_fault_is_named",
            "tests/tools/test_forensics.py::test_the_reading_follows_the_order_a_step_computes_in",
        ),
    ),
    Mutation(
        "forensics_takes_a_replay_that_is_not_the_run",  # per-layer numbers of another run
        "lit_spikes/tools/forensics/run.py",
        "        same = replayed == ran or (math.isnan(replayed) and math.isnan(ran))\n",
        "        same = True\n",
        (
            "tests/tools/test_forensics.py::test_a_replay_that_is_not_the_run_is_refused",
            "tests/tools/test_forensics.py::test_every_logged_step_is_compared_to_the_bit",
        ),
    ),
    Mutation(
        "elastic_sum_in_another_order",  # the processes' parts added as they come, not in the tree
        "lit_spikes/elastic/tree.py",
        "    return _finish(sums, 0, num_shards)\n",
        "    return torch.stack([part[0] for part in parts]).sum(0)\n",
        (
            "tests/library/test_elastic_tree.py::"
            "test_every_process_count_that_divides_the_shards_gives_the_same_bits",
            "tests/library/test_elastic_tree.py::"
            "test_a_modules_gradient_is_the_same_on_1_2_and_4_processes",
        ),
    ),
]


def tracked_copy(into: Path) -> Path:
    """The tracked files of the checkout (as they are in the work tree) under ``into``."""
    names = subprocess.run(
        ["git", "ls-files", "-z"], cwd=REPO, check=True, capture_output=True, text=True
    ).stdout.split("\0")
    root = into / "repo"
    for name in filter(None, names):
        source, target = REPO / name, root / name
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_symlink():
            target.symlink_to(os.readlink(source))
        elif source.is_file():
            shutil.copy2(source, target)
    for name in (
        "tests/modules/guarantee_runs.py",
        "tests/modules/guarantee_modules.py",
    ):  # if untracked
        if (REPO / name).is_file() and not (root / name).exists():
            shutil.copy2(REPO / name, root / name)
    return root


def anchored(root: Path, mutation: Mutation) -> str:
    text = (root / mutation.file).read_text()
    count = text.count(mutation.old)
    if count != 1:
        raise LookupError(f"{mutation.name}: its anchor occurs {count} times in {mutation.file}")
    return text


def pytest_run(root: Path, *args: str) -> tuple[str, bool]:
    """pytest's output on ``args`` in the copy, and whether it ran past ``TIMEOUT_S`` (its
    process group killed then: a mutation can make a run loop, a rollback to the spike's
    own file for one)."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *args]
    with subprocess.Popen(
        command, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, start_new_session=True,
    ) as process:  # fmt: skip
        try:
            return process.communicate(timeout=TIMEOUT_S)[0], False
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            return process.communicate()[0], True


def imports_the_copy(root: Path) -> str | None:
    """None where Python, run as the tests run, imports the library from ``root``; else
    what it imports instead."""
    env = {**os.environ, "PYTHONPATH": str(root)}
    code = "import lit_spikes.callbacks as c, lit_spikes.loader as l; print(c.__file__, l.__file__)"
    done = subprocess.run(
        [sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True
    )
    files = done.stdout.split()
    inside = done.returncode == 0 and all(f.startswith(str(root)) for f in files)
    return None if inside else (done.stdout + done.stderr).strip()


def failing_functions(output: str) -> list[str]:
    """The distinct test functions pytest's short summary names as failed (``-rf``), the
    parameters of a parametrized test folded into one."""
    found = re.findall(r"^(?:FAILED|ERROR) (\S+?::\S+?)(?:\[.*?\])?(?: - |$)", output, re.M)
    return list(dict.fromkeys(found))


def judged(root: Path) -> tuple[list[str], float, bool]:
    """The failing test functions of ``DIRS`` on the copy as it is now, the seconds, and
    whether the run hung (past ``TIMEOUT_S``)."""
    start = time.perf_counter()
    output, hung = pytest_run(
        root,
        "-rf",
        "-m",
        "not slow",
        "-n",
        "2",
        f"--maxfail={MAX_FAILURES}",
        f"--timeout={TEST_TIMEOUT_S}",
        *DIRS,
    )
    return failing_functions(output), time.perf_counter() - start, hung


DEMO_HELPERS = ("demo_setup",)
"""Modules of ``tests/modules`` that set the project's own model up (the demo's)."""
DEMO_WORDS = {"TinyGPTModule", "StepDataModule", "tiny_reference", "tiny", "fit"}
"""Names a test uses the project's model by: its classes, and conftest's tiny runs."""


def _imported(tree: ast.Module, wanted: Any) -> set[str]:
    names: set[str] = set()
    for node in tree.body:
        if isinstance(node, ast.ImportFrom) and wanted(node.module or ""):
            names |= {alias.asname or alias.name for alias in node.names}
    return names


def _words(source: str) -> set[str]:
    return set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", source))


def _is_own_module(module: str) -> bool:
    return module.startswith("tests.modules.") and module.split(".")[2] not in DEMO_HELPERS


def _is_demo_module(module: str) -> bool:
    return module.startswith("lit_spikes.demo") or module == "tests.modules.demo_setup"


def _uses(source: str, names: set[str], own: bool) -> bool:
    paths = re.findall(r"tests\.modules\.(\w+)\.", source)  # a class path given as text
    given = any((m not in DEMO_HELPERS) == own for m in paths) or (
        not own and "lit_spikes.demo." in source
    )
    return given or bool(_words(source) & names)


def on_own_module(root: Path, test: str) -> bool:
    """Whether test ``file::name`` is not only on the project's model: it uses something
    written for the tests (a module, data or callback of its file or of ``tests/modules``,
    by name or class path), or nothing of the demo's (a check of files or of a function).
    Read from the source of the test, the fixtures of its file it takes and its file's
    constants, not from what runs."""
    file, _, name = test.partition("::")
    text = (root / file).read_text()
    tree = ast.parse(text)
    own = {n.name for n in tree.body if isinstance(n, ast.ClassDef)}
    own |= _imported(tree, _is_own_module)
    shared = _imported(tree, lambda module: module == "tests.conftest")
    demo = DEMO_WORDS | {w for w in shared if w.startswith(("TINY", "tiny"))}
    demo |= _imported(tree, _is_demo_module)
    for node in (n for n in tree.body if isinstance(n, ast.Assign | ast.AnnAssign)):
        source = ast.get_source_segment(text, node) or ""
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]
        named = {t.id for t in targets if isinstance(t, ast.Name)}
        own |= named if _uses(source, own, True) else set()
        demo |= named if _uses(source, demo, False) else set()
    functions = {n.name: n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    function = functions.get(name.rpartition("::")[2])
    if function is None:
        return False
    taken = [functions[a.arg] for a in function.args.args if a.arg in functions]
    sources = [ast.get_source_segment(text, f) or "" for f in (function, *taken)]
    return any(_uses(s, own, True) for s in sources) or not any(
        _uses(s, demo, False) for s in sources
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="*", help="mutation names (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    args = parser.parse_args()
    chosen = [m for m in MUTATIONS if not args.only or m.name in args.only]
    if args.list:
        for m in chosen:
            print(f"{m.name}: {m.file} ({len(m.tests)} tests)")
        return 0
    with tempfile.TemporaryDirectory(prefix="mutations-") as tmp:
        root = tracked_copy(Path(tmp))
        texts = {}
        try:
            texts = {m.name: anchored(root, m) for m in chosen}
        except LookupError as error:
            print(f"anchor not found: {error}", file=sys.stderr)
            return 2
        elsewhere = imports_the_copy(root)
        if elsewhere is not None:
            print(f"the tests would not import the copy but: {elsewhere}", file=sys.stderr)
            return 1
        failing, seconds, hung = judged(root)
        if failing or hung:
            print(f"the unmutated copy fails: {failing or 'it hung'}", file=sys.stderr)
            return 1
        print(f"unmutated: {', '.join(DIRS)} pass ({seconds:.0f} s)", flush=True)
        rows, missed = [], 0
        for m in chosen:
            path = root / m.file
            path.write_text(texts[m.name].replace(m.old, m.new))
            try:
                failing, seconds, hung = judged(root)
            finally:
                path.write_text(texts[m.name])
            own = sum(on_own_module(root, test) for test in failing)
            caught = len(failing) >= 2 and (own >= 1 or m.of_the_demo)
            missed += not caught
            unmet = [t for t in m.tests if t not in failing]
            rows.append((m.name, m.file, len(failing), own, caught, seconds, unmet, hung))
            print(f"{m.name}: {len(failing)} failing, {own} on own modules ({seconds:.0f} s)")
    width, files = max(len(r[0]) for r in rows), max(len(r[1]) for r in rows)
    print(f"{'mutation':<{width}}  {'file':<{files}}  failing  own  verdict  seconds")
    for name, file, count, own, caught, seconds, unmet, hung in rows:
        verdict = "caught" if caught else "HUNG" if hung and count < 2 else "MISSED"
        shown = f"{count}{'+' if count >= MAX_FAILURES else ''}"
        print(f"{name:<{width}}  {file:<{files}}  {shown:<8} {own:<4} {verdict:<8} {seconds:.0f}")
        for test in unmet:
            print(f"{'':<{width}}  (not among the failures: {test})")
    return 1 if missed else 0


if __name__ == "__main__":
    sys.exit(main())
