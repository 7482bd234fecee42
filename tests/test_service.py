"""`remote/service.py`: one-line counted refusals, the authentication throttle, the token and TLS."""

import shutil
import subprocess

import pyarrow.flight as flight
import pytest

from jaxrl_llm.remote import wire
from jaxrl_llm.remote.client import Client
from jaxrl_llm.remote.service import Service
from tests.remote_helpers import _group


class _Echo:
    def hello(self, req):
        return {"hi": req["name"]}

    def lease(self, req):
        raise PermissionError("node x was refused")


class _Faulty:
    """A handler whose put_group fails in every way the service must contain."""

    def __init__(self):
        import collections

        self.refusals, self.streams = collections.Counter(), 0

    def refuse(self, reason):
        self.refusals[reason] += 1

    def check_session(self, req):
        if req.get("session") != "ok":
            e = wire.Rejected("the session key does not match")
            e.counted = True
            self.refuse("session")
            raise e
        self.streams += 1

    def put_group(self, req):
        if req["group"] == 1:
            raise RuntimeError("/secret/server/path.py exploded")  # a bug, not a refusal
        if req["group"] == 2:
            raise KeyError("lease")  # not counted by the handler: the service counts it
        return {"accepted": True}

    def hello(self, req):
        return {}


def test_service_refusals_are_one_line_counted_by_reason_and_a_bad_group_refuses_only_itself():
    h = _Faulty()
    svc = Service(h, "127.0.0.1", 0, token="s3cret")
    try:
        c = Client(svc.address, token="s3cret")
        f = _group(rows=2, p=2, new=2, k=0, prompt=(1,))
        groups = [(wire.group_batch(f), {"lease": 1, "group": g}) for g in range(4)]
        groups[3] = (groups[3][0], {"lease": 1, "group": 3, "pad": "x" * 17000})  # metadata past MAX_META_BYTES
        answers = c.put_groups(groups, session="ok")
        assert answers[0] == {"accepted": True} and answers[1]["rejected"] == (
            "internal error on the learner (RuntimeError); it is logged there")
        assert "KeyError" in answers[2]["rejected"] and "at most 16384 bytes" in answers[3]["rejected"]
        assert all("Traceback" not in str(a) and "/secret" not in str(a) for a in answers)
        with pytest.raises(flight.FlightServerError, match="session key does not match"):
            c.put_groups(groups[:1], session="forged")
        with pytest.raises(flight.FlightServerError, match="at most 65536 bytes"):
            c.call("hello", pad="x" * (70 << 10))
        with pytest.raises(flight.FlightServerError, match="unknown action"):
            c.call("nope")
        for _ in range(3):
            with pytest.raises(flight.FlightUnauthenticatedError):
                Client(svc.address, token="guess").call("hello")
        assert h.streams == 1 and dict(h.refusals) == {"internal": 1, "request": 4, "session": 1, "token": 3}
    finally:
        svc.close()


def test_failed_authentication_past_a_burst_waits_before_each_refusal():
    from jaxrl_llm.remote.service import TokenCheck

    now, slept, counted = [0.0], [], []
    check = TokenCheck("s3cret", counted.append, burst=3, delay_s=0.5, clock=lambda: now[0], sleep=slept.append)
    for i in range(6):
        with pytest.raises(flight.FlightUnauthenticatedError):
            check.start_call(None, {"authorization": ["Bearer guess"]})
    assert slept == [0.5] * 3 and counted == ["token"] * 3 + ["throttled"] * 3
    assert check.start_call(None, {"authorization": ["Bearer s3cret"]}) is None and len(slept) == 3  # never delayed
    now[0] = 1.5  # a second later the burst is free again
    with pytest.raises(flight.FlightUnauthenticatedError):
        check.start_call(None, {"authorization": ["Bearer guess"]})
    assert len(slept) == 3 and counted[-1] == "token"


def test_service_requires_its_token_and_speaks_tls(tmp_path):
    svc = Service(_Echo(), "127.0.0.1", 0, token="s3cret")
    try:
        assert Client(svc.address, token="s3cret").call("hello", name="n") == {"hi": "n"}
        with pytest.raises(flight.FlightUnauthenticatedError, match="the one sent does not match"):
            Client(svc.address, token="wrong").call("hello", name="n")
        with pytest.raises(flight.FlightUnauthenticatedError, match="none was sent"):
            Client(svc.address).call("hello", name="n")
        with pytest.raises(flight.FlightUnauthorizedError, match="refused: node x was refused"):
            Client(svc.address, token="s3cret").call("lease")
        with pytest.raises(flight.FlightServerError, match="unknown action 'nope'; valid: hello"):
            Client(svc.address, token="s3cret").call("nope")
        assert svc.auth.refused == 2
    finally:
        svc.close()
    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed: no self-signed certificate for the TLS half")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
                    "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1", "-keyout", str(key), "-out", str(cert)],
                   check=True, capture_output=True)
    svc = Service(_Echo(), "127.0.0.1", 0, token="t", tls=(cert.read_bytes(), key.read_bytes()))
    try:
        assert Client(svc.address, token="t", tls_root_cert=cert.read_bytes()).call("hello", name="tls") == {"hi": "tls"}
        with pytest.raises(flight.FlightError):
            Client(svc.address, token="t", timeout=5).call("hello", name="plain")  # no TLS: no answer
    finally:
        svc.close()


# ---------------------------------------------------------------------- processes
