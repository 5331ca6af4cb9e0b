"""The README says what the code does: its quoted flags exist, its quoted error message is the one the
code prints, the files and documents it names exist, and its first two commands are the main job and
the tests (CI runs the second in a fresh environment; the first was typed in a fresh clone when its
output was quoted)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = (ROOT / "README.md").read_text()


def _code_blocks(text):
    return re.findall(r"```(?:bash|python)?\n(.*?)```", text, flags=re.S)


def test_the_first_two_commands_run_the_main_job_and_the_tests():
    blocks = [b for b in _code_blocks(README) if b.strip()]
    assert "mpirun -n 4 python -m pympar.train --preset small --steps 600 --lr 3e-3" in blocks[0]
    assert 'pip install ".[mpich,mkl]"' in blocks[0]
    assert blocks[1].strip().endswith("pytest")


def test_every_trainer_flag_the_readme_quotes_exists():
    from pympar.config import build_parser

    known = {s for a in build_parser()._actions for s in a.option_strings}
    commands = re.findall(r"python -m pympar\.train[^`\n]*", README)
    assert len(commands) >= 3
    flags = {f for c in commands for f in re.findall(r"(--[a-z][a-z0-9-]*)", c)}
    # flags quoted in prose after a trainer mention ("`--zero 1|2|3`", "`--dtype float32`")
    flags |= {f for f in re.findall(r"`(--[a-z][a-z0-9-]*)", README)
              if f not in ("--no-build-isolation", "--hostfile", "--max-restarts", "--tune")}
    missing = sorted(f for f in flags if f not in known)
    assert not missing, f"README quotes trainer flags the parser does not know: {missing}"


def test_the_quoted_error_is_the_codes():
    """The README's example of a refused layout, word for word."""
    from pympar.config import ConfigError, parse_args

    quoted = re.search(r"`pympar\.train: error: (dp\*[^`]+)`\s*\n\(from `mpirun -n (\d+) python -m pympar\.train ([^`]+)`\)",
                       README)
    assert quoted, "the README's error example and the command that prints it"
    message, world, args = quoted.group(1), int(quoted.group(2)), quoted.group(3).split()
    with pytest.raises(ConfigError) as e:
        parse_args(args, world)
    assert str(e.value) == message


def test_the_files_and_documents_it_names_exist():
    paths = set(re.findall(r"\(((?:docs|bench|tests|src)/[^)#\s:]+)", README))
    paths |= set(re.findall(r"`((?:src/pympar|csrc|bench|tests|docs)/[A-Za-z0-9_./-]+\.(?:py|cpp|md|h|sh))`", README))
    paths.add("CHANGELOG.md")
    assert len(paths) > 10
    missing = sorted(p for p in paths if not (ROOT / p).exists())
    assert not missing, f"README names files that do not exist: {missing}"
