"""Replay diagnosis of a loss spike (``lit-spikes diagnose``): data, state, or neither?

From a real checkpoint written before the spike, the run is replayed past the spike's
step, bit-exactly (the data of a step is a function of the step, the rest is in the
checkpoint):

(a) the same state with the same data. Does the same spike come back, the same loss to
    the last bit? If not, the original spike is **not reproducible**: something outside
    the run's state and data made it (a hardware fault, a bit flip, a stray process).
    If the same loss comes back but the detector does not flag that step, it is **no
    spike**, and there is nothing to diagnose there.
(b) the same state with other data, three times (``windows``): the data positions around
    the spike's are skipped, each time to another stretch of data, so from the window on
    every step sees batches it never saw. Does the loss still rise as high? Then the
    spike is **state-caused** (the weights, the optimizer's moments and the LR were going
    to blow up whatever came next); otherwise **data-caused** (those batches).
(c) optionally, an earlier checkpoint with the same data: the spike must come back from
    there too, to the same bits. If it does not, the later checkpoint's state is not the
    product of the run's own history: the spike is **not reproducible** from clean state.

A spike is judged by a ``SpikeDetector`` run over each replay's losses: the run's own,
rebuilt from the checkpoint's record of it (settings and state; ``DiagnoseConfig.detector``
sets another), counting flags from ``window_before`` steps before the spike to the end of
the replay. Whether (b) brings the spike back is not a flag but the one judgement recover
shares (``lit_spikes.tools.judgement``): the loss's highest rise over its median, as a
share of the spike's own (same data); at least ``recurrence`` (0.5) is the spike again,
and the median of the windows' shares decides. Replays end at the run's end at the latest,
train with ``ExactResume`` and are seeded, so that each is the same every time.

Any LightningModule and data can be diagnosed (``model=``, ``data=``: factories or class
paths, as ``lit-spikes fit`` takes them); by default the run's own record says what it
trained (``subject``).

Where to read on: ``verdict`` (the rules: the cause as a function of the replays'
numbers), ``explain`` (the evidence's text), ``subject`` (what a replay trains: module,
data, callbacks), ``replay`` (one replay as a Lightning run, each checkpoint read once),
``run`` (``diagnose``: which replays, in which order), ``cli`` (``lit-spikes diagnose``).
"""

from lit_spikes.tools.diagnose.cli import (
    DiagnoseCommand,
    build_parser,
    data_from_args,
    main,
    print_verdict,
)
from lit_spikes.tools.diagnose.config import DiagnoseConfig
from lit_spikes.tools.diagnose.replay import (
    CheckpointReads,
    StepRecorder,
    logged_loss,
    logged_losses,
)
from lit_spikes.tools.diagnose.run import diagnose
from lit_spikes.tools.diagnose.subject import (
    Subject,
    callbacks_from_checkpoint,
    from_file,
)
from lit_spikes.tools.diagnose.verdict import (
    Cause,
    Replay,
    Verdict,
    bit_equal,
    cause_from_same_data,
    given_decimals,
    judged,
    verdict_cause,
)

__all__ = [
    "Cause",
    "CheckpointReads",
    "DiagnoseCommand",
    "DiagnoseConfig",
    "Replay",
    "StepRecorder",
    "Subject",
    "Verdict",
    "bit_equal",
    "build_parser",
    "callbacks_from_checkpoint",
    "cause_from_same_data",
    "data_from_args",
    "diagnose",
    "from_file",
    "given_decimals",
    "judged",
    "logged_loss",
    "logged_losses",
    "main",
    "print_verdict",
    "verdict_cause",
]
