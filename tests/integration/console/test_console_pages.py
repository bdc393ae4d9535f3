"""The console in a real browser (headless chromium): what a team does with it, on a server with two tenants.

Screenshots of every page land in ``out/console/`` (see tests/support/browser.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from selenium.webdriver.support.ui import Select

from tests.support.browser import Browser
from tests.support.console import (
    ACME,
    GLOBEX,
    Console,
    schedule_with_regression,
    sign_in,
    signed_in,
    submit_job,
    trained,
)
from tests.support.training import DATASET


def _rows(browser: Browser, testid: str) -> list[Any]:
    return browser.all(f"[data-testid={testid}]")


def _no_errors(browser: Browser) -> None:
    """No script error and no refused load (a CSP violation, a 404 asset) in the browser's console."""
    errors = [e for e in browser.console_errors() if "favicon" not in e and "401" not in e]
    assert errors == []


def test_sign_in_refuses_a_wrong_key_and_keeps_the_key_for_the_session_only(console: Console) -> None:
    with signed_in(console.root, None) as browser:
        browser.open("/console")
        browser.wait_for("#api-key").send_keys("sk-not-a-key")
        browser.shot("sign-in")
        browser.css("#sign-in").click()
        assert "not accepted" in browser.text("#sign-in-error")
        browser.shot("sign-in-wrong-key")
        field = browser.css("#api-key")
        assert field.get_attribute("type") == "password"
        field.clear()
        field.send_keys(ACME)
        browser.css("#sign-in").click()
        browser.wait_for("[data-testid=nav]")
        assert browser.driver.execute_script("return window.localStorage.length;") == 0
        assert browser.driver.execute_script("return window.sessionStorage.length;") >= 1
        assert browser.driver.current_url.endswith("/console/jobs")


def test_a_submitted_jobs_progress_reaches_100_percent_without_a_reload(console: Console) -> None:
    with console.browser() as browser:
        browser.open("/console/jobs")
        browser.wait_for("[data-testid=jobs-table]")
        browser.driver.execute_script("window.__samePage = true;")
        job_id = submit_job(console, [f"Great product number {i}" for i in range(40)])
        bar = f"[data-testid=job-row][data-job-id='{job_id}'] [data-testid=job-progress]"
        seen: list[int] = []

        def done() -> bool:
            value = int(float(browser.css(bar).get_attribute("value") or 0))
            seen.append(value)
            return value == int(float(browser.css(bar).get_attribute("max") or -1))

        browser.wait_for(bar, timeout=20)
        browser.until(done, 60, "the job's progress bar at 100%")
        browser.shot("jobs-progress-done")
        assert browser.driver.execute_script("return window.__samePage === true;")  # no reload happened
        assert min(seen) < 40  # it was seen moving, not only finished
        _no_errors(browser)


def test_a_jobs_items_failures_first_and_its_trace(console: Console) -> None:
    reviews = ["Great phone", "It will explode", "Awful support", "Lovely screen", "explode again", "Great"]
    job_id = submit_job(console, reviews)
    console.wait(console.acme, f"/v1/jobs/{job_id}")
    with console.browser() as browser:
        browser.open(f"/console/jobs/{job_id}")
        browser.until(lambda: len(_rows(browser, "item-row")) == 6, 20, "six item rows")
        browser.wait_for("[data-testid=trace-waterfall]")
        browser.shot("job")
        browser.css("[data-testid=failures-first]").click()
        browser.until(lambda: _rows(browser, "item-row")[0].get_attribute("data-status") == "failed", 20,
                      "a failed item first")
        statuses = [row.get_attribute("data-status") for row in _rows(browser, "item-row")]
        assert statuses[:2] == ["failed", "failed"] and statuses.count("failed") == 2
        spans = int(browser.css("[data-testid=trace-waterfall]").get_attribute("data-spans") or 0)
        assert spans >= 4  # a bar per node that ran (the failed calls' nodes too, when they have a row)
        browser.shot("job-failures-first")
        _no_errors(browser)


def test_compare_two_evaluation_runs_item_by_item(console: Console) -> None:
    made = trained(console)
    before, after = made["evaluations"]  # version 1 scores 0, version 2 scores 1
    with console.browser() as browser:
        browser.open("/console/evaluations")
        browser.until(lambda: len(_rows(browser, "evaluation-row")) >= 2, 20, "the evaluation runs")
        browser.shot("evaluations")
        browser.open(f"/console/evaluations/{after['id']}")
        Select(browser.wait_for("[data-testid=baseline-select]")).select_by_value(before["id"])
        browser.until(lambda: len(_rows(browser, "compare-row")) == 4, 20, "four compared examples")
        browser.until(lambda: all(r.get_attribute("data-delta") == "1" for r in _rows(browser, "compare-row")),
                      20, "every example improved")
        browser.css("[data-testid=diff-button]").click()
        diff = browser.wait_for("[data-testid=example-diff]")
        browser.until(lambda: diff.find_elements("css selector", "ins, del"), 20, "a word diff")
        browser.shot("evaluation-compare")
        # the other way round, regressions first: every example regressed against the better run
        browser.open(f"/console/evaluations/{before['id']}")
        Select(browser.wait_for("[data-testid=baseline-select]")).select_by_value(after["id"])
        browser.until(lambda: len(_rows(browser, "compare-row")) == 4
                      and all(r.get_attribute("data-delta") == "-1" for r in _rows(browser, "compare-row")),
                      20, "every example regressed")
        browser.shot("evaluation-regressions")
        _no_errors(browser)


def test_a_schedules_chart_marks_its_regression_and_links_each_run(console: Console) -> None:
    schedule = schedule_with_regression(console)["schedule"]
    with console.browser() as browser:
        browser.open(f"/console/schedules/{schedule['id']}")
        chart = browser.wait_for("[data-testid=schedule-chart]")
        browser.until(lambda: chart.find_elements("css selector", "canvas"), 20, "the chart drawn")
        browser.until(lambda: len(_rows(browser, "run-row")) == 3, 20, "three runs")
        regressed = browser.all("[data-testid=run-row][data-regressed=true]")
        assert len(regressed) == 1
        assert regressed[0] == _rows(browser, "run-row")[2]
        browser.shot("schedule")
        run_id = regressed[0].get_attribute("data-evaluation-id")
        regressed[0].find_element("css selector", "a").click()
        browser.until(lambda: browser.driver.current_url.endswith(f"/console/evaluations/{run_id}"), 20,
                      "the regressed run's page")
        browser.wait_for("[data-testid=evaluation-summary]")
        _no_errors(browser)


def test_a_trainings_candidates_steps_and_prompt_diffs(console: Console) -> None:
    training = trained(console)["training"]  # the default optimizer: candidates scored and selected
    with console.browser() as browser:
        browser.open(f"/console/trainings/{training['id']}")
        browser.wait_for("[data-testid=training-chart]")
        browser.until(lambda: browser.all("[data-testid=candidate-row][data-best=true][data-accepted=true]"), 20,
                      "the accepted best candidate")
        assert len(_rows(browser, "candidate-row")) == len(training["candidates"])
        update = browser.wait_for("[data-testid=update-diff]")
        browser.until(lambda: update.find_elements("css selector", "ins"), 20, "the new prompt's words marked")
        browser.shot("training")
        _no_errors(browser)


def test_an_sfa_trainings_update_shows_the_feedback_that_caused_it(console: Console) -> None:
    trained(console)
    console.acme.post("/v1/pipelines/sentiment/parameters/versions/1/activate")  # a prompt with something to fix
    made = console.acme.post("/v1/trainings", json={"pipeline": "sentiment", "dataset": DATASET, "metric": "exact",
                                                     "batch_size": 4, "optimizer": {"type": "sfa"}})
    assert made.status_code == 201, made.text
    training = console.wait(console.acme, f"/v1/trainings/{made.json()['id']}")
    with console.browser() as browser:
        browser.open(f"/console/trainings/{training['id']}")
        update = browser.wait_for("[data-testid=update-diff]")
        assert "Reply with the label only." in update.text  # the aggregated feedback behind the rewrite
        assert browser.all("[data-testid=candidate-row]") == []  # SFA keeps no candidates
        browser.shot("training-sfa")
    console.acme.post("/v1/pipelines/sentiment/parameters/versions/2/activate")  # as the other tests expect


def test_diff_two_prompt_versions_and_activate_one(console: Console) -> None:
    trained(console)
    with console.browser() as browser:
        browser.open("/console/pipelines/sentiment")
        browser.until(lambda: len(_rows(browser, "version-row")) >= 2, 20, "the versions")
        Select(browser.css("[data-testid=from-select]")).select_by_value("1")
        Select(browser.css("[data-testid=to-select]")).select_by_value("2")
        diff = browser.wait_for("[data-testid=version-diff]")
        browser.until(lambda: diff.find_elements("css selector", "ins") and diff.find_elements("css selector", "del"),
                      20, "the versions' diff")
        browser.shot("pipeline-diff")
        browser.css("[data-testid=activate-button][data-version='1']").click()
        browser.wait_for("[data-testid=activate-dialog]")
        browser.shot("pipeline-activate-dialog")
        browser.css("[data-testid=activate-confirm]").click()
        browser.until(lambda: browser.css("[data-testid=version-row][data-version='1']")
                      .get_attribute("data-active") == "true", 20, "version 1 active")
        versions = console.acme.get("/v1/pipelines/sentiment/parameters/versions").json()
        assert versions["active_version"] == 1
        console.acme.post("/v1/pipelines/sentiment/parameters/versions/2/activate")  # as the other tests expect
        _no_errors(browser)


def test_another_tenants_key_sees_none_of_its_data(console: Console) -> None:
    made = trained(console)
    job_id = submit_job(console, ["Great phone"])
    with console.browser(GLOBEX) as browser:
        browser.open("/console/jobs")
        browser.wait_for("[data-testid=jobs-table]")
        assert _rows(browser, "job-row") == []
        browser.open(f"/console/jobs/{job_id}")
        assert f"no job '{job_id}'" in browser.text("[role=alert]").lower()
        assert browser.all("[data-testid=job-header]") == [] and browser.all("[data-testid=item-row]") == []
        browser.open("/console/evaluations")
        browser.wait_for("[data-testid=evaluations-table]")
        assert _rows(browser, "evaluation-row") == []
        browser.open(f"/console/trainings/{made['training']['id']}")
        assert "no training" in browser.text("[role=alert]").lower()
        assert browser.all("[data-testid=update-diff]") == []
        browser.shot("other-tenant")
        page = browser.driver.page_source
        assert job_id not in page.replace(f"/console/jobs/{job_id}", "")


def test_pages_are_readable_at_a_phone_width_and_fetch_nothing_from_elsewhere(console: Console) -> None:
    made = trained(console)
    with console.browser(width=390, height=844) as browser:
        for name, path, ready in [("jobs", "/console/jobs", "jobs-table"),
                                  ("evaluation", f"/console/evaluations/{made['evaluations'][1]['id']}",
                                   "evaluation-summary"),
                                  ("pipeline", "/console/pipelines/sentiment", "versions-table")]:
            browser.open(path)
            browser.wait_for(f"[data-testid={ready}]")
            browser.shot(f"phone-{name}")
            width = browser.driver.execute_script("return document.documentElement.scrollWidth;")
            assert width <= 392, f"{path} scrolls sideways at a phone width ({width} px)"
        urls = browser.driver.execute_script(
            "return performance.getEntriesByType('resource').map(e => e.name);")
        assert urls and all(url.startswith(console.root) for url in urls)
        _no_errors(browser)


def test_a_server_without_keys_opens_the_console_directly(console: Console, tmp_path: Path) -> None:
    """The keyed server asks for a key; one without keys (its own SQLite database) opens at once."""
    from api.main import create_app
    from app.settings import Settings
    from tests.support.browser import chromium
    from tests.support.server_helpers import ServerThread
    from tests.support.serving_fakes import FakeBackend

    settings = Settings(data_dir=tmp_path, api_keys=[], jobs_poll_interval=0.05)
    with ServerThread(create_app(settings, backend=FakeBackend())) as server, chromium(server.root) as browser:
        browser.open("/console")
        browser.wait_for("[data-testid=nav]")
        assert browser.all("#api-key") == []
        browser.wait_for("[data-testid=jobs-table]")
    with chromium(console.root) as browser:
        sign_in(browser, ACME)


def test_batches_and_files_with_their_counts_and_downloads(console: Console) -> None:
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "fake-model", "messages": [{"role": "user", "content": f"hi {i}"}]}} for i in range(3)]
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    uploaded = console.acme.post("/v1/files", files={"file": ("batch.jsonl", content, "application/jsonl")},
                                 data={"purpose": "batch"})
    assert uploaded.status_code == 200, uploaded.text
    made = console.acme.post("/v1/batches", json={"input_file_id": uploaded.json()["id"],
                                                  "endpoint": "/v1/chat/completions", "completion_window": "24h"})
    assert made.status_code == 200, made.text
    batch = console.wait(console.acme, f"/v1/batches/{made.json()['id']}")
    with console.browser() as browser:
        browser.open("/console/batches")
        row = browser.wait_for(f"[data-testid=batch-row][data-batch-id='{batch['id']}']")
        browser.shot("batches")
        counts = batch["request_counts"]
        assert counts == {"total": 3, "completed": 3, "failed": 0} and "3 / 3" in row.text
        for kind, file_id in (("input", batch["input_file_id"]), ("output", batch["output_file_id"]),
                              ("errors", batch["error_file_id"])):
            buttons = row.find_elements("css selector", f"[data-testid=download-{kind}]")
            assert bool(buttons) == bool(file_id), (kind, file_id)
        browser.open("/console/files")
        browser.wait_for(f"[data-testid=file-row][data-file-id='{uploaded.json()['id']}']")
        browser.shot("files")
        _no_errors(browser)
