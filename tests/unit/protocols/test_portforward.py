import pytest

from vkubelet.protocols.channel import ChannelFraming
from vkubelet.protocols.portforward import (
    PairComplete,
    PairExpired,
    PairPending,
    StreamPairer,
    StreamRejected,
    forward_error_message,
    negotiate_spdy_portforward,
    negotiate_websocket_portforward,
    pair_headers,
    parse_port,
    parse_port_query,
)


def headers(kind: str, port: str = "8080", request_id: str | None = "0") -> dict[str, str]:
    h = {"streamtype": kind, "port": port}
    if request_id is not None:
        h["requestid"] = request_id
    return h


def test_error_then_data_stream_complete_a_pair() -> None:
    pairer = StreamPairer()
    assert pairer.add_stream(1, headers("error")) == PairPending("0")
    assert pairer.pending == {"0"}
    assert pairer.add_stream(3, headers("data")) == PairComplete("0", 8080, 3, 1)
    assert pairer.pending == frozenset()


def test_data_first_also_pairs() -> None:
    pairer = StreamPairer()
    assert pairer.add_stream(1, headers("data")) == PairPending("0")
    assert pairer.add_stream(3, headers("error")) == PairComplete("0", 8080, 1, 3)


def test_interleaved_connections_are_matched_by_request_id() -> None:
    pairer = StreamPairer()
    results = [
        pairer.add_stream(1, headers("error", "80", "a")),
        pairer.add_stream(3, headers("error", "443", "b")),
        pairer.add_stream(5, headers("data", "443", "b")),
        pairer.add_stream(7, headers("data", "80", "a")),
    ]
    assert results[2] == PairComplete("b", 443, 5, 3)
    assert results[3] == PairComplete("a", 80, 7, 1)


def test_the_data_streams_port_is_the_one_forwarded() -> None:
    pairer = StreamPairer()
    pairer.add_stream(1, headers("error", "1"))
    assert pairer.add_stream(3, headers("data", "2")) == PairComplete("0", 2, 3, 1)


def test_without_request_ids_consecutive_error_and_data_ids_pair_up() -> None:
    pairer = StreamPairer()
    assert pairer.add_stream(5, headers("error", request_id=None)) == PairPending("5")
    assert pairer.add_stream(7, headers("data", request_id=None)) == PairComplete("5", 8080, 7, 5)


@pytest.mark.parametrize(
    ("hdrs", "reason"),
    [
        ({"streamtype": "data"}, "unable to parse"),
        (headers("data", port="0"), "1..65535"),
        (headers("data", port="65536"), "1..65535"),
        (headers("data", port="+80"), "unable to parse"),
        (headers("data", port=" 80"), "unable to parse"),
        (headers("data", port="8_0"), "unable to parse"),
        (headers("data", port="80\x0081"), "unable to parse"),
        (headers("stdin"), "invalid stream type"),
        ({"port": "80"}, "invalid stream type"),
    ],
)
def test_streams_with_bad_headers_are_rejected(hdrs: dict[str, str], reason: str) -> None:
    result = StreamPairer().add_stream(9, hdrs)
    assert isinstance(result, StreamRejected)
    assert result.stream_id == 9
    assert result.error_stream_id is None
    assert reason in result.reason


def test_a_second_stream_of_the_same_type_is_rejected_and_reported_on_the_error_stream() -> None:
    pairer = StreamPairer()
    pairer.add_stream(1, headers("error"))
    dup = pairer.add_stream(3, headers("error"))
    assert dup == StreamRejected(
        3, "error processing stream for request 0: error stream already assigned", 1
    )
    pairer.add_stream(5, headers("data"))
    assert pairer.pending == frozenset()


def test_duplicate_data_stream_is_rejected_while_the_pair_waits() -> None:
    pairer = StreamPairer()
    pairer.add_stream(1, headers("data"))
    dup = pairer.add_stream(3, headers("data"))
    assert isinstance(dup, StreamRejected)
    assert dup.error_stream_id is None
    assert "data stream already assigned" in dup.reason
    assert pairer.pending == {"0"}


def test_expiring_an_incomplete_pair_reports_its_streams() -> None:
    pairer = StreamPairer()
    pairer.add_stream(1, headers("error", request_id="r"))
    expired = pairer.expire("r")
    assert expired == PairExpired("r", "timed out waiting for streams of request r", None, 1)
    assert pairer.expire("r") is None
    assert pairer.pending == frozenset()


def test_a_reset_half_pair_is_forgotten() -> None:
    pairer = StreamPairer()
    pairer.add_stream(1, headers("error", request_id="r"))
    pairer.add_stream(3, headers("data", request_id="s"))
    pairer.stream_closed(1)
    assert pairer.pending == {"s"}
    pairer.stream_closed(3)
    assert pairer.pending == frozenset()


def test_parse_port_accepts_plain_decimal_in_range() -> None:
    assert parse_port("1") == 1
    assert parse_port("065535") == 65535
    for bad in ("", "-1", "0x50", "80 ", "٣"):
        with pytest.raises(ValueError):
            parse_port(bad)


def test_websocket_port_query_allows_repeats_and_commas() -> None:
    assert parse_port_query(["80,443", "8080"]) == [80, 443, 8080]
    with pytest.raises(ValueError, match="required"):
        parse_port_query([])
    with pytest.raises(ValueError, match="cannot be empty"):
        parse_port_query(["80", ""])
    with pytest.raises(ValueError, match="unable to parse"):
        parse_port_query(["80,"])


def test_port_forward_negotiation() -> None:
    assert negotiate_spdy_portforward(["portforward.k8s.io"]) == "portforward.k8s.io"
    assert negotiate_spdy_portforward(["v4.channel.k8s.io"]) is None
    assert negotiate_websocket_portforward([]) == ("", ChannelFraming())
    assert negotiate_websocket_portforward(["v4.base64.channel.k8s.io"]) == (
        "v4.base64.channel.k8s.io",
        ChannelFraming(base64=True),
    )
    # Unlike exec, port-forward has no unversioned names.
    assert negotiate_websocket_portforward(["channel.k8s.io"]) is None


def test_forward_error_message_matches_the_kubelets_wording() -> None:
    assert forward_error_message(80, "web", "u-1", "connection refused") == (
        "error forwarding port 80 to pod web, uid u-1: connection refused"
    )


def test_client_pair_headers_complete_a_pair_at_the_server() -> None:
    error, data = pair_headers(8080, 7)
    pairer = StreamPairer()
    assert pairer.add_stream(1, error) == PairPending("7")
    assert pairer.add_stream(3, data) == PairComplete("7", 8080, 3, 1)


def test_client_pair_headers_refuse_a_bad_port() -> None:
    with pytest.raises(ValueError):
        pair_headers(0, 1)
