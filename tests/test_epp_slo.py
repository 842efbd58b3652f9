"""The endpoint picker refuses a request no instance is predicted to serve within its
TTFT SLO the way the front door does (issue 33): an ImmediateResponse 429 in the OpenAI
error shape with Retry-After; a bad SLO header is a 400 naming it."""

from __future__ import annotations

from contextlib import ExitStack

import pytest

from test_epp import (
    ExtProcStream,
    chat_body,
    dispatch,
    epp_settings,
    fleet,
    immediate_error,
    length_model,
    request_body,
    request_headers,
)

__all__ = ["length_model"]  # the fixture used below

grpc = pytest.importorskip("grpc")


def _send(channel, headers: dict[str, str]):
    s = ExtProcStream(channel)
    s.send(request_headers(extra=headers))
    data = chat_body()
    s.send(request_body(data[:10], eos=False))
    s.send(request_body(data[10:], eos=True))
    resp = s.recv()
    assert s.close() == []
    return resp


@pytest.mark.timeout(120)
def test_epp_refuses_an_unmeetable_slo_with_429(length_model, tmp_path):
    with ExitStack() as st:
        engs, preds = fleet(st, tmp_path)
        from rps_astro_cli.services.epp import EppThread

        srv = st.enter_context(EppThread(epp_settings(engs, preds, length_model)))
        channel = st.enter_context(grpc.insecure_channel(srv.address))
        resp = _send(channel, {"x-slo-ttft-ms": "0.001"})
        code, err = immediate_error(resp)
        assert code == 429 and err["type"] == "slo_unmeetable" and err["param"] == "x-slo-ttft-ms"
        hdrs = {h.header.key: h.header.raw_value.decode() for h in resp.immediate_response.headers.set_headers}
        assert int(hdrs["Retry-After"]) >= 1
        code, err = immediate_error(_send(channel, {"x-slo-ttft-ms": "soon"}))
        assert code == 400 and err["param"] == "x-slo-ttft-ms"
        # a generous SLO is picked as usual
        from rps_astro_cli.services.epp import endpoint_address

        dest, _, _ = dispatch(channel, chat_body(), extra={"x-slo-ttft-ms": "60000"})
        assert dest in {endpoint_address(e.url) for e in engs}
