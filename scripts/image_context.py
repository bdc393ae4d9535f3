"""What the image's ``COPY`` lines put into it, reproduced without Docker (scripts/check_wheel.sh builds the wheel
from it, so CI sees what the image sees).

``python scripts/image_context.py [--dockerfile deploy/Dockerfile] [--context .] [--out DIR]`` reads the
Dockerfile's ``COPY``/``ADD`` instructions (JSON or plain form, line continuations, heredocs skipped), takes the
build context as Docker sends it (``.dockerignore`` applied, with Docker's pattern rules: ``**``, ``!``
exceptions, a pattern that matches a directory excludes what is inside it), and copies exactly those sources to
their destinations under DIR (the image's ``/`` becomes DIR; symbolic links stay links, as Docker keeps them).
It prints the final stage's ``WORKDIR`` inside DIR, the folder ``pip install .`` runs in.

It fails with one line (exit status 1) when a source is missing from the context (absent, or excluded by
``.dockerignore``) or when a link the copies bring points at nothing inside the image (the migrations'
``app/db/migrations -> ../../migrations`` without ``COPY migrations``). Without ``--out`` it only checks.

The context's files are those a clone has when the context is a git work tree (tracked, and new files git does
not ignore), so local leftovers do not hide a missing ``COPY``; ``--all-files`` takes the whole folder instead,
as a local ``docker build`` does.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import os
import posixpath
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

GLOB_CHARS = set("*?[")


class ContextError(Exception):
    """A COPY the image build would fail on, or a copy that leaves the image broken: one line."""


@dataclass(frozen=True)
class Copy:
    """One COPY (or ADD) of the final stage: its sources (relative to the context) and destination (absolute)."""

    line: int
    sources: tuple[str, ...]
    dest: str
    instruction: str = "COPY"


# -- the Dockerfile -------------------------------------------------------------------------------------------------
def _instructions(text: str) -> list[tuple[int, str]]:
    """(first line number, instruction text) with continuations joined, comments and heredoc bodies dropped."""
    out: list[tuple[int, str]] = []
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        raw = lines[i]
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            i += 1
            continue
        start = i + 1
        parts = []
        while True:
            body = lines[i].rstrip()
            if body.endswith("\\"):
                parts.append(body[:-1])
                i += 1
                # comment and blank lines inside a continued instruction are dropped, as Docker does
                while i < len(lines) and (not lines[i].strip() or lines[i].strip().startswith("#")):
                    i += 1
                if i >= len(lines):
                    break
                continue
            parts.append(body)
            i += 1
            break
        instruction = " ".join(p.strip() for p in parts)
        out.append((start, instruction))
        for marker in re.findall(r"<<-?\s*[\"']?([A-Za-z_][A-Za-z0-9_]*)[\"']?", instruction):
            while i < len(lines) and lines[i].strip() != marker:  # the heredoc's body is data, not instructions
                i += 1
            i += 1
    return out


def _arguments(rest: str, where: str) -> tuple[list[str], list[str]]:
    """(flags, paths) of a COPY/ADD: ``--flag=value`` words first, then the JSON form or plain words."""
    flags = []
    rest = rest.strip()
    while rest.startswith("--"):
        flag, _, rest = rest.partition(" ")
        flags.append(flag)
        rest = rest.strip()
    if rest.startswith("["):
        try:
            words = json.loads(rest)
        except json.JSONDecodeError:
            raise ContextError(f"{where}: cannot read the JSON form {rest!r}") from None
        return flags, [str(w) for w in words]
    return flags, shlex.split(rest, posix=True)


def parse_copies(text: str, dockerfile: str = "Dockerfile") -> tuple[list[Copy], str]:
    """The final stage's COPY/ADD instructions from the build context, and its last WORKDIR (absolute)."""
    copies: list[Copy] = []
    workdir = "/"
    for line, instruction in _instructions(text):
        keyword, _, rest = instruction.partition(" ")
        keyword = keyword.upper()
        where = f"{dockerfile}:{line}"
        if keyword == "FROM":  # a new stage: only the last one is the image
            copies, workdir = [], "/"
        elif keyword == "WORKDIR":
            if "$" in rest:
                raise ContextError(f"{where}: WORKDIR with a variable is not supported by this check: {rest.strip()}")
            workdir = posixpath.normpath(posixpath.join(workdir, rest.strip()))
        elif keyword in {"COPY", "ADD"}:
            flags, words = _arguments(rest, where)
            if any(f.startswith("--from") for f in flags):
                raise ContextError(f"{where}: {keyword} --from (another stage or image) is not supported by this check")
            if any(f.startswith("--parents") for f in flags):
                raise ContextError(f"{where}: {keyword} --parents is not supported by this check")
            if len(words) < 2:
                raise ContextError(f"{where}: {keyword} needs a source and a destination: {instruction}")
            *sources, dest = words
            if any("$" in w for w in words):
                raise ContextError(f"{where}: {keyword} with a variable is not supported by this check: {instruction}")
            if keyword == "ADD" and any(re.match(r"^[a-z]+://", s) or s.startswith("git@") for s in sources):
                raise ContextError(f"{where}: ADD from a URL is not supported by this check: {instruction}")
            absolute = posixpath.normpath(posixpath.join(workdir, dest))
            if dest.endswith("/") or dest in {".", "./"}:
                absolute = absolute.rstrip("/") + "/"
            copies.append(Copy(line, tuple(sources), absolute, keyword))
    return copies, workdir


# -- .dockerignore ----------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class _Pattern:
    regex: re.Pattern[str]
    exclusion: bool  # a '!' line: what it matches is kept


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    """Docker's (moby/patternmatcher) pattern as a regular expression: ``**`` any number of path segments, ``*``
    and ``?`` within one segment, ``[...]`` a class."""
    out = "^"
    i = 0
    while i < len(pattern):
        ch = pattern[i]
        if ch == "*":
            if pattern[i : i + 2] == "**":
                i += 2
                if pattern[i : i + 1] == "/":  # '**/' : zero or more whole segments
                    i += 1
                    out += "(.*/)?"
                else:
                    out += ".*"
                continue
            out += "[^/]*"
        elif ch == "?":
            out += "[^/]"
        elif ch == "[":
            end = pattern.find("]", i + 1)
            if end == -1:
                out += re.escape(ch)
            else:
                body = pattern[i + 1 : end]
                out += "[" + ("^" + body[1:] if body.startswith("!") else body) + "]"
                i = end
        elif ch == "\\" and i + 1 < len(pattern):
            i += 1
            out += re.escape(pattern[i])
        else:
            out += re.escape(ch)
        i += 1
    return re.compile(out + "$")


def read_dockerignore(text: str) -> list[_Pattern]:
    patterns = []
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        exclusion = line.startswith("!")
        if exclusion:
            line = line[1:].strip()
        line = posixpath.normpath(line).lstrip("/")
        if line in {"", "."}:
            continue
        patterns.append(_Pattern(_pattern_regex(line), exclusion))
    return patterns


def ignored(path: str, patterns: list[_Pattern]) -> bool:
    """Whether Docker leaves ``path`` (relative, '/'-separated) out of the context: the last pattern that matches
    the path or one of its parent folders decides."""
    parts = path.split("/")
    candidates = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    result = False
    for pattern in patterns:
        if pattern.regex.match(path) or any(pattern.regex.match(c) for c in candidates[:-1]):
            result = not pattern.exclusion
    return result


# -- the context and the copies ---------------------------------------------------------------------------------------
def context_files(context: Path, all_files: bool = False) -> list[str]:
    """The context's files and links ('/'-separated, relative), before .dockerignore."""
    if not all_files:
        listed = subprocess.run(
            ["git", "-C", str(context), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            capture_output=True,
        )
        if listed.returncode == 0:
            names = [n for n in listed.stdout.decode().split("\0") if n]
            return sorted(n for n in set(names) if os.path.lexists(context / n))
    files = []
    for folder, dirs, names in os.walk(context):
        base = Path(folder).relative_to(context)
        for name in names + [d for d in dirs if (Path(folder) / d).is_symlink()]:
            files.append((base / name).as_posix())
    return sorted(files)


def _resolve_in_context(context: Path, source: str) -> str:
    """A source that is itself a link is followed (Docker follows the source path, not the links inside it)."""
    path = context / source
    if path.is_symlink():
        target = Path(os.path.realpath(path))
        try:
            return target.relative_to(context.resolve()).as_posix()
        except ValueError:
            raise ContextError(f"COPY source {source!r} is a link out of the build context") from None
    return source


def plan(copies: list[Copy], files: list[str], context: Path, dockerfile: str = "Dockerfile") -> dict[str, str]:
    """{image path (absolute): context path} for every file or link the copies bring."""
    kept = set(files)
    placed: dict[str, str] = {}
    for copy in copies:
        where = f"{dockerfile}:{copy.line}"
        matched: list[str] = []
        for source in copy.sources:
            clean = posixpath.normpath(source).lstrip("/")
            if clean.startswith(".."):
                raise ContextError(f"{where}: {copy.instruction} source {source!r} is outside the build context")
            if any(c in GLOB_CHARS for c in clean):
                roots = sorted({"/".join(f.split("/")[: clean.count("/") + 1]) for f in kept})
                hits = [r for r in roots if fnmatch.fnmatchcase(r, clean)]
            else:
                hits = [clean] if clean == "." or clean in kept or any(f.startswith(clean + "/") for f in kept) else []
            if not hits:
                raise ContextError(
                    f"{where}: {copy.instruction} source {source!r} is not in the build context "
                    "(missing, or left out by .dockerignore)"
                )
            matched += hits
        into_folder = copy.dest.endswith("/") or len(matched) > 1 or len(copy.sources) > 1
        for source in matched:
            resolved = _resolve_in_context(context, source) if source != "." else "."
            if resolved in kept and not (context / resolved).is_dir():  # a file (or a link to a file)
                name = copy.dest + posixpath.basename(source) if into_folder else copy.dest
                placed[posixpath.normpath(name)] = resolved
                continue
            prefix = "" if resolved == "." else resolved + "/"
            inside = [f for f in kept if f.startswith(prefix)]
            if not inside:
                raise ContextError(f"{where}: {copy.instruction} source {source!r} is an empty folder in the build context")
            for f in inside:  # a folder: its contents go into the destination
                placed[posixpath.normpath(posixpath.join(copy.dest, f[len(prefix):]))] = f
    return placed


def reproduce(placed: dict[str, str], context: Path, out: Path) -> None:
    for image_path, source in sorted(placed.items()):
        target = out / image_path.lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        origin = context / source
        if target.is_symlink() or target.is_file():
            target.unlink()
        if origin.is_symlink():
            os.symlink(os.readlink(origin), target)
        else:
            shutil.copy2(origin, target)


def dangling_links(out: Path) -> list[tuple[str, str, str]]:
    """(image path, link text, what it points at in the image) of every link under ``out`` that points at
    nothing inside the image."""
    broken = []
    for folder, dirs, names in os.walk(out):
        for name in dirs + names:
            path = Path(folder) / name
            if not path.is_symlink():
                continue
            link = os.readlink(path)
            image_path = "/" + path.relative_to(out).as_posix()
            target = posixpath.normpath(posixpath.join(posixpath.dirname(image_path), link))
            if not (out / target.lstrip("/")).exists():
                broken.append((image_path, link, target))
    return sorted(broken)


def build_context(dockerfile: Path, context: Path, out: Path, *, all_files: bool = False) -> str:
    """Reproduce the image's copies under ``out``; the final WORKDIR (absolute, inside the image)."""
    shown = os.path.relpath(dockerfile, context) if dockerfile.is_relative_to(context) else str(dockerfile)
    copies, workdir = parse_copies(dockerfile.read_text(), shown)
    ignore_file = context / ".dockerignore"
    patterns = read_dockerignore(ignore_file.read_text()) if ignore_file.is_file() else []
    files = [f for f in context_files(context, all_files) if not ignored(f, patterns)]
    placed = plan(copies, files, context, shown)
    reproduce(placed, context, out)
    for image_path, link, target in dangling_links(out):
        source = placed.get(image_path, image_path)
        wanted = posixpath.normpath(posixpath.join(posixpath.dirname(source), link))
        raise ContextError(
            f"{shown}: the image's {image_path} links to {link}, but no COPY brings {target}"
            + (f" (the context's {wanted} is left out by .dockerignore)" if ignored(wanted, patterns)
               else f": copy the context's {wanted} there")
        )
    return workdir


def main(argv: list[str] | None = None) -> int:
    root = Path(__file__).resolve().parents[1]
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dockerfile", type=Path, default=root / "deploy" / "Dockerfile")
    parser.add_argument("--context", type=Path, default=root)
    parser.add_argument("--out", type=Path, help="where to reproduce the image's files (default: check only)")
    parser.add_argument("--all-files", action="store_true", help="the whole folder, not what a clone has")
    args = parser.parse_args(argv)
    context = args.context.resolve()
    try:
        if args.out is not None:
            args.out.mkdir(parents=True, exist_ok=True)
            workdir = build_context(args.dockerfile.resolve(), context, args.out.resolve(), all_files=args.all_files)
        else:
            with tempfile.TemporaryDirectory() as scratch:
                workdir = build_context(args.dockerfile.resolve(), context, Path(scratch), all_files=args.all_files)
    except ContextError as exc:
        print(f"image context: {exc}", file=sys.stderr)
        return 1
    out = args.out.resolve() if args.out is not None else None
    print(str(out / workdir.lstrip("/")) if out is not None else str(PurePosixPath(workdir)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
