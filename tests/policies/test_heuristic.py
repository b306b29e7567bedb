"""The one heuristic predictor: its per-access log-odds, and that the learned policy uses it."""

from __future__ import annotations

import numpy as np

from kvtier.policies.features import FEATURE_NAMES, N_FEATURES
from kvtier.policies.heuristic import HeuristicPredictor
from kvtier.policies.learned import LearnedPolicy


def test_log_odds_penalise_a_partial_tail_and_reward_retouches_up_to_a_cap() -> None:
    x = np.zeros((4, N_FEATURES))
    tail, lf = FEATURE_NAMES.index("partial_tail"), FEATURE_NAMES.index("log_freq")
    x[1, tail] = 1.0
    x[2, lf] = np.log1p(3.0)
    x[3, lf] = 10.0  # capped at 3
    got = HeuristicPredictor.log_odds(x)
    want = np.array([-1.0, -4.0, -1.0 + 0.5 * np.log1p(3.0), 0.5])
    np.testing.assert_array_equal(got, want)


def test_the_learned_policy_uses_the_heuristic_with_a_60_s_scale_until_its_first_fit() -> None:
    pol = LearnedPolicy(16)
    assert isinstance(pol.heuristic, HeuristicPredictor)
    assert pol.heuristic.tau_s == 60.0 and pol.tau_s == 60.0 and not pol.model.trained
    assert HeuristicPredictor().tau_s == 300.0  # the loop's default fallback scale
