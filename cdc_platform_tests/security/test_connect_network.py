"""The Spark Connect server on the network: a client never sends its token in plain
text off this machine nor carries it in its URL, and a non-loopback host needs TLS in front."""

from __future__ import annotations

import pytest

from cdc_platform import connect_server
from cdc_platform.lib.spark.connect import ConnectSetupError, connect_endpoint


@pytest.mark.parametrize(
    "url",
    [
        "sc://attacker.example:15002",
        "sc://10.0.0.5:15002",
        "sc://0.0.0.0:15002",
        "sc://attacker.example:15002/;use_ssl=false",
    ],
)
def test_a_client_never_sends_the_token_in_plain_text_off_this_machine(url):
    with pytest.raises(ConnectSetupError, match="TLS"):
        connect_endpoint(url)


def test_a_client_url_never_carries_its_own_token_and_tls_hosts_are_allowed():
    with pytest.raises(ConnectSetupError, match="token"):
        connect_endpoint("sc://127.0.0.1:15002/;token=guessed")
    assert connect_endpoint("sc://spark.internal:443/;use_ssl=true") == (
        "spark.internal",
        443,
        {"use_ssl": "true"},
    )
    assert connect_endpoint("sc://localhost:15002")[:2] == ("localhost", 15002)


def test_the_server_refuses_a_non_loopback_host_without_tls_in_front(tmp_path):
    with pytest.raises(ValueError, match="allow-remote-clients"):
        connect_server.start(connect_server.free_port(), host="0.0.0.0", state_dir=tmp_path)
    assert not (tmp_path / "auth.json").exists()
