"""Results files hold a script's output and, below it, notes written by hand that read the numbers. A script that
rewrites such a file keeps the notes: everything from the marker line on stays as it was."""
from pathlib import Path

NOTES_MARKER = "<!-- written by hand from here on: scripts that rewrite this file keep it -->"


def write_keeping_notes(path, generated):
    """Write ``generated`` to ``path``, followed by the hand-written part of the file already there, if any."""
    path = Path(path)
    old = path.read_text() if path.is_file() else ""
    at = old.find(NOTES_MARKER)
    notes = "\n" + old[at:] if at >= 0 else ""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(generated.rstrip("\n") + "\n" + notes)
