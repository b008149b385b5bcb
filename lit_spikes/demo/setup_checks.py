"""The checks ``TinyGPTModule`` makes of its setup and of a checkpoint it resumes: each
names every part that differs or would fail, before any step."""

from __future__ import annotations

from typing import Any

from lit_spikes.demo.data import StepDataModule, config_differences
from lit_spikes.demo.model import GPTConfig


def check_training_setup(
    gpt: GPTConfig,
    datamodule: StepDataModule | None,
    accumulate_grad_batches: int = 1,
    overfit_batches: float = 0,
) -> None:
    """Raises ``ValueError`` naming every part of a model, data and Trainer setup that
    would fail at the first step or silently train on other batches: a text too short
    for a row, rows longer than the model's context, characters beyond its vocabulary,
    gradient accumulation (the batch of global step k is one whole batch), Lightning's
    ``overfit_batches`` (the batches never repeat)."""
    problems = []
    if datamodule is not None:
        try:
            datamodule.setup("fit")  # builds the text, checking that rows can be cut from it
        except ValueError as error:
            problems.append(str(error))
        rows, vocab = datamodule.config.block_size, datamodule.tokenizer.vocab_size
        if rows > gpt.block_size:
            problems.append(
                f"DataConfig.block_size={rows} exceeds GPTConfig.block_size={gpt.block_size}: "
                "rows must fit the model's context (make them equal)"
            )
        if gpt.vocab_size < vocab:
            problems.append(
                f"GPTConfig.vocab_size={gpt.vocab_size} is smaller than the {vocab} characters "
                f"of the data's alphabet: use vocab_size={vocab}"
            )
    if accumulate_grad_batches != 1:
        problems.append(
            f"Trainer(accumulate_grad_batches={accumulate_grad_batches}): the batch of global "
            "step k is one whole batch here; set DataConfig.batch_size to the rows a step "
            "should see instead"
        )
    if overfit_batches:
        problems.append(
            f"Trainer(overfit_batches={overfit_batches}): the batch of global step k is drawn "
            "for (data seed, k), so no batch comes again and Lightning's overfitting mode "
            "would train on fresh batches without saying so; leave it at 0"
        )
    if problems:
        raise ValueError("; ".join(problems))


def _refuse_differences(
    saved: dict[str, Any], current: dict[str, Any], what: str, advice: str
) -> None:
    differ = config_differences(saved, current)
    if differ:
        raise ValueError(
            f"the checkpoint's {what} differs from this module's ({'; '.join(differ)}): {advice}"
        )


def check_model_config(saved: dict[str, Any], current: dict[str, Any]) -> None:
    """Raises ``ValueError`` listing every model-config field that differs."""
    advice = "build the module with the checkpoint's config to resume it"
    _refuse_differences(saved, current, "model config", advice)


def check_optim_config(saved: dict[str, Any], current: dict[str, Any]) -> None:
    """Raises ``ValueError`` listing every optimizer-config field that differs: a resume
    restores AdamW's hyperparameters and the schedule's own from the checkpoint, so a
    different config would be silently overridden."""
    advice = (
        "a resume restores AdamW and the LR schedule from the checkpoint, so these would be "
        "silently ignored. Resume with the checkpoint's config; to change the LR from the "
        "resume point on, add an LRScaler callback"
    )
    _refuse_differences(saved, current, "optimizer config", advice)
