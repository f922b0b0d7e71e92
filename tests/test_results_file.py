"""Results files keep their hand-written notes when a script rewrites them (benchmarks/results_file.py)."""
import pytest

from benchmarks.results_file import NOTES_MARKER, write_keeping_notes
from benchmarks.roofline import main as roofline


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
