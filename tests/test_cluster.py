"""The local AIStore cluster's lifecycle through the command line, as a user runs it."""
import json
from pathlib import Path
import pytest
import requests
from conftest import free_base_port, main_cli, run_cli


def test_up_status_down_leaves_nothing_running(tmp_path, ais_cluster):
    # ais_cluster first: it builds aisnode once for the session, so this test only starts nodes
    # ports below Linux's ephemeral range (32768-60999): there any program's outgoing connection may take one between
    # the check and aisnode's bind (a target exited at start once, at 38081-40081); the session's clusters use 28080+
    root, port = tmp_path / "c", free_base_port(start=20080)
    r = run_cli("ais", "up", "--targets", "1", "--root", root, "--port", port, check=True)
    assert f"export AIS_ENDPOINT=http://127.0.0.1:{port}" in r.stdout
    r = run_cli("ais", "status", "--root", root)
    assert r.returncode == 0 and "ready: yes" in r.stdout and r.stdout.count("running") == 2, r.stdout
    pids = [n["pid"] for n in json.loads((root / "cluster.json").read_text())["nodes"]]
    assert requests.get(f"http://127.0.0.1:{port}/v1/health?prr=true", timeout=3).status_code == 200
    # a second `up` finds the running cluster instead of starting another
    assert "already running" in run_cli("ais", "up", "--targets", "1", "--root", root, "--port", port, check=True).stdout
    r = run_cli("ais", "down", "--root", root, "--wipe", check=True)
    assert "stopped 2 node(s)" in r.stdout
    assert not any(Path(f"/proc/{p}").exists() and "aisnode" in Path(f"/proc/{p}/cmdline").read_text(errors="replace") for p in pids)
    with pytest.raises(requests.ConnectionError): requests.get(f"http://127.0.0.1:{port}/v1/health", timeout=2)
    assert not root.exists()
    r = run_cli("ais", "status", "--root", root)
    assert r.returncode == 1 and "shardkit ais up" in r.stdout


def test_busy_port_is_named(tmp_path, ais_cluster):
    port = int(ais_cluster["endpoint"].rsplit(":", 1)[1])
    r = run_cli("ais", "up", "--root", tmp_path, "--port", port)
    assert r.returncode == 2 and f"{port}" in r.stderr and "--port" in r.stderr


def test_missing_go_is_one_line(tmp_path):
    env = {"PATH": "/usr/bin:/bin", "SHARDKIT_HOME": str(tmp_path)}  # no Go on PATH, no cached build
    r = run_cli("ais", "up", "--root", tmp_path / "c", "--port", free_base_port(start=24080), env=env)
    assert r.returncode == 2
    assert r.stderr.strip().count("\n") == 0 and "Go is not installed" in r.stderr, r.stderr


def test_help_reads_well():
    r = main_cli("ais", "up", "--help")
    assert r.returncode == 0, r.stderr
    for opt in ("--targets", "--root", "--port", "Number of storage targets"): assert opt in r.stdout
    r = main_cli("--help")
    assert r.returncode == 0, r.stderr
    assert "ais up" in r.stdout and "convert pets" in r.stdout and "bench loader" in r.stdout


def test_a_planted_aisnode_in_a_folder_others_can_write_is_refused_not_run(tmp_path, monkeypatch):
    from shardkit.stores.ais_cluster import ClusterError, aisnode_path, build_aisnode
    home, marker = tmp_path / "home", tmp_path / "ran"
    monkeypatch.setenv("SHARDKIT_HOME", str(home))
    planted = aisnode_path()
    planted.parent.mkdir(parents=True)
    planted.write_text(f"#!/bin/sh\ntouch {marker}\n")
    planted.chmod(0o755)
    home.chmod(0o775)  # a group-writable SHARDKIT_HOME: anyone in the group could have put it there
    with pytest.raises(ClusterError) as e: build_aisnode(quiet=True)
    msg = str(e.value)
    assert "\n" not in msg and f"chmod go-w {home}" in msg and "SHARDKIT_HOME" in msg, msg
    assert not marker.exists(), "the planted aisnode ran"
    home.chmod(0o700)
    planted.chmod(0o777)  # now the binary itself is writable by anyone
    with pytest.raises(ClusterError, match=f"refusing to run {planted.name}: {planted} can be written by others"): build_aisnode(quiet=True)
    assert not marker.exists()
