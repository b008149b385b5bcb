"""The tools: the ``lit-spikes`` commands (fit, recover, diagnose, check-resume)
and what they share. They take any model and data by class path; the demo's are
named once, as class-path strings, in ``lit_spikes.tools.defaults``.

Their public API is what this package and its command packages (``diagnose``,
``recover``) list in ``__all__``: the demo, on the floor above, uses nothing else of
them (tests/test_layers.py). What both build runs with (``RunSpec``, the TensorBoard
logger) is in ``lit_spikes.shared``, below both."""

from lit_spikes.tools.command_line import command_parser, parse_config

__all__ = ["command_parser", "parse_config"]
