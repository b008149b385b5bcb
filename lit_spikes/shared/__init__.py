"""What the tools and the demo share to build and record runs, below both (issue 63):
the Trainer of every run (``training``: ``RunSpec``, ``standard_run``, the checkpoint
layout), its TensorBoard logger and summaries (``tb``), its step progress bar
(``progress``), configs as plain data (``plain``) and the process group's teardown
(``processes``). It imports the library alone, never the tools or the demo
(tests/test_layers.py)."""
