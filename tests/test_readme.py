"""The README's and docs/' commands are real: the make targets they name exist (the two commands in
the README) and the CLI they show runs."""

import re
import subprocess
import sys

import pytest

from tests.helpers import ROOT, doc_files

README = (ROOT / "README.md").read_text()
DOCS = "\n".join((ROOT / doc).read_text() for doc in doc_files())


def test_readme_names_the_two_commands_and_ci_runs_make_test():
    assert "make demo" in README and "make test" in README
    assert "make test" in (ROOT / ".ci/run").read_text()
    makefile = (ROOT / "Makefile").read_text()
    named = set(re.findall(r"`make ([a-z0-9-]+)`", DOCS)) - {"bench-"}  # less `make bench-<name>`
    assert {"bench", "lint", "proto", "test", "bench-codec"} <= named, named  # the regex still finds them
    for target in named:
        assert re.search(rf"^{re.escape(target)}:", makefile, re.M), target
    benches = re.findall(r"^(bench-[a-z0-9-]+):", makefile, re.M)
    assert len(benches) >= 6 and set(benches) <= named, set(benches) - named  # every bench documented


def test_every_cli_subcommand_documented_exists():
    from recserve.cli import COMMANDS

    shown = set(re.findall(r"^recserve ([a-z]+)", DOCS, re.M))
    assert {"train", "up", "score", "down"} <= shown, shown  # the regex still finds the lines
    assert shown <= set(COMMANDS), shown - set(COMMANDS)


@pytest.mark.slow
def test_recserve_transform_runs_as_documented(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "recserve", "transform", "--schema", "data/schemas/criteo.yaml",
         "--data", "data/criteo/wide_resdnn_criteo_test.tsv", "--limit", "400", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "400 rows" in out.stdout and len(list(tmp_path.glob("*.rscb"))) == 2
