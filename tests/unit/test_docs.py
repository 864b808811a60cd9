"""The docs against the code, for what goes stale without a word: a test a doc names as proof (a renamed test left
docs/RELIABILITY.md citing one that no longer exists: three did), a `modelfs` option a doc tells users to give, a
`module.name` or `Class.member` it points the next engineer to, a constant's value it quotes, and the defaults that
README and `--help` write out."""

from __future__ import annotations

import argparse
import ast
import importlib
import inspect
import re
from pathlib import Path

from fsmount.cli import make_parser

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "bench" / "README.md"]

# `--x` in the docs that are other programs' options (aws, cp, rsync, tar, getfattr, systemctl, prlimit, hf,
# radosgw-admin) or no option at all (`--flag`, a placeholder; `--shared-cache-`, the family). Another tool's: add it.
NOT_MODELFS = {"--bucket", "--lifecycle-configuration", "--sparse", "--inplace", "--update", "--overwrite",
               "--only-values", "--now", "--nofile", "--local-dir", "--gen-secret", "--flag", "--shared-cache-"}


def defined_tests() -> dict[str, set[str]]:
    """Every test function under tests/, by its file's path relative to the repository root."""
    found: dict[str, set[str]] = {}
    for path in (ROOT / "tests").rglob("test_*.py"):
        tree = ast.parse(path.read_text())
        found[path.relative_to(ROOT).as_posix()] = {
            node.name for node in tree.body
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name.startswith("test_")}
    return found


def test_every_test_the_docs_name_as_proof_exists() -> None:
    """`path::name`, `file.py::name`, a bare `test_name`, or a prefix written `test_name_...` / `test_name_*`: each
    must name a test function or a test file that exists."""
    tests = defined_tests()
    names = {name for functions in tests.values() for name in functions}
    stems = {Path(path).stem for path in tests}
    stale = []
    for doc in DOCS:
        text = doc.read_text()
        for m in re.finditer(r"([\w/{},]*\.py)::(test_\w+)", text):
            file, name = m.groups()
            prefix = text[m.end():m.end() + 3] in ("...", "*") or name.endswith("_")
            files = [p for p in tests if p == file or p.endswith("/" + file)]
            if not any(n == name or (prefix and n.startswith(name)) for p in files for n in tests[p]):
                stale.append(f"{doc.name}: {file}::{name}")
        for m in re.finditer(r"(?<![\w/:])(test_\w+)", text):
            name = m.group(1)
            after = text[m.end():m.end() + 3]
            if after.startswith(".py"):
                if name not in stems:
                    stale.append(f"{doc.name}: {name}.py")
            elif after in ("...", "*") or after.startswith("*") or name.endswith("_"):
                if not any(n.startswith(name) for n in names | stems):
                    stale.append(f"{doc.name}: {name}...")
            elif name not in names | stems:
                stale.append(f"{doc.name}: {name}")
    assert not stale, f"the docs name tests that do not exist (renamed?): {sorted(set(stale))}"


def test_every_option_the_docs_give_modelfs_is_one_it_takes() -> None:
    parser = make_parser()
    options = set(parser._option_string_actions)
    for action in parser._actions:
        if isinstance(action.choices, dict):  # the subcommands
            for sub in action.choices.values():
                options |= set(sub._option_string_actions)
    unknown = []
    for doc in [*DOCS[:-1], *sorted((ROOT / "systemd").iterdir())]:  # bench/README's are the bench scripts'
        for flag in set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", doc.read_text())):
            if flag not in options and flag not in NOT_MODELFS:
                unknown.append(f"{doc.name}: {flag}")
    assert not unknown, f"the docs give options no modelfs command takes: {sorted(unknown)}"


# `module.name` in the docs that is no module of ours: mount(8)'s helper, safetensors' own numpy loader.
NOT_OURS = {"mount.fuse3", "safetensors.numpy"}


def test_every_module_name_the_docs_point_to_is_defined_there() -> None:
    """`engine.peek`, `data.ChunkEngine.request`, `mount_users.mounts_inside`: the next engineer greps that module
    for that name (B144's `cli.mount_users` stayed in docs/RELIABILITY.md after the scan moved out of cli.py)."""
    sources: dict[str, str] = {}
    for path in (ROOT / "fsmount").rglob("*.py"):
        name = path.parent.name if path.stem == "__init__" else path.stem
        text = path.read_text()
        if path.stem == "__init__":  # a package holds its modules, and the names it imports from them
            held = [p.stem for p in path.parent.glob("*.py")]
            held += [p.parent.name for p in path.parent.glob("*/__init__.py")]
            held += [alias.asname or alias.name for node in ast.walk(ast.parse(text))
                     if isinstance(node, ast.ImportFrom) for alias in node.names]
            text += "".join(f"\n{module} = ...\n" for module in held)
        sources[name] = sources.get(name, "") + text
    missing = []
    for doc in DOCS:
        for m in re.finditer(r"(?<![\w./@-])(?:fsmount\.)?(?:data\.)?([a-z_]+)\.([A-Za-z_]\w*)", doc.read_text()):
            module, name = m.groups()
            if module not in sources or name == "py" or f"{module}.{name}" in NOT_OURS:
                continue
            defined = rf"\b(def|class) {name}\b|^{name}\b|self\.{name}\b|^\s+{name}\s*[:=]|[\"']{name}[\"']"
            if not re.search(defined, sources[module], re.M):
                missing.append(f"{doc.name}: {m.group(0)}")
    assert not missing, f"the docs point to names their module does not define (moved? renamed?): {sorted(missing)}"


def test_every_class_member_the_docs_name_exists() -> None:
    """`Writes._in_bucket`, `NewFile.write`, `MemoryBudget.touch`: a method, attribute or field of that class."""
    classes: dict[str, type] = {}
    for path in sorted((ROOT / "fsmount").rglob("*.py")):
        if path.stem in ("__init__", "__main__"):
            continue
        module = importlib.import_module(".".join(path.relative_to(ROOT).with_suffix("").parts))
        for name, obj in vars(module).items():
            if isinstance(obj, type) and obj.__module__ == module.__name__:
                classes[name] = obj
    missing = []
    for doc in DOCS:
        for m in re.finditer(r"(?<![\w.])([A-Z][A-Za-z0-9]+)\.([a-z_]\w*)", doc.read_text()):
            cls, name = classes.get(m.group(1)), m.group(2)
            if cls is None or hasattr(cls, name):
                continue
            own = "".join(inspect.getsource(c) for c in cls.__mro__ if c.__module__.startswith("fsmount"))
            if not re.search(rf"self\.{name}\b|^\s+{name}\s*:", own, re.M):
                missing.append(f"{doc.name}: {m.group(0)}")
    assert not missing, f"the docs name class members that do not exist (renamed?): {sorted(missing)}"


UNITS = {"": 1, "ms": 1e-3, "s": 1, "minutes": 60, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}


def test_every_constant_the_docs_give_a_value_has_that_value() -> None:
    """`LOCAL_WINDOW (32 MiB)`, `ONE_CALL_S` (0.1 s), `GET_ATTEMPTS = 3`: the value the docs quote beside a
    constant's name is the code's (any module's, where two modules have a constant of that name)."""
    values: dict[str, list[object]] = {}
    for path in sorted((ROOT / "fsmount").rglob("*.py")):
        if path.stem == "__main__":
            continue
        dotted = ".".join(path.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
        module = importlib.import_module(dotted)
        for name, value in vars(module).items():
            if re.fullmatch(r"[A-Z][A-Z0-9_]+", name) and isinstance(value, int | float):
                values.setdefault(name, []).append(value)
    number = r"(\d[\d,]*(?:\.\d+)?) ?(ms|s|minutes|KiB|MiB|GiB)?"
    quoted = re.compile(rf"\b([A-Z][A-Z0-9_]{{3,}})`? \({number}[;)]|`([A-Z][A-Z0-9_]{{3,}}) = {number}`")
    checked, wrong = 0, []
    for doc in DOCS[:-1]:  # bench/README's `PARALLEL_PUSHES = 1` is what bench/device.sh sets in a copy
        for m in quoted.finditer(doc.read_text()):
            name, number, unit = m.groups()[:3] if m.group(1) else m.groups()[3:]
            if name not in values:
                continue
            checked += 1
            said = float(number.replace(",", "")) * UNITS[unit or ""]
            if not any(abs(float(v) - said) <= 1e-9 * max(1.0, said) for v in values[name]):
                wrong.append(f"{doc.name}: {m.group(0)} (code: {values[name]})")
    assert checked >= 10, checked  # the pattern still finds what the docs quote
    assert not wrong, f"the docs quote constants at values the code no longer has: {wrong}"


def test_a_default_the_help_writes_out_is_the_option_s_default() -> None:
    """`--chunk-size ... (default 8M)`: the help texts that spell a default out instead of `%(default)s` say the
    value the parser gives (a changed default left `--help` saying the old one)."""
    parser = make_parser()
    checked, wrong = 0, []
    for action in parser._actions:
        if not isinstance(action.choices, dict):
            continue
        for sub in action.choices.values():
            for option in sub._actions:
                said = re.search(r"\(default (\w[\w.]*)\)", option.help or "")
                if said is None or option.default is None:
                    continue
                checked += 1
                value = option.type(said.group(1)) if callable(option.type) else said.group(1)
                if value != option.default:
                    wrong.append(f"{option.option_strings[0]}: help says {said.group(1)}, default {option.default!r}")
    assert checked >= 4, checked
    assert not wrong, wrong


def test_the_defaults_the_readme_gives_are_the_parser_s() -> None:
    """README's "Main options" (`--chunk-size` (8M), `--max-connections` (16 parallel GETs), ...) and the options it
    gives a "default X" (`--shared-cache-wait`, ...): each the value `modelfs mount` takes when it is not given."""
    text = (ROOT / "README.md").read_text()
    main = text[text.index("Main options:"):]
    main = main[:main.index("\n\n")]
    said = re.findall(r"`(--[a-z-]+)` \((\d[\w.%]*)[ ,;)]", main)
    said += re.findall(r"`(--[a-z-]+)` \([^)`]*?default `?([\w./%]+?)`?[),;]", text)
    options = make_parser()._subparsers._group_actions[0].choices["mount"]._option_string_actions
    checked, wrong = 0, []
    for flag, value in said:
        option = options[flag]
        if option.default is None:  # worked out at mount (--memory-limit, --cache-size): not the parser's
            continue
        checked += 1
        if (option.type(value) if callable(option.type) else value) != option.default:
            wrong.append(f"README: {flag} ({value}), default {option.default!r}")
    assert checked >= 8, checked
    assert not wrong, wrong


def test_every_option_a_command_s_help_lists_says_what_it_does_and_the_readme_names_it() -> None:
    """`--log-level` had no help text, and `--no-sign-request`, in `modelfs mount --help`, was named nowhere in README:
    an operator who follows README never learnt of it (B263)."""
    readme = (ROOT / "README.md").read_text()
    silent, unnamed = [], []
    for action in make_parser()._actions:
        if not isinstance(action.choices, dict):
            continue
        for name, sub in action.choices.items():
            for option in sub._actions:
                if not option.option_strings or option.help == argparse.SUPPRESS or "-h" in option.option_strings:
                    continue
                if not option.help:
                    silent.append(f"modelfs {name} {option.option_strings[0]}")
                named = (re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", readme) for flag in option.option_strings)
                if not any(named):
                    unnamed.append(f"modelfs {name} {option.option_strings[0]}")
    assert not silent, f"options whose --help says nothing: {sorted(set(silent))}"
    assert not unnamed, f"options README never names: {sorted(set(unnamed))}"


def test_the_waits_the_readme_spells_out_are_the_code_s() -> None:
    """README's Usage and its systemd and pod sections give waits in prose, not as constants' names: `modelfs stats`
    answers "within 10 s" or exits 1 (a probe's `timeoutSeconds` is sized by it), a pod's grace period is the unit's
    `TimeoutStopSec`, which covers every bound of a stop. A changed constant left the prose saying the old one."""
    from fsmount import cli, mount
    from fsmount.data import cache_dir, disk_cache
    from fsmount.stats_table import STATS_TIMEOUT_S
    from tests.unit.test_ops import stop_worst_s

    text = re.sub(r"\s*\n\s*(?:# )?", " ", (ROOT / "README.md").read_text())  # one line, Usage's comments joined
    unit = (ROOT / "systemd" / "modelfs@.service").read_text()
    timeout_stop = float(re.search(r"^TimeoutStopSec=(\d+)s$", unit, re.M).group(1))
    worst = stop_worst_s()
    said = {
        r"started meanwhile waits for them \(up to (\d+) s\)": cache_dir.DRAINING_WAIT_S,
        r"exit 1 for a daemon silent for (\d+) s": cli.STALE_CHECK_S,
        r"exit 1 where no daemon answers there within (\d+) s": STATS_TIMEOUT_S,
        r"its daemon does not answer within (\d+) s \(stopped, hung\)": STATS_TIMEOUT_S,
        r"Requests still in flight get (\d+) s to finish": mount.STOP_GRACE_S,
        r"to finish \((\d+) s while a file is open for writing": mount.STOP_GRACE_WRITING_S,
        r"its steps take up to (\d+) s at worst": worst,
        r"`TimeoutStopSec=(\d+)s`": timeout_stop,
        r"`terminationGracePeriodSeconds` of (\d+)": timeout_stop,
        r"the cache also leaves (\d+) GiB of that filesystem free": disk_cache.DEFAULT_MIN_FREE / (1 << 30),
        r"GiB of that filesystem free, or (\d+)% of a smaller one": disk_cache.MIN_FREE_SHARE * 100,
    }
    wrong = []
    for pattern, value in said.items():
        m = re.search(pattern, text)
        assert m, f"README no longer says {pattern!r}: reword this check with it"
        if float(m.group(1)) != value:
            wrong.append(f"README: {m.group(0)!r}, code: {value:g}")
    # The descriptors a mount holds at once with --cache-dir and the defaults, "about" as README says.
    m = re.search(r"the cache's files: about (\d+) with `--cache-dir` and the defaults", text)
    connections = make_parser()._subparsers._group_actions[0].choices["mount"]._option_string_actions[
        "--max-connections"].default
    held = mount.open_files_needed(connections, cache_dir=True)
    assert m, "README no longer says how many descriptors a mount holds: reword this check with it"
    if abs(int(m.group(1)) - held) > 2:
        wrong.append(f"README: {m.group(0)!r}, code: {held}")
    m = re.search(r"(\d+) s at worst", unit)
    if m is None or float(m.group(1)) != worst:
        wrong.append(f"systemd/modelfs@.service: {m and m.group(0)!r}, the bounds of a stop: {worst:g} s")
    assert not wrong, wrong
