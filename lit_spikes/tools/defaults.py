"""The commands' default model and data: the demo's, named by class path as a user's
module is (the tools import nothing of the demo by name for them)."""

DEMO_MODEL = "lit_spikes.demo.module.TinyGPTModule"
"""The default ``--model`` of the commands: the demo's tiny GPT."""
DEMO_DATA = "lit_spikes.demo.data.StepDataModule"
"""The default ``--data`` of the commands: the demo's character world."""
