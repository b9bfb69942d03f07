"""A request's id and trace as gateway/tracing.py makes them from what the client sent."""

import re

import pytest

from gateway.tracing import SAMPLED, identify

TRACE, SPAN = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


def test_nothing_sent_makes_an_id_and_begins_a_trace_each_new():
    (one, first), (two, second) = identify("", ""), identify("", "")
    assert re.fullmatch(r"req_[0-9a-f]{24}", one) and one != two
    assert first.parent_id == "" and first.flags == SAMPLED and first.trace_id != second.trace_id
    assert re.fullmatch(rf"00-{first.trace_id}-{first.span_id}-01", first.traceparent())
    assert len(first.trace_id) == 32 and len(first.span_id) == 16 and first.trace_id[:16] != first.span_id


def test_a_sane_id_and_a_valid_traceparent_are_kept_the_gateway_a_span_between():
    rid, trace = identify("job-17/turn:3", f"00-{TRACE}-{SPAN}-00")
    assert rid == "job-17/turn:3"
    assert (trace.trace_id, trace.parent_id, trace.flags) == (TRACE, SPAN, "00") and trace.span_id != SPAN
    assert trace.traceparent() == f"00-{TRACE}-{trace.span_id}-00"


@pytest.mark.parametrize("sent", ["a b", "x" * 129, "_x", "é", "a\r\nb", "a,b"])
def test_an_id_that_could_not_travel_as_a_header_or_a_log_word_is_replaced(sent):
    assert identify(sent, "")[0].startswith("req_")


@pytest.mark.parametrize("sent", [f"ff-{TRACE}-{SPAN}-01", f"00-{'0' * 32}-{SPAN}-01", f"00-{TRACE}-{'0' * 16}-01",
                                  f"00-{TRACE.upper()}-{SPAN}-01", f"00-{TRACE}-{SPAN}-01-extra", "00"])
def test_a_traceparent_w3c_refuses_is_not_continued(sent):
    trace = identify("", sent)[1]
    assert trace.trace_id != TRACE and trace.parent_id == "" and trace.flags == SAMPLED
