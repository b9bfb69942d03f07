"""ground.confirmation: which changes add so many replicas at once that they are confirmed first."""

import pytest

from ground.confirmation import CONFIRM_ABOVE, needs_confirmation, replicas_added

FIXED_2 = {"replicas": 2, "min_replicas": None, "max_replicas": None}
AUTO_1_3 = {"replicas": 1, "min_replicas": 1, "max_replicas": 3}


@pytest.mark.parametrize("current, values, added", [
    (None, {}, 1),  # a new model: one replica
    (None, {"replicas": 9}, 9),
    (None, {"min_replicas": 0, "max_replicas": 20}, 20),  # its ceiling is its maximum
    (FIXED_2, {"replicas": 1000}, 998),
    (FIXED_2, {"replicas": 1}, 0),
    (FIXED_2, {"wait_seconds": 5}, 0),
    (FIXED_2, {"min_replicas": 1, "max_replicas": 40}, 38),
    (AUTO_1_3, {"max_replicas": 30}, 27),
    (AUTO_1_3, {"min_replicas": 12}, 9),  # the range's minimum above its maximum: the operation refuses it anyway
    (AUTO_1_3, {"replicas": 3}, 0),
])
def test_the_replicas_a_change_may_add(current, values, added):
    assert replicas_added(current, values) == added
    assert bool(needs_confirmation(current, values)) == (added > CONFIRM_ABOVE)


def test_eight_at_once_go_ahead_nine_are_confirmed():
    assert CONFIRM_ABOVE == 8
    assert needs_confirmation(FIXED_2, {"replicas": 10}) == ""
    assert needs_confirmation(FIXED_2, {"replicas": 11}) == (
        "this adds up to 9 replicas at once (to 11); more than 8 at once is confirmed first")
