"""The ``lit-spikes`` commands and top-level description: light (no torch, no Lightning),
so that the console script's help answers at once and the fit CLI can show them without
importing the dispatcher."""

COMMANDS = {
    "recover": "lit_spikes.tools.recover",
    "diagnose": "lit_spikes.tools.diagnose",
    "check-resume": "lit_spikes.tools.check_resume",
    "forensics": "lit_spikes.tools.forensics.cli",
    "study": "lit_spikes.tools.study.cli",
}
"""Sub-commands outside the LightningCLI: name -> module with ``main(argv)``."""

NAMES = ("fit", "validate", *COMMANDS)
TOP_USAGE = f"lit-spikes {{{','.join(NAMES)}}} ..."
"""The usage line of every command (LightningCLI's own would name only fit and validate)."""

DESCRIPTION = """lit-spikes: train a Lightning module that resumes bit-exactly and survives loss
spikes (a tiny GPT by default).

Commands:
  fit           train (LightningCLI: --model CLASS_PATH, --data CLASS_PATH, the
                project's tiny GPT and its data by default, --model.*, --data.*,
                --trainer.*, --config, --ckpt_path, --checkpoint_every); also
                validate (a checkpoint or a fresh model)
  recover       train with automatic spike recovery (lit-spikes recover --help)
  diagnose      replay a spike from a checkpoint: data-caused, state-caused or not
                reproducible (lit-spikes diagnose --help)
  check-resume  does a LightningModule resume bit for bit, and if not, what breaks it
                (lit-spikes check-resume --help)
  forensics     which layer went first before a spike: an exact replay with per-layer
                instruments, at no cost to the run (lit-spikes forensics --help)
  study         a recipe over many seeds: how often it spikes, whether its resume
                is exact, which remedy helps, which signal warns, an LR sweep; each
                finding as k of n with an interval (lit-spikes study --help)"""
