"""scripts/image_context.py: deploy/Dockerfile's COPY lines reproduced without Docker (.dockerignore applied), as
scripts/check_wheel.sh builds the wheel from them; a missing source or a link to nothing fails in one line."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from scripts.image_context import (
    ContextError,
    build_context,
    ignored,
    main,
    parse_copies,
    read_dockerignore,
)

ROOT = Path(__file__).resolve().parents[3]

# deploy/Dockerfile as it was when the image could not create its schema (no COPY of migrations/)
BEFORE = """FROM python:3.11-slim
WORKDIR /srv/inf-engine
RUN pip install "torch==2.13.0"
COPY pyproject.toml README.md ./
COPY app ./app
COPY api ./api
COPY workers ./workers
RUN pip install ".[engine,flower]"
"""


def _context(tmp_path: Path, dockerfile: str, dockerignore: str | None = None) -> Path:
    """A small build context shaped like the repository's, with the migrations link."""
    context = tmp_path / "ctx"
    for name in ("pyproject.toml", "README.md", "app/__init__.py", "app/db/__init__.py", "api/__init__.py",
                 "workers/__init__.py", "migrations/__init__.py", "migrations/env.py", "tests/test_x.py"):
        (context / name).parent.mkdir(parents=True, exist_ok=True)
        (context / name).write_text("")
    os.symlink("../../migrations", context / "app" / "db" / "migrations")
    (context / "deploy").mkdir()
    (context / "deploy" / "Dockerfile").write_text(dockerfile)
    if dockerignore is not None:
        (context / ".dockerignore").write_text(dockerignore)
    return context


def _build(context: Path, tmp_path: Path) -> tuple[str, Path]:
    out = tmp_path / "image"
    return build_context(context / "deploy" / "Dockerfile", context, out, all_files=True), out


# -- the parser -------------------------------------------------------------------------------------------------------
def test_the_repositorys_dockerfile_copies_the_sources_and_the_migrations() -> None:
    copies, workdir = parse_copies((ROOT / "deploy" / "Dockerfile").read_text())
    assert workdir == "/srv/inf-engine"
    sources = {s for c in copies for s in c.sources}
    assert {"pyproject.toml", "README.md", "app", "api", "workers", "migrations"} <= sources
    assert {c.dest for c in copies} >= {"/srv/inf-engine/", "/srv/inf-engine/app", "/srv/inf-engine/migrations"}


def test_continuations_comments_json_form_flags_and_heredocs() -> None:
    text = """# syntax=docker/dockerfile:1
FROM python:3.11 AS build
COPY build-only ./x
FROM python:3.11-slim
WORKDIR /srv
WORKDIR app
COPY --chown=1000:1000 --chmod=644 a.txt \\
  # a comment inside the continuation
  b.txt /etc/
COPY ["with space", "dest/"]
RUN <<EOF
COPY not-an-instruction ./nowhere
EOF
add c.txt d
"""
    copies, workdir = parse_copies(text)
    assert workdir == "/srv/app"
    assert [(c.sources, c.dest) for c in copies] == [
        (("a.txt", "b.txt"), "/etc/"),  # the first stage's COPY is not the image's
        (("with space",), "/srv/app/dest/"),
        (("c.txt",), "/srv/app/d"),
    ]
    assert copies[0].line == 7 and copies[2].instruction == "ADD"


@pytest.mark.parametrize(
    "line",
    ["COPY --from=build /x ./x", "COPY $SRC ./x", "ADD https://example.com/x.tar.gz /x", "COPY only-one"],
)
def test_what_the_check_cannot_reproduce_is_an_error_not_a_silent_skip(line: str) -> None:
    with pytest.raises(ContextError, match=r"^Dockerfile:2: "):
        parse_copies(f"FROM python\n{line}\n")


# -- .dockerignore ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("pattern", "path", "left_out"),
    [
        ("__pycache__", "__pycache__/x.pyc", True),
        ("__pycache__", "app/__pycache__/x.pyc", False),  # a bare name matches at the top only
        ("**/__pycache__", "app/db/__pycache__/x.pyc", True),
        ("**/*.pyc", "x.pyc", True),
        (".venv", ".venv/lib/python3.11/site.py", True),  # a folder's pattern leaves out what it holds
        ("/out", "out/a.jsonl", True),
        ("app/*.txt", "app/a.txt", True),
        ("app/*.txt", "app/db/a.txt", False),
        ("docs/?.md", "docs/a.md", True),
        ("[ab].md", "c.md", False),
    ],
)
def test_dockerignore_patterns_follow_dockers_rules(pattern: str, path: str, left_out: bool) -> None:
    assert ignored(path, read_dockerignore(f"# comment\n\n{pattern}\n")) is left_out


def test_the_last_matching_pattern_wins_and_exceptions_keep_files() -> None:
    patterns = read_dockerignore("*.md\n!README.md\n")
    assert ignored("CHANGES.md", patterns) and not ignored("README.md", patterns)
    assert ignored("README.md", read_dockerignore("!README.md\n*.md\n"))


def test_the_repositorys_dockerignore_keeps_the_junk_out_and_the_sources_in() -> None:
    patterns = read_dockerignore((ROOT / ".dockerignore").read_text())
    for junk in (".venv/bin/python", ".git/HEAD", "app/__pycache__/models.cpython-311.pyc",
                 "app/db/__pycache__/x.pyc", ".mypy_cache/3.11/x.json", ".ruff_cache/x", ".pytest_cache/v/x",
                 "tests/unit/.pytest_cache/x", "out/review-compare.jsonl", ".inf-engine/inf-engine.db",
                 "inf_engine.egg-info/PKG-INFO", "build/lib/app/__init__.py", ".venv-vllm/bin/python"):
        assert ignored(junk, patterns), junk
    for source in ("pyproject.toml", "README.md", "app/db/models.py", "app/db/migrations",
                   "migrations/env.py", "migrations/alembic.ini", "migrations/versions/0001_initial_job_platform_schema.py",
                   "app/engine/kernels/qblock.c", "app/examples/reviews.jsonl", "api/main.py", "workers/tasks.py"):
        assert not ignored(source, patterns), source


# -- the copies -------------------------------------------------------------------------------------------------------
def test_a_missing_copy_source_fails_in_one_line(tmp_path: Path) -> None:
    context = _context(tmp_path, BEFORE + "COPY docs ./docs\n")
    with pytest.raises(ContextError) as failure:
        _build(context, tmp_path)
    message = str(failure.value)
    assert message == (
        "deploy/Dockerfile:9: COPY source 'docs' is not in the build context (missing, or left out by .dockerignore)"
    )


def test_a_source_left_out_by_dockerignore_is_missing(tmp_path: Path) -> None:
    context = _context(tmp_path, BEFORE.replace("COPY workers", "COPY migrations ./migrations\nCOPY workers"),
                       dockerignore="migrations\n")
    with pytest.raises(ContextError, match=r"COPY source 'migrations' is not in the build context"):
        _build(context, tmp_path)


def test_the_dockerfile_before_the_fix_leaves_the_migrations_link_dangling(tmp_path: Path) -> None:
    context = _context(tmp_path, BEFORE)
    with pytest.raises(ContextError) as failure:
        _build(context, tmp_path)
    assert str(failure.value) == (
        "deploy/Dockerfile: the image's /srv/inf-engine/app/db/migrations links to ../../migrations, but no COPY "
        "brings /srv/inf-engine/migrations: copy the context's migrations there"
    )


def test_with_the_migrations_copied_the_link_resolves_and_ignored_files_stay_out(tmp_path: Path) -> None:
    fixed = BEFORE.replace("COPY workers ./workers\n", "COPY workers ./workers\nCOPY migrations ./migrations\n")
    context = _context(tmp_path, fixed, dockerignore="**/__pycache__\n")
    (context / "app" / "__pycache__").mkdir()
    (context / "app" / "__pycache__" / "x.pyc").write_text("")
    workdir, out = _build(context, tmp_path)
    image = out / workdir.lstrip("/")
    assert workdir == "/srv/inf-engine"
    assert (image / "app" / "db" / "migrations").is_symlink()
    assert (image / "app" / "db" / "migrations" / "env.py").is_file()
    assert (image / "pyproject.toml").is_file() and (image / "README.md").is_file()
    assert not (image / "app" / "__pycache__").exists()
    assert not (image / "tests").exists() and not (image / "deploy").exists()  # not copied


def test_the_repository_builds_its_image_context(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """What CI's scripts/check_wheel.sh runs first; the real build follows there."""
    assert main(["--out", str(tmp_path)]) == 0
    image = Path(capsys.readouterr().out.strip())
    assert image == tmp_path / "srv" / "inf-engine"
    assert (image / "app" / "db" / "migrations" / "env.py").is_file()
    assert not list(image.rglob("__pycache__"))


def test_the_command_says_why_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    context = _context(tmp_path, BEFORE)
    assert main(["--dockerfile", str(context / "deploy" / "Dockerfile"), "--context", str(context),
                 "--all-files"]) == 1
    captured = capsys.readouterr()
    assert captured.out == ""
    (line,) = captured.err.splitlines()
    assert line.startswith("image context: deploy/Dockerfile: the image's /srv/inf-engine/app/db/migrations links")
