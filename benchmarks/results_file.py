"""Results files hold a script's output and, below it, notes written by hand that read the numbers. A script that
rewrites such a file keeps the notes: everything from the marker line on stays as it was.

``check_outputs`` is every benchmark's first step after parsing: a run of minutes on a GPU must not fail at its
last write."""
import json
import os
import shlex
import sys
from pathlib import Path

NOTES_MARKER = "<!-- written by hand from here on: scripts that rewrite this file keep it -->"


def command_line(script, argv=None):
    """The command that ran ``script`` (a benchmark's ``__file__``) with ``argv`` (default: the process's), as a
    results file names it: ``python benchmarks/<name>.py ...``, from the repository's root."""
    return shlex.join(["python", f"benchmarks/{Path(script).name}"] + [str(arg) for arg in
                                                                       (sys.argv[1:] if argv is None else argv)])


def shown_path(path):
    """``path`` as a results file's command names it: from the repository's root when inside it, so that the
    command pastes on any clone; as given otherwise."""
    resolved, root = Path(path).resolve(), Path(__file__).resolve().parent.parent
    return str(resolved.relative_to(root)) if resolved.is_relative_to(root) else str(path)


def write_keeping_notes(path, generated):
    """Write ``generated`` to ``path``, followed by the hand-written part of the file already there, if any."""
    path = Path(path)
    old = path.read_text() if path.is_file() else ""
    at = old.find(NOTES_MARKER)
    notes = "\n" + old[at:] if at >= 0 else ""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(generated.rstrip("\n") + "\n" + notes)


def write_study(out, text, record, draw):
    """A study's three files beside ``out``: its table (``text``, as .md, keeping the notes below it), the figure
    ``draw(path)`` saves (.png) and its ``record`` (.json)."""
    out = Path(out)
    write_keeping_notes(out.with_suffix(".md"), text)
    draw(out.with_suffix(".png"))
    out.with_suffix(".json").write_text(json.dumps(record, indent=2))
    print(f"wrote {out.with_suffix('.md')}, .png and .json")


def check_outputs(parser, files=None, folders=None):
    """A one-line parser error (exit code 2) unless each output can be written: ``files`` and ``folders`` map a
    flag to its path (None: not asked for). Nothing is created: the nearest folder that exists must be writable."""
    outputs = [(flag, Path(path), False) for flag, path in (files or {}).items() if path] + \
        [(flag, Path(path), True) for flag, path in (folders or {}).items() if path]
    for flag, path, is_folder in outputs:
        if path.exists() and path.is_dir() != is_folder:
            parser.error(f"{flag} {path} is a {'file' if is_folder else 'folder'}; give a "
                         f"{'folder' if is_folder else 'file name'}")
        existing = path.absolute()
        while not existing.exists():
            existing = existing.parent
        if existing != path.absolute() and not existing.is_dir():
            parser.error(f"{flag} {path}: {existing} is a file, so nothing can be made under it; choose another place")
        if not os.access(existing if existing.is_dir() else existing.parent, os.W_OK):
            parser.error(f"{flag} {path}: {existing} is not writable; choose another place")
