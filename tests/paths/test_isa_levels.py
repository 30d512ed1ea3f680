"""The kernel and fidelity tests at every instruction-set level this machine runs below its own
(tests/isa_paths.py): a Sapphire Rapids machine tests Zen 4's, Ice Lake's, Zen 3's and the plain loops' paths."""

from __future__ import annotations

import pytest
from isa_paths import run_at

from tokenmill.cpu import LEVEL_NAMES


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("level", LEVEL_NAMES[:-1])
def test_the_kernel_and_fidelity_tests_pass_at_a_lower_level(level: str) -> None:
    run_at(level)
