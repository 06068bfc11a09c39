"""`experiments.side_by_side`: per-request TPOT, medians and ratios, and whole runs
against scripted servers that stand in for installed peers (one missing, one broken)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from experiments.engines import NotInstalled, Peers, ServerSpec, names_model
from experiments.side_by_side import main
from experiments.side_by_side_report import measurement, summarize, table
from tests.processes import running

REPO = Path(__file__).resolve().parents[2]


def result(itls: list[list[float]], output_lens: list[int], throughput: float) -> dict:
    return {
        "completed": len(itls), "failed": 0, "duration": 1.0, "output_throughput": throughput,
        "median_ttft_ms": 100.0, "p99_ttft_ms": 150.0, "median_itl_ms": 20.0,
        "p99_itl_ms": 40.0, "median_tpot_ms": 21.0, "total_output_tokens": sum(output_lens),
        "itls": itls, "output_lens": output_lens, "errors": ["", ""],
    }  # fmt: skip


def record(server: str, repeat: int, metrics: dict, status: str = "ok") -> dict:
    return {"server": server, "scenario": "single", "repeat": repeat, "status": status,
            "metrics": metrics}  # fmt: skip


def test_tpot_runs_from_first_to_last_token_whatever_the_chunks_carry() -> None:
    # Five tokens in three chunks (gaps 0.1 s and 0.3 s): TPOT 0.4 s / 4 tokens.
    found = measurement(result([[0.1, 0.3], [0.02, 0.02, 0.02]], [5, 4], 50.0))
    assert found["request_tpot_ms"] == pytest.approx([100.0, 20.0])
    assert found["median_request_tpot_ms"] == pytest.approx(60.0)
    assert found["tokens_per_chunk"] == pytest.approx(9 / 7)
    assert found["errors"] == []


def test_rows_take_medians_over_good_rounds_and_ratios_to_the_baseline() -> None:
    base = [measurement(result([[0.02] * 3], [4], t)) for t in (10.0, 30.0, 20.0)]
    other = [measurement(result([[0.04] * 3], [4], t)) for t in (40.0, 60.0)]
    other[1]["failed"] = 3
    records = [
        *(record("base", i, m) for i, m in enumerate(base)),
        record("other", 0, other[0]),
        {"server": "other", "scenario": "single", "repeat": 1,
         "status": "failed: did not start (exited with 1)"},
        record("other", 2, other[1]),
        {"server": "peer", "scenario": "single", "repeat": None,
         "status": "skipped: not installed: vllm-cpu.sh install /x"},
    ]  # fmt: skip
    rows = {row["server"]: row for row in summarize(records, "base")}
    assert rows["base"]["output_throughput"] == 20.0 and rows["base"]["status"] == "3/3"
    assert rows["other"]["status"] == "2/3" and rows["other"]["output_throughput"] == 50.0
    assert rows["other"]["failed"] == 3
    assert rows["other"]["ratios"]["output_throughput"] == pytest.approx(2.5)
    assert rows["other"]["ratios"]["median_request_tpot_ms"] == pytest.approx(2.0)
    assert rows["peer"]["ratios"] == {} and "output_throughput" not in rows["peer"]
    text = table(list(rows.values()), "base").splitlines()
    assert text[0].startswith("| server | scenario | rounds ok | out tok/s | × base |")
    assert text[3].startswith("| other | single | 2/3 | 50.0 | 2.50 | 100.0 | 1.00 | 40.0 | 2.00 |")
    assert text[4] == (
        "| peer | single | skipped: not installed: vllm-cpu.sh install /x"
        " | - | - | - | - | - | - | - | - | - |"
    )


def test_a_missing_peer_names_the_command_that_makes_it(tmp_path) -> None:
    scripts, llama = fake_llama_install(tmp_path)
    peers = Peers(scripts, tmp_path / "vllm", llama, tmp_path / "ckpt")
    with pytest.raises(NotInstalled, match=r"llama-server.sh f16 .*/llama .*/ckpt .*ckpt-f16.gguf"):
        peers.llama_command(["f16"], 8012)
    with pytest.raises(NotInstalled, match=r"not installed: no .*/scripts/vllm-cpu.sh$"):
        peers.vllm_command([], 8011)
    (scripts / "vllm-cpu.sh").touch()
    with pytest.raises(NotInstalled, match=r"not installed: .*/vllm-cpu.sh install .*/vllm$"):
        peers.vllm_command([], 8011)
    spec = ServerSpec.parse("llama", "q=/m.gguf -c 4096")
    assert (spec.label, spec.args) == ("q", ["/m.gguf", "-c", "4096"])
    with pytest.raises(ValueError, match="needs a model"):
        ServerSpec.parse("llama", "q=")
    with pytest.raises(ValueError, match="LABEL=ARGS"):
        ServerSpec.parse("pdserve", "--mode colocated")


def test_a_pdserve_label_that_names_its_own_model_serves_it() -> None:
    assert names_model(["/m/x.Q4_1.gguf", "--mode", "colocated"])
    assert names_model(["--mode", "colocated", "--model", "/m"])
    assert names_model(["--model=/m"])
    assert not names_model(["--mode", "colocated", "--num-colocated", "1"])
    assert not names_model([])


def fake_llama_install(tmp_path: Path) -> tuple[Path, Path]:
    """A peer scripts folder whose llama-server.sh serves the scripted server on the
    port it is given (its flags after the port are the scripted server's) or exits at
    once for a model named broken, and an install folder that looks built. Each served
    one leaves a child of its own behind (its PID in `children`), as vLLM's engine core."""
    scripts = tmp_path / "scripts"
    scripts.mkdir()
    server = f"{sys.executable} -m tests.bench.scripted_server"
    (scripts / "llama-server.sh").write_text(
        'case "$3" in *broken*) echo "cannot read $3" >&2; exit 3;; esac\n'
        f"sleep 300 & echo $! >> {tmp_path / 'children'}\n"
        f'cd {REPO} && exec {server} --port "$4" "${{@:5}}"\n'
    )
    llama = tmp_path / "llama"
    (llama / "build" / "bin").mkdir(parents=True)
    (llama / "build" / "bin" / "llama-server").touch()
    return scripts, llama


@pytest.mark.slow
def test_a_run_measures_each_server_in_rounds_and_skips_what_is_missing(tmp_path, capsys) -> None:
    scripts, llama = fake_llama_install(tmp_path)
    gguf, broken = tmp_path / "model.gguf", tmp_path / "broken.gguf"
    gguf.touch()
    broken.touch()
    out = tmp_path / "run.json"
    fast = json.dumps({"ttft_s": 0.01, "itl_s": 0.0005})
    slow = json.dumps({"ttft_s": 0.01, "itl_s": 0.0015})
    code = main([
        "--scenarios", "single", "--repeats", "2", "--warmups", "1", "--num-prompts", "4",
        "--llama", f"fast={gguf} --script '{fast}'", "--llama", f"slow={gguf} --script '{slow}'",
        "--llama", f"broken={broken}",
        "--servers", "fast", "slow", "broken", "vllm-bf16",
        "--peer-scripts", str(scripts), "--llama-dir", str(llama),
        "--vllm-dir", str(tmp_path / "no-vllm"), "--checkpoint", str(tmp_path),
        "--approximate-tokens", "--start-timeout", "60", "--out", str(out),
    ])  # fmt: skip
    assert code == 0
    saved = json.loads(out.read_text())
    printed = capsys.readouterr().out
    assert saved["table"] in printed and saved["baseline"] == "fast"
    measured = [r for r in saved["records"] if r["status"] == "ok"]
    # Round-major: fast, slow, fast, slow; each server and its children stopped after its round.
    assert [(r["server"], r["repeat"]) for r in measured] == [
        ("fast", 0), ("slow", 0), ("fast", 1), ("slow", 1)
    ]  # fmt: skip
    for r in measured:
        assert r["metrics"]["completed"] == 4 and r["metrics"]["tokens_per_chunk"] == 1.0
    children = [int(pid) for pid in (tmp_path / "children").read_text().split()]
    assert len(children) == 4
    assert [pid for pid in [r["pid"] for r in measured] + children if running(pid)] == []
    rows = {row["server"]: row for row in saved["rows"]}
    assert list(rows) == ["fast", "slow", "broken", "vllm-bf16"]
    assert rows["fast"]["status"] == rows["slow"]["status"] == "2/2"
    assert rows["fast"]["ratios"]["median_request_tpot_ms"] == 1.0
    assert rows["slow"]["ratios"]["median_request_tpot_ms"] > 1.5, rows
    assert rows["broken"]["status"].startswith("failed: did not start (exited with 3")
    assert rows["vllm-bf16"]["status"].startswith("skipped: not installed: ")
    assert "| vllm-bf16 | single | skipped: not installed: " in printed
    assert main(["--show", str(out)]) == 0
    assert saved["table"] in capsys.readouterr().out
    assert main(["--show", str(tmp_path / "missing.json")]) == 2
    assert "not a results file" in capsys.readouterr().err
