"""gpushare-cluster simulate: its table, its JSON, and what it says of bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from click.testing import CliRunner

from gpushare.exitcodes import EXIT_DATA, EXIT_USAGE
from placement.cli import cli
from placement.replay import CHECKPOINTS

NODES = "sn,cpu_milli,memory_mib,gpu,model\nn0,64000,262144,4,T4\nn1,32000,131072,2,P100\n"
PODS = (
    "name,cpu_milli,memory_mib,num_gpu,gpu_milli,gpu_spec,qos,creation_time,deletion_time\n"
    "a,4000,8192,1,500,,LS,0,100\n"
    "b,8000,16384,2,1000,T4,BE,10,\n"
    "c,2000,4096,0,0,,BE,20,50\n"
    "d,4000,8192,1,1000,P100|T4,LS,30,90\n"
) + "".join(f"s{i},1000,1024,1,{100 + 50 * (i % 4)},,BE,{40 + i},\n" for i in range(40))


def files(tmp_path: Path, nodes: str = NODES, pods: str = PODS) -> list[str]:
    (tmp_path / "nodes.csv").write_text(nodes)
    (tmp_path / "pods.csv").write_text(pods)
    return ["--nodes", str(tmp_path / "nodes.csv"), "--pods", str(tmp_path / "pods.csv")]


def test_simulate_prints_the_table(tmp_path: Path) -> None:
    r = CliRunner().invoke(cli, ["simulate", *files(tmp_path), "--policy", "fgd"])
    assert r.exit_code == 0, r.output
    lines = r.output.splitlines()
    assert lines[0].startswith("policy fgd, seed 42, tune 1.3: ")
    # The published table's columns this run reached (a 2,000-milli task jumps some).
    header = lines[1].split()
    assert header[:2] == ["arrived", "%"] and header[2:]
    assert {int(a) for a in header[2:]} <= set(CHECKPOINTS)
    for line, name in zip(lines[2:4], ["allocated", "fragmented"], strict=True):
        assert line.split()[:2] == [name, "%"] and len(line.split()) == len(header)


def test_simulate_json_is_the_documented_document(tmp_path: Path) -> None:
    args = ["simulate", *files(tmp_path), "--policy", "bestfit", "--seed", "7", "--tune", "2"]
    r = CliRunner().invoke(cli, [*args, "--json"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.output)
    assert {"policy", "seed", "tune", "alloc_at", "failed_pods", "fragmentation"} <= set(doc)
    assert (doc["policy"], doc["seed"], doc["tune"]) == ("bestfit", 7, 2.0)
    assert doc["pods"] == doc["placed"] + doc["failed_pods"] + doc["evicted_unplaced"]
    assert set(doc["alloc_at"]) == set(doc["fragmentation"])
    assert all(0 <= v <= 100 for v in doc["alloc_at"].values())
    again = json.loads(CliRunner().invoke(cli, [*args, "--json"]).output)
    assert {k: v for k, v in again.items() if k != "seconds"} == {
        k: v for k, v in doc.items() if k != "seconds"
    }


def test_bad_trace_files_name_the_line_and_column(tmp_path: Path) -> None:
    for pods, says in [
        (PODS.replace("a,4000", "a,four"), "pods.csv:2: cpu_milli 'four' is not valid"),
        (PODS.replace("b,8000,16384,2,1000", "b,8000,16384,2,500"), "pods.csv:3: pod b: a share"),
        (PODS.replace(",num_gpu,", ",gpus,"), "pods.csv: no column num_gpu"),
        ("name,cpu_milli,num_gpu,gpu_milli\n", "pods.csv: no pods"),
        (PODS.replace("0,100\n", "0,-5\n"), "pods.csv:2: deletion_time '-5' is not valid"),
    ]:
        r = CliRunner().invoke(cli, ["simulate", *files(tmp_path, pods=pods), "--policy", "random"])
        assert r.exit_code == EXIT_DATA, (pods, r.output)
        assert says in r.output, r.output
    nodes = NODES.replace("n1,32000,131072,2", "n0,32000,131072,2")
    r = CliRunner().invoke(cli, ["simulate", *files(tmp_path, nodes=nodes), "--policy", "random"])
    assert r.exit_code == EXIT_DATA and "node n0 is listed twice" in r.output
    r = CliRunner().invoke(
        cli, ["simulate", "--nodes", str(tmp_path / "none.csv"), "--pods", "x", "--policy", "fgd"]
    )
    assert r.exit_code == EXIT_DATA and "cannot read" in r.output


def test_unknown_policies_and_tunes_are_usage_errors(tmp_path: Path) -> None:
    r = CliRunner().invoke(cli, ["simulate", *files(tmp_path), "--policy", "worstfit"])
    assert r.exit_code == EXIT_USAGE
    assert "'worstfit' is not one of 'random', 'dotprod'" in r.output
    r = CliRunner().invoke(cli, ["simulate", *files(tmp_path), "--policy", "fgd", "--tune", "0"])
    assert r.exit_code == EXIT_USAGE


def test_the_installed_command_runs(tmp_path: Path) -> None:
    exe = Path(sys.executable).parent / "gpushare-cluster"
    r = subprocess.run(
        [str(exe), "simulate", *files(tmp_path), "--policy", "packing", "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["policy"] == "packing"
