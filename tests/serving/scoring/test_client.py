"""The scoring client and ``recserve score``: http and https URLs, a CA for HTTPS, and clear errors
for a URL, a CA or an endpoint that cannot be used."""

from __future__ import annotations

import pytest

from recserve.cli import main
from serving.rpc.procs import free_ports
from serving.scoring.client import ScoringClient
from tests.serving.helpers import TEST


def test_a_url_that_is_not_http_or_a_ca_for_plain_http_is_refused():
    with pytest.raises(ValueError, match="not http"):
        ScoringClient("ftp://127.0.0.1/predictions/criteo")
    with pytest.raises(ValueError, match="is for an https:// URL"):
        ScoringClient("http://127.0.0.1:8080/predictions/criteo", ca="ca.pem")
    assert ScoringClient("https://scoring/predictions/criteo").port == 443


def test_score_says_why_it_cannot_start_or_reach_the_endpoint(tmp_path, capsys):
    (port,) = free_ports(1)  # nothing listens there
    assert main(["score", TEST, "--url", "ftp://127.0.0.1/x", "--limit", "10"]) == 2
    assert "is not http(s)://" in capsys.readouterr().err
    missing = tmp_path / "ca.pem"
    assert main(["score", TEST, "--url", f"https://127.0.0.1:{port}/x", "--ca", str(missing)]) == 2
    assert "No such file" in capsys.readouterr().err
    assert main(["score", TEST, "--url", f"http://127.0.0.1:{port}/predictions/criteo", "--limit", "10"]) == 1
    err = capsys.readouterr().err
    assert f"recserve score: http://127.0.0.1:{port}/predictions/criteo: " in err and "refused" in err


def test_serve_refuses_https_files_it_cannot_use_naming_them(tmp_path, capsys):
    """An HTTPS key others can read, or one that is not the certificate's: exit 2 at configuration,
    before anything listens (the checks gRPC's TLS makes, ``serving.rpc.tls.ServerTLS``)."""
    from serving.rpc.tls import local_pki

    a, _ = local_pki(tmp_path / "a", ["scoring"])
    b, _ = local_pki(tmp_path / "b", ["scoring"])
    store = str(tmp_path / "store")
    assert main(["serve", "--store", store, "--https-cert", a.cert, "--https-key", b.key]) == 2
    assert f"{b.key} does not belong to the certificate {a.cert}" in capsys.readouterr().err
    (tmp_path / "a" / "server.key").chmod(0o644)
    assert main(["serve", "--store", store, "--https-cert", a.cert, "--https-key", a.key]) == 2
    err = capsys.readouterr().err
    assert a.key in err and "bad configuration" in err
    assert main(["serve", "--store", store, "--https-cert", a.cert]) == 2
    assert "--https-cert and --https-key go together" in capsys.readouterr().err
