"""pytest plugin (entry point ``pytest11``): the ``resume_check`` fixture.

    def test_resumes(resume_check):
        resume_check(MyModule, MyData, steps=40, resume_at=17)

It calls ``lit_spikes.testing.assert_resumes_exactly`` with a fresh directory under the
test's temporary directory. This module imports nothing heavy: pytest loads it in every
session of an environment where lit-spikes is installed."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from lit_spikes.testing.verdict import Report


@pytest.fixture
def resume_check(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Report]:
    """``resume_check(model, data=None, callbacks=None, *, steps, resume_at, seed=0,
    new_process=False, trainer_kwargs=None)``: fails the test with the first divergence
    unless the resume is bit-for-bit exact; returns the report otherwise."""

    def check(*args: Any, **kwargs: Any) -> Report:
        from lit_spikes.testing import assert_resumes_exactly

        kwargs.setdefault("workdir", tmp_path_factory.mktemp("resume-check"))
        return assert_resumes_exactly(*args, **kwargs)

    return check
