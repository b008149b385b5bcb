"""The cells of a study of any module, and how one is computed. Each training cell is a
Lightning run as a ``recover`` branch trains it (the module and data built after the
seed's ``seed_everything``, ``ExactResume``, the detector, ``TrainingCurves``, the
step records of ``history.jsonl``), under ``<log_root>/seed<ss>/<cell>``.

Per seed: the ``reference`` run from scratch, which writes the checkpoints and flags the
spikes; from the checkpoint before its first spike (or before ``no_spike_step``), the
``resume_exact`` (nothing changed: it must equal the reference to the bit) and one cell
per rung of the ladder; and ``diagnose`` on each flagged spike's onset.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import torch
import yaml
from lightning.fabric.utilities.seed import seed_everything
from lightning.pytorch.utilities.model_helpers import is_overridden

from lit_spikes.callbacks import Spike, TrainingCurves
from lit_spikes.checkpoints import atomic_torch_save, atomic_write
from lit_spikes.shared.plain import plain_config
from lit_spikes.shared.tb import hparam_tag, write_hparams
from lit_spikes.shared.training import RunSpec, checkpoint_path
from lit_spikes.tools.recover.branch import Builders
from lit_spikes.tools.recover.config import RecoverConfig
from lit_spikes.tools.recover.history import HISTORY_NAME, HistoryLog, StepClock, read_history
from lit_spikes.tools.recover.remedies import SpikeContext, remedy_callbacks, remedy_spec
from lit_spikes.tools.resume_callbacks import with_exact_resume
from lit_spikes.tools.run_record import RECORD_NAME
from lit_spikes.tools.study.config import StudyConfig, plain_rung
from lit_spikes.tools.study.early_warning import UPDATE_NORMS, BlockUpdateNorms
from lit_spikes.tools.study.jobs import RESULT, Cell, StudyPlan
from lit_spikes.tools.study.sweep import final_loss, metric_of, point_name

REFERENCE = "reference"
RESUME = "resume_exact"
REMEDY = "remedy"
DIAGNOSE = "diagnose"
SWEEP = "sweep"
VARIANT = "variant"
CONTROL = "control"
FROM_SCRATCH = (REFERENCE, SWEEP, VARIANT)
"""Cells that train from step 0 (the others resume from the reference's checkpoint)."""
FINAL_STATE = "final_state.pt"
"""The reference's final weights, which the exact resume is compared with (``torch.equal``)."""
DIAGNOSE_STEPS = 4
"""diagnose's replays (same data and three other-data windows), for the time left."""


def seed_dir(seed: int) -> str:
    return f"seed{seed:02d}"


def first_cells(config: StudyConfig) -> list[Cell]:
    """Each seed's reference run (and its variants' runs), and the sweep's runs."""
    steps = config.steps
    cells = []
    for seed in config.seeds:
        cells.append(Cell(f"{seed_dir(seed)}/{REFERENCE}", REFERENCE, seed, 0, steps))
        for name in config.variant_cells:
            cells.append(Cell(f"{seed_dir(seed)}/{name}", VARIANT, seed, 0, steps))
    sweep = config.sweep
    if sweep.lr_arg is None:
        return cells
    steps = sweep.steps or steps
    for lr in config.sweep_lrs():
        for variant in sweep.arms:
            for seed in config.seeds[: sweep.seeds]:
                params = {"peak_lr": lr, "variant": variant}
                name = point_name(lr, variant, seed)
                cells.append(Cell(name, SWEEP, seed, 0, steps, params))
    return cells


def seed_cells(config: StudyConfig, reference: dict[str, Any]) -> list[Cell]:
    """A seed's cells after its reference (``reference``: its result): the exact resume
    and the ladder's rungs from the checkpoint before its first spike, and a diagnosis
    of each spike with a checkpoint before it."""
    seed, onset = reference["model_seed"], reference["onset"]
    base = seed_dir(seed)
    place = config.place(onset)
    k = config.checkpoint_before(place)
    cells = []
    if k is not None:
        params = {"onset": onset, "place": place, "ckpt_step": k}
        cost = config.steps - k
        cells.append(Cell(f"{base}/{RESUME}", RESUME, seed, 0, cost, params))
        for name in config.controls:
            cells.append(Cell(f"{base}/{name}", CONTROL, seed, 0, cost, params))
        for rung in config.rungs:
            rung_params = {**params, "rung": plain_rung(rung)}
            cells.append(Cell(f"{base}/{rung['name']}", REMEDY, seed, 0, cost, rung_params))
    for step in reference["onsets"]:
        k = config.checkpoint_before(step)
        if k is not None:
            params = {"onset": step, "ckpt_step": k}
            cost = DIAGNOSE_STEPS * (step - k + 20)
            cells.append(Cell(f"{base}/{DIAGNOSE}_step{step}", DIAGNOSE, seed, 0, cost, params))
    return cells


def compute(config: StudyConfig, cell: Cell) -> dict[str, Any]:
    """Compute ``cell`` into its run directory; its result (``jobs.run_cell`` writes it)."""
    return _diagnose(config, cell) if cell.kind == DIAGNOSE else _train(config, cell)


def plan(config: StudyConfig) -> StudyPlan:
    """The study of ``config`` as the job runner runs it."""
    later = 1 + len(config.rungs) + len(config.controls)
    return StudyPlan(
        config=config,
        log_root=config.log_root,
        fingerprint=config.fingerprint(),
        seeds=[(s, 0) for s in config.seeds],
        first=first_cells,
        follow=seed_cells,
        compute=compute,
        later_cells=later,
        later_cost=later * config.steps // 2,
        preload=__name__,
    )


def _reference_dir(config: StudyConfig, cell: Cell) -> Path:
    return config.log_root / seed_dir(cell.model_seed) / REFERENCE


def _reference(config: StudyConfig, cell: Cell) -> dict[str, Any]:
    result: dict[str, Any] = json.loads((_reference_dir(config, cell) / RESULT).read_text())
    return result


def _remedies(config: StudyConfig, cell: Cell) -> list[Any]:
    """The rung's callbacks, built for the seed's spike (or its placement) as recover
    builds them for a spike."""
    k, place = cell.params["ckpt_step"], cell.params["place"]
    reference = _reference(config, cell)
    records = [r for r in reference["records"] if "step" in r]
    at = {int(r["step"]): r for r in records}
    flagged = [s for s in reference["spikes"] if s["step"] == place]  # none: a placement
    metric = flagged[0]["metric"] if flagged else config.detector.monitor[0]
    spike = Spike(
        step=place,
        metric=metric,
        value=flagged[0]["value"] if flagged else float(at.get(place, {}).get("loss", math.nan)),
        reference=flagged[0]["reference"] if flagged else math.nan,
        position=int(at[place].get("position", place)) if place in at else place,
    )
    context = SpikeContext(
        spike=spike,
        ckpt_step=k,
        ckpt_position=int(at[k].get("position", k)) if k in at else k,
        losses=[float(r["loss"]) for r in records if r["step"] < k and math.isfinite(r["loss"])],
    )
    return remedy_callbacks([remedy_spec(cell.params["rung"], context)])


def _run(config: StudyConfig, cell: Cell) -> RecoverConfig:
    """What the cell trains: its seed's run, or a sweep point's."""
    if cell.kind == SWEEP:
        params = cell.params
        return config.sweep_run(cell.model_seed, params["peak_lr"], params["variant"])
    if cell.kind == VARIANT:
        return config.variant(cell.model_seed, cell.name.rsplit("/", 1)[-1])
    if cell.kind == CONTROL:
        return config.control(cell.model_seed, cell.name.rsplit("/", 1)[-1])
    return config.recover(cell.model_seed)


def _train(config: StudyConfig, cell: Cell) -> dict[str, Any]:
    run = _run(config, cell)
    run_dir = config.log_root / cell.name
    is_reference = cell.kind == REFERENCE
    start = 0 if cell.kind in FROM_SCRATCH else int(cell.params["ckpt_step"])
    remedies = _remedies(config, cell) if cell.kind == REMEDY else []
    detector = run.detector.build(run.facts)
    clock = StepClock()
    columns = [c.key for c in run.facts.columns]
    history = HistoryLog(run_dir / HISTORY_NAME, clock, True, columns)
    callbacks = [detector, *remedies, clock, history, TrainingCurves()]
    if is_reference:  # the early-warning signals (it changes nothing the run computes)
        callbacks.append(BlockUpdateNorms(run_dir / UPDATE_NORMS))
        _write_record(run_dir, run)
    spec = RunSpec(
        log_root=config.log_root,
        name=cell.name,
        max_steps=run.steps,
        checkpoint_every=run.checkpoint_every if is_reference else None,
        val_every=run.val_every,
        callbacks=with_exact_resume(callbacks, run.exact_resume),
        progress_bar=False,
        trainer_kwargs=_trainer_kwargs(run, cell),
        resume_step=start or None,
    )
    ckpt = checkpoint_path(_reference_dir(config, cell), start) if start else None
    module = _fit(run, spec, cell, ckpt, history)
    records = read_history(run_dir / HISTORY_NAME)
    onsets = [s for s in detector.onsets if s >= start]
    out: dict[str, Any] = {
        "start_step": start,
        "records": records,
        "spikes": [_plain(s) for s in detector.spikes if s.step >= start],
        "onsets": onsets,
        "onset": onsets[0] if onsets else None,
        "charts": detector.charts,
    }
    _write_hparams(run_dir, cell, records, run.facts.val_metric)
    state = {k: v.detach().cpu() for k, v in module.state_dict().items()}
    if is_reference:
        atomic_torch_save(state, run_dir / FINAL_STATE)
    elif cell.kind in (RESUME, CONTROL):
        out |= _compare(config, cell, state, records)
    return out


def _trainer_kwargs(run: RecoverConfig, cell: Cell) -> dict[str, Any]:
    """The run's Trainer arguments; a sweep point's validate under ``no_grad``, not
    inference mode: it is validated before it trains too, and a metric's state made in
    inference mode cannot be updated in place outside it (torchmetrics)."""
    kwargs = run.trainer_kwargs()
    return {**kwargs, "inference_mode": False} if cell.kind == SWEEP else kwargs


def _fit(
    run: RecoverConfig, spec: RunSpec, cell: Cell, ckpt: Path | None, history: HistoryLog
) -> Any:
    """Build the module and data after the seed, and train them; the module trained. A
    sweep point is validated first (its loss at initialization)."""
    seed_everything(cell.model_seed, verbose=False)
    if run.num_threads is not None:
        torch.set_num_threads(run.num_threads)
    builders = Builders.of(run)
    module, data = builders.model(), builders.datamodule()
    try:
        trainer = spec.trainer()
        if cell.kind == SWEEP and _validates(module, data):
            trainer.validate(module, datamodule=data, verbose=False)
        trainer.fit(module, datamodule=data, ckpt_path=ckpt)
    finally:
        history.close()
    return module


def _write_hparams(
    run_dir: Path, cell: Cell, records: list[dict[str, Any]], preferred: str | None
) -> None:
    """The cell in TensorBoard's HPARAMS view: its name in the seed (``row``), seed and
    sweep point, with its final value of the module's validation metric (none: the
    training loss's last 10 steps), so the view filters by seed and remedy."""
    metric = metric_of(records, preferred)
    validated = [r["val"][metric] for r in records if "val_step" in r and metric in r["val"]]
    steps = [r for r in records if "step" in r]
    if not steps:
        return
    if validated:
        value, tag = float(validated[-1]), hparam_tag(str(metric))
    else:
        value, tag = final_loss(steps), hparam_tag("train_loss")
    params: dict[str, float | int | str | bool] = {
        "row": cell.name.rsplit("/", 1)[-1],
        "seed": cell.model_seed,
        "kind": cell.kind,
    }
    params |= {k: v for k, v in cell.params.items() if k in ("peak_lr", "variant")}
    write_hparams(run_dir, params, value, int(steps[-1]["step"]), tag)


def _validates(module: Any, data: Any) -> bool:
    """Whether the run has validation data (the module's own or its data module's)."""
    owner = data if data is not None else module
    return is_overridden("val_dataloader", owner) or is_overridden("val_dataloader", module)


def _write_record(run_dir: Path, run: RecoverConfig) -> None:
    """The reference's ``config.yaml``, as ``lit-spikes fit`` writes one: what a replay of
    its checkpoints (``diagnose``, by the study or by hand) trains, and how long."""
    trainer = {
        **run.trainer,
        "max_steps": run.steps,
        "val_check_interval": run.val_every or run.steps,
        "check_val_every_n_epoch": None,
    }
    record = {"model": run.model, "data": run.data, "trainer": trainer}
    run_dir.mkdir(parents=True, exist_ok=True)
    text = yaml.safe_dump(plain_config(record), sort_keys=False)
    atomic_write(run_dir / RECORD_NAME, lambda handle: handle.write(text.encode()))


def _plain(spike: Spike) -> dict[str, Any]:
    return {
        "step": spike.step,
        "metric": spike.metric,
        "value": spike.value,
        "reference": spike.reference,
    }


def _same(a: float, b: float) -> bool:
    return a == b or (math.isnan(a) and math.isnan(b))


def _compare(
    config: StudyConfig, cell: Cell, state: dict[str, torch.Tensor], records: list[dict[str, Any]]
) -> dict[str, Any]:
    """Whether the resume is the reference: every final tensor of the module's state
    ``torch.equal`` and every loss logged from the checkpoint on equal."""
    saved = torch.load(_reference_dir(config, cell) / FINAL_STATE, weights_only=True)
    reference = {
        int(r["step"]): r["loss"] for r in _reference(config, cell)["records"] if "step" in r
    }
    steps = [r for r in records if "step" in r]
    losses_equal = bool(steps) and all(
        int(r["step"]) in reference and _same(reference[int(r["step"])], r["loss"]) for r in steps
    )
    differing = sorted(
        k for k, v in state.items() if k not in saved or not torch.equal(saved[k], v)
    )
    return {
        "params_equal": not differing and set(saved) == set(state),
        "losses_equal": losses_equal,
        "differing": differing[:10],
    }


def _diagnose(config: StudyConfig, cell: Cell) -> dict[str, Any]:
    from lit_spikes.tools.diagnose import DiagnoseConfig, diagnose

    onset, k = cell.params["onset"], cell.params["ckpt_step"]
    run = config.recover(cell.model_seed)
    records = _reference(config, cell)["records"]
    original = next(r["loss"] for r in records if r.get("step") == onset)
    verdict = diagnose(
        checkpoint_path(_reference_dir(config, cell), k),
        onset,
        DiagnoseConfig(recurrence=config.recurrence),
        model=run.model,
        data=run.data,
        trainer_kwargs=dict(run.trainer),
        original_loss=original,
        log_root=config.log_root / cell.name,
    )
    return {
        "cause": str(verdict.cause),
        "spike_step": verdict.spike_step,
        "ckpt_step": verdict.ckpt_step,
        "evidence": list(verdict.evidence),
        "rise_ratios": [other.ratio for other in verdict.other_data],
    }
