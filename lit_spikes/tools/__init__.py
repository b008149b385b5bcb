"""The tools: the ``lit-spikes`` commands (fit, recover, diagnose, check-resume)
and what they share. They take any model and data by class path; the demo's are
named once, in ``lit_spikes.tools.defaults``."""
