"""Results files keep their hand-written notes when a script rewrites them (benchmarks/results_file.py)."""
import json
import re

import pytest

from benchmarks.results_file import NOTES_MARKER, check_outputs, command_line, write_keeping_notes, write_study
from benchmarks.roofline import main as roofline
from utils.config import REPO_ROOT


def test_notes_below_the_marker_survive_a_rewrite(tmp_path):
    path = tmp_path / "sub" / "table.md"
    write_keeping_notes(path, "| a | 1 |\n")                      # a new file: the output alone
    assert path.read_text() == "| a | 1 |\n"
    path.write_text(path.read_text() + f"\n{NOTES_MARKER}\n## Reading it\nby hand\n")
    write_keeping_notes(path, "| a | 2 |\n\n\n")                   # a rerun: new numbers, the same notes
    assert path.read_text() == f"| a | 2 |\n\n{NOTES_MARKER}\n## Reading it\nby hand\n"
    write_keeping_notes(path, "| a | 2 |")
    assert path.read_text() == f"| a | 2 |\n\n{NOTES_MARKER}\n## Reading it\nby hand\n"  # idempotent


def test_a_file_without_the_marker_is_replaced(tmp_path):
    path = tmp_path / "table.md"
    path.write_text("old output\nno notes\n")
    write_keeping_notes(path, "new output\n")
    assert path.read_text() == "new output\n"


def test_a_study_writes_its_table_figure_and_record_and_keeps_the_tables_notes(tmp_path, capsys):
    """scaling_study and large_batch_study write their three files this way: a rerun on a cluster keeps the notes
    a reader wrote below the table, as every other results file does."""
    out, drawn = tmp_path / "study" / "scaling", []
    out.parent.mkdir()
    out.with_suffix(".md").write_text(f"old table\n\n{NOTES_MARKER}\nread by hand\n")
    command = command_line("benchmarks/scaling_study.py", ["--ranks", "1", "2", "--out", tmp_path / "a b"])
    assert command == f"python benchmarks/scaling_study.py --ranks 1 2 --out '{tmp_path / 'a b'}'"  # pastes as is
    write_study(out, "new table\n", {"command": command, "rows": [1, 2]}, drawn.append)
    assert out.with_suffix(".md").read_text() == f"new table\n\n{NOTES_MARKER}\nread by hand\n"
    assert drawn == [out.with_suffix(".png")]
    assert json.loads(out.with_suffix(".json").read_text()) == {"command": command, "rows": [1, 2]}
    assert capsys.readouterr().out == f"wrote {out.with_suffix('.md')}, .png and .json\n"


def test_outputs_that_cannot_be_written_are_refused_before_any_work(tmp_path, capsys):
    """A benchmark of minutes must not fail at its last write (every script calls check_outputs after parsing)."""
    import argparse
    a_file, parser = tmp_path / "a_file", argparse.ArgumentParser(prog="bench")
    a_file.write_text("")
    for files, folders, message in (({"--out": tmp_path}, None, f"--out {tmp_path} is a folder; give a file name"),
                                    (None, {"OUT": a_file}, f"OUT {a_file} is a file; give a folder"),
                                    ({"--json": a_file / "r.json"}, None,
                                     f"--json {a_file / 'r.json'}: {a_file} is a file, so nothing can be made under "
                                     f"it; choose another place")):
        with pytest.raises(SystemExit) as caught:
            check_outputs(parser, files=files, folders=folders)
        assert caught.value.code == 2 and capsys.readouterr().err.endswith(f"bench: error: {message}\n")
    check_outputs(parser, files={"--out": tmp_path / "new" / "r.md", "--json": None, "--plot": a_file},
                  folders={"OUT": tmp_path / "runs"})
    assert not (tmp_path / "new").exists() and not (tmp_path / "runs").exists()  # a refused run leaves nothing
    # every script with an output calls it
    scripts = [p for p in (REPO_ROOT / "benchmarks").glob("*.py") if re.search(r"add_argument\(\"(--out|--json|"
               r"--output|--plot|out)\"", p.read_text())]
    assert len(scripts) >= 18 and all("check_outputs(parser" in p.read_text() for p in scripts), \
        [p.name for p in scripts if "check_outputs(parser" not in p.read_text()]


@pytest.mark.parametrize("gpu", ["h100", "h200"])
def test_the_committed_rooflines_are_the_scripts_output_and_their_notes(gpu, tmp_path, capsys):
    """Rerunning roofline.py over a copy of benchmarks/results/roofline_<gpu>.md gives the file back unchanged:
    its table is current (the kernel times in <gpu>.json included), and its notes are kept."""
    committed = f"benchmarks/results/roofline_{gpu}.md"
    with open(committed) as f:
        text = f.read()
    assert NOTES_MARKER in text
    copy = tmp_path / "roofline.md"
    copy.write_text(text)
    roofline(["--gpu", gpu, "--out", str(copy)])
    assert copy.read_text() == text
