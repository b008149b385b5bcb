"""The cells of a study and how one is computed. A cell is one real Lightning run (or one
diagnosis) with its own run directory under the log root; its result is ``cell.json`` in
that directory, written last and atomically, so a cell with that file is done.

Per seed (a model seed and a data seed): the reference run, which writes the
checkpoints, watches for spikes and records per-layer update norms; a QK-norm run of the
same seed; then, placed from the reference's first post-warm-up spike (or
``no_spike_step``), the demos' resumes and remedies from the checkpoint before it, and
``diagnose`` on that spike. The sweep's cells train from scratch.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from typing import Any

import torch

from lit_spikes.checkpoints import atomic_torch_save
from lit_spikes.demo.ablations import ForgetOptimizerState
from lit_spikes.demo.branches import Branch, BranchResult, run_branch
from lit_spikes.demo.model import GPTConfig
from lit_spikes.demo.module import OptimConfig
from lit_spikes.demo.study.config import StudyConfig
from lit_spikes.demo.study.leads import UpdateNormRecorder
from lit_spikes.shared.training import checkpoint_path
from lit_spikes.tools.study import RESULT, Cell, StudyPlan

FINAL_STATE = "final_state.pt"
"""The reference's final weights, which the resumes are compared with (``torch.equal``)."""

REMEDIES = (
    "resume_exact",
    "fresh_adamw",
    "other_data_seed",
    "skip_before",
    "skip_straddle",
    "scale_lr",
    "clip",
)
"""The cells resumed from a seed's checkpoint before its spike, in the report's order."""


def seed_dir(model_seed: int, data_seed: int) -> str:
    return f"seed{model_seed:02d}-data{data_seed}"


def first_cells(config: StudyConfig) -> list[Cell]:
    """The cells that need nothing else: each seed's reference and QK-norm runs, and the
    sweep."""
    cells = []
    for m, d in config.seeds:
        base = seed_dir(m, d)
        cells.append(Cell(f"{base}/reference", "reference", m, d, config.steps))
        cells.append(Cell(f"{base}/qk_norm", "qk_norm", m, d, config.steps))
    sweep = config.sweep
    for lr in sweep.peak_lrs:
        for qk in (False, True):
            for seed in range(sweep.seeds):
                name = f"sweep/lr{lr:g}-qk{int(qk)}-seed{seed}"
                params = {"peak_lr": lr, "qk_norm": qk}
                cells.append(Cell(name, "sweep", seed, 0, sweep.steps, params))
    return cells


def placement(config: StudyConfig, onset: int | None) -> dict[str, Any]:
    """Where a seed's remedies start and what they skip: the newest checkpoint at least
    ``rollback_distance`` steps before the spike (``RollbackRestore``'s choice) and the
    demos' two skip windows, one ending at the spike, one straddling it."""
    place = config.no_spike_step if onset is None else onset
    every = config.checkpoint_every
    k = (max(place - config.rollback_distance, 0) // every) * every
    k = max(k, every)  # a spike earlier than the first checkpoint: the first one
    window = config.skip_window
    straddle = max(k, place - window // 3)
    return {
        "onset": onset,
        "place": place,
        "ckpt_step": k,
        "skip_before": [max(k, place - window), place],
        "skip_straddle": [straddle, straddle + window],
    }


def seed_cells(config: StudyConfig, reference: dict[str, Any]) -> list[Cell]:
    """A seed's cells that resume from its reference's checkpoint (``reference``: its
    result), and its diagnosis where it spiked."""
    m, d = reference["model_seed"], reference["data_seed"]
    plan = placement(config, reference["onset"])
    cost = config.steps - plan["ckpt_step"]
    base = seed_dir(m, d)
    cells = [Cell(f"{base}/{kind}", kind, m, d, cost, plan) for kind in REMEDIES]
    if plan["onset"] is not None:
        # Four replays (same data, three other-data windows) of about the spike's
        # distance from the checkpoint and 20 steps on.
        replay = plan["onset"] - plan["ckpt_step"] + 20
        cells.append(Cell(f"{base}/diagnose", "diagnose", m, d, 4 * replay, plan))
    return cells


def compute(config: StudyConfig, cell: Cell) -> dict[str, Any]:
    """Compute ``cell`` into its run directory; its result (``jobs.run_cell`` writes it)."""
    return _diagnose(config, cell) if cell.kind == "diagnose" else _train(config, cell)


def plan(config: StudyConfig) -> StudyPlan:
    """The demos' study as the job runner runs it."""
    return StudyPlan(
        config=config,
        log_root=config.log_root,
        fingerprint=config.fingerprint(),
        seeds=config.seeds,
        first=first_cells,
        follow=seed_cells,
        compute=compute,
        later_cells=len(REMEDIES) + 1,
        later_cost=len(REMEDIES) * (config.steps - config.checkpoint_every * 2),
        preload=__name__,
    )


def _branch(config: StudyConfig, cell: Cell) -> Branch:
    """The Lightning run of a training cell. Its label is the cell's kind: TensorBoard's
    HParams view lists it as ``row`` beside ``model_seed`` and ``data_seed``."""
    from lit_spikes.callbacks import BatchSkipper, LRScaler, SpikeDetector

    base = Branch(
        name=cell.name,
        label=cell.kind,
        max_steps=config.steps,
        gpt=config.gpt(),
        optim=config.optim(),
        data=config.data(cell.data_seed),
        model_seed=cell.model_seed,
        val_every=config.steps,
    )
    root = config.log_root
    if cell.kind == "reference":
        detector = SpikeDetector(ratio=config.spike_ratio, min_step=config.warmup_steps)
        recorder = UpdateNormRecorder(root / cell.name / "update_norms.json")
        return replace(
            base, checkpoint_every=config.checkpoint_every, callbacks=[detector, recorder]
        )
    if cell.kind == "qk_norm":
        return replace(base, gpt=config.gpt(qk_norm=True))
    if cell.kind == "sweep":
        sweep = config.sweep
        optim = OptimConfig(
            peak_lr=cell.params["peak_lr"], warmup_steps=sweep.warmup_steps, max_steps=sweep.steps
        )
        gpt = GPTConfig(
            n_layer=config.n_layer, d_model=config.d_model, qk_norm=cell.params["qk_norm"]
        )
        return replace(base, max_steps=sweep.steps, optim=optim, gpt=gpt, val_every=sweep.steps)
    k = cell.params["ckpt_step"]
    ckpt = checkpoint_path(root / seed_dir(cell.model_seed, cell.data_seed) / "reference", k)
    base = replace(base, ckpt_path=ckpt)
    if cell.kind == "fresh_adamw":
        return replace(base, callbacks=[ForgetOptimizerState()])
    if cell.kind == "other_data_seed":
        return replace(base, data=config.data(cell.data_seed + config.other_data_seed))
    if cell.kind in ("skip_before", "skip_straddle"):
        window = tuple(cell.params[cell.kind])
        return replace(base, callbacks=[BatchSkipper(ranges=[window])])
    if cell.kind == "scale_lr":
        return replace(base, callbacks=[LRScaler(config.lr_scale, start_step=k)])
    if cell.kind == "clip":
        return replace(base, trainer_kwargs={"gradient_clip_val": config.clip_val})
    if cell.kind == "resume_exact":
        return base
    raise ValueError(f"unknown cell kind {cell.kind!r}")


def _train(config: StudyConfig, cell: Cell) -> dict[str, Any]:
    branch = _branch(config, cell)
    result = run_branch(branch, config.log_root, progress_bar=False)
    history = [
        {key: float(record[key]) for key in ("step", "loss", "max_logit", "grad_norm")}
        for record in result.history
    ]
    losses = [r["loss"] for r in history]
    out: dict[str, Any] = {
        "val_bpc": result.val_bpc,
        "final_loss": sum(losses[-10:]) / len(losses[-10:]),
        "max_logit": max(r["max_logit"] for r in history),
        "start_step": result.start_step,
        "history": history,
    }
    run_dir = config.log_root / cell.name
    if cell.kind == "reference":
        spikes = result.callback_states.get("SpikeDetector", {}).get("spikes", [])
        spikes = [{k: float(v) for k, v in s.items() if _number(v)} for s in spikes]
        out["spikes"] = spikes
        out["onset"] = int(spikes[0]["step"]) if spikes else None
        atomic_torch_save(result.state, run_dir / FINAL_STATE)
    elif cell.kind in ("resume_exact", "other_data_seed"):
        out |= _compare_with_reference(config, cell, result)
    return out


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _compare_with_reference(
    config: StudyConfig, cell: Cell, result: BranchResult
) -> dict[str, Any]:
    """Whether a resume is the reference: every final parameter ``torch.equal`` and every
    logged loss from the checkpoint on equal."""
    ref_dir = config.log_root / seed_dir(cell.model_seed, cell.data_seed) / "reference"
    state = torch.load(ref_dir / FINAL_STATE, weights_only=True)
    reference = json.loads((ref_dir / RESULT).read_text())
    ref_losses = {int(r["step"]): r["loss"] for r in reference["history"]}
    losses_equal = all(ref_losses.get(int(r["step"])) == r["loss"] for r in result.history)
    params_equal = all(torch.equal(state[k], v) for k, v in result.state.items())
    diff = max((state[k].double() - v.double()).abs().max().item() for k, v in result.state.items())
    return {"params_equal": params_equal, "losses_equal": losses_equal, "max_param_diff": diff}


def _diagnose(config: StudyConfig, cell: Cell) -> dict[str, Any]:
    from lit_spikes.tools.diagnose import DiagnoseConfig, diagnose

    onset, k = cell.params["onset"], cell.params["ckpt_step"]
    ref_dir = config.log_root / seed_dir(cell.model_seed, cell.data_seed) / "reference"
    reference = json.loads((ref_dir / RESULT).read_text())
    original = next(r["loss"] for r in reference["history"] if int(r["step"]) == onset)
    verdict = diagnose(
        checkpoint_path(ref_dir, k),
        onset,
        DiagnoseConfig(recurrence=config.recurrence),
        original_loss=original,
        log_root=config.log_root / cell.name,
    )
    return {
        "cause": str(verdict.cause),
        "spike_step": verdict.spike_step,
        "ckpt_step": verdict.ckpt_step,
        "evidence": list(verdict.evidence),
        "rise_ratios": [other.ratio for other in verdict.other_data],
        "val_bpc": math.nan,
    }
