"""Knowledge written down twice, once in code and once in a document or example, stays the
same in both: each test reads the document and compares it with the definition in code."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

from nodemgr._ledger import lib as ledger_lib

from gpushare import envvars, exitcodes, messages, protocol
from nodemgr import config
from nodemgr.host import ledger

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"


def doc_with_table(page: str, table: str, rows: str, source: str) -> str:
    """docs/``page``'s text, once it holds ``table``: its ``rows`` as generated from their
    definition in ``source``."""
    text = (DOCS / page).read_text()
    assert table in text, (
        f"docs/{page}'s table of {rows} differs from {source}; replace it with:\n" + table
    )
    return text


def test_configuration_doc_table_is_current() -> None:
    doc_with_table("configuration.md", config.doc_table(), "keys", "nodemgr/config.py's KEYS")


def test_every_key_defaults_to_its_documented_default(tmp_path: Path) -> None:
    f = tmp_path / "empty.toml"
    f.write_text("")
    loaded = config.load(f)
    for key in config.KEYS:
        if key.default is not None:
            assert getattr(loaded, key.attr) == key.parse(key.default, key.path), key.path
    assert loaded.context_memory is None
    assert loaded.admin_access.mode == loaded.env_default_access.mode == 0o600


def _example_lines() -> dict[tuple[str, str], tuple[bool, str]]:
    """configs/nodemgr.toml's keys, set or commented out: (section, key) -> (commented,
    the comment lines just above it)."""
    found: dict[tuple[str, str], tuple[bool, str]] = {}
    section = ""
    comment: list[str] = []
    for line in (ROOT / "configs" / "nodemgr.toml").read_text().splitlines():
        header = re.fullmatch(r"\[([a-z_]+)\]", line)
        setting = re.fullmatch(r"(# )?([a-z_]+) = .*", line)
        if header:
            section = header.group(1)
        elif setting:
            found.setdefault(
                (section, setting.group(2)), (bool(setting.group(1)), " ".join(comment))
            )
        if line.startswith("#") and not setting:
            comment.append(line)
        elif not setting:
            comment = []
    return found


def test_example_config_has_every_key_and_says_where_it_differs() -> None:
    example = config.load(ROOT / "configs" / "nodemgr.toml")
    lines = _example_lines()
    for key in config.KEYS:
        assert (key.section, key.name) in lines, f"configs/nodemgr.toml lacks {key.path}"
        commented, comment = lines[(key.section, key.name)]
        if commented or key.default is None:
            continue
        if getattr(example, key.attr) != key.parse(key.default, key.path):
            # A value other than the default says so, and what the default is.
            shown = key.shown_default().strip("`")
            assert "Default" in comment and shown in comment, key.path
    for table, _ in config.ACCESS_TABLES:
        for name, _, _ in config.ACCESS_KEYS:
            assert (table, name) in lines, f"configs/nodemgr.toml lacks {table}.{name}"


def test_client_doc_lists_exactly_the_client_variables() -> None:
    text = doc_with_table("client.md", envvars.doc_table(), "variables", "gpushare/envvars.py")
    defined = {name for name, *_ in envvars.SETTINGS} | {n for n, _ in envvars.TASK_VARIABLES}
    module = {v for k, v in vars(envvars).items() if k.isupper() and isinstance(v, str)}
    assert module == defined, "every name in gpushare/envvars.py is in its tables"
    assert set(re.findall(r"GPUSHARE_[A-Z_]+", text)) == defined | {config.CONFIG_ENV}
    # gpushare-run's option table: one row per option, with its variable.
    rows = re.findall(r"^\| `(--[a-z-]+)[^|]*\| `(GPUSHARE_[A-Z_]+)`", text, re.M)
    options = {name: option.split()[0] for name, option, _, _ in envvars.SETTINGS if option}
    assert {name: option for option, name in rows} == options


def _markdown() -> str:
    """README.md and every page of docs/: where a copy of a constant may be written."""
    pages = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
    return "\n".join(p.read_text() for p in pages)


def test_gpu_counts_in_docs_are_the_protocols() -> None:
    most = protocol.MAX_GPUS_PER_REQUEST
    forms = {name: form for name, _, form, _ in envvars.SETTINGS}
    assert forms[envvars.GPUS] == f"N, 1 to {most}"
    assert f"GPUs CMD needs (1\u2013{most})" in (DOCS / "client.md").read_text()
    assert protocol.MAX_TASK_ID + 1 == ledger_lib.GS_TASK_ID_LEN
    assert config.MAX_SIMULATED == ledger.MAX_GPUS


def test_every_reclaim_reason_has_its_exit_code() -> None:
    """What a `reclaimed` error may say (protocol) and what gpushare-run maps to an exit
    code (exitcodes) are the same reasons; others exit EXIT_RECLAIMED_OTHER."""
    assert set(exitcodes.RECLAIM_EXIT_CODES) == set(protocol.RECLAIM_REASONS)


def test_exit_code_tables_are_the_defined_codes() -> None:
    text = _markdown()
    # gpushare-run's table of exit codes: | code | meaning |, one row per code.
    tables = re.findall(r"^\| code \| meaning \|\n\|---\|---\|\n((?:\|.*\n)+)", text, re.M)
    assert len(tables) == 1
    documented = {int(c) for c in re.findall(r"^\| (\d+) \|", tables[0], re.M)}
    assert documented == {
        exitcodes.EXIT_USAGE,
        exitcodes.EXIT_UNREACHABLE,
        exitcodes.EXIT_NO_RESOURCES,
        exitcodes.EXIT_REFUSED,
        exitcodes.EXIT_INTERNAL,
        exitcodes.EXIT_NOT_EXECUTABLE,
        exitcodes.EXIT_NOT_FOUND,
        exitcodes.EXIT_CANCELLED,
        exitcodes.EXIT_RECLAIMED_IDLE,
        exitcodes.EXIT_RECLAIMED_TIMEOUT,
        exitcodes.EXIT_RECLAIMED_ADMIN,
        exitcodes.EXIT_RECLAIMED_DELETED,
        exitcodes.EXIT_RECLAIMED_OTHER,
        exitcodes.EXIT_PREEMPTED,
        exitcodes.EXIT_CLASS_REFUSED,
        exitcodes.EXIT_NOT_PREDICTED,
    }
    # nodemgr's, in a sentence: "Exit codes: 0 success; 1 ...; 78 ...".
    sentence = re.search(r"Exit codes: 0 success(;.*?)\n\n", text, re.S)
    assert sentence is not None
    assert {int(c) for c in re.findall(r"(?:^|; |\n)(\d+) ", sentence.group(1))} == {
        exitcodes.EXIT_ADMIN_REFUSED,
        exitcodes.EXIT_USAGE,
        exitcodes.EXIT_UNREACHABLE,
        exitcodes.EXIT_SOFTWARE,
        exitcodes.EXIT_CONFIG,
    }


def test_the_failed_turns_bound_in_docs_is_the_servers() -> None:
    from nodemgr.loop.server import MAX_FAILED_TURNS

    said = f"{MAX_FAILED_TURNS} in a row"
    for doc in (DOCS / "nodemgr.md", DOCS / "operations.md", DOCS.parent / "README.md"):
        assert said in doc.read_text(), doc


# A field as docs/protocol.md writes it: `name` (type...), the type in balanced parentheses.
_FIELD = re.compile(r"`(\w+)` \(((?:[^()]|\([^()]*\))*)\)")


def _fields(text: str) -> dict[str, str]:
    """The leading list of fields of a paragraph or table cell: name -> type."""
    fields: dict[str, str] = {}
    pos = 0
    while m := _FIELD.match(text, pos):
        fields[m.group(1)] = m.group(2)
        pos = m.end()
        if not text.startswith(", ", pos):
            break
        pos += 2
    return fields


def _check_fields(where: str, schema: messages.Schema, fields: dict[str, str]) -> None:
    assert set(fields) == set(schema), f"{where}: fields {sorted(fields)} != {sorted(schema)}"
    for name, (required, _) in schema.items():
        # An optional field is one that may be nil, and the doc says so.
        assert ("nil" not in fields[name]) == required, f"{where}.{name}: {fields[name]!r}"


def test_protocol_doc_has_every_message_field_and_error() -> None:
    text = (DOCS / "protocol.md").read_text()
    for kind, cls in messages.TASK_REQUESTS.items():
        schema = messages.schema(cls)
        section = re.search(rf"^### `{kind}` → `\w+`\n\n(.*?)(?=\n### |\n## )", text, re.M | re.S)
        assert section, f"docs/protocol.md has no section for task message {kind!r}"
        body = section.group(1)
        rows = re.findall(r"^\| `(\w+)` \| ([^|]*) \| (yes|no) \|", body, re.M)
        if rows:  # a table with a required column
            _check_fields(kind, schema, {name: kind_ for name, kind_, _ in rows})
            for name, _, required in rows:
                assert (required == "yes") == schema[name][0], f"{kind}.{name}: required"
        elif not schema:
            assert body.startswith("No fields."), kind
        else:
            _check_fields(kind, schema, _fields(body))
    for kind, admin_cls in messages.ADMIN_REQUESTS.items():
        schema = messages.schema(admin_cls)
        row = re.search(rf"^\| `{kind}` \| ([^|]*) \|", text, re.M)
        assert row, f"docs/protocol.md's admin table has no row for {kind!r}"
        if not schema:
            assert row.group(1) == "—", kind
        else:
            _check_fields(kind, schema, _fields(row.group(1)))
    codes = {v for k, v in vars(protocol.Err).items() if k.isupper() and isinstance(v, str)}
    table = dict(re.findall(r"^\| `([a-z_]+)` \| [^\n]* \| (yes|no) \|$", text, re.M))
    assert set(table) == codes, "docs/protocol.md's error table lists exactly Err's codes"
    for code, retryable in table.items():
        assert (retryable == "yes") == (code in protocol.Err.RETRYABLE), code


def _module_map() -> ModuleType:
    spec = importlib.util.spec_from_file_location("module_map", DOCS / "module_map.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_architecture_module_map_is_current() -> None:
    """Every module of the packages is in docs/architecture.md's map, described by its
    own docstring's first sentence, and nothing else is."""
    module_map = _module_map()
    made = module_map.block()
    assert made in (DOCS / "architecture.md").read_text(), (
        "docs/architecture.md's module map differs from the modules; run "
        "`python docs/module_map.py --write`"
    )
    named = set(re.findall(r"^\| `([\w.]+)` \|", made, re.M))
    on_disk = {
        ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        for pkg in module_map.PACKAGES
        for p in (ROOT / pkg).rglob("*.py")
        # (the generated protocol modules have no docstring of their own: make proto's)
        if p.name != "__main__.py" and "_pb2" not in p.name
    }
    assert named == on_disk


def test_the_startup_hook_knows_the_same_false_words() -> None:
    """gpushare-autoload.pth cannot import gpushare.envvars before deciding whether to load
    anything, so it spells the words out; they are FALSE_WORDS, and the empty string."""
    hook = (ROOT / "gpushare-autoload.pth").read_text()
    spelled = re.search(r"not in \(([^)]*)\)", hook)
    assert spelled is not None, "gpushare-autoload.pth no longer lists its false words"
    words = {w.strip().strip("\"'") for w in spelled[1].split(",") if w.strip()}
    assert words == {*envvars.FALSE_WORDS, ""}
    assert envvars.AUTOLOAD in hook and envvars.TASK_ID in hook
