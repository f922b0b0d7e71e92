"""The default run's code stays readable: extras are imported only when their config key turns them on."""
import re
import subprocess
import sys

import pytest

from benchmarks import code_reach
from utils.config import REPO_ROOT

# Imported inside the function that uses them, when their key is on: never by `import train` alone.
EXTRAS = ("science", "utils.benchy", "utils.profiling", "utils.comm_hooks", "utils.data.fast", "utils.data.gpu",
          "utils.data.dali", "utils.pinned_copy", "utils.data.batches", "utils.data.symmetry_torch", "utils.units",
          "utils.make_dataset",
          "utils.cpu_amp", "utils.arguments", "matplotlib")


def test_reach_counts_the_files_an_import_chain_reaches(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text("import os\nfrom pkg import b\n\n\ndef later():\n    import pkg.c\n")
    (tmp_path / "pkg" / "b.py").write_text("x = 1\ny = 2\n")
    (tmp_path / "pkg" / "c.py").write_text("z = 3\n")
    (tmp_path / "main.py").write_text("import pkg.a\n")
    top = code_reach.reach(tmp_path / "main.py", root=tmp_path)
    assert {p.relative_to(tmp_path).as_posix(): n for p, n in top.items()} == {
        "main.py": 1, "pkg/__init__.py": 0, "pkg/a.py": 6, "pkg/b.py": 2}  # os is not the project's
    everything = code_reach.reach(tmp_path / "main.py", root=tmp_path, inside_functions=True)
    assert tmp_path / "pkg" / "c.py" in everything and len(everything) == 5


def test_an_entry_that_is_no_python_file_here_is_one_line(capsys):
    """Unchecked, each is a traceback (FileNotFoundError, IsADirectoryError, a SyntaxError from parsing the README)."""
    for entry in ("nonexist.py", "README.md", "utils", "/"):
        with pytest.raises(SystemExit) as stop:
            code_reach.main([entry])
        assert stop.value.code == 2
        assert f"error: {entry} is not a Python file of this repository" in capsys.readouterr().err


def test_train_reaches_no_extra_at_module_level():
    reached = {p.relative_to(REPO_ROOT).with_suffix("").as_posix().replace("/", ".").removesuffix(".__init__")
               for p in code_reach.reach(REPO_ROOT / "train.py")}
    assert not {name for name in reached if name.startswith(EXTRAS)}, reached


def test_importing_train_loads_no_extra():
    """What the interpreter really loads (the static count above could miss an import made another way)."""
    code = "import sys, train; print('\\n'.join(sorted(sys.modules)))"
    loaded = subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, capture_output=True, text=True,
                            check=True).stdout.split()
    assert not [name for name in loaded if name.startswith(EXTRAS)]


def test_the_default_runs_code_stays_within_its_budget():
    """A ratchet on what a reader of the default run meets (README section 18): about today's size, so it can only
    shrink towards the readability goal of 2,500 lines in at most 12 files, never grow by accident."""
    reached = code_reach.reach(REPO_ROOT / "train.py")
    assert len(reached) <= 12 and sum(reached.values()) <= 3539, {p.name: n for p, n in reached.items()}


def test_the_readme_quotes_todays_count():
    """README section 18's code-map command shows what it prints today."""
    quoted = re.search(r"code_reach\.py train\.py --files +# (\d+) files, ([\d,]+) lines reached by module-level "
                       r"imports", (REPO_ROOT / "README.md").read_text())
    reached = code_reach.reach(REPO_ROOT / "train.py")
    assert quoted and (int(quoted[1]), int(quoted[2].replace(",", ""))) == (len(reached), sum(reached.values()))
