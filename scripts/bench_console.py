"""Figures for the console: time to a usable page and bytes transferred on the first (cold-cache) view, in headless
Chromium on this machine, against ``inf-engine serve`` with 10,000 jobs and one job of 50,000 items.

    .venv/bin/python scripts/bench_console.py [--jobs 10000] [--items 50000] [--database postgres|sqlite]
        [--repeat 3]

The data is written straight through the repository functions (the 50,000 items finished, some failed), the server
runs as a user starts it (``python -m app.cli serve`` with an API key), and each view is a fresh browser profile:
sign in through the form, clear the browser cache, then load the page. "Usable" is the moment the first row of the
page's table is in the DOM (an observer installed before the page's own scripts run), in ms from the navigation's
start; bytes are the transfer sizes of the document and every resource the page fetched by then (API calls
included). Goals: under 1,000 ms and under 500 KB.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from app.db import ItemStatus, JobStatus, create_db_engine, make_session_factory, repository, session_scope  # noqa: E402
from app.db.migrate import upgrade  # noqa: E402
from app.db.repository.items import ItemOutcome  # noqa: E402
from app.jobs.ids import new_job_id  # noqa: E402
from scripts.bench_platform import fake_server, scratch_database  # noqa: E402
from tests.support.browser import Browser, chromium  # noqa: E402
from tests.support.cluster import free_port  # noqa: E402

TENANT, KEY = "acme", "sk-bench-console"
PIPELINE, IMPORT_PATH = "sentiment", "app.examples.sentiment:SentimentLabel"
# records when the first row of the page's table appears (run by the browser before any script of the page)
OBSERVER = """
new MutationObserver((_, observer) => {
  if (document.querySelector(window.__usableSelector || '[data-testid=job-row], [data-testid=item-row]')) {
    window.__usableAt = performance.now();
    observer.disconnect();
  }
}).observe(document, {childList: true, subtree: true});
"""


def seed(url: str, jobs: int, items: int) -> str:
    """``jobs`` finished jobs and one of ``items`` items (1 in 20 failed); returns the big job's id."""
    engine = create_db_engine(url)
    sessions = make_session_factory(engine)
    try:
        with session_scope(sessions) as session:
            pipeline = repository.get_or_create_pipeline(session, owner=TENANT, name=PIPELINE,
                                                         import_path=IMPORT_PATH)
            for _ in range(jobs):
                job_id = new_job_id()
                repository.create_job(session, job_id=job_id, pipeline_id=pipeline.id, pipeline_name=PIPELINE,
                                      total_items=0, owner=TENANT)
                repository.finish_job(session, job_id=job_id, status=JobStatus.COMPLETED)
            big = new_job_id()
            repository.create_job(session, job_id=big, pipeline_id=pipeline.id, pipeline_name=PIPELINE,
                                  total_items=items, owner=TENANT)
            rows = [{"custom_id": f"review-{i}", "position": i, "input": {"args": [f"Review number {i}: fine"],
                                                                          "kwargs": {}}} for i in range(items)]
            repository.add_items(session, job_id=big, rows=rows)
            ids = repository.open_item_ids(session, job_id=big)
            outcomes = [
                ItemOutcome(item_id, ItemStatus.FAILED, error={"type": "ValueError", "message": "refused"})
                if n % 20 == 0 else ItemOutcome(item_id, ItemStatus.COMPLETED, output="positive")
                for n, item_id in enumerate(ids)
            ]
            repository.finish_items(session, job_id=big, outcomes=outcomes)
            repository.finish_job(session, job_id=big, status=JobStatus.COMPLETED)
        return big
    finally:
        engine.dispose()


@contextmanager
def serve(db_url: str, base_url: str, tmp: Path) -> Iterator[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("INF_ENGINE_")}
    env.update(INF_ENGINE_DATABASE_URL=db_url, INF_ENGINE_API_KEYS=f'["{TENANT}:{KEY}"]',
               INF_ENGINE_BACKEND="openai", INF_ENGINE_OPENAI_BASE_URL=base_url, INF_ENGINE_LOG_LEVEL="WARNING",
               INF_ENGINE_DATA_DIR=str(tmp / "data"), PYTHONPATH=str(ROOT))
    port = free_port()
    root = f"http://127.0.0.1:{port}"
    with (tmp / "serve.log").open("wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "app.cli", "serve", "--host", "127.0.0.1", "--port",
                                 str(port)], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 120
            while True:
                try:
                    if httpx.get(f"{root}/ready", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline or proc.poll() is not None:
                    raise RuntimeError(f"the server did not start; see {tmp}/serve.log")
                time.sleep(0.3)
            yield root
        finally:
            proc.terminate()
            proc.wait(30)


def first_view(root: str, path: str, selector: str) -> tuple[float, int, int]:
    """(ms to usable, bytes transferred, requests) of one cold view of ``path`` in a fresh browser."""
    with chromium(root) as browser:
        sign_in(browser)
        driver = browser.driver
        driver.execute_cdp_cmd("Network.enable", {})
        driver.execute_cdp_cmd("Network.clearBrowserCache", {})
        driver.execute_cdp_cmd("Page.addScriptToEvaluateOnNewDocument",
                               {"source": f"window.__usableSelector = {selector!r};" + OBSERVER})
        browser.open(path)
        usable = browser.until(lambda: driver.execute_script("return window.__usableAt;"), 30, f"a row at {path}")
        entries: list[dict[str, Any]] = driver.execute_script(
            "const seen = [...performance.getEntriesByType('navigation'),"
            " ...performance.getEntriesByType('resource')];"
            "return seen.filter(e => e.startTime <= window.__usableAt)"
            ".map(e => ({size: e.transferSize || e.encodedBodySize || 0}));"
        )
        return float(usable), sum(int(e["size"]) for e in entries), len(entries)


def sign_in(browser: Browser) -> None:
    browser.open("/console")
    browser.wait_for("#api-key").send_keys(KEY)
    browser.css("#sign-in").click()
    browser.wait_for("[data-testid=nav]")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--jobs", type=int, default=10_000)
    parser.add_argument("--items", type=int, default=50_000)
    parser.add_argument("--database", choices=("postgres", "sqlite"), default="postgres")
    parser.add_argument("--postgres", default="postgresql://postgres@127.0.0.1:5432")
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with ExitStack() as stack:
        tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-console-")))
        if args.database == "postgres":
            db_url = stack.enter_context(scratch_database(args.postgres))
        else:
            db_url = f"sqlite:///{tmp / 'console.db'}"
        upgrade(db_url)
        started = time.perf_counter()
        big = seed(db_url, args.jobs, args.items)
        print(f"seeded {args.jobs} jobs and one of {args.items} items on {args.database} in "
              f"{time.perf_counter() - started:.1f} s")
        root = stack.enter_context(serve(db_url, stack.enter_context(fake_server(0.0)), tmp))
        pages = [("jobs page", "/console/jobs", "[data-testid=job-row]"),
                 (f"job page ({args.items} items)", f"/console/jobs/{big}", "[data-testid=item-row]")]
        print(f"{'first view (cold cache)':<28} {'best ms':>8} {'median ms':>10} {'KB':>7} {'requests':>9}  goal")
        for label, path, selector in pages:
            runs = [first_view(root, path, selector) for _ in range(args.repeat)]
            times = [r[0] for r in runs]
            size = statistics.median(r[1] for r in runs) / 1024
            count = int(statistics.median(r[2] for r in runs))
            print(f"{label:<28} {min(times):>8.0f} {statistics.median(times):>10.0f} {size:>7.1f} {count:>9}  "
                  f"< 1000 ms, < 500 KB")


if __name__ == "__main__":
    main()
