"""`microspec client` load mode's report on fixed results (no server: the serving tests need the serve extra, and
none of them runs a load): throughput, TTFT, inter-token latency from the streamed pieces' arrival times; the
class of a failed request's message."""
from __future__ import annotations

import pytest

from trtllm_microspec.cli import main
from trtllm_microspec.serving import client


def completion(tokens: int, ttft: float, last: float, pieces: int) -> client.Completion:
    stats = {"num_output_tokens": tokens, "acceptance_length": 2.0}
    return client.Completion("x" * pieces, stats, ttft, last + 0.01, ["x"] * pieces, last)


RESULTS = [completion(11, 0.1, 1.1, 6), completion(5, 0.3, 1.1, 3), completion(4, 0.2, 0.2, 1), "server busy"]


def test_load_report():
    r = client.load_report(RESULTS, concurrency=2, wall=2.0)
    assert (r["requests"], r["completed"], r["errors"]) == (4, 3, ["server busy"])
    assert r["requests_per_s"] == 1.5 and r["output_tokens_per_s"] == 10.0
    assert r["ttft_s"] == {"p50": 0.2, "p90": pytest.approx(0.28), "p99": pytest.approx(0.298)}
    # (1.1 - 0.1) / 10 and (1.1 - 0.3) / 4; the one-piece response has no inter-token latency
    assert r["itl_s"] == {"p50": pytest.approx(0.15), "p90": pytest.approx(0.19), "p99": pytest.approx(0.199)}
    r = client.load_report([completion(1, 0.1, 0.1, 1)], concurrency=1, wall=1.0)
    assert r["itl_s"] == {"p50": None, "p90": None, "p99": None}


def test_load_lines(monkeypatch, capsys):
    monkeypatch.setattr(client, "load", lambda url, prompts, conc, n, tokens, **kw:
                        client.load_report(RESULTS, conc, 2.0))
    with pytest.raises(SystemExit) as e:  # a failed request: exit 1 after the report
        main(["client", "--prompt", "hi", "--concurrency", "2", "--requests", "4"])
    out, err = capsys.readouterr()
    assert e.value.code == 1 and err == "  error (1x): server busy\n"
    assert out.splitlines() == [
        "3/4 requests at concurrency 2 in 2.00 s: 1.50 req/s, 10.0 output tok/s, mean acceptance length 2.00",
        "  time to first token: p50 200.0 ms p90 280.0 ms p99 298.0 ms",
        "  request latency:     p50 1110.0 ms p90 1110.0 ms p99 1110.0 ms",
        "  inter-token latency: p50 150.0 ms p90 190.0 ms p99 199.0 ms"]


@pytest.mark.parametrize("message, code", [
    ("[request id: <id_unknown>] Exceeds maximum queue size", "UNAVAILABLE"),  # Triton's queue is full: retry
    ("the server is shutting down", "UNAVAILABLE"),
    ("the request was cancelled", "CANCELLED"),
    ("generation failed: RuntimeError: CUDA error", "INTERNAL"),
    ("internal error reading the request: ValueError: x", "INTERNAL"),
    ("max_tokens must be between 1 and 256 (this engine's maximum sequence length), got 0", "INVALID_ARGUMENT"),
])
def test_error_classes(message, code):
    """Triton's gRPC stream carries a failed response's message only: the client reads its class from it."""
    assert client.error_code(message) == code and client.RequestError(message).code == code
    assert client.RequestError("Stream removed (Socket closed)", "UNAVAILABLE").code == "UNAVAILABLE"
