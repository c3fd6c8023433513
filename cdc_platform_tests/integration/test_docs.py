"""The documentation is true: every example in README.md and docs/ runs or is checked here.

* ``python`` blocks run, page by page and in order, in a folder laid out as after ``make demo``
  (``data/warehouse/orders`` built through the real pipeline, ``cdc_platform.yaml`` beside it),
  with ``spark`` bound to the suite's session; the history-table page's answers are checked.
* ``yaml`` blocks are parsed by ``lib.config`` (a whole config or a fragment completed with a
  minimal one); a Launchpad config, marked ``# job: <name>``, is validated against that job's
  run config schema in the code location.
* ``json`` (the keyring) is loaded by ``Keyring.from_mapping`` with its placeholders filled.
* ``bash`` lines are not run (they start services, install packages or take minutes); each is
  checked instead: a ``make`` target exists, a ``python -m`` module's ``--help`` lists the
  flags used, a ``dagster`` subcommand and its options exist, an exported variable is one the
  code reads, a repo file named exists. ``make demo``, ``make test`` and the deploy recipe run
  in ``test_demo_run.py``, CI and ``test_deploy.py``.
* Every relative link (and ``#anchor``) resolves inside the repository.
* ``docs/configuration.md`` is what ``python -m cdc_platform.config_reference`` generates.
"""

from __future__ import annotations

import base64
import contextlib
import io
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml

from cdc_platform import config_reference
from cdc_platform.lib import config as cfg
from cdc_platform.lib.landing.decoding.keyring import Keyring
from cdc_platform.lib.pipeline import materialize
from cdc_platform_tests.helpers import event as ev
from cdc_platform_tests.helpers import write_parquet_events

ROOT = cfg.REPO_ROOT
PAGES = sorted([ROOT / "README.md", *(ROOT / "docs").glob("*.md")])
SKIPPED_LANGUAGES = {"mermaid", "text"}  # pictures and sample output: nothing to run
# Environment variables the docs export that Spark reads, not this package.
SPARK_VARIABLES = {"PYSPARK_PYTHON"}
README_MAX_LINES = 150


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    language: str
    code: str

    def __str__(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line} ({self.language})"


_FENCE = re.compile(r"^( *)```(\S*)[^\n]*\n(.*?)^\1```", re.S | re.M)


@cache
def blocks(page: Path) -> tuple[Block, ...]:
    text = page.read_text()
    out = []
    for m in _FENCE.finditer(text):
        indent = len(m.group(1))
        code = "\n".join(line[indent:] for line in m.group(3).splitlines())
        line = text.count("\n", 0, m.start()) + 1
        out.append(Block(page, line, m.group(2).lower(), code + "\n"))
    return tuple(out)


def all_blocks(language: str) -> list[Block]:
    """Every block of a language; the generated reference's are checked by comparison."""
    return [
        b
        for page in PAGES
        if page != config_reference.PAGE
        for b in blocks(page)
        if b.language == language
    ]


def test_every_block_has_a_known_language() -> None:
    known = {"python", "yaml", "json", "bash", *SKIPPED_LANGUAGES}
    unknown = [str(b) for page in PAGES for b in blocks(page) if b.language not in known]
    assert not unknown, f"no rule runs or checks these blocks: {unknown}"


# -- the README --------------------------------------------------------------------------------


def test_readme_is_the_front_door() -> None:
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= README_MAX_LINES
    assert "make demo" in readme and "make test" in readme
    linked = set(re.findall(r"\]\((docs/[^)#\s]+)", readme))
    pages = {f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")}
    assert pages <= linked, f"docs pages missing from the README's contents: {pages - linked}"


# -- links -------------------------------------------------------------------------------------

_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    """The page without its code blocks and inline code (a `#` there is no heading)."""
    text = _FENCE.sub("", text)
    return re.sub(r"`[^`\n]*`", "", text)


def github_anchor(heading: str) -> str:
    """GitHub's heading id: lower case, punctuation dropped, spaces to hyphens."""
    text = heading.strip().lower().replace("`", "")
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for m in re.finditer(r"^#{1,6} (.+)$", _FENCE.sub("", page.read_text()), re.M):
        base = github_anchor(m.group(1))
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def test_every_relative_link_resolves() -> None:
    broken = []
    for page in PAGES:
        for target in _LINK.findall(_prose(page.read_text())):
            if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            path_part, _, anchor = target.partition("#")
            dest = (page.parent / path_part).resolve() if path_part else page
            where = f"{page.relative_to(ROOT)}: {target}"
            if ROOT not in (dest, *dest.parents):
                broken.append(f"{where} points outside the repository")
            elif not dest.exists():
                broken.append(f"{where}: no such file")
            elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
                broken.append(f"{where}: no heading with that anchor")
    assert not broken, "\n".join(broken)


# -- the configuration reference ---------------------------------------------------------------


def test_configuration_reference_matches_the_code() -> None:
    generated = config_reference.render()
    committed = config_reference.PAGE.read_text() if config_reference.PAGE.is_file() else ""
    assert committed == generated, (
        f"docs/configuration.md differs from the code: run `{config_reference.COMMAND}`"
    )


def test_reference_descriptions_cover_every_config_key() -> None:
    config_reference.check_descriptions()  # raises naming the key


def test_the_published_json_schema_matches_the_models() -> None:
    committed = config_reference.SCHEMA.read_text() if config_reference.SCHEMA.is_file() else ""
    assert committed == config_reference.schema_text(), (
        f"docs/{config_reference.SCHEMA.name} differs from the code: run "
        f"`{config_reference.COMMAND}`"
    )


def _schema_errors(config: Any) -> list[str]:
    import jsonschema

    schema = json.loads(config_reference.SCHEMA.read_text())
    validator = jsonschema.Draft202012Validator(schema)
    return [f"{list(e.absolute_path)}: {e.message}" for e in validator.iter_errors(config)]


def test_the_repo_config_and_its_examples_satisfy_the_schema() -> None:
    for path in sorted(ROOT.glob("**/cdc_platform*.yaml")):
        if ".venv" in path.parts:
            continue
        assert not _schema_errors(yaml.safe_load(path.read_text())), path


@pytest.mark.parametrize(
    ("table", "where"),
    [
        ({"primay_key": ["id"]}, "primay_key"),  # a typo
        ({"compression": "gzip"}, "gzip"),
        ({"lookback_hours": 0}, "0"),
        ({"start": "2024-01-01"}, "2024-01-01"),
        ({"name": "1orders"}, "1orders"),
    ],
)
def test_the_schema_catches_what_the_parser_refuses(tmp_path: Path, table: Any, where: str) -> None:
    """An editor using the schema flags, as one types, what loading would refuse."""
    config = _as_config([{**_MINIMAL_TABLE, **table}])
    with pytest.raises(cfg.ConfigError):
        cfg.parse_config(config, base_dir=tmp_path)
    errors = _schema_errors(config)
    assert errors and where in " ".join(errors)


# -- yaml and json -----------------------------------------------------------------------------

_MINIMAL_TABLE = {"name": "orders", "primary_key": ["order_id"], "start": "2024-01-01-00:00"}


def _as_config(data: Any) -> dict[str, Any]:
    """A YAML example as a whole config: fragments are completed with a minimal one."""
    base: dict[str, Any] = {"landing_root": "landing", "warehouse_root": "warehouse"}
    if isinstance(data, list):  # entries to paste under tables:
        return {**base, "tables": data}
    assert isinstance(data, dict), "a mapping or a list of tables"
    if set(data) <= set(cfg.file_keys(cfg.PlatformConfig)):
        tables = {} if "tables" in data or "discover" in data else {"tables": [_MINIMAL_TABLE]}
        return {**base, **tables, **data}
    if set(data) <= set(cfg.file_keys(cfg.TableConfig)):
        return {**base, "tables": [{**_MINIMAL_TABLE, **data}]}
    raise AssertionError(f"neither config keys nor table keys: {sorted(data)}")


def _job_name(code: str) -> str | None:
    m = re.match(r"\s*# job: (\w+)", code)
    return m.group(1) if m else None


@pytest.mark.parametrize("block", all_blocks("yaml"), ids=str)
def test_yaml_examples_parse(block: Block, tmp_path: Path, code_location: Any) -> None:
    data = yaml.safe_load(block.code)
    job = _job_name(block.code)
    if job is None:
        assert not (isinstance(data, dict) and "ops" in data), "mark a Launchpad config # job:"
        cfg.parse_config(_as_config(data), base_dir=tmp_path)
        assert not _schema_errors(_as_config(data)), "the JSON Schema refuses an example"
        return
    import dagster as dg

    names = {j.name for j in code_location.get_repository_def().get_all_jobs()}
    assert job in names, f"no job {job} in the code location"
    result = dg.validate_run_config(code_location.get_job_def(job), data)
    assert result is not None


@pytest.mark.parametrize("block", all_blocks("json"), ids=str)
def test_json_examples_are_keyrings(block: Block) -> None:
    key = base64.b64encode(bytes(32)).decode()
    raw = json.loads(re.sub(r'"<[^">]*>"', json.dumps(key), block.code))
    Keyring.from_mapping(raw)


# -- shell commands ----------------------------------------------------------------------------


def _commands() -> Iterator[tuple[Block, str]]:
    for block in all_blocks("bash"):
        for line in block.code.splitlines():
            command = re.sub(r"(^|\s+)#.*$", "", line).strip()
            if command:
                yield block, command


@cache
def make_targets() -> set[str]:
    return set(re.findall(r"^([\w.-]+):", (ROOT / "Makefile").read_text(), re.M))


@cache
def module_help(module: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", module, "--help"], capture_output=True, text=True, cwd=ROOT
    )
    assert done.returncode == 0, f"python -m {module} --help: {done.stderr}"
    return done.stdout


@cache
def package_sources() -> str:
    return "\n".join(p.read_text() for p in (ROOT / "cdc_platform").rglob("*.py"))


def _check_dagster(words: list[str]) -> None:
    from dagster._cli import create_dagster_cli

    command: Any = create_dagster_cli()
    args = words[1:]
    while args and hasattr(command, "commands") and args[0] in command.commands:
        command = command.commands[args.pop(0)]
    assert not hasattr(command, "commands"), f"no dagster subcommand {' '.join(words[:3])}"
    options = {opt for p in command.params for opt in p.opts}
    for i, word in enumerate(args):
        if word.startswith("-"):
            assert word in options, f"dagster {command.name} has no option {word}"
            if word in ("-w", "--workspace", "-f", "--python-file"):
                assert (ROOT / args[i + 1]).is_file(), args[i + 1]
            if word in ("-m", "--module-name"):
                __import__(args[i + 1])


def check_command(command: str) -> None:
    words = command.split()
    first = words[0]
    if first == "make":
        assert words[1] in make_targets(), f"no make target {words[1]}"
    elif first == "export":
        name = words[1].split("=", 1)[0]
        assert name in SPARK_VARIABLES or name in package_sources(), f"nothing reads {name}"
    elif first.endswith("python") and words[1] == "-m" and words[2].startswith("cdc_platform"):
        shown = module_help(words[2])
        for word in words[3:]:
            if word.startswith("--"):
                assert word in shown, f"python -m {words[2]} has no option {word}"
            elif not word.startswith("-"):
                assert word in shown, f"python -m {words[2]} takes no {word}"
    elif first.endswith("python") and words[1] == "-m" and words[2].startswith("benchmarks."):
        shown = module_help(words[2])  # a script's options, its own and the harness's
        for word in words[3:]:
            if word.startswith("--"):
                assert word in shown, f"python -m {words[2]} has no option {word}"
    elif first == "dagster":
        _check_dagster(words)
    elif first in ("sudo", "sudoedit", "cd", "journalctl"):
        # The deploy recipe (test_deploy.py runs its psql statements and the units' commands):
        # the repository files it installs must exist.
        for word in words:
            if word.startswith("deploy/"):
                assert list(ROOT.glob(word)), f"no {word} in the repository"
    else:
        raise AssertionError(f"no rule checks `{first}` commands: add one to test_docs.py")


@pytest.mark.parametrize(("block", "command"), list(_commands()), ids=lambda x: str(x))
def test_shell_commands_exist(block: Block, command: str) -> None:
    check_command(command)


# -- python: run against a small table built through the real pipeline ------------------------

H4 = datetime(2024, 1, 1, 4, tzinfo=UTC)
H5 = H4 + timedelta(hours=1)


def _order(op: str, seq: int, minute: int, key: int, status: str | None, amount: float | None):
    return ev(
        op,
        seq,
        H4 + timedelta(minutes=minute),
        key,
        key_column="order_id",
        customer_id=1,
        status=status,
        amount=amount,
        currency="EUR",
    )


@pytest.fixture(scope="module")
def demo_folder(spark: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A folder laid out as after `make demo`: data/warehouse/orders and cdc_platform.yaml."""
    root = tmp_path_factory.mktemp("docs")
    (root / "cdc_platform.yaml").write_text(
        yaml.safe_dump(
            {
                "landing_root": "data/landing",
                "warehouse_root": "data/warehouse",
                "tables": [_MINIMAL_TABLE],
            }
        )
    )
    platform = cfg.load_config(root / "cdc_platform.yaml")
    table = platform.table("orders")
    runs = {
        H4: [
            _order("INSERT", 1, 10, 42, "NEW", 10.0),
            _order("INSERT", 2, 20, 7, "NEW", 20.0),
            _order("UPDATE", 3, 60, 42, "PAID", 10.0),  # 05:00, status changes
        ],
        H5: [
            _order("UPDATE", 4, 75, 7, "PAID", 20.0),  # 05:15, status changes
            _order("UPDATE", 5, 100, 42, "PAID", 9.0),  # 05:40, amount only
            _order("INSERT", 6, 105, 8, "NEW", 5.0),
            _order("DELETE", 7, 110, 7, None, None),
        ],
    }
    for hour, events in runs.items():
        write_parquet_events(platform.landing_path, "orders", hour, events)
    # One run for both hours (a run costs seconds even when tiny: see docs/how-it-works.md).
    materialize(spark, table, platform.landing_path, platform.warehouse_root, list(runs))
    return root


@pytest.fixture(scope="module")
def code_location(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The code location over a config with the docs' `orders` table (no Spark needed)."""
    from cdc_platform.definitions import build_definitions

    base = {"landing_root": "landing", "warehouse_root": "warehouse", "tables": [_MINIMAL_TABLE]}
    return build_definitions(cfg.parse_config(base, base_dir=tmp_path_factory.mktemp("defs")))


def run_page(page: Path, spark: Any, folder: Path, monkeypatch: pytest.MonkeyPatch) -> dict:
    monkeypatch.chdir(folder)
    monkeypatch.setenv(cfg.CONFIG_ENV_VAR, str(folder / "cdc_platform.yaml"))
    namespace: dict[str, Any] = {"__name__": "__docs__", "spark": spark}
    for block in blocks(page):
        if block.language != "python":
            continue
        with contextlib.redirect_stdout(io.StringIO()):
            try:
                exec(compile(block.code, str(block), "exec"), namespace)
            except Exception as exc:
                raise AssertionError(f"{block} fails: {exc!r}") from exc
    return namespace


def test_readme_python_runs(spark: Any, demo_folder: Path, monkeypatch: pytest.MonkeyPatch):
    ns = run_page(ROOT / "README.md", spark, demo_folder, monkeypatch)
    assert ns["orders"].filter(ns["pl"].col("_fivetran_active")).height == 2


def test_history_table_examples_run_and_answer(
    spark: Any, demo_folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ns = run_page(ROOT / "docs" / "history-table.md", spark, demo_folder, monkeypatch)
    # As of 05:30: 42 paid (10.0), 7 paid; now: 42 (9.0) and 8; status changed for 42 and 7.
    as_of = {(r["order_id"], r["status"], r["amount"]) for r in ns["as_of_530"].collect()}
    assert as_of == {(42, "PAID", 10.0), (7, "PAID", 20.0)}
    assert {r["order_id"] for r in ns["current_rows"].collect()} == {42, 8}
    changes = [(r["order_id"], r["status"]) for r in ns["status_changes"].collect()]
    assert changes == [(7, "PAID"), (42, "PAID")]
    assert ns["as_of_frame"].collect().height == 2
    assert ns["current_frame"].collect().height == 2
    assert ns["changed_frame"].collect().height == 2
    assert sorted(r["order_id"] for r in ns["df"].collect()) == [7, 42]


def test_engines_examples_run(spark: Any, demo_folder: Path, monkeypatch: pytest.MonkeyPatch):
    """delta-spark on the table: the suite's session has Delta's library (conftest)."""
    from deltalake import DeltaTable

    ns = run_page(ROOT / "docs" / "engines.md", spark, demo_folder, monkeypatch)
    table = DeltaTable(str(demo_folder / "data" / "warehouse" / "orders"))
    assert ns["history"].count() == table.to_pyarrow_table().num_rows
    assert ns["commits"].count() == table.version() + 1
    first = DeltaTable(str(demo_folder / "data" / "warehouse" / "orders"), version=0)
    assert ns["first_version"].count() == first.to_pyarrow_table().num_rows


def test_every_page_with_python_is_run() -> None:
    run = {"README.md", "history-table.md", "engines.md"}
    with_python = {p.name for p in PAGES if any(b.language == "python" for b in blocks(p))}
    assert with_python <= run, f"add a test that runs the python of {with_python - run}"


def test_the_code_map_lists_every_module_and_folder_where_it_is():
    """docs/development.md's code map is one a newcomer can check against the folders: every
    module and folder of the package is on it, under its folder, and nothing else is."""
    text = (ROOT / "docs" / "development.md").read_text()
    block = text.split("## Code layout", 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    listed: set[str] = set()
    parents: list[tuple[int, str]] = []  # (indent, folder) of the folders above a line
    for line in block.splitlines():
        indent = len(line) - len(line.lstrip(" "))
        words = line.split()
        if not words or indent % 2:  # a description's continuation is indented oddly
            continue
        parents = [(i, f) for i, f in parents if i < indent]
        prefix = "".join(f for _, f in parents)
        names = []
        for word in words:  # the names come first, then the description
            if not re.fullmatch(r"[\w.]+(\.py|\.properties|/)", word):
                break
            names.append(word)
        for name in names:
            listed.add(prefix + name)
        if len(names) == 1 and names[0].endswith("/"):
            parents.append((indent, names[0]))
    package = ROOT / "cdc_platform"
    actual = {
        str(p.relative_to(ROOT)) + ("/" if p.is_dir() else "")
        for p in package.rglob("*")
        if "__pycache__" not in p.parts
        and p.name != "__init__.py"
        and (p.is_dir() or p.suffix in (".py", ".properties"))
        and "demo" not in p.relative_to(package).parts[:1]
    }
    actual |= {"cdc_platform/", "cdc_platform/demo/"}
    listed = {name for name in listed if name.startswith("cdc_platform/")}
    assert sorted(actual - listed) == [], "modules missing from the code map"
    assert sorted(listed - actual) == [], "the code map names what does not exist"
