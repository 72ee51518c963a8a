"""The grpc_port setting: off by default, a port, not another listener's, and under the same
token rule as the REST API it listens beside."""

from __future__ import annotations

import pytest

from kvferry import cli
from kvferry.engine import settings


def test_grpc_is_off_unless_a_port_is_set():
    assert settings.Settings().grpc_port == 0
    on = settings.load({"grpc_port": "7702"}, {})
    on.check()
    assert on.grpc_port == 7702 and settings.load(None, {"KVFERRY_GRPC_PORT": "7703"}).grpc_port == 7703


@pytest.mark.parametrize("value, message", [(70000, "not a port"), (7700, "taken"), (7701, "taken")])
def test_a_bad_grpc_port_is_refused(value, message):
    with pytest.raises(ValueError, match=message):
        settings.Settings(grpc_port=value).check()


def test_nothing_listens_beyond_loopback_without_a_token():
    with pytest.raises(ValueError, match="without a token"):
        settings.Settings(host="0.0.0.0", grpc_port=7702).check()
    settings.Settings(host="0.0.0.0", grpc_port=7702, token="t").check()


def test_the_flag_reaches_the_setting(monkeypatch):
    seen = {}
    monkeypatch.setattr(cli, "_serve", lambda args: seen.setdefault("grpc_port", args.grpc_port) and 0)
    cli.main(["serve", "--grpc-port", "7702"])
    assert seen["grpc_port"] == "7702"
