"""Resumed vs uninterrupted: bit-exact, and each part of the checkpoint shown to matter."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from lightning.pytorch.callbacks import Callback

from lit_spikes.callbacks.exact_resume import STATE_KEY
from lit_spikes.demo.ablations import ForgetOptimizerState, ForgetRNGState
from lit_spikes.demo.data import StepDataModule
from lit_spikes.shared.training import RunSpec, checkpoint_path
from tests.conftest import (
    TINY_DATA,
    TINY_GPT,
    TINY_OPTIM,
    Run,
    assert_states_equal,
    fit,
    load_ckpt,
)

N, K, EVERY = 20, 10, 5

CASES = {
    "plain": {},
    "dropout": {"gpt": replace(TINY_GPT, dropout=0.1)},
    "skip_set": {"data": replace(TINY_DATA, skip=(3, 4, 11, 12, 13))},
    "lr_scale": {"optim": replace(TINY_OPTIM, lr_scale=0.5)},
}


@pytest.mark.parametrize("case", CASES)
def test_resume_from_checkpoint_is_bit_exact(tmp_path: Path, case: str) -> None:
    kwargs = CASES[case]
    reference = fit(tmp_path, "reference", N, checkpoint_every=EVERY, **kwargs)
    resumed = fit(
        tmp_path,
        "resumed",
        N,
        checkpoint_every=EVERY,
        ckpt_path=checkpoint_path(reference.spec.run_dir, K),
        **kwargs,
    )
    assert_states_equal(
        load_ckpt(checkpoint_path(reference.spec.run_dir, N)),
        load_ckpt(checkpoint_path(resumed.spec.run_dir, N)),
    )
    assert sorted(resumed.losses) == list(range(K, N))
    assert all(resumed.losses[s] == reference.losses[s] for s in resumed.losses)


def test_resume_at_step_off_every_interval(tmp_path: Path) -> None:
    """K=7 is no multiple of the checkpoint (5) or logging (3) interval: a run stopped
    there and saved by hand resumes exactly, logging on its own cadence."""
    reference = fit(tmp_path, "reference", N, checkpoint_every=EVERY, log_every_n_steps=3)
    stopped = fit(tmp_path, "stopped", 7, log_every_n_steps=3)
    path = tmp_path / "stopped" / "step=7.ckpt"
    stopped.trainer.save_checkpoint(path)
    resumed = fit(
        tmp_path, "resumed", N, checkpoint_every=EVERY, ckpt_path=path, log_every_n_steps=3
    )
    assert_states_equal(
        load_ckpt(checkpoint_path(reference.spec.run_dir, N)),
        load_ckpt(checkpoint_path(resumed.spec.run_dir, N)),
    )
    assert sorted(resumed.losses) == list(range(7, N))
    assert all(resumed.losses[s] == reference.losses[s] for s in resumed.losses)


def test_checkpoints_leave_the_causal_mask_out_and_older_ones_holding_it_still_resume(
    tmp_path: Path, tiny_reference: Run
) -> None:
    """The mask is derived from block_size: bloat in every file, ignored where found."""
    from lit_spikes.checkpoints import atomic_torch_save

    reference = tiny_reference
    saved = load_ckpt(checkpoint_path(reference.spec.run_dir, K))
    assert not [key for key in saved["state_dict"] if "mask" in key]
    causal = torch.tril(torch.ones(TINY_GPT.block_size, TINY_GPT.block_size, dtype=torch.bool))
    for layer in range(TINY_GPT.n_layer):  # as files written before held it
        saved["state_dict"][f"model.blocks.{layer}.attn.mask"] = causal.view(1, 1, *causal.shape)
    older = tmp_path / "older" / f"step={K}.ckpt"
    older.parent.mkdir()
    atomic_torch_save(saved, older)
    resumed = fit(tmp_path, "resumed", N, checkpoint_every=EVERY, ckpt_path=older)
    assert_states_equal(
        load_ckpt(checkpoint_path(reference.spec.run_dir, N)),
        load_ckpt(checkpoint_path(resumed.spec.run_dir, N)),
    )


def test_resume_in_a_new_process_through_the_cli(tmp_path: Path, tiny_reference: Run) -> None:
    reference = tiny_reference
    config = {
        "model": {
            "gpt": TINY_GPT.to_dict(),
            "optim": vars(TINY_OPTIM),
            "model_seed": 0,
        },
        "data": {
            "config": {
                "seed": TINY_DATA.seed,
                "batch_size": TINY_DATA.batch_size,
                "block_size": TINY_DATA.block_size,
                "world": vars(TINY_DATA.world),
            }
        },
        "trainer": {
            "default_root_dir": str(tmp_path / "cli"),
            "limit_val_batches": 0,
            "enable_progress_bar": False,
        },
        "checkpoint_every": EVERY,
    }
    config_file = tmp_path / "tiny.yaml"
    config_file.write_text(yaml.safe_dump(config))
    ckpt = checkpoint_path(reference.spec.run_dir, K)
    command = [sys.executable, "-m", "lit_spikes.tools.cli", "fit", "--config", str(config_file)]
    result = subprocess.run(
        [*command, "--ckpt_path", str(ckpt)], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    resumed_ckpts = sorted((tmp_path / "cli" / "checkpoints").glob("*.ckpt"))
    assert [p.name for p in resumed_ckpts] == ["step=15.ckpt", "step=20.ckpt"]
    assert_states_equal(
        load_ckpt(checkpoint_path(reference.spec.run_dir, N)),
        load_ckpt(checkpoint_path(tmp_path / "cli", N)),
    )


def _final_params(run_dir: Path) -> dict[str, torch.Tensor]:
    return load_ckpt(checkpoint_path(run_dir, N))["state_dict"]


def _differs(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return any(not torch.equal(a[k], b[k]) for k in a)


def test_fresh_optimizer_changes_the_weights(tmp_path: Path, tiny_reference: Run) -> None:
    reference = tiny_reference
    ckpt = checkpoint_path(reference.spec.run_dir, K)
    fresh = fit(
        tmp_path,
        "fresh",
        N,
        checkpoint_every=EVERY,
        ckpt_path=ckpt,
        callbacks=[ForgetOptimizerState()],
    )
    assert _differs(_final_params(reference.spec.run_dir), _final_params(fresh.spec.run_dir))
    # the first step after the resume already moves differently
    assert fresh.losses[K] == reference.losses[K]
    assert fresh.losses[K + 1] != reference.losses[K + 1]


def test_other_data_seed_changes_the_weights(tmp_path: Path, tiny_reference: Run) -> None:
    reference = tiny_reference
    ckpt = checkpoint_path(reference.spec.run_dir, K)
    with pytest.warns(UserWarning, match="data seed 3"):
        other = fit(
            tmp_path,
            "other",
            N,
            checkpoint_every=EVERY,
            ckpt_path=ckpt,
            data=replace(TINY_DATA, seed=7),
        )
    assert _differs(_final_params(reference.spec.run_dir), _final_params(other.spec.run_dir))
    assert other.losses[K] != reference.losses[K]


def test_dropout_without_rng_restore_changes_the_weights(tmp_path: Path) -> None:
    gpt = replace(TINY_GPT, dropout=0.1)
    reference = fit(tmp_path, "reference", N, checkpoint_every=EVERY, gpt=gpt)
    ckpt = checkpoint_path(reference.spec.run_dir, K)
    torch.manual_seed(12345)  # whatever state the process happens to be in
    forgot = fit(
        tmp_path,
        "forgot",
        N,
        checkpoint_every=EVERY,
        ckpt_path=ckpt,
        gpt=gpt,
        callbacks=[ForgetRNGState()],
    )
    assert _differs(_final_params(reference.spec.run_dir), _final_params(forgot.spec.run_dir))
    assert forgot.losses[K] != reference.losses[K]


def test_a_warm_start_from_load_from_checkpoint_draws_from_its_own_train_seed(
    tmp_path: Path,
) -> None:
    """Weights loaded for a new run (no ckpt_path) start a run at step 0: its dropout masks
    come from train_seed, as for weights loaded with load_state_dict, not from the RNG
    states the checkpoint carries."""
    from lit_spikes.demo.module import TinyGPTModule

    gpt = replace(TINY_GPT, dropout=0.2)
    ckpt = checkpoint_path(fit(tmp_path, "ref", K, checkpoint_every=K, gpt=gpt).spec.run_dir, K)

    def warm_losses(module: TinyGPTModule, name: str) -> list[float]:
        spec = RunSpec(
            tmp_path, name, 3, progress_bar=False, trainer_kwargs={"limit_val_batches": 0}
        )
        spec.trainer().fit(module, datamodule=StepDataModule(TINY_DATA))
        return [r["loss"] for r in module.history]

    five = warm_losses(TinyGPTModule.load_from_checkpoint(ckpt, train_seed=5), "five")
    six = warm_losses(TinyGPTModule.load_from_checkpoint(ckpt, train_seed=6), "six")
    by_hand = TinyGPTModule(gpt=gpt, optim=TINY_OPTIM, train_seed=5)
    by_hand.load_state_dict(load_ckpt(ckpt)["state_dict"])
    assert five == warm_losses(by_hand, "by_hand") and five != six


def test_a_new_run_from_loaded_weights_skips_none_of_the_old_runs_nan_steps(
    tmp_path: Path,
) -> None:
    """The steps a run skipped (NaN loss) are its own: a new run from its weights
    (load_from_checkpoint, no ckpt_path) trains every step, as one from the same weights
    loaded by hand does, and its checkpoints mark none."""
    from lit_spikes.demo.module import TinyGPTModule
    from tests.conftest import NaNLossModule

    with pytest.warns(UserWarning, match="non-finite loss at step 2"):
        module = NaNLossModule(gpt=TINY_GPT, optim=TINY_OPTIM, model_seed=0, nan_step=2)
        spec = RunSpec(tmp_path, "nan", K, checkpoint_every=K, progress_bar=False)
        spec.trainer().fit(module, datamodule=StepDataModule(TINY_DATA))
    ckpt = checkpoint_path(spec.run_dir, K)
    assert load_ckpt(ckpt)["lit_spikes"]["nonfinite_steps"] == [2]

    def new_run(module: TinyGPTModule, name: str) -> TinyGPTModule:
        spec = RunSpec(tmp_path, name, 4, checkpoint_every=4, progress_bar=False)
        spec.trainer().fit(module, datamodule=StepDataModule(TINY_DATA))
        assert load_ckpt(checkpoint_path(spec.run_dir, 4))["lit_spikes"]["nonfinite_steps"] == []
        return module

    loaded = new_run(TinyGPTModule.load_from_checkpoint(ckpt), "loaded")
    by_hand = TinyGPTModule(gpt=TINY_GPT, optim=TINY_OPTIM)
    by_hand.load_state_dict(load_ckpt(ckpt)["state_dict"])
    new_run(by_hand, "by_hand")
    assert loaded.nonfinite_steps == [] and "grad_norm" in loaded.history[2]
    for key, value in by_hand.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[key]), key


def test_a_second_fit_on_a_trainer_is_refused(tmp_path: Path) -> None:
    """Lightning builds AdamW and the LR schedule anew for each fit while the Trainer's
    step and the data go on: a second fit would train another run than the one asked for."""
    run = fit(tmp_path, "run", K)
    run.trainer.fit_loop.epoch_loop.max_steps = N  # to train on (at max_steps: nothing)
    with pytest.raises(RuntimeError, match=r"already trained to step 10.*ckpt_path"):
        run.trainer.fit(run.module, datamodule=StepDataModule(TINY_DATA))


def test_load_from_checkpoint_and_validate_take_another_optimizer_config(
    tmp_path: Path,
) -> None:
    """Weights need no optimizer: a new run's (fine-tuning) optimizer config, given to
    load_from_checkpoint or to a module that only validates, is no resume's mismatch."""
    from lit_spikes.demo.module import TinyGPTModule

    ckpt = checkpoint_path(fit(tmp_path, "ref", K, checkpoint_every=K).spec.run_dir, K)
    other = replace(TINY_OPTIM, peak_lr=0.001)
    loaded = TinyGPTModule.load_from_checkpoint(ckpt, optim=other)
    assert loaded.optim_config == other
    spec = RunSpec(tmp_path, "validate", K, progress_bar=False)
    module = TinyGPTModule(gpt=TINY_GPT, optim=other)
    results = spec.trainer().validate(module, datamodule=StepDataModule(TINY_DATA), ckpt_path=ckpt)
    assert results[0]["val/bpc"] > 0


def test_lightning_run_equals_plain_pytorch_loop(tmp_path: Path) -> None:
    """The Trainer adds nothing to the numerics: same weights as a hand-written loop."""
    from lit_spikes.demo.plain import evaluate_bpc, train_plain

    run = fit(tmp_path, "lightning", N, val_every=N)
    plain = train_plain(TINY_GPT, TINY_OPTIM, TINY_DATA, N, model_seed=0)
    lightning_bpc = float(run.trainer.callback_metrics["val/bpc"])
    assert evaluate_bpc(plain.model, TINY_DATA) == lightning_bpc
    lightning_state = run.module.model.state_dict()
    for key, value in plain.model.state_dict().items():
        assert torch.equal(value, lightning_state[key]), key
    assert [r["loss"] for r in plain.history] == [r["loss"] for r in run.module.history]


def test_different_model_config_is_refused_before_any_step(
    tmp_path: Path, tiny_reference: Run
) -> None:
    reference = tiny_reference
    ckpt = checkpoint_path(reference.spec.run_dir, K)
    with pytest.raises(ValueError, match=r"d_model: checkpoint 16, now 32"):
        fit(tmp_path, "wider", N, ckpt_path=ckpt, gpt=replace(TINY_GPT, d_model=32))
    assert not (tmp_path / "wider" / "checkpoints").exists()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"lr_scale": 0.5}, r"lr_scale: checkpoint 1.0, now 0.5"),
        ({"peak_lr": 0.05, "max_steps": 40}, r"max_steps: checkpoint 20, now 40; peak_lr"),
    ],
)
def test_different_optimizer_config_is_refused_before_any_step(
    tmp_path: Path, tiny_reference: Run, change: dict[str, Any], message: str
) -> None:
    """A resume restores AdamW's and the schedule's settings from the file: another
    config would be silently overridden, and the run would not be the one asked for."""
    reference = tiny_reference
    ckpt = checkpoint_path(reference.spec.run_dir, K)
    with pytest.raises(ValueError, match=message + r".*LRScaler"):
        fit(tmp_path, "other", N, ckpt_path=ckpt, optim=replace(TINY_OPTIM, **change))
    assert not (tmp_path / "other" / "checkpoints").exists()


@pytest.mark.parametrize(
    ("key", "saved"), [("num_threads", 7), ("flush_denormal", False), ("cpu", "VSX")]
)
def test_fingerprint_difference_warns(tmp_path: Path, key: str, saved: object) -> None:
    reference = fit(tmp_path, "reference", K, checkpoint_every=EVERY)
    ckpt = checkpoint_path(reference.spec.run_dir, K)
    checkpoint = load_ckpt(ckpt)
    fingerprint = checkpoint["callbacks"][STATE_KEY]["fingerprint"]
    now, fingerprint[key] = fingerprint[key], saved
    torch.save(checkpoint, tmp_path / "edited.ckpt")
    match = rf"{key}: checkpoint {saved!r}, now {now!r}.*not guaranteed"
    with pytest.warns(UserWarning, match=match):
        fit(tmp_path, "resumed", K + 2, ckpt_path=tmp_path / "edited.ckpt")


@pytest.mark.parametrize("flush", [True, False])
def test_setup_applies_flush_denormal(tmp_path: Path, flush: bool) -> None:
    """The module's ``flush_denormal`` is what the training thread does, and what its
    checkpoints record."""
    from lit_spikes.callbacks.fingerprint import flush_denormal_enabled
    from lit_spikes.demo.module import TinyGPTModule, set_flush_denormal

    seen: list[bool] = []

    class Probe(Callback):
        def on_train_batch_start(self, *args: Any) -> None:
            seen.append(flush_denormal_enabled())

    before = flush_denormal_enabled()
    set_flush_denormal(not flush)
    try:
        module = TinyGPTModule(gpt=TINY_GPT, optim=TINY_OPTIM, flush_denormal=flush)
        spec = RunSpec(tmp_path, "run", 3, checkpoint_every=3, callbacks=[Probe()])
        spec.progress_bar = False
        spec.trainer().fit(module, datamodule=StepDataModule(TINY_DATA))
    finally:
        set_flush_denormal(before)
    assert seen == [flush] * 3
    saved = load_ckpt(checkpoint_path(spec.run_dir, 3))
    assert saved["callbacks"][STATE_KEY]["fingerprint"]["flush_denormal"] is flush
    assert saved["hyper_parameters"]["flush_denormal"] is flush


def test_a_file_from_before_flush_denormal_loads_as_its_run_trained(tmp_path: Path) -> None:
    """Files written before the option existed were trained without flushing:
    ``load_from_checkpoint`` (diagnose's rebuild of the demo's run) builds them so."""
    from lit_spikes.demo.module import TinyGPTModule

    reference = fit(tmp_path, "reference", EVERY, checkpoint_every=EVERY)
    checkpoint = load_ckpt(checkpoint_path(reference.spec.run_dir, EVERY))
    assert TinyGPTModule.load_from_checkpoint(
        checkpoint_path(reference.spec.run_dir, EVERY)
    ).flush_denormal
    del checkpoint["hyper_parameters"]["flush_denormal"]
    torch.save(checkpoint, tmp_path / "old.ckpt")
    assert TinyGPTModule.load_from_checkpoint(tmp_path / "old.ckpt").flush_denormal is False


def test_flush_denormal_enabled_reads_the_thread_state() -> None:
    from lit_spikes.callbacks.fingerprint import flush_denormal_enabled
    from lit_spikes.demo.module import set_flush_denormal

    before = flush_denormal_enabled()
    try:
        set_flush_denormal(False)
        assert not flush_denormal_enabled()
        assert torch.tensor(1e-40) * 1.0 != 0  # a subnormal survives
        set_flush_denormal(True)
        assert flush_denormal_enabled()
        assert torch.tensor(1e-40) * 1.0 == 0
    finally:
        set_flush_denormal(before)


def test_skip_before_resume_point_is_refused(tmp_path: Path, tiny_reference: Run) -> None:
    reference = tiny_reference
    ckpt = checkpoint_path(reference.spec.run_dir, K)
    with pytest.raises(ValueError, match=r"skip positions \[4\] lie before data position 10"):
        fit(tmp_path, "bad", N, ckpt_path=ckpt, data=replace(TINY_DATA, skip=(4, 12)))


@pytest.mark.parametrize("precision", ["64-true", "bf16-mixed", "bf16-true"])
def test_the_default_model_resumes_bit_exactly_in_every_cpu_precision(
    tmp_path: Path, precision: str
) -> None:
    """A 64-true resume rounded the restored float64 weights to float32: Lightning loads
    them before its precision plugin converts the module (159 of 212 tensors differed)."""
    reference = fit(tmp_path, "reference", N, checkpoint_every=EVERY, precision=precision)
    resumed = fit(
        tmp_path,
        "resumed",
        N,
        ckpt_path=checkpoint_path(reference.spec.run_dir, K),
        checkpoint_every=EVERY,
        precision=precision,
    )
    final = load_ckpt(checkpoint_path(resumed.spec.run_dir, N))
    assert_states_equal(load_ckpt(checkpoint_path(reference.spec.run_dir, N)), final)
    assert all(resumed.losses[s] == reference.losses[s] for s in resumed.losses)
    if precision == "64-true":
        assert all(
            v.dtype == torch.float64 for v in final["state_dict"].values() if v.is_floating_point()
        )
