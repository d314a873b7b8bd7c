"""The container image's invariants, read from the Dockerfile and .dockerignore.

There is no container engine in CI, so the image is never built here. These tests parse
the Dockerfile (instructions, line continuations, stages) and check what a reviewer would
otherwise check by eye: a named builder stage, a slim Python base, a numeric non-root
user, the console script as the exec-form entry point, no build tools or installer in the
final stage, no secret-looking build arguments, a build context that holds what the
builder copies and keeps out the repository's other files and anything secret-looking.
See docs/container.md.
"""

from __future__ import annotations

import json
import os
import posixpath
import re
import shlex
import subprocess
import sys
import tomllib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from rolegate_cli.main import _parser

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"
EXAMPLE_MANIFESTS = ROOT / "examples" / "manifests"

SLIM_PYTHON = re.compile(
    r"python:(?P<major>\d+)\.(?P<minor>\d+)-slim(?:-[a-z]+)?(?:@sha256:[0-9a-f]{64})?"
)
SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL", re.IGNORECASE)
# Package managers, compilers and build tools, as whole words of a shell command.
BUILD_TOOL = re.compile(
    r"(?<![\w.-])(apt-get|apt|apk|dnf|yum|microdnf|gcc|g\+\+|cc|clang|make|build-essential)"
    r"(?![\w.-])"
)
PIP_INSTALL = re.compile(r"\bpip3?\s+install\b")


# A small Dockerfile parser -----------------------------------------------------------


@dataclass(frozen=True)
class Instruction:
    keyword: str  # upper-cased: RUN, COPY, ...
    args: str  # everything after the keyword, continuation lines joined by a space
    line: int  # where the instruction starts


@dataclass
class Stage:
    base: str  # the image, global ARG defaults substituted
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def env(self) -> dict[str, str]:
        values: dict[str, str] = {}
        for instruction in self.all("ENV"):
            values.update(key_values(instruction.args))
        return values


def parse_instructions(text: str) -> list[Instruction]:
    """Instructions in order. A line ending in a backslash continues on the next one;
    comment and blank lines are dropped, also inside a continuation (as Docker does)."""
    instructions: list[Instruction] = []
    parts: list[str] = []
    start = 0
    for number, raw in enumerate(text.splitlines(), start=1):
        stripped = raw.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if "<<" in raw and re.search(r"<<-?\s*['\"]?[A-Za-z_]+", raw):
            # A deliberate limit: a heredoc would hide instructions from these checks.
            raise ValueError(
                f"line {number}: write this RUN without a heredoc, which these checks cannot read"
            )
        if not parts:
            start = number
        body = raw.rstrip()
        if body.endswith("\\"):
            parts.append(body[:-1])
            continue
        parts.append(body)
        instructions.append(_instruction(" ".join(parts), start))
        parts = []
    if parts:
        instructions.append(_instruction(" ".join(parts), start))
    return instructions


def _instruction(joined: str, line: int) -> Instruction:
    keyword, _, args = joined.strip().partition(" ")
    return Instruction(keyword=keyword.upper(), args=args.strip(), line=line)


def parse_stages(text: str) -> tuple[dict[str, str], list[Stage]]:
    """The global ARG defaults (before the first FROM) and the stages."""
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for instruction in parse_instructions(text):
        if instruction.keyword == "FROM":
            words = [w for w in shlex.split(instruction.args) if not w.startswith("--")]
            name = words[2] if len(words) == 3 and words[1].lower() == "as" else None
            stages.append(Stage(base=substitute(words[0], global_args), name=name))
        elif not stages:
            assert instruction.keyword == "ARG", f"line {instruction.line}: before any FROM"
            global_args.update(key_values(instruction.args))
        else:
            stages[-1].instructions.append(instruction)
    return global_args, stages


def substitute(text: str, variables: Mapping[str, str]) -> str:
    def value(match: re.Match[str]) -> str:
        return variables.get(match.group(1) or match.group(2), "")

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", value, text)


def key_values(args: str) -> dict[str, str]:
    """`ENV`/`ARG`/`LABEL` arguments: `K=V K2="V 2"`, a bare `K` (ARG), or `K V` (legacy)."""
    words = shlex.split(args)
    if len(words) >= 2 and "=" not in words[0]:
        return {words[0]: " ".join(words[1:])}
    pairs = (word.partition("=") for word in words)
    return {key: value for key, _, value in pairs}


def exec_form(args: str) -> list[str] | None:
    """The JSON array of an exec-form instruction, or None for the shell form."""
    try:
        value = json.loads(args)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, list) and all(isinstance(v, str) for v in value) else None


def copy_parts(instruction: Instruction) -> tuple[dict[str, str], list[str], str]:
    """A COPY's flags (`--from=builder` as {"from": "builder"}), sources and destination."""
    words = shlex.split(instruction.args)
    flags = dict(w[2:].partition("=")[::2] for w in words if w.startswith("--"))
    paths = [w for w in words if not w.startswith("--")]
    return flags, paths[:-1], paths[-1]


# A .dockerignore matcher (moby/patternmatcher semantics) -----------------------------


@dataclass(frozen=True)
class IgnoreRule:
    pattern: re.Pattern[str]
    negated: bool


def parse_dockerignore(lines: Sequence[str]) -> list[IgnoreRule]:
    rules: list[IgnoreRule] = []
    for raw in lines:
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        text = line[1:].strip() if negated else line
        # Docker cleans each pattern like a path: no leading "/" or "./", no trailing "/".
        text = posixpath.normpath(text).lstrip("/")
        rules.append(IgnoreRule(pattern=re.compile(_glob_regex(text)), negated=negated))
    return rules


def _glob_regex(glob: str) -> str:
    """Go's filepath.Match (`*` and `?` stop at "/", `[...]` classes) plus `**`."""
    out: list[str] = []
    i = 0
    while i < len(glob):
        char = glob[i]
        if glob.startswith("**/", i):
            out.append("(?:.*/)?")
            i += 3
            continue
        if glob.startswith("**", i):
            out.append(".*")
            i += 2
            continue
        if char == "*":
            out.append("[^/]*")
        elif char == "?":
            out.append("[^/]")
        elif char == "[":
            end = glob.index("]", i + 1)
            body = glob[i + 1 : end]
            negate = body[:1] in ("^", "!")
            out.append("[" + ("^" if negate else "") + body[1 if negate else 0 :] + "]")
            i = end
        elif char == "\\":
            i += 1
            out.append(re.escape(glob[i]))
        else:
            out.append(re.escape(char))
        i += 1
    return "".join(out)


def is_ignored(rules: Sequence[IgnoreRule], path: str) -> bool:
    """Whether `path` (relative, "/"-separated) is left out of the build context: the
    last rule that matches it or one of its parent directories decides."""
    parts = path.split("/")
    candidates = ["/".join(parts[:n]) for n in range(len(parts), 0, -1)]
    ignored = False
    for rule in rules:
        if any(rule.pattern.fullmatch(candidate) for candidate in candidates):
            ignored = not rule.negated
    return ignored


# The repository's files ---------------------------------------------------------------


@cache
def pyproject() -> dict[str, Any]:
    with (ROOT / "pyproject.toml").open("rb") as file:
        return tomllib.load(file)


@cache
def stages() -> list[Stage]:
    return parse_stages(DOCKERFILE.read_text(encoding="utf-8"))[1]


def builder() -> Stage:
    named = [stage for stage in stages() if stage.name == "builder"]
    assert len(named) == 1, "exactly one stage is named builder"
    return named[0]


def final() -> Stage:
    return stages()[-1]


@cache
def ignore_rules() -> list[IgnoreRule]:
    return parse_dockerignore(DOCKERIGNORE.read_text(encoding="utf-8").splitlines())


def builder_sources() -> list[str]:
    sources: list[str] = []
    for instruction in builder().all("COPY"):
        flags, paths, _ = copy_parts(instruction)
        if "from" not in flags:
            sources.extend(paths)
    return sources


def files_under(path: Path) -> Iterator[Path]:
    if path.is_file():
        yield path
        return
    for child in sorted(path.rglob("*")):
        if child.is_file() and "__pycache__" not in child.parts and child.suffix != ".pyc":
            yield child


def run_text(stage: Stage) -> str:
    return "\n".join(i.args for i in stage.all("RUN"))


# The parsers themselves ---------------------------------------------------------------


def test_parser_joins_continuations_skips_comments_and_splits_stages() -> None:
    text = "\n".join(
        [
            "# syntax=docker/dockerfile:1",
            "ARG BASE=python:3.11-slim",
            "FROM ${BASE} AS builder",
            "RUN echo one \\",
            "    # a comment inside a continuation",
            "",
            "    && echo two",
            "FROM --platform=linux/amd64 $BASE",
            "ENV A=1 \\",
            '    B="two words"',
            'ENTRYPOINT ["rolegate"]',
            "CMD --help",
        ]
    )
    global_args, parsed = parse_stages(text)
    assert global_args == {"BASE": "python:3.11-slim"}
    assert [(s.base, s.name) for s in parsed] == [
        ("python:3.11-slim", "builder"),
        ("python:3.11-slim", None),
    ]
    (run,) = parsed[0].all("RUN")
    assert run.line == 4
    assert " ".join(run.args.split()) == "echo one && echo two"
    assert parsed[1].env() == {"A": "1", "B": "two words"}
    assert exec_form(parsed[1].all("ENTRYPOINT")[0].args) == ["rolegate"]
    assert exec_form(parsed[1].all("CMD")[0].args) is None


def test_dockerignore_matcher_follows_docker_semantics() -> None:
    rules = parse_dockerignore(["*", "!keep/", "**/*.key", "!keep/public.key", "/abs/"])
    assert is_ignored(rules, "a.txt")
    assert is_ignored(rules, "other/deep/file.py")
    assert not is_ignored(rules, "keep/module.py")
    assert not is_ignored(rules, "keep/sub/module.py")
    assert is_ignored(rules, "keep/sub/private.key")
    assert is_ignored(rules, "keep/private.key")  # `**/` matches zero directories too
    assert not is_ignored(rules, "keep/public.key")  # the last matching rule decides
    only_abs = parse_dockerignore(["/abs/"])
    assert is_ignored(only_abs, "abs/x")
    assert not is_ignored(only_abs, "absent/x")


# Stages and base images -----------------------------------------------------------


def test_the_image_is_built_in_two_stages_from_a_named_builder() -> None:
    names = [stage.name for stage in stages()]
    assert len(names) >= 2, "a multi-stage build"
    assert names.index("builder") < len(names) - 1, "the builder is not the final stage"
    assert final().name != "builder"


def test_the_final_stage_is_slim_python_like_the_builder() -> None:
    match = SLIM_PYTHON.fullmatch(final().base)
    assert match, f"final base {final().base!r} is not a python:X.Y-slim image"
    required = pyproject()["project"]["requires-python"]
    minimum = re.fullmatch(r">=\s*(\d+)\.(\d+)", required)
    assert minimum, required
    assert (int(match["major"]), int(match["minor"])) >= (int(minimum[1]), int(minimum[2]))
    # The venv copied from the builder links to the builder's interpreter.
    assert builder().base == final().base


# Who runs what ----------------------------------------------------------------------


def test_the_final_stage_runs_as_a_numeric_non_root_user() -> None:
    users = final().all("USER")
    assert users, "the final stage sets USER"
    match = re.fullmatch(r"(\d+):(\d+)", users[-1].args)
    assert match, f"USER {users[-1].args!r} is not numeric uid:gid (runAsNonRoot needs it)"
    uid, gid = int(match[1]), int(match[2])
    assert uid != 0
    assert gid != 0
    # The account created for it, if any, has the same ids.
    run = run_text(final())
    for option, expected in (("--uid", uid), ("--gid", gid)):
        for value in re.findall(rf"{option}[ =](\d+)", run):
            assert int(value) == expected, f"{option} {value} differs from USER {users[-1].args}"


def test_the_entry_point_is_the_console_script_in_exec_form() -> None:
    entrypoints = final().all("ENTRYPOINT")
    assert entrypoints
    assert exec_form(entrypoints[-1].args) == ["rolegate"]
    assert "rolegate" in pyproject()["project"]["scripts"]
    commands = final().all("CMD")
    assert commands
    assert exec_form(commands[-1].args) is not None, "CMD in exec form"


def test_the_exposed_port_is_the_proxy_default() -> None:
    default_port = _parser().parse_args(["proxy", "--manifests", "m"]).port
    exposed = {word for i in final().all("EXPOSE") for word in i.args.split()}
    assert str(default_port) in exposed or f"{default_port}/tcp" in exposed


# What is in the final stage ----------------------------------------------------------


def test_the_final_stage_installs_nothing_and_has_no_build_tools() -> None:
    for instruction in final().all("RUN"):
        assert not BUILD_TOOL.search(instruction.args), f"line {instruction.line}"
        assert not PIP_INSTALL.search(instruction.args), f"line {instruction.line}"
    assert not final().all("ADD"), "ADD can fetch URLs and unpack archives: use COPY"


def test_pip_setuptools_and_wheel_are_removed_from_the_image() -> None:
    def uninstalled(stage: Stage) -> set[str]:
        names: set[str] = set()
        for match in re.finditer(r"\bpip\s+uninstall\s+([^&;|]*)", run_text(stage)):
            names.update(w for w in match[1].split() if not w.startswith("-"))
        return names

    # From the base interpreter in the final stage, and from the venv in the builder.
    assert {"pip", "setuptools", "wheel"} <= uninstalled(final())
    assert {"pip", "setuptools", "wheel"} <= uninstalled(builder())


def test_the_final_stage_copies_the_environment_from_the_builder_only() -> None:
    copies = final().all("COPY")
    assert copies
    for instruction in copies:
        flags, sources, _ = copy_parts(instruction)
        assert flags.get("from") == "builder", f"line {instruction.line}: COPY from the context"
        assert "." not in sources
        assert "./" not in sources
    targets = {copy_parts(i)[2].rstrip("/") for i in copies}
    path = final().env()["PATH"].split(":")
    assert path[0].endswith("/bin")
    assert path[0].removesuffix("/bin") in targets, "PATH starts with the copied venv's bin"


def test_no_build_argument_or_variable_is_named_like_a_secret() -> None:
    global_args, parsed = parse_stages(DOCKERFILE.read_text(encoding="utf-8"))
    names = set(global_args)
    for stage in parsed:
        for instruction in stage.instructions:
            if instruction.keyword in ("ARG", "ENV"):
                names.update(key_values(instruction.args))
    assert names, "the parser found the ARG and ENV names"
    assert not [name for name in names if SECRET_NAME.search(name)]


def test_python_writes_no_bytecode_and_modules_are_compiled_at_build_time() -> None:
    env = final().env()
    assert env.get("PYTHONDONTWRITEBYTECODE") == "1"
    assert env.get("PYTHONUNBUFFERED") == "1"
    runs = builder().all("RUN")
    installs = [i for i, run in enumerate(runs) if PIP_INSTALL.search(run.args)]
    compiles = [i for i, run in enumerate(runs) if "compileall" in run.args]
    assert installs
    assert compiles
    assert max(compiles) >= max(installs), "byte-compiled after the install"


def test_labels_name_the_source_the_license_and_the_version() -> None:
    labels: dict[str, str] = {}
    for instruction in final().all("LABEL"):
        labels.update(key_values(instruction.args))
    prefix = "org.opencontainers.image."
    for key in ("source", "description", "licenses", "version"):
        assert prefix + key in labels, key
    project = pyproject()["project"]
    assert labels[prefix + "licenses"] == project["license"]
    assert labels[prefix + "version"] == project["version"]
    assert labels[prefix + "description"]


# The build context ----------------------------------------------------------------------


def test_the_builder_copies_exactly_what_the_build_reads_and_it_exists() -> None:
    sources = builder_sources()
    for source in sources:
        assert not re.search(r"[*?\[]", source), f"{source}: name files, not globs"
        assert (ROOT / source).exists(), f"COPY {source}: not in the repository"
    project = pyproject()
    needed = {"pyproject.toml", project["project"]["readme"], "constraints.txt"}
    needed.update(project["tool"]["setuptools"]["packages"]["find"]["where"])
    assert {source.rstrip("/") for source in sources} == needed


def test_the_context_holds_every_file_the_builder_copies() -> None:
    files = [file for source in builder_sources() for file in files_under(ROOT / source)]
    assert len(files) > 50
    left_out = [
        str(f.relative_to(ROOT))
        for f in files
        if is_ignored(ignore_rules(), f.relative_to(ROOT).as_posix())
    ]
    assert not left_out, f".dockerignore leaves out files the build needs: {left_out}"


@pytest.mark.parametrize(
    "path",
    [
        ".git/HEAD",
        ".venv/bin/python",
        "tests/conftest.py",
        "bench/overhead.py",
        "docs/gitops.md",
        "deploy/helm/rolegate/values.yaml",
        "rolegate.egg-info/PKG-INFO",
        ".mypy_cache/3.11/cache.db",
        "proxy/rolegate_proxy/__pycache__/server.cpython-311.pyc",
        "policy/rolegate_policy/stray.pyc",
        "secrets.yaml",
        "proxy/rolegate_proxy/secrets.json",
        "policy/rolegate_policy/my-secret.yaml",
        "operator/tls.key",
        "cli/client.pem",
        ".env",
        ".env.production",
        "sim/.env",
        "kubeconfig",
        "cli/kubeconfig.yaml",
        ".kube/config",
        "operator/.kube/config",
    ],
)
def test_the_context_keeps_out_the_repository_and_anything_secret(path: str) -> None:
    assert is_ignored(ignore_rules(), path)


# What the image runs ------------------------------------------------------------------


def test_compile_runs_without_writing_to_disk(tmp_path: Path) -> None:
    """`rolegate compile` writes nothing but its output.

    A weak but real stand-in for running the image with a read-only root filesystem,
    which needs a container engine: the same entry module runs in a subprocess with
    PYTHONDONTWRITEBYTECODE=1 (as in the image), its working directory, HOME and TMPDIR
    all empty temporary directories, and they must all be empty afterwards. It does not
    catch a write to some other absolute path.
    """
    work, home, tmp = (tmp_path / name for name in ("work", "home", "tmp"))
    for directory in (work, home, tmp):
        directory.mkdir()
    env = {
        **os.environ,
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONIOENCODING": "utf-8",
        "HOME": str(home),
        "TMPDIR": str(tmp),
    }
    result = subprocess.run(
        [sys.executable, "-m", "rolegate_cli.main", "compile", str(EXAMPLE_MANIFESTS)],
        cwd=work,
        env=env,
        capture_output=True,
        encoding="utf-8",
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["config"]["hash"].startswith("sha256:")
    assert "✓ RoleTable rolegate/agents" in result.stderr
    for directory in (work, home, tmp):
        assert list(directory.rglob("*")) == [], f"{directory.name} was written to"


def test_constraints_pin_every_dependency_the_image_and_the_venv_install() -> None:
    """constraints.txt holds one exact version for every dependency pyproject names
    (runtime and extras), so the image and `make venv` install the same versions."""
    project = pyproject()["project"]
    wanted = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        wanted.extend(extra)
    pinned = {}
    for line in (ROOT / "constraints.txt").read_text(encoding="utf-8").splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not name==version"
            pinned[_canonical(name)] = version
    for requirement in wanted:
        name = re.split(r"[<>=!~;\[ ]", requirement, maxsplit=1)[0]
        assert _canonical(name) in pinned, f"{name} is not pinned in constraints.txt"


def _canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()
