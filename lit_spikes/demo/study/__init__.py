"""``lit-spikes study``: the seed's findings as frequencies over many seeds (see
docs/study.md)."""

from lit_spikes.demo.study.config import LeadConfig, StudyConfig, SweepConfig
from lit_spikes.demo.study.findings import Finding, wilson

__all__ = ["Finding", "LeadConfig", "StudyConfig", "SweepConfig", "wilson"]
