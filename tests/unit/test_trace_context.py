"""The bus's W3C trace context against OpenTelemetry's own W3C propagators."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from opentelemetry import baggage, trace
from opentelemetry.baggage.propagation import W3CBaggagePropagator
from opentelemetry.context import Context
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from lamina.libs import trace_context

W3C = (TraceContextTextMapPropagator(), W3CBaggagePropagator())


def reference_extract(headers: dict[str, str]) -> Context:
    context = Context()
    for propagator in W3C:
        context = propagator.extract(headers, context=context)
    return context


def reference_inject(context: Context) -> dict[str, str]:
    headers: dict[str, str] = {}
    for propagator in W3C:
        propagator.inject(headers, context=context)
    return headers


def seen(context: Context) -> tuple:
    """What a context carries that the bus propagates: the remote span's identity, its
    flags and trace state, and the baggage."""
    span = trace.get_current_span(context).get_span_context()
    return (
        span.trace_id,
        span.span_id,
        span.is_remote,
        int(span.trace_flags),
        span.trace_state.to_header(),
        dict(baggage.get_all(context)),
    )


fields = st.one_of(
    st.just("0" * 32),
    st.text("0123456789abcdef", min_size=32, max_size=32),
    st.text("0123456789abcdefABCDEF-_ \t", min_size=0, max_size=40),
)


@st.composite
def traceparents(draw) -> str:
    version = draw(st.sampled_from(["00", "01", "ff", "0g", "AA", "000"]))
    trace_id = draw(fields)
    span_id = draw(
        st.one_of(
            st.just("0" * 16),
            st.text("0123456789abcdef", min_size=16, max_size=16),
            st.text("0123456789abcdefABCDEF_ ", max_size=20),
        )
    )
    flags = draw(st.sampled_from(["00", "01", "03", "ff", "1", "0x"]))
    tail = draw(st.sampled_from(["", "-extra", " ", "\t", "-"]))
    lead = draw(st.sampled_from(["", " ", "\t"]))
    return f"{lead}{version}-{trace_id}-{span_id}-{flags}{tail}"


@given(
    traceparents(),
    st.one_of(st.none(), st.sampled_from(["", "a=1", "a=1,b=2", "bad value", "x@y=1"])),
    st.one_of(st.none(), st.sampled_from(["", "k=v", "k=v,j=w;p", "bad"])),
)
def test_extract_is_what_the_w3c_propagators_extract(parent, state, carried) -> None:
    headers = {"traceparent": parent}
    if state is not None:
        headers["tracestate"] = state
    if carried is not None:
        headers["baggage"] = carried
    assert seen(trace_context.extract(headers)) == seen(reference_extract(headers))


def test_a_message_without_a_context_has_none() -> None:
    for headers in (None, {}, {"Status": "503"}):
        context = trace_context.extract(headers)
        assert not trace.get_current_span(context).get_span_context().is_valid
    valid = trace_context.extract({"traceparent": "00-" + "a" * 32 + "-" + "b" * 16 + "-01"})
    assert trace.get_current_span(valid).get_span_context().is_valid


@given(
    st.integers(1, 2**128 - 1),
    st.integers(1, 2**64 - 1),
    st.sampled_from([0, 1, 3]),
    st.sampled_from([[], [("vendor", "v1")], [("a", "1"), ("b", "2")]]),
    st.sampled_from([{}, {"tenant": "a"}, {"k": "v w", "j": "1"}]),
)
def test_inject_is_what_the_w3c_propagators_inject(trace_id, span_id, flags, state, carried):
    remote = SpanContext(
        trace_id,
        span_id,
        is_remote=False,
        trace_flags=TraceFlags(flags),
        trace_state=TraceState(state),
    )
    context = trace.set_span_in_context(NonRecordingSpan(remote))
    for key, value in carried.items():
        context = baggage.set_baggage(key, value, context)
    headers: dict[str, str] = {}
    trace_context.inject(headers, context)
    assert headers == reference_inject(context)
    assert seen(trace_context.extract(headers))[:2] == (trace_id, span_id)


def test_outside_a_trace_nothing_is_written() -> None:
    headers: dict[str, str] = {}
    trace_context.inject(headers, Context())
    assert headers == {}
