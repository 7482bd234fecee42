"""`remote/mode.py`: the remote options fail at start-up, naming the key."""

import pytest

from jaxrl_llm.parallel.launch import free_port


def test_remote_options_fail_at_start_up(tmp_path, monkeypatch, capsys):
    from jaxrl_llm.remote import node as sampler_node
    from jaxrl_llm import validation as V
    from jaxrl_llm.remote import mode as remote
    from jaxrl_llm.runtime import orchestrator

    c = orchestrator.default_config()
    c.remote.port = 70000
    assert V.check(c, V.flatten(orchestrator.rules(), "runtime."), "runtime.") == [
        "runtime.remote.port=70000: expected an integer in [0, 65535]"]
    c.remote.port = free_port()
    first = remote.serve(None, c.remote)
    try:
        with pytest.raises(ValueError, match=rf"runtime.remote.port={c.remote.port}: cannot serve on 127.0.0.1:"):
            remote.serve(None, c.remote)  # taken by the first
    finally:
        first.shutdown()
    for argv, why in ((["--learner=nohostport"], "expected HOST:PORT"), (["--learner=h:70000"], "expected HOST:PORT"),
                      (["--learner=h:1", "--cpu_devices=-1"], "--cpu_devices=-1: expected 0")):
        with pytest.raises(SystemExit):
            sampler_node.main(argv)
        assert why in capsys.readouterr().err
    assert sampler_node.main(["--learner=h:1", f"--tls_root_cert={tmp_path}/none.pem"]) == 2
    err = capsys.readouterr().err
    assert err.splitlines()[0] == f"jaxrl_llm.sampler_node: error: --tls_root_cert='{tmp_path}/none.pem' does not exist"
    assert "Traceback" not in err
    with pytest.raises(FileNotFoundError):
        sampler_node.main(["--learner=h:1", f"--tls_root_cert={tmp_path}/none.pem", "--verbose"])
    c = orchestrator.default_config()
    c.mode = "remote"
    orchestrator.validate(c)  # loopback: no token needed
    c.remote.host = "0.0.0.0"
    monkeypatch.delenv("JAXRL_REMOTE_TOKEN", raising=False)
    with pytest.raises(ValueError, match="reachable beyond this machine: set a shared token"):
        orchestrator.validate(c)
    monkeypatch.setenv("JAXRL_REMOTE_TOKEN", "t")
    orchestrator.validate(c)
    c.remote.tls_cert = str(tmp_path / "cert.pem")
    with pytest.raises(ValueError, match="needs both runtime.remote.tls_cert and runtime.remote.tls_key"):
        orchestrator.validate(c)
    c.remote.tls_key = str(tmp_path / "key.pem")
    with pytest.raises(ValueError, match="cert.pem' does not exist"):
        orchestrator.validate(c)
