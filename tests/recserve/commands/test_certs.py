"""``recserve certs``: the TLS files of a deployment, valid for the names its clients dial."""

from __future__ import annotations

import shlex
import subprocess

from cryptography import x509

from recserve.cli import main
from serving.rpc.tls import ClientTLS, ServerTLS


def test_certs_writes_a_server_certificate_for_the_names_given_and_a_client_one(tmp_path, capsys):
    out = tmp_path / "tls"
    assert main(["certs", str(out), "--hosts", "ps-0.ps,worker,198.18.0.7"]) == 0
    cert = x509.load_pem_x509_certificate((out / "server.pem").read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert {"ps-0.ps", "worker", "localhost"} <= set(sans.get_values_for_type(x509.DNSName))
    assert "198.18.0.7" in {str(a) for a in sans.get_values_for_type(x509.IPAddress)}
    assert sorted(p.name for p in out.iterdir()) == [
        "ca.pem",
        "client.key",
        "client.pem",
        "server.key",
        "server.pem",
    ]
    assert (out / "server.key").stat().st_mode & 0o077 == 0 and (
        out / "client.key"
    ).stat().st_mode & 0o077 == 0
    ServerTLS(str(out / "server.pem"), str(out / "server.key"), str(out / "ca.pem"))  # a valid pair, checked
    ClientTLS(str(out / "ca.pem"), str(out / "client.pem"), str(out / "client.key"))
    printed = capsys.readouterr().out
    assert f"--tls-client-ca {out / 'ca.pem'}" in printed and "--ps-tls-*" in printed


def test_certs_without_client_auth_leaves_no_client_certificate_and_hosts_are_required(tmp_path, capsys):
    out = tmp_path / "tls"
    assert main(["certs", str(out), "--hosts", "worker"]) == 0
    assert main(["certs", str(out), "--hosts", "worker", "--no-client-auth"]) == 0  # replaces the earlier PKI
    assert sorted(p.name for p in out.iterdir()) == ["ca.pem", "server.key", "server.pem"]
    assert main(["certs", str(tmp_path / "other")]) == 2
    assert "give --hosts" in capsys.readouterr().err
    assert not (tmp_path / "other").exists()


def test_the_readmes_certs_line_runs_as_printed(tmp_path):
    from tests.helpers import recserve_argv
    from tests.test_readme_cli import line

    text = line("recserve certs ")
    done = subprocess.run(recserve_argv(text), cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    hosts = shlex.split(text)[shlex.split(text).index("--hosts") + 1].split(",")
    cert = x509.load_pem_x509_certificate((tmp_path / "tls" / "server.pem").read_bytes())
    sans = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert set(hosts) <= {str(a) for a in sans.get_values_for_type(x509.IPAddress)}
