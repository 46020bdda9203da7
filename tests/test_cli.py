"""The command table as it is: every command shardkit has, and every `shardkit X Y` the README and the notebooks tell a
reader to type, resolves in cli.COMMANDS to a function that imports and parses its options. No test adds or replaces a
command (the last test checks the suite for it), so deleting an entry from the table fails here."""
import inspect, json, re
from pathlib import Path
import pytest
from shardkit.apps.cli import COMMANDS, command_description, find_command, load_command, parser_of
from conftest import main_cli

ROOT = Path(__file__).resolve().parents[1]

# Every command shardkit has. A new command goes into cli.py (nbs/99_cli) and here; one removed from here on purpose.
SHARDKIT_COMMANDS = {
    ("demo",), ("ais", "up"), ("ais", "down"), ("ais", "status"), ("ais", "build"), ("ais", "put"),
    ("synth", "pets"), ("download", "pets"), ("convert", "pets"), ("synth", "folder"), ("convert", "folder"),
    ("shuffle",), ("ls",), ("show",), ("verify",), ("etl", "serve"), ("etl", "run"),
    ("bench", "convert"), ("bench", "etl"), ("bench", "dask-etl"), ("bench", "random"), ("bench", "mix"),
    ("bench", "loader"), ("bench", "train"), ("bench", "gpu"), ("bench", "scale"), ("bench", "startup"), ("bench", "soak"),
    ("bench", "tenants"), ("train",), ("docs",), ("docs", "execute"), ("docs", "shrink"), ("lab",), ("profile",),
}


def test_the_command_table_has_every_command():
    missing, unlisted = SHARDKIT_COMMANDS - set(COMMANDS), set(COMMANDS) - SHARDKIT_COMMANDS
    lost = " ".join(min(missing)) if missing else ""
    assert not missing, f"cli.COMMANDS lost {sorted(missing)}: `shardkit {lost}` answers 'unknown command'"
    assert not unlisted, f"new commands {sorted(unlisted)}: add them to SHARDKIT_COMMANDS in tests/test_cli.py"


@pytest.mark.parametrize("cmd", sorted(SHARDKIT_COMMANDS), ids=" ".join)
def test_each_command_imports_and_parses(cmd):
    "The function behind each command imports, and `--help` builds its parser from the signature and answers 0."
    assert cmd in COMMANDS, f"`shardkit {' '.join(cmd)}` is not in cli.COMMANDS"
    assert callable(load_command(cmd))
    parser_of(cmd)
    r = main_cli(*cmd, "--help")
    assert r.returncode == 0 and f"usage: shardkit {' '.join(cmd)}" in r.stdout, (r.stdout, r.stderr)


# `shardkit W1 [W2] [| W3 | W4]` (the README writes `shardkit ais up | down | status` for three commands)
_MENTION = re.compile(r"(?<![\w.])(?<!from )shardkit((?: (?!import\b)[a-z][\w-]*){1,2})((?: \| [a-z][\w-]*)*)")
_SPAN = re.compile(r"`([^`\n]+)`")  # inline code


def _texts():
    "(where, text, is_code) for README.md and every cell of every notebook under nbs/, tutorials included."
    yield "README.md", (ROOT / "README.md").read_text(), False
    for nb in sorted((ROOT / "nbs").rglob("*.ipynb")):
        if ".ipynb_checkpoints" in nb.parts: continue
        for i, cell in enumerate(json.loads(nb.read_text())["cells"]):
            yield f"{nb.relative_to(ROOT)} cell {i}", "".join(cell["source"]), cell["cell_type"] == "code"


def command_lines(text: str, is_code: bool) -> list[str]:
    "The pieces of `text` written as something to type: inline code, fenced blocks, `!` lines of a code cell."
    pieces, fenced = [], False
    for line in text.splitlines():
        if line.lstrip().startswith("```"): fenced = not fenced; continue
        if fenced or (is_code and line.lstrip().startswith("!")): pieces.append(line.lstrip(" !"))
        else: pieces += _SPAN.findall(line)
    return pieces


def mentioned_commands(text: str, is_code: bool) -> list[list[str]]:
    """Each `shardkit ...` in `text` as the words a user types: the ones written as something to type, and wherever
    else its first word names a command or group (prose such as "shardkit is" is not a command)."""
    groups = {k[0] for k in SHARDKIT_COMMANDS | set(COMMANDS)}
    typed = "\n".join(command_lines(text, is_code))
    found = []
    for source, all_of_it in ((typed, True), (text, False)):
        for m in _MENTION.finditer(source):
            words = m.group(1).split()
            if not all_of_it and words[0] not in groups: continue
            found += [words] + [words[:1] + [alt] for alt in m.group(2).split(" | ")[1:]]
    return [list(w) for w in dict.fromkeys(map(tuple, found))]  # once each, in order


def test_mentions_are_found():
    "The scanner itself, on the README's way of writing commands."
    assert mentioned_commands("```bash\nshardkit ais up | down | status   a cluster\n```", False) == [
        ["ais", "up"], ["ais", "down"], ["ais", "status"]]
    assert mentioned_commands("`shardkit lab` opens; shardkit is a kit", False) == [["lab"]]
    assert mentioned_commands('!shardkit ls data/x\nprint("shardkit bench gpu: nothing")', True) == [
        ["ls", "data"], ["bench", "gpu"]]


def _resolves(words: list[str]) -> bool:
    "A command, or a group asked for its list (`shardkit etl --help`)."
    cmd, _ = find_command(words)
    is_group = any(len(k) == 2 and k[0] == words[0] for k in COMMANDS)
    return cmd is not None or (is_group and (len(words) == 1 or words[1].startswith("-")))


def test_every_documented_command_exists():
    mentions = [(where, words) for where, text, is_code in _texts() for words in mentioned_commands(text, is_code)]
    assert len(mentions) > 100, "the scanner found too few commands in the README and notebooks"
    unknown = sorted({f"shardkit {' '.join(w)}  ({where})" for where, w in mentions if not _resolves(w)})
    assert not unknown, "documented commands that cli.COMMANDS does not have:\n" + "\n".join(unknown)
    used = {find_command(w)[0] for _, w in mentions} - {None}
    readme = {find_command(w)[0] for w in mentioned_commands((ROOT / "README.md").read_text(), False)}
    assert {("demo",), ("ais", "up"), ("convert", "pets"), ("bench", "loader"), ("lab",)} <= readme
    assert len(used) >= 25, f"only {len(used)} commands documented: {sorted(used)}"


def test_the_readme_lists_every_command():
    "The README's command list (the block after `<!-- command-list`) names every command in the table, and no other."
    text = (ROOT / "README.md").read_text()
    block = text[text.index("<!-- command-list"):]
    block = block[:block.index("```", block.index("```") + 3)]
    listed = {find_command(w)[0] for w in mentioned_commands(block, False)}
    assert None not in listed, "the README's command list names a command the table does not have"
    missing = sorted(" ".join(c) for c in set(COMMANDS) - listed)
    assert not missing, f"commands missing from the README's command list: {missing}"


def test_no_test_edits_the_command_table():
    "CLI tests run the real table: a test that registers the command it tests passes with the command deleted."
    edit = re.compile(r"COMMANDS\s*\[[^\]]*\]\s*=|setitem\([^,]*COMMANDS|delitem\([^,]*COMMANDS|"
                      r"COMMANDS\.(update|pop|popitem|setdefault|clear)\(|setattr\([^,]*,\s*['\"]COMMANDS")
    offenders = [f"{p.name}:{i}" for p in sorted((ROOT / "tests").glob("*.py")) if p.name != "test_cli.py"
                 for i, line in enumerate(p.read_text().splitlines(), 1) if edit.search(line)]
    assert not offenders, f"tests that change cli.COMMANDS (use the real table): {offenders}"


def test_help_has_no_placeholders_and_version_answers():
    "`--help` names each value the way the option reads (`--try TRY`, not `TRY_`); `--version` says the version."
    for cmd in COMMANDS:  # every command's help, built in this process (each parser is what `--help` prints)
        text = parser_of(cmd).format_help()
        odd = re.findall(r"\b[A-Z][A-Z0-9_]*_\b|default: None|%\(\w+\)|\bTODO\b", text)
        assert not odd, f"`shardkit {' '.join(cmd)} --help` shows {odd}:\n{text}"
        assert f"usage: shardkit {' '.join(cmd)}" in text and len(text.splitlines()) >= 4, text
    r = main_cli("profile", "--help")
    assert r.returncode == 0 and "--try TRY " in r.stdout and "TRY_" not in r.stdout, r.stdout
    r = main_cli("--version")
    assert r.returncode == 0 and r.stdout.startswith("shardkit 0."), r.stdout
    r = main_cli("convertt", "folder")
    assert r.returncode == 2 and "did you mean 'shardkit convert folder'" in r.stderr, r.stderr
    assert "commands:" not in r.stdout, "an unknown command says so first, without the list of every command"


def test_every_command_takes_its_options_from_its_function():
    """A command's options are its library function's parameters, defaults and docments (`shardkit.command`): its
    `*_cli` is at most 10 lines, declares no parameters of its own, and every option it shows has help."""
    long, own, bare = [], [], []
    for cmd in COMMANDS:
        run = load_command(cmd)
        assert hasattr(run, "options"), f"`shardkit {' '.join(cmd)}` is not made with shardkit.command.command"
        report = run.report
        lines = inspect.getsource(report).rstrip().splitlines()
        if len(lines) > 10: long.append(f"{report.__name__} ({len(lines)} lines)")
        if len(inspect.signature(report).parameters) != 2: own.append(report.__name__)
        bare += [f"{' '.join(cmd)} {a.option_strings or a.dest}" for a in parser_of(cmd)._actions
                 if not (a.help or "").strip()]
    assert not long, f"*_cli functions over 10 lines (move the work into the library function): {long}"
    assert not own, f"*_cli functions with parameters of their own (take them from the function): {own}"
    assert not bare, f"options without help (give the library parameter a docment): {bare}"


def test_each_command_has_one_description():
    """A command's description is its function's docstring, one line: what its `--help` starts with, what `shardkit
    --help` lists beside it (from the kept table, without importing it) and what the README's command list says."""
    from shardkit.apps.cli import overview
    usage = overview()
    for cmd in COMMANDS:
        run, name = load_command(cmd), " ".join(cmd)
        doc = run.__doc__ or ""
        assert doc.strip() and "\n" not in doc.strip(), f"`shardkit {name}`: give {run.__name__} a one-line docstring"
        assert command_description(cmd) == doc, name
        assert parser_of(cmd).description == doc, name
        assert re.search(rf"^  {re.escape(name)} +{re.escape(doc)}$", usage, re.M), f"`shardkit --help` on {name}"
    text = (ROOT / "README.md").read_text()
    block = text[text.index("<!-- command-list"):]
    block = block[:block.index("```", block.index("```") + 3)]
    lines = {find_command(line.split()[1:])[0]: line for line in block.splitlines() if line.startswith("shardkit ")}
    wrong = [f"shardkit {' '.join(cmd)}: {lines.get(cmd)!r}" for cmd in COMMANDS
             if not (lines.get(cmd) or "").endswith(" " + command_description(cmd))]
    assert not wrong, "the README's command list: each command on a line of its own, ending in its description " \
                      "(its function's docstring):\n" + "\n".join(wrong)


def test_a_commands_signature_tells_the_truth():
    "`inspect.signature` of a command shows what it takes: its options, by keyword, with their defaults."
    for cmd in COMMANDS:
        run = load_command(cmd)
        params = inspect.signature(run).parameters
        assert [p for p in params] == [o.name for o in run.options], cmd
        assert all(p.kind is p.KEYWORD_ONLY for p in params.values()), cmd
        assert [p.default for p in params.values()] == [o.default for o in run.options], cmd
    train = inspect.signature(load_command(("train",)))
    assert "shards" in train.parameters and "hist" not in train.parameters, train
