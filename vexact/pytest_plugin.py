"""pytest plugin for exactness tests of your own stack: the ``vexact_exact`` fixture.

Installed with vexact (entry point ``pytest11``: ``vexact = "vexact.pytest_plugin"``), so any test in an
environment that has vexact can ask for it -- no import, no conftest::

    def test_my_engine_matches_my_trainer(vexact_exact):
        report = vexact_exact.check_paths(my_generate, my_score, prompts)   # raises AssertionError on a mismatch
        vexact_exact.assert_logprobs_equal(rollout_logprobs, train_logprobs, tokens=tokens)

The fixture's methods are ``vexact.testing``'s functions (same arguments, same errors, see that module):
``assert_logprobs_equal``, ``compare_logprobs``, ``check_paths``, ``record_sites``, ``record_vllm_sites`` and
``assert_sites_equal``.
Two additions: a failure's traceback ends at the test's own line, and ``check_paths``'s report is attached to
the test as the property ``vexact_check_paths`` (in the test's ``user_properties``, as ``record_property`` puts it: it
appears in ``--junitxml`` reports).

This module imports neither torch nor ``vexact.testing``: the fixture imports them when a test asks for it, so
the plugin costs other test runs nothing beyond importing the ``vexact`` package. Disable it with
``-p no:vexact``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest


class VexactExact:
    """What the ``vexact_exact`` fixture gives a test: ``vexact.testing``'s checks as methods."""

    def __init__(self, record_property: Callable[[str, object], None]):
        self._record_property = record_property

    def assert_logprobs_equal(self, rollout: Any, train: Any, **options: Any) -> None:
        """``vexact.testing.assert_logprobs_equal``: None if bitwise equal, else AssertionError with the report."""
        __tracebackhide__ = True
        from vexact.testing import assert_logprobs_equal

        assert_logprobs_equal(rollout, train, **options)

    def compare_logprobs(self, rollout: Any, train: Any, **options: Any) -> Any:
        """``vexact.testing.compare_logprobs``: the findings as a ``LogprobComparison``, never raising on a mismatch."""
        from vexact.testing import compare_logprobs

        return compare_logprobs(rollout, train, **options)

    def check_paths(self, generate_fn: Callable[..., Any], score_fn: Callable[..., Any], prompts: Any,
                    **options: Any) -> dict[str, Any]:
        """``vexact.testing.check_paths``; the report it returns is also recorded as ``vexact_check_paths``."""
        __tracebackhide__ = True
        from vexact.testing import check_paths

        report = check_paths(generate_fn, score_fn, prompts, **options)
        self._record_property("vexact_check_paths", report)
        return report

    def record_sites(self, model: Any, sequences: Any, **options: Any) -> Any:
        """``vexact.testing.record_sites``: every named site of one forward path of ``model``."""
        from vexact.testing import record_sites

        return record_sites(model, sequences, **options)

    def record_vllm_sites(self, model_dir: Any, sequences: Any, **options: Any) -> Any:
        """``vexact.testing.record_vllm_sites``: every named site of vLLM's forward (needs vLLM)."""
        from vexact.testing import record_vllm_sites

        return record_vllm_sites(model_dir, sequences, **options)

    def assert_sites_equal(self, a: Any, b: Any, **options: Any) -> None:
        """``vexact.testing.assert_sites_equal``: None if every shared site is bitwise equal, else AssertionError
        naming the first divergent site."""
        __tracebackhide__ = True
        from vexact.testing import assert_sites_equal

        assert_sites_equal(a, b, **options)


@pytest.fixture
def vexact_exact(request: pytest.FixtureRequest) -> VexactExact:
    """Bitwise rollout-vs-training checks: ``.assert_logprobs_equal``, ``.compare_logprobs``, ``.check_paths``,
    ``.record_sites``, ``.record_vllm_sites``, ``.assert_sites_equal`` (see ``vexact.testing``)."""

    def record(name: str, value: object) -> None:
        # what pytest's record_property does, without depending on that fixture: it warns in every test that asks
        # for it under --junitxml's default family (xunit2), an error where warnings are errors
        request.node.user_properties.append((name, value))

    return VexactExact(record)
