"""The README's front door: its "Measured" section shows a chart that exists and is light, and every figure in its table
comes with a command that reproduces it, a real `shardkit` command; its "Limits" list is there. (The two command lines
of the quick start are tests/test_project.py's.)"""
import re, shlex
from pathlib import Path

from PIL import Image

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text(encoding="utf-8")


def _section(title: str) -> str:
    "The text of the README's `## title` section, up to the next `## `."
    assert f"\n## {title}\n" in README, f"README.md has no '## {title}' section"
    return README.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def _shardkit_commands(text: str) -> list[str]:
    "Every `shardkit ...` in `text`'s inline code and fenced blocks (a line may join several commands with &&)."
    blocks = re.findall(r"```[a-z]*\n(.*?)\n```", text, re.S)
    text = re.sub(r"```[a-z]*\n.*?\n```", "", text, flags=re.S)
    codes = re.findall(r"`([^`]*shardkit [^`]*)`", text) + [line for b in blocks for line in b.splitlines()]
    return [part.strip() for code in codes for part in code.split("&&") if part.strip().startswith("shardkit ")]


def test_measured_comes_first():
    "A reader sees results before the quick start: the Measured section is the first section."
    assert README.index("\n## Measured\n") < README.index("\n## Quick start\n") < README.index("\n## Limits\n")


def test_the_chart_exists_and_is_light():
    images = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", _section("Measured"))
    assert images, "the Measured section shows no chart"
    chart = ROOT / images[0]
    assert chart.is_file(), f"the README's chart {images[0]} does not exist; make it with the command under it"
    kb = chart.stat().st_size / 1e3
    assert kb < 200, f"{images[0]} is {kb:.0f} KB: save it at 1x (dpi 100-110)"
    with Image.open(chart) as im: assert im.format == "PNG" and im.width <= 1400, (im.format, im.size)


def test_every_image_in_the_readme_exists():
    missing = [p for p in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", README) if not (ROOT / p).is_file()]
    assert not missing, f"README.md shows images that do not exist: {missing}"


def test_every_measured_figure_has_a_real_command():
    "Each row of the headline table names a command, and each command is a shardkit command (shardkit.apps.cli.COMMANDS)."
    from shardkit.apps.cli import COMMANDS, find_command
    measured = _section("Measured")
    rows = [r for r in measured.splitlines() if r.startswith("|") and not r.startswith(("| what", "|---"))]
    assert len(rows) >= 4, f"the headline table has {len(rows)} rows: the loader, the profiler, scale, the GPU path"
    for row in rows:
        assert _shardkit_commands(row.split("|")[-2]), f"a row without a reproducing `shardkit ...` command: {row}"
    commands = _shardkit_commands(measured)
    chart = re.findall(r"!\[[^\]]*\]\(([^)]+)\)", measured)[0]
    assert any(" bench loader " in c and "--peers" in c and chart in c for c in commands), \
        f"the command that made {chart} (`shardkit bench loader ... --peers --plot {chart}`) is not under it"
    for c in commands:
        cmd, _ = find_command(shlex.split(c)[1:])
        assert cmd in COMMANDS, f"`{c}` is not a shardkit command; `shardkit --help` lists them"


def test_the_chart_says_when_and_where():
    measured = _section("Measured")
    assert re.search(r"20\d\d-\d\d-\d\d", measured) and "load average" in measured and "cores" in measured, \
        "under the chart: the date, the machine (cores) and the load average"


def test_limits_are_listed():
    items = [l for l in _section("Limits").splitlines() if l.startswith("- ")]
    assert len(items) >= 4, f"the Limits section lists {len(items)} items"
