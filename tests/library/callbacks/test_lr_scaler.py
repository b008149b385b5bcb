"""``LRScaler``: a scaled run resumes bit-exactly, two scalers keep their own state, a
recursive schedule is left alone, an optimizer without a scheduler is refused."""

from __future__ import annotations

from pathlib import Path

import lightning.pytorch as pl
import pytest
import torch

from lit_spikes.callbacks import (
    ExactResume,
    LRScaler,
)
from lit_spikes.demo.module import TinyGPTModule
from lit_spikes.shared.training import checkpoint_path
from tests.conftest import TINY_DATA, TINY_OPTIM, assert_states_equal, fit, load_ckpt
from tests.modules.guarantee_modules import (
    DrawingRegressor,
    seed_all,
)
from tests.modules.guarantee_runs import GUARANTEE_STEPS, guarantee_differences, train_guarded


def test_an_lr_scaler_resume_equals_the_uninterrupted_run(tmp_path: Path) -> None:
    def run(name: str, steps: int, ckpt: Path | None = None) -> pl.Trainer:
        scaler = LRScaler(factor=0.5, start_step=5, end_step=13)
        return train_guarded(
            tmp_path / name, DrawingRegressor(schedule=True), steps, [scaler, ExactResume()], ckpt
        )

    seed_all(3)
    whole = run("a", GUARANTEE_STEPS)
    seed_all(3)
    run("b", 9)
    seed_all(4)
    resumed = run("c", GUARANTEE_STEPS, tmp_path / "b" / "step=9.ckpt")
    lrs, again = whole.lightning_module.lrs, resumed.lightning_module.lrs
    assert [lrs[s] for s in range(9, GUARANTEE_STEPS)] == [
        again[s] for s in range(9, GUARANTEE_STEPS)
    ]
    assert lrs[12] == 0.5 * lrs[13]  # scaled to step 12, as scheduled from 13 on
    assert guarantee_differences(whole, resumed) == []


N, K, EVERY = 20, 10, 5


def test_lr_scaler_run_resumes_bit_exactly(tmp_path: Path) -> None:
    reference = fit(
        tmp_path, "ref", N, checkpoint_every=EVERY, callbacks=[LRScaler(0.5, start_step=7)]
    )
    plain = fit(tmp_path, "plain", 8)
    assert reference.module.history[7]["lr"] == plain.module.history[7]["lr"] * 0.5
    assert reference.module.history[6]["lr"] == plain.module.history[6]["lr"]
    resumed = fit(
        tmp_path,
        "resumed",
        N,
        checkpoint_every=EVERY,
        ckpt_path=checkpoint_path(reference.spec.run_dir, K),
        callbacks=[LRScaler(0.5, start_step=7)],
    )
    assert_states_equal(
        load_ckpt(checkpoint_path(reference.spec.run_dir, N)),
        load_ckpt(checkpoint_path(resumed.spec.run_dir, N)),
    )


def test_two_lr_scalers_differing_only_in_their_end_each_keep_their_own_state(
    tmp_path: Path,
) -> None:
    def scalers() -> list[LRScaler]:
        return [LRScaler(0.5, start_step=3, end_step=6), LRScaler(0.5, start_step=3, end_step=9)]

    reference = fit(tmp_path, "ref", N, checkpoint_every=EVERY, callbacks=scalers())
    saved = load_ckpt(checkpoint_path(reference.spec.run_dir, K))["callbacks"]
    assert sorted(v["end_step"] for k, v in saved.items() if k.startswith("LRScaler")) == [6, 9]
    resumed = fit(
        tmp_path,
        "resumed",
        N,
        checkpoint_every=EVERY,
        ckpt_path=checkpoint_path(reference.spec.run_dir, K),
        callbacks=scalers(),
    )
    assert_states_equal(
        load_ckpt(checkpoint_path(reference.spec.run_dir, N)),
        load_ckpt(checkpoint_path(resumed.spec.run_dir, N)),
    )


class _CosineModule(TinyGPTModule):
    """A scheduler that computes each LR from the current one (most of torch's do)."""

    def configure_optimizers(self) -> dict[str, object]:
        optimizer = torch.optim.AdamW(self.parameters(), lr=0.01)
        cosine = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=100)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": cosine, "interval": "step"}}


class _NoSchedulerModule(TinyGPTModule):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.01)


def _lrs(module: TinyGPTModule, callbacks: list[object], steps: int = 8) -> list[float]:
    import lightning.pytorch as pl

    from lit_spikes.demo.data import StepDataModule

    trainer = pl.Trainer(
        max_steps=steps,
        callbacks=callbacks,  # type: ignore[arg-type]
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    trainer.fit(module, datamodule=StepDataModule(TINY_DATA))
    return [record["lr"] for record in module.history]


def test_lr_scaler_leaves_a_recursive_schedule_untouched() -> None:
    """Cosine annealing computes each LR from the last one: the scaled LR must not become
    its own, or the factor compounds every step and stays after end_step."""
    from tests.conftest import TINY_GPT

    plain = _lrs(_CosineModule(gpt=TINY_GPT, optim=TINY_OPTIM), [])
    scaled = _lrs(
        _CosineModule(gpt=TINY_GPT, optim=TINY_OPTIM), [LRScaler(0.5, start_step=2, end_step=5)]
    )
    expected = [lr * 0.5 if 2 <= step < 5 else lr for step, lr in enumerate(plain)]
    assert scaled == expected


def test_lr_scaler_refuses_an_optimizer_without_a_scheduler() -> None:
    from tests.conftest import TINY_GPT

    module = _NoSchedulerModule(gpt=TINY_GPT, optim=TINY_OPTIM)
    with pytest.raises(ValueError, match="optimizer 0 \\(AdamW\\) has none"):
        _lrs(module, [LRScaler(0.5, start_step=2)])
