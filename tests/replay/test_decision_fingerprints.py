"""Replay decisions stay bit-identical across refactors (the hashes in tests/data/replay_fingerprints.json).

A change that is meant to alter decisions re-records them with ``python -m bench.decision_fingerprints
--write`` and says why in its commit.
"""

from __future__ import annotations

import json

import pytest

from bench import decision_fingerprints as fp


@pytest.mark.slow
@pytest.mark.parametrize("policy", fp.POLICIES)
def test_per_request_output_is_unchanged(policy: str) -> None:
    want = json.loads(fp.EXPECTED.read_text())
    for capacity in fp.CAPACITIES:
        assert fp.fingerprint(policy, capacity) == want[f"{policy}@{capacity}"], f"{policy} at {capacity}"
