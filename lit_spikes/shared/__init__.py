"""What the tools and the demo share to build and record runs, below both (issue 63):
configs as plain data (``plain``) and the process group's teardown (``processes``).
It imports the library alone, never the tools or the demo (tests/test_layers.py)."""
