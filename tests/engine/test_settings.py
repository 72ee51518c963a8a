"""Settings merge: defaults < YAML file < KVFERRY_* environment < CLI flags."""

from __future__ import annotations

import pytest

from kvferry import transport
from kvferry.engine import settings
from kvferry.engine.links import data_plane


def test_precedence(tmp_path):
    config = tmp_path / "kvferry.yaml"
    config.write_text("port: 9000\ndata_port: 9001\nchunk_bytes: 1024\nucx_options: {TLS: tcp}\n")
    merged = settings.load({"port": 9100}, {"KVFERRY_DATA_PORT": "9201", "KVFERRY_TOKEN": "s3cret"}, config)
    assert (merged.port, merged.data_port, merged.chunk_bytes) == (9100, 9201, 1024)
    assert merged.ucx_options == {"TLS": "tcp"}
    assert merged.public()["token"] == "***"


def test_unknown_yaml_key_is_an_error(tmp_path):
    config = tmp_path / "kvferry.yaml"
    config.write_text("prot: 1\n")
    with pytest.raises(ValueError, match="prot"):
        settings.load({}, {}, config)


def test_ucx_options_from_environment():
    merged = settings.load({}, {"KVFERRY_UCX_OPTIONS": "TLS=tcp,TCP_TX_SEG_SIZE=2m"})
    assert merged.ucx_options == {"TLS": "tcp", "TCP_TX_SEG_SIZE": "2m"}


def test_secure_by_default():
    settings.load({}, {}).check()  # loopback: fine without secrets
    with pytest.raises(ValueError, match="KVFERRY_TOKEN"):
        settings.load({"host": "0.0.0.0"}, {}).check()
    with pytest.raises(ValueError, match="KVFERRY_PEER_SECRET"):
        settings.load({"data_host": "0.0.0.0"}, {"KVFERRY_TOKEN": "t"}).check()
    merged = settings.load({"host": "0.0.0.0", "data_host": "0.0.0.0"}, {"KVFERRY_TOKEN": "t",
                                                                        "KVFERRY_PEER_SECRET": "p"})
    merged.check()
    assert merged.public()["peer_secret"] == "***"


def test_loopback_is_an_address_of_loopback_not_a_name_that_looks_like_one():
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        settings.load({"host": host, "data_host": host}, {}).check()
    for host in ("127.evil.example", "127.0.0.1.example", "0.0.0.0", "::"):
        with pytest.raises(ValueError, match="KVFERRY_TOKEN"):
            settings.load({"host": host}, {}).check()
        with pytest.raises(ValueError, match="KVFERRY_PEER_SECRET"):
            settings.load({"data_host": host}, {}).check()


def test_a_token_an_http_header_cannot_carry_is_refused_at_start():
    with pytest.raises(ValueError, match="ASCII"):
        settings.load({}, {"KVFERRY_TOKEN": "s\u00e9same"}).check()


def test_an_ipv6_data_address_is_served_over_tcp(monkeypatch):
    """ucxx's listener binds 0.0.0.0 only: asked for by name with an IPv6 data address, the sidecar
    refuses to start; chosen by ``auto`` (an RDMA host), it gives way to tcp."""
    secret = {"KVFERRY_PEER_SECRET": "p", "KVFERRY_TOKEN": "t"}
    for where in ({"data_host": "::"}, {"data_host": "0.0.0.0", "advertise_host": "fd00::7"}):
        with pytest.raises(ValueError, match="IPv4 only"):
            settings.load({**where, "transport_backend": "ucxx"}, secret).check()
        merged = settings.load(where, secret)
        merged.check()
        monkeypatch.setattr(transport, "resolve_backend", lambda config: "ucxx")  # as where RDMA is
        assert data_plane(merged, False, 4 << 20)[1] == "tcp"
    ipv4 = settings.load({"data_host": "0.0.0.0", "transport_backend": "ucxx"}, secret)
    ipv4.check()
    assert data_plane(ipv4, False, 4 << 20)[1] == "ucxx"


def test_ucx_progress_mode_defaults_to_blocking_and_is_checked():
    assert settings.load({}, {}).ucx_progress_mode == "blocking"
    merged = settings.load({}, {"KVFERRY_UCX_PROGRESS_MODE": "thread"})
    merged.check()
    assert merged.ucx_progress_mode == "thread"
    with pytest.raises(ValueError, match="ucx_progress_mode: 'spin'"):
        settings.load({}, {"KVFERRY_UCX_PROGRESS_MODE": "spin"}).check()


def test_the_peer_floor_rate_is_one_mib_a_second_unless_set_and_must_be_positive():
    assert settings.load({}, {}).min_peer_bytes_per_s == 1 << 20
    chosen = settings.load({}, {"KVFERRY_MIN_PEER_BYTES_PER_S": "65536"})
    chosen.check()
    assert chosen.min_peer_bytes_per_s == 65536
    with pytest.raises(ValueError, match="min_peer_bytes_per_s must be positive"):
        settings.load({}, {"KVFERRY_MIN_PEER_BYTES_PER_S": "0"}).check()


def test_spin_is_on_for_a_gpu_and_off_for_the_cpu_unless_set():
    default = settings.load({}, {})
    assert default.spin_seconds("cuda") == settings.GPU_SPIN_MS / 1e3 > 0
    assert default.spin_seconds("cpu") == 0
    chosen = settings.load({}, {"KVFERRY_SPIN_MS": "7.5"})
    chosen.check()
    assert chosen.spin_seconds("cpu") == chosen.spin_seconds("cuda") == 0.0075
    assert settings.load({}, {"KVFERRY_SPIN_MS": "0"}).spin_seconds("cuda") == 0
    with pytest.raises(ValueError, match="spin_ms: -2"):
        settings.load({}, {"KVFERRY_SPIN_MS": "-2"}).check()


def test_the_loop_moves_off_slow_cpus_only_where_it_spins_with_four_cpus_or_more(monkeypatch):
    from kvferry.engine import engine

    monkeypatch.setattr(engine.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    assert settings.load({}, {}).loop_moves is True
    assert engine.Engine(settings.Settings(spin_ms=10)).spinner.mover.cpus == [0, 1, 2, 3]
    assert engine.Engine(settings.load({}, {"KVFERRY_SPIN_MS": "10", "KVFERRY_LOOP_MOVES": "false"})).spinner.mover is None
    assert engine.Engine(settings.Settings()).spinner.mover is None  # a CPU engine does not spin
    monkeypatch.setattr(engine.os, "sched_getaffinity", lambda pid: {0, 1, 2})
    assert engine.Engine(settings.Settings(spin_ms=10)).spinner.mover is None


@pytest.mark.parametrize("variable", ["KVFERRY_TESTING_CORRUPT_CHUNK", "KVFERRY_FAULT_CORRUPT_CHUNK", "KVFERRY_LINK_GBPS"])
def test_the_product_knows_no_test_fault_and_no_old_knob(variable):
    """Faults are installed only by the test entry point (``kvferry.testing.serve``); a production
    sidecar given one, or the old name of the link emulator, refuses to start."""
    with pytest.raises(ValueError, match=variable):
        settings.load({}, {variable: "0"})
    assert settings.load({}, {"KVFERRY_EMULATED_LINK_GBPS": "0.5"}).emulated_link_gbps == 0.5
