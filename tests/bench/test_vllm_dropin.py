"""`bench serve` as a drop-in for `vllm bench serve`: the chat backend, the API key,
the detailed result file and its naming, request options, the ready check, a local
`--tokenizer`, and the `prefix_repetition` dataset."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from pdserve.bench.cli import dataset_spec, parse_metadata
from pdserve.bench.datasets import build_samples
from pdserve.bench.server_metrics import MetricsWatcher
from pdserve.bench.tokenizer import ApproximateTokenizer, LocalTokenizer
from pdserve.cli import build_parser, main

if TYPE_CHECKING:
    from tests.bench.conftest import ScriptedServer

KEY = "sk-bench-test"
SMALL = "--num-prompts 3 --random-input-len 6 --random-output-len 4 --disable-tqdm"


def bench(*argv: str) -> int:
    return main(["bench", "serve", *SMALL.split(), *argv])


@pytest.fixture
def server(scripted_server) -> Iterator[ScriptedServer]:
    """The session's scripted server, back to its open default script afterwards: other
    modules' tests must not meet a scripted API key or a failing /v1/models."""
    yield scripted_server
    scripted_server.script()


def test_chat_backend_with_api_key_writes_detailed_vllm_json(
    server, tmp_path, monkeypatch, capsys
) -> None:
    """The acceptance test: openai-chat, OPENAI_API_KEY, --save-detailed arrays."""
    server.script(ttft_s=0.01, itl_s=0.002, api_key=KEY)
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    code = bench(
        *("--backend", "openai-chat", "--base-url", server.base_url),
        *("--save-result", "--save-detailed", "--result-dir", str(tmp_path)),
        *("--label", "mylabel", "--metadata", "site=lab", "gpu=none"),
        *("--max-concurrency", "2", "--ready-check-timeout-sec", "5"),
    )
    assert code == 0, capsys.readouterr()
    stats = server.stats()
    assert stats["unauthorized"] == 0
    assert stats["chat_requests"] == stats["requests"] == 3
    assert stats["last_body"]["messages"][0]["role"] == "user"
    assert stats["last_body"]["max_completion_tokens"] == 4
    (path,) = tmp_path.glob("*.json")
    assert path.name.startswith("mylabel-infqps-concurrency2-scripted-model-")
    result = json.loads(path.read_text())
    assert result["backend"] == result["endpoint_type"] == "openai-chat"
    assert result["completed"] == 3 and result["total_output_tokens"] == 12
    for name in ("input_lens", "output_lens", "ttfts", "itls", "generated_texts", "errors"):
        assert len(result[name]) == 3, name
    assert result["generated_texts"] == [" tok" * 4] * 3
    assert result["site"] == "lab" and result["gpu"] == "none"
    assert result["label"] == "mylabel"


def test_without_the_key_the_server_refuses_every_request(server, capsys) -> None:
    server.script(api_key=KEY)
    assert bench("--base-url", server.base_url, "--token-counting", "approximate") == 1
    assert "HTTP 401" in capsys.readouterr().out


def test_generated_texts_only_with_save_detailed(scripted_server, tmp_path) -> None:
    scripted_server.script(ttft_s=0.01, itl_s=0.002)
    path = tmp_path / "plain.json"
    assert bench("--base-url", scripted_server.base_url, "--result-filename", str(path)) == 0
    result = json.loads(path.read_text())
    assert "generated_texts" not in result
    # Fields existing callers (the planner's calibration) read stay in every result.
    assert len(result["ttfts"]) == 3 and result["backend"] == "openai"


def test_temperature_extra_body_and_endpoint_reach_the_request(scripted_server) -> None:
    scripted_server.script(ttft_s=0.01, itl_s=0.002)
    code = bench(
        *("--base-url", scripted_server.base_url, "--temperature", "0.7"),
        *("--extra-body", '{"top_k": 5, "seed": 11}', "--endpoint", "/v1/completions"),
    )
    assert code == 0
    body = scripted_server.stats()["last_body"]
    assert body["temperature"] == 0.7 and body["top_k"] == 5 and body["seed"] == 11
    scripted_server.script(ttft_s=0.01, itl_s=0.002)
    assert bench("--base-url", scripted_server.base_url) == 0
    assert scripted_server.stats()["last_body"]["temperature"] == 0.0


def test_metrics_scrape_sends_the_key_and_says_a_401_loudly(server, monkeypatch, capsys) -> None:
    server.script(api_key=KEY)

    async def watch() -> dict:
        watcher = MetricsWatcher(server.base_url, interval_s=0.05)
        await watcher.start()
        await asyncio.sleep(0.2)
        return await watcher.stop()

    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    assert asyncio.run(watch())["kv_cache_usage_perc"] == 0.0
    assert capsys.readouterr().err == ""
    monkeypatch.setenv("OPENAI_API_KEY", "wrong")
    assert asyncio.run(watch())["kv_cache_usage_perc"] is None
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "/metrics answered 401" in err[0] and "OPENAI_API_KEY" in err[0]


def test_ready_check_waits_then_gives_up_in_one_line(server, capsys) -> None:
    server.script(models_status=503)
    code = bench("--base-url", server.base_url, "--ready-check-timeout-sec", "1")
    err = capsys.readouterr().err.strip()
    assert code == 2
    assert err.startswith("pdserve bench serve: error: server not ready after 1 s")
    assert "HTTP 503" in err and "\n" not in err
    assert server.stats()["requests"] == 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--extra-body", "[1]"], "argument --extra-body: must be a JSON object: [1]"),
        (["--metadata", "novalue"], "--metadata 'novalue' must look like KEY=VALUE"),
        (["--tokenizer", "/nonexistent"], "--tokenizer /nonexistent: no tokenizer.json there"),
    ],
)
def test_bad_dropin_flags_are_one_line(refused_url, capsys, argv, message) -> None:
    code: int | None
    try:
        code = bench("--base-url", refused_url, *argv)
    except SystemExit as exit_info:  # argparse's own errors
        code = int(exit_info.code or 0)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert message in err[-1]


def word_level_tokenizer(folder: Path) -> Path:
    """A tiny tokenizer.json, as a model folder holds one."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"[UNK]": 0, **{w: i + 1 for i, w in enumerate(["hello", "world", "a", "b"])}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    folder.mkdir()
    tokenizer.save(str(folder / "tokenizer.json"))
    return folder


def test_tokenizer_is_a_local_folder_as_in_vllm(scripted_server, tmp_path) -> None:
    folder = word_level_tokenizer(tmp_path / "tok")
    tokenizer = LocalTokenizer(str(folder))
    assert tokenizer.exact and tokenizer.encode("hello world zzz") == [1, 2, 0]
    scripted_server.script(ttft_s=0.01, itl_s=0.002)
    path = tmp_path / "r.json"
    code = bench(
        *("--base-url", scripted_server.base_url, "--tokenizer", str(folder)),
        *("--result-filename", str(path)),
    )
    assert code == 0
    result = json.loads(path.read_text())
    assert result["tokenizer_id"] == str(folder) and result["input_lens"] == [6, 6, 6]


def test_token_counting_keeps_the_old_tokenizer_modes(scripted_server, tmp_path, capsys) -> None:
    scripted_server.script(ttft_s=0.01, itl_s=0.002, tokenize=False)
    for mode in ("auto", "approximate"):
        path = tmp_path / f"{mode}.json"
        argv = ("--token-counting", mode, "--result-filename", str(path))
        assert bench("--base-url", scripted_server.base_url, *argv) == 0
    assert bench("--base-url", scripted_server.base_url, "--token-counting", "server") == 2
    assert "/tokenize answered HTTP 404" in capsys.readouterr().err


def test_prefix_repetition_repeats_prefixes_as_vllm() -> None:
    flags = (  # the flag names of `vllm bench serve`, as a drop-in must take them
        "bench serve --dataset-name prefix_repetition --num-prompts 12 --seed 4"
        " --prefix-repetition-prefix-len 20 --prefix-repetition-suffix-len 5"
        " --prefix-repetition-num-prefixes 3 --prefix-repetition-output-len 7"
    )
    args = build_parser().parse_args(flags.split())
    spec = dataset_spec(args, args.num_prompts)
    samples = build_samples(spec, ApproximateTokenizer())
    assert len(samples) == 12
    assert all(s.prompt_len == 25 and s.expected_output_len == 7 for s in samples)
    prefixes = [" ".join(str(s.prompt).split()[:20]) for s in samples]
    assert len(set(prefixes)) == 3 and all(prefixes.count(p) == 4 for p in set(prefixes))
    assert len({str(s.prompt) for s in samples}) == 12
    assert build_samples(spec, ApproximateTokenizer()) == samples


def test_prefix_repetition_from_the_command_line(scripted_server, tmp_path) -> None:
    scripted_server.script(ttft_s=0.01, itl_s=0.002)
    path = tmp_path / "p.json"
    code = bench(
        *("--base-url", scripted_server.base_url, "--dataset-name", "prefix_repetition"),
        *("--prefix-repetition-prefix-len", "8", "--prefix-repetition-suffix-len", "2"),
        *("--prefix-repetition-num-prefixes", "1", "--prefix-repetition-output-len", "3"),
        *("--result-filename", str(path)),
    )
    assert code == 0
    result = json.loads(path.read_text())
    assert result["input_lens"] == [10, 10, 10] and result["output_lens"] == [3, 3, 3]


def test_parse_metadata_keeps_equals_in_values() -> None:
    assert parse_metadata(["a=b=c", " k = v "]) == {"a": "b=c", "k": "v"}


def test_sweep_takes_the_chat_backend_and_the_key(server, tmp_path, monkeypatch, capsys) -> None:
    server.script(ttft_s=0.005, itl_s=0.002, api_key=KEY)
    monkeypatch.setenv("OPENAI_API_KEY", KEY)
    path = tmp_path / "sweep.json"
    sweep = (
        "bench sweep --backend openai-chat --concurrency-steps 1,2 --requests-per-step 4 "
        "--num-warmups 0 --no-prefill-probe --random-input-len 6 --random-output-len 3 "
        "--disable-tqdm"
    )
    code = main([*sweep.split(), "--base-url", server.base_url, "--result-filename", str(path)])
    assert code in (0, 1), capsys.readouterr()
    stats = server.stats()
    assert stats["unauthorized"] == 0 and stats["chat_requests"] == stats["requests"] == 8
    result = json.loads(path.read_text())
    assert all(step["kv_cache_usage_perc"] is not None for step in result["steps"])
    assert "answered 401" not in capsys.readouterr().err
