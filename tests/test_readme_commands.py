"""The README's CPU walk-through, pasted in order on a fresh clone, does what the README says.

Which commands run is decided in README.md itself, so the README cannot drift from this test:

* A ```bash block runs when the line just before its fence is the HTML comment
  ``<!-- cpu-walkthrough -->`` (every command of the block) or
  ``<!-- cpu-walkthrough: commands 1-3 -->`` / ``<!-- cpu-walkthrough: command 2 -->`` (only those
  commands of the block, counted from 1). A command is a non-blank line that is not a ``#`` comment,
  with ``\\``-continued lines joined. Unmarked blocks are not run: GPU-only commands, launches on
  many GPUs, Slurm (``sbatch``/``salloc``), containers, placeholder paths, the test suite itself,
  and data at the reference's sizes (38.7 GB).
* A leading ``pip install -r FILE && `` is dropped from a command: CI has just installed exactly
  those files (``.ci/run``), and a test must not change the environment it runs in.
* Commands run as written, with bash, in README order, in a fresh ``git clone`` of this repository
  over which the working tree's files (tracked, and untracked but not ignored: what ``git add -A``
  would commit) are copied, so the code under test is checked, committed or not; ``data/`` is not
  copied: the clone generates its own, as a new user's does. ``python`` and ``torchrun`` are this
  interpreter's, the environment is a user's (no ``$EXPDIR``, no rank or Slurm variables) and no GPU
  is visible: this is the laptop path. Under pytest-xdist it is a user's who shares the machine:
  ``OMP_NUM_THREADS`` is the worker's share of the cores (``tests/conftest.py``).
* Each command must exit with status 0, and a few of the README's claims about it are checked
  (``CLAIMS``). After the walk-through the quickstart command runs once more and must continue its
  own run (section 3: "the same command continues its run").

The README's other commands (GPU, many nodes, Slurm) are not run, but each must be accepted: a training command
parses and loads its config, another script's command passes that script's argument parser with its flags spelt
out, and every flag the prose quotes is one of those parsers' or another tool's; each section's *Code:* line names
files that exist and what they define (fast tests). The results files' commands and the scripts' usage lines (the
Python scripts' docstrings, submit_pm.sh's header) are held to the same checks.

``test_readme_marks_the_walkthrough`` (fast) checks the extraction; ``test_readme_walkthrough_on_a_fresh_clone``
(slow, run with --full as CI does) runs it; CI starts it first, and it takes minutes (the quickstart alone
86-111 s on the 2-core machine; the suite's times are in benchmarks/results/test_times.md).
"""
import ast
import json
import os
import contextlib
import io
import itertools
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from unittest import mock

import pytest
import torch

from conftest import free_port, project_files

REPO_ROOT = Path(__file__).resolve().parent.parent
README = REPO_ROOT / "README.md"

MARKER = re.compile(r"^<!--\s*cpu-walkthrough(?::\s*commands?\s+([0-9,\s-]+))?\s*-->\s*$")
PIP_PREFIX = re.compile(r"^pip install (-q )?-r \S+ && ")

# The walk-through must keep at least these commands (so a marked block cannot silently drop out);
# the README may add more. Compared without the trailing comment and with spaces collapsed.
EXPECTED = [
    "python train.py --config=quickstart",
    "python -m utils.make_dataset --box 256 --seed 1 --out data/train.h5",
    "python -m utils.make_dataset --box 128 --seed 2 --out data/val.h5",
    "python -m utils.make_dataset --out data/train.h5 --npy_only",
    "python train.py --config=quickstart --num_epochs 1 --Nsamples 256 --profile_dir traces",
    "python train.py --config=quickstart --enable_benchy",
    "python benchmarks/ladder.py --tiny",
    "python benchmarks/roofline.py",
    "torchrun --nproc_per_node=2 train.py --config=quickstart --num_epochs 1 --Nsamples 512",
    "torchrun --nproc_per_node=2 train.py --config=quickstart --num_epochs 1 --spatial_parallel 2",
    "python benchmarks/gpu_suite.py logs/suite_small --small",
    "python -m utils.plot_logs logs/quickstart/1GPU/0",
    "python -m science.report logs/quickstart/1GPU/0",
    "python predict.py --checkpoint logs/quickstart/1GPU/0 --input data/quickstart_val.h5 --output logs/hydro.h5 "
    "--force",
    "python -m science.report logs/hydro.h5",
]
QUICKSTART = "python train.py --config=quickstart"
TIMEOUT_S = 900  # per command; the slowest, the quickstart, takes 86-111 s on the 2-core machine


def select(spec, count):
    """The 1-based command numbers a marker names ("1-3", "2", "1, 3"); all of them without a list."""
    if spec is None:
        return list(range(1, count + 1))
    numbers = []
    for part in spec.replace(" ", "").split(","):
        first, _, last = part.partition("-")
        numbers += range(int(first), int(last or first) + 1)
    assert numbers and all(1 <= n <= count for n in numbers), f"marker names commands {spec} of a {count}-command block"
    return numbers


def block_commands(lines):
    """The commands of a code block's lines: comments and blank lines dropped, continuations joined."""
    commands, pending = [], ""
    for line in lines:
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1]
            continue
        commands.append((pending + line).strip())
        pending = ""
    assert not pending, f"a code block ends inside a continued command: {pending}"
    return commands


def readme_commands(text):
    """[(section, command)] of the marked blocks, in README order, pip prefix dropped."""
    lines, section, found = text.split("\n"), None, []
    for i, line in enumerate(lines):
        if line.startswith("## "):
            section = line[3:].strip()
        match = MARKER.match(line.strip())
        if not match:
            assert not (line.lstrip().startswith("<!--") and "cpu-walkthrough" in line), \
                f"README line {i + 1}: malformed marker {line!r}"
            continue
        assert i + 1 < len(lines) and lines[i + 1].strip() == "```bash", \
            f"README line {i + 1}: the marker must be the line just before a ```bash fence"
        end = next(j for j in range(i + 2, len(lines)) if lines[j].strip() == "```")
        commands = block_commands(lines[i + 2:end])
        for n in select(match.group(1) and match.group(1).strip(), len(commands)):
            found.append((section, PIP_PREFIX.sub("", commands[n - 1])))
    return found


def bare(command):
    """The command without its trailing comment, spaces collapsed (for comparisons)."""
    return " ".join(re.sub(r"\s+#.*$", "", command).split())


def test_readme_marks_the_walkthrough():
    text = README.read_text()
    commands = [bare(c) for _, c in readme_commands(text)]
    missing = [c for c in EXPECTED if c not in commands]
    assert not missing, f"README commands no longer in the marked walk-through: {missing}; found {commands}"
    assert sum(bool(MARKER.match(line.strip())) for line in text.split("\n")) >= 8
    # What must never run here: the suite itself (it would run this test), GPU, Slurm, containers.
    for command in commands:
        assert not re.search(r"\b(sbatch|salloc|srun|docker|nsys|pytest)\b", command), command
    # The rules themselves.
    assert block_commands(["# c", "", "a \\", "  --b", "c  # d"]) == ["a   --b", "c  # d"]
    assert select(None, 3) == [1, 2, 3] and select("1-3", 5) == [1, 2, 3] and select("2", 2) == [2]
    assert PIP_PREFIX.sub("", "pip install -r requirements.txt && python x.py") == "python x.py"


def test_every_conv_forms_value_the_readme_quotes_is_accepted():
    """The README quotes --conv_forms values (after the flag, or as `layer=form,...`) that no walk-through runs:
    each must pass the config's check for the model it names (the reference's on 64^3 crops), or a reader's
    paste fails at start-up."""
    from networks.conv_forms import FORMS
    from utils.config import load_config
    text = README.read_text()
    spec = r"[a-z0-9_]+(?:=[a-z_]+)?(?:,[a-z0-9_]+=[a-z_]+)*"
    values = set(re.findall(rf"--conv_forms[ =]({spec})(?![a-z0-9_=,.])", text))
    values |= {value for value in re.findall(rf"`({spec})`", text)
               if "=" in value and set(re.findall(r"=([a-z_]+)", value)) <= set(FORMS)}
    assert len(values) >= 8, sorted(values)  # the extraction still finds them
    for value in sorted(values):
        load_config("base", overrides={"conv_forms": value})  # raises ConfigError naming what was wrong


COMMAND_START = re.compile(r"^(\$ )?(\w+=\S* +)*(python|torchrun|sbatch|bash) ")


def shown_commands(text, commands_only=False):
    """[(command, its words)] of every command a markdown text shows, run or not: each line of a code block
    (continued lines joined) and inline code naming a script with arguments. With ``commands_only``, a code block's
    lines that do not start like a command (``python``, ``$ torchrun``, ``VAR=x sbatch``) are dropped: the results
    files' blocks hold printed output too. Placeholders in capitals (``CELL``) and shell variables (``$k``) become 1,
    and the words stop at the first shell operator or redirection."""
    lines, block, prose = [], None, []
    for line in text.split("\n"):
        if line.startswith("```"):
            if block is not None:
                lines += [c for c in block_commands(block) if not commands_only or COMMAND_START.match(c)]
            block = [] if block is None else None
        elif block is not None:
            block.append(line)
        else:
            prose.append(line)
    spans = [span for span in re.findall(r"`([^`]+)`", "\n".join(prose))
             if re.search(r"\b(?:[\w/]+\.(?:py|sh)|-m [\w.]+) -", span)]
    lines += [" ".join(span.split()) for span in spans]  # inline code may wrap onto the next line
    found = []
    for line in lines:
        words = itertools.takewhile(lambda w: w not in ("|", "&&", ";", "&") and not re.match(r"\d*[<>]", w),
                                    shlex.split(line, comments=True))
        found.append((line, ["1" if re.fullmatch(r"[A-Z][A-Z_]*|\$\w+|\$\{\w+\}", w) else w for w in words]))
    return found


def usage_commands(path):
    """shown_commands of a script's usage lines: a Python script's docstring lines indented by four spaces or more, a
    shell script's comment lines indented by three (``#   sbatch ...``); their ``[--flag value]`` brackets dropped and
    the first of ``a|b|c`` alternatives taken."""
    if path.suffix == ".sh":
        doc = "\n".join(" " + line[1:] for line in path.read_text().splitlines() if line.startswith("#   "))
    else:
        doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    doc = re.sub(r"\[(--[^\]]+)\]", r"\1", doc)
    doc = re.sub(r"(?<= )([\w.]+)(?:\|[\w.]+)+", r"\1", doc)
    usage = [line.strip() for line in doc.splitlines() if line.startswith("    ")]
    return shown_commands("```\n" + "\n".join(usage) + "\n```", commands_only=True)


def script_arguments(words, scripts):
    """The arguments after the first of ``scripts`` in ``words`` (not a file named on another script's command
    line, as in ``code_reach.py train.py``), or None."""
    at = next((i for i, word in enumerate(words)
               if word.endswith(scripts) and not (i and words[i - 1].endswith(".py"))), None)
    return None if at is None or "--help" in words else words[at + 1:]


TRAINING_SCRIPTS = ("train.py", "train_graph.py", "submit_pm.sh")


class Parsed(Exception):
    """Raised in place of returning from argparse: the command line was accepted, and nothing more runs."""


def refusals(commands):
    """([(command, None or why it is refused)], the option strings of every parser asked) for shown_commands' list.

    A training command (train.py, train_graph.py, submit_pm.sh) must parse and load its config, at world size 1
    (the batch's split over ranks is checked at launch). Another python command must pass its own script's argument
    parser: the script runs up to its parse, then stops (``Parsed``). The suite's own commands and --help are not
    asked; train.py's parser always is."""
    import argparse
    import runpy
    import train
    from utils.config import ConfigError, load_config
    parse, results, options = argparse.ArgumentParser.parse_args, [], set()

    def parse_then_stop(self, args=None, namespace=None):
        options.update(self._option_string_actions)  # every parser refuses abbreviations (test_arguments.py)
        parse(self, args, namespace)
        raise Parsed
    for line, words in commands:
        if (arguments := script_arguments(words, TRAINING_SCRIPTS)) is None:
            continue
        err = io.StringIO()
        try:
            with contextlib.redirect_stderr(err):
                args = train.parse_args(arguments)
            load_config(args.config, args.yaml_config, train.config_overrides(args, 1))
            results.append((line, None))
        except SystemExit:
            results.append((line, err.getvalue().strip().splitlines()[-1]))
        except ConfigError as error:
            results.append((line, str(error)))
    with mock.patch.object(argparse.ArgumentParser, "parse_args", parse_then_stop), \
            mock.patch.object(sys, "path", list(sys.path)), mock.patch.object(sys, "argv", list(sys.argv)):
        with pytest.raises(Parsed):
            train.parse_args([])
        for line, words in commands:
            after_python = words[words.index("python") + 1:] if "python" in words else []
            if after_python[:1] == ["-m"]:  # a module, by its file: run_module would warn that the tests imported it
                target, arguments = after_python[1].replace(".", "/") + ".py", after_python[2:]
            elif (arguments := script_arguments(words, (".py",))) is not None:  # after python, torchrun, or alone
                target = words[len(words) - len(arguments) - 1]
            else:
                continue
            if "--help" in words or target == "pytest.py" or target.endswith(TRAINING_SCRIPTS):
                continue  # the suite itself; the training commands (above)
            if not (REPO_ROOT / target).is_file():
                results.append((line, f"{target}: no such script"))
                continue
            sys.argv = [target] + arguments  # the scripts (the scripts put the repository on sys.path)
            err = io.StringIO()
            try:
                with contextlib.redirect_stderr(err):
                    runpy.run_path(str(REPO_ROOT / target), run_name="__main__")
                results.append((line, "ran past its argument parser"))
            except Parsed:
                results.append((line, None))
            except SystemExit:
                refusal = err.getvalue().strip().splitlines()[-1]
                # `predict.py --whole_box` in the prose names a flag, not a whole command: its flags must exist
                whole = "python" in words or "torchrun" in words
                results.append((line, refusal if whole or "arguments are required" not in refusal else None))
    return results, options


def refused(results):
    """The refusals of refusals()' results, each with its command."""
    return [f"{line!r}: {refusal}" for line, refusal in results if refusal]


def test_every_command_the_readme_shows_is_accepted():
    """Most of the README's commands need a GPU or many nodes and no test runs them: each must still name flags,
    values and a config that exist, or a reader's paste fails at start-up. The training commands (train.py,
    train_graph.py, submit_pm.sh; docker/README.md's too) parse and load their config; the benchmarks', predict.py's
    and the modules' pass their script's parser."""
    text = README.read_text() + "\n" + (REPO_ROOT / "docker" / "README.md").read_text()
    results, _ = refusals(shown_commands(text))
    assert sum(bool(script_arguments(words, TRAINING_SCRIPTS) is not None) for _, words in shown_commands(text)) \
        >= 20  # the extraction still finds them
    assert len(results) >= 45, results
    assert not refused(results), refused(results)
    assert shown_commands("```bash\npython train.py --config=x \\\n  --seed N  # c\n```\n`x.py train.py --a`") == [
        ("python train.py --config=x   --seed N  # c", ["python", "train.py", "--config=x", "--seed", "1"]),
        ("x.py train.py --a", ["x.py", "train.py", "--a"])]
    assert script_arguments(["x.py", "train.py", "--a"], ("train.py",)) is None


def test_every_command_of_the_results_files_and_the_scripts_usage_is_accepted():
    """The results files' commands are how a reader repeats a measurement, and each script's docstring (or shell
    header) shows its usage: the same checks as the README's commands. A renamed flag must update them too."""
    docs = sorted((REPO_ROOT / "benchmarks" / "results").glob("*.md")) + [REPO_ROOT / "example_logs" / "README.md"]
    commands = [c for doc in docs for c in shown_commands(doc.read_text(), commands_only=True)]
    commands += [c for path in project_files("*.py", "*.sh") for c in usage_commands(path)]
    results, _ = refusals(commands)
    assert len(results) >= 70, results  # the extraction still finds them
    assert not refused(results), refused(results)
    assert shown_commands("```\nlog line 'unbalanced\n$ K=1 python x.py --k $k\n```", commands_only=True) == [
        ("$ K=1 python x.py --k $k", ["$", "K=1", "python", "x.py", "--k", "1"])]


# Flags the README quotes of other tools: torchrun, TensorBoard, Nsight Systems, Slurm (srun's, sbatch's), Shifter,
# docker run, pytest, pip; and the prefix of the on/off flags' off form, named on its own
OTHER_TOOLS_FLAGS = {"--index-url", "--nproc_per_node", "--max_restarts", "--logdir", "--capture-range",
                     "--capture-range-end", "--trace", "--constraint", "--gpus-per-node", "--ntasks-per-node",
                     "--signal", "--kill-on-bad-exit", "--export", "--image", "--module", "--full", "--dist",
                     "--ignore", "--timeout", "--no-", "--cpu-bind", "--mem", "--memory"}


def test_every_flag_the_readme_names_exists():
    """A flag quoted in the prose (`--no-channels_last`) is pasted too: each is one of train.py's, of a script
    the README runs, or of another tool (``OTHER_TOOLS_FLAGS``). `--num_epoch` is quoted as the typo it is."""
    _, options = refusals(shown_commands(README.read_text()))
    text = README.read_text().replace("`--num_epoch` is an error", "")
    quoted = set(re.findall(r"(?<![\w-])--[A-Za-z][\w.-]*|(?<![\w-])--no-(?![\w])", text))
    unknown = quoted - options - OTHER_TOOLS_FLAGS
    assert not unknown, f"README flags that no parser here knows: {sorted(unknown)}"
    assert {"--amp_mode", "--no-channels_last", "--box", "--tiny", "--checkpoint"} <= options  # the parsers were asked


def test_every_code_line_names_files_that_define_what_it_names():
    """Each section's *Code:* line is where a reader looks for the lesson: its files exist, and every name it gives
    is defined (def or class) or imported in one of them, or is a config key (``conv_forms``)."""
    from utils.config import SCHEMA
    lines = [" ".join(m.group(0).split()) for m in re.finditer(r"^\*Code:.*?\*$", README.read_text(), re.S | re.M)]
    assert len(lines) >= 15, lines  # one per section
    checked = 0
    for line in lines:
        quoted = re.findall(r"`([^`]+)`", line)
        paths = [q for q in quoted if "/" in q or re.search(r"\.(py|sh|txt|ipynb|md)$", q) or q.startswith(".")]
        folders = {REPO_ROOT / p for p in paths if p.endswith("/")} | {(REPO_ROOT / p).parent for p in paths}
        files = []
        for path in paths:  # a bare name is beside a file the line named before (`fast.py` in utils/data/)
            found = [f for f in [REPO_ROOT / path] + [folder / path for folder in folders] if f.exists()]
            assert found, f"README {line[:60]!r}: {path} does not exist"
            files += [f for f in found[:1] if f.is_file()]
        source = "\n".join(f.read_text() for f in files if f.suffix == ".py")
        for name in (q for q in quoted if re.fullmatch(r"[A-Za-z_]\w*", q) and q not in paths):
            defined = re.search(rf"^\s*(def|class) {name}\b|^from \S+ import .*\b{name}\b|^import .*\b{name}\b",
                                source, re.M)
            assert defined or name in SCHEMA, f"README {line[:60]!r}: {name} is in none of {[f.name for f in files]}"
            checked += 1
    assert checked >= 25, checked


def github_slug(heading):
    """The anchor GitHub gives a heading: lower case, punctuation (but - and _) dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_of_the_markdown_files_lands():
    """The table of contents' anchors are headings' GitHub anchors; images and file links are files here."""
    checked = 0
    for doc in [README, REPO_ROOT / "docker" / "README.md", REPO_ROOT / "example_logs" / "README.md"]:
        text = doc.read_text()
        headings = {github_slug(h) for h in re.findall(r"^#{1,6} (.+)$", re.sub(r"```.*?```", "", text, flags=re.S),
                                                          re.M)}
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if target.startswith("http"):
                continue
            path, _, fragment = target.partition("#")
            if path:
                assert (doc.parent / path).exists(), f"{doc.name}: the link to {target} leads nowhere"
            else:
                assert fragment in headings, f"{doc.name}: no heading has the anchor #{fragment}"
            checked += 1
    assert checked >= 20, checked
    assert github_slug("5. One GPU: mixed precision, fused Adam, channels-last, compile") == \
        "5-one-gpu-mixed-precision-fused-adam-channels-last-compile"



def test_the_quickstart_log_the_readme_shows_is_the_example_logs():
    """Section 2's log excerpt is lines of example_logs/'s out.log, each whole or cut where it ends in '...'."""
    text = README.read_text()
    block = re.search(r"```\n(\d\d:\d\d:\d\d Run directory: logs/quickstart/.*?)```", text, re.S)
    assert block, "README: no quickstart log block starting with its 'Run directory:' line"
    logged = (REPO_ROOT / "example_logs" / "quickstart" / "1GPU" / "0" / "out.log").read_text().splitlines()
    shown = [line for line in block.group(1).splitlines() if line != "..."]
    for line in shown:
        found = any(entry.startswith(line[:-3]) for entry in logged) if line.endswith("...") else line in logged
        assert found, f"README shows a quickstart log line that example_logs/ does not have:\n{line}"
    assert len(shown) >= 10 and "Final validation L1" in shown[-2] and "Time spent:" in shown[-1]


# --- running it ----------------------------------------------------------------------------------

def git_status(clone):
    """The lines of ``git status --porcelain``: what differs from the commit, ignored files left out."""
    return subprocess.run(["git", "status", "--porcelain"], cwd=clone, check=True, capture_output=True,
                          text=True).stdout.splitlines()


def fresh_clone(target):
    """git clone of the repository, with the working tree's files (tracked or not ignored) copied over it."""
    subprocess.run(["git", "clone", "-q", str(REPO_ROOT), str(target)], check=True, capture_output=True, text=True)
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=REPO_ROOT,
                            check=True, capture_output=True, text=True).stdout.split("\0")
    wanted = {name for name in listed if name and (REPO_ROOT / name).is_file()}  # deleted files are not wanted
    cloned = subprocess.run(["git", "ls-files", "-z"], cwd=target, check=True, capture_output=True,
                            text=True).stdout.split("\0")
    for name in set(filter(None, cloned)) - wanted:
        (target / name).unlink()
    for name in wanted:
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO_ROOT / name, target / name, follow_symlinks=False)
    assert not (target / "data").exists() or not any((target / "data").rglob("*.h5"))


def user_env():
    """A user's shell: this interpreter's python and torchrun first on PATH, no GPU, no leftovers of a launcher."""
    env = {k: v for k, v in os.environ.items()
           if not (k.startswith(("SLURM_", "TORCHELASTIC_", "PYTEST_")) or k in {
               "EXPDIR", "BENCHY_OUTPUT", "DATADIR", "LOGDIR", "PYTHONPATH", "RANK", "LOCAL_RANK", "WORLD_SIZE",
               "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CUDA_VISIBLE_DEVICES"})}
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    env["CUDA_VISIBLE_DEVICES"] = ""  # the laptop path, also where CI has a GPU
    # torchrun without --standalone binds 29500 unless told; another job on a shared host may hold it. PET_MASTER_PORT
    # is torchrun's own default for --master_port, so the README's command line stays as written.
    env["PET_MASTER_PORT"] = str(free_port())
    return env


def run(command, cwd, env):
    """(exit status, stdout and stderr together, seconds) of one command under bash; killed as a group on timeout."""
    start = time.monotonic()
    process = subprocess.Popen(["bash", "-o", "pipefail", "-c", command], cwd=cwd, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = process.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        output += f"\n[killed after {TIMEOUT_S} s]"
    return process.returncode, output, time.monotonic() - start


def run_dir_of(output, clone):
    """The 'Run directory: ...' train.py logs at start-up, relative to the clone (it may log it absolute)."""
    found = re.findall(r"Run directory: (\S+)", output)
    assert found, "no 'Run directory:' line"
    path = Path(found[-1])
    return str(path.relative_to(clone) if path.is_absolute() else path)


# The README's claims about a command's effect, checked after it ran: f(clone, output, seen) where seen
# holds state shared along the walk (run directories seen so far).
def check_quickstart(clone, output, seen):
    # Section 1: trains `quickstart` on a dataset it generates on first use, into data/.
    assert (clone / "data" / "quickstart_train.h5").is_file() and (clone / "data" / "quickstart_val.h5").is_file()
    # Section 2: a run writes out.log, config.yaml, checkpoints/ and a TensorBoard logs/ folder to
    # expdir/<config>/<N>GPU/<run_num>/, and ends comparing with the mean predictor.
    run_dir = run_dir_of(output, clone)
    assert run_dir == "logs/quickstart/1GPU/0", run_dir
    for name in ("out.log", "config.yaml", "logs"):
        assert (clone / run_dir / name).exists(), name
    assert list((clone / run_dir / "checkpoints").glob("*.pt"))
    assert re.search(r"Final validation L1 [0-9.]+ vs [0-9.]+ for the mean predictor", output)
    seen["quickstart"] = run_dir


def check_file(*names):
    def check(clone, output, seen):
        for name in names:
            assert (clone / name).is_file(), f"{name} was not written"
    return check


def check_new_run(clone, output, seen):
    """Section 2: a changed command gets the next free number and never touches an earlier run."""
    run_dir = run_dir_of(output, clone)
    assert run_dir not in seen.values(), f"{run_dir} was already used by {seen}"
    return run_dir


def check_profile(clone, output, seen):
    # Section 8: --profile_dir traces writes a *.pt.trace.json into the run directory.
    run_dir = seen["profile"] = check_new_run(clone, output, seen)
    assert list((clone / run_dir).rglob("*.pt.trace.json")), f"no trace in {run_dir}"


def check_benchy(clone, output, seen):
    # Section 8: the three BENCHY summary lines; the JSON goes to the run directory.
    for mode in ("IO", "SYNTHETIC", "FULL"):
        assert re.search(rf"BENCHY::SUMMARY::{mode} average trial throughput: [0-9.]+ \+/- [0-9.]+", output), mode
    run_dir = seen["benchy"] = check_new_run(clone, output, seen)
    assert (clone / run_dir / "benchy.json").is_file()


def check_torchrun(clone, output, seen):
    # Section 10: two ranks on a CPU, with gloo, into <config>/2GPU/.
    run_dir = seen["torchrun"] = check_new_run(clone, output, seen)
    assert run_dir.startswith("logs/quickstart/2GPU/"), run_dir
    assert "2 rank(s) on cpu" in output


def check_gpu_suite(clone, output, seen):
    """Section 17: the GPU suite's CPU smoke mode runs every CPU part, skips the GPU parts saying why, and writes
    the documented files (this command is the suite's one smoke run in CI)."""
    out = clone / "logs" / "suite_small"
    summary = json.loads((out / "summary.json").read_text())
    checks = {c["name"]: c for c in summary["checks"]}
    failed = {name: c["detail"] for name, c in checks.items() if c["status"] == "FAIL"}
    assert not failed and re.search(r"\bPASS ", output), failed
    files = sorted(p.name for p in out.iterdir())  # at most 8 files, all of them the documented ones
    assert len(files) <= 8 and set(files) <= {"summary.json", "summary.md", "probe.json", "ladder.json", "ladder.md",
                                               "ladder.png", "suite.log", "pytest.log"}, files
    # The results file's contract (benchmarks/results/h100.json has the same keys).
    assert summary["device"] == "cpu" and summary["versions"]["torch"] == torch.__version__
    rows = {row["rung"]: row for row in summary["ladder"]}
    assert {"fp32", "bf16", "fused_adam", "channels_last"} <= {r for r, row in rows.items() if row["status"] == "ok"}
    for row in (rows["fp32"], rows["channels_last"]):
        assert row["samples_per_s"] > 0 and row["loss"] < row["loss_first"]  # it trains on the generated batch
    assert rows["cuda_graph"]["status"] == "skipped"
    (name, benchy), = summary["benchy"].items()
    assert name.startswith("fast inmem") and all(benchy[mode] > 0 for mode in ("IO", "SYNTHETIC", "FULL"))
    for skipped in ("cuDNN for every convolution", "benchmark mode, GPU-resident loader", "train_graph.py vs train.py",
                    "cuDNN kernels in the trace; copy/compute overlap"):
        assert checks[skipped]["status"] == "SKIP" and checks[skipped]["detail"] == "no GPU", skipped
        assert f"SKIP {skipped}: no GPU" in output
    assert not any(name.startswith("more levers") for name in checks)  # part i runs only when named (--parts i)
    assert checks["profiler trace of the window"]["status"] == "PASS"
    assert summary["checkpoint"]["checkpoints"] >= 1 and summary["checkpoint"]["max_stall_s"] >= 0
    summary_md = (out / "summary.md").read_text()
    # per loader, FULL/SYNTHETIC and the loader's cost per step (batch/FULL - batch/SYNTHETIC)
    cost = 1e3 * summary["setup"]["global_batch_size"] * (1 / benchy["FULL"] - 1 / benchy["SYNTHETIC"])
    assert "| status | check | detail |" in summary_md and (
        f"| {name} | {benchy['IO']:.0f} | {benchy['SYNTHETIC']:.0f} | {benchy['FULL']:.0f} | "
        f"{benchy['FULL'] / benchy['SYNTHETIC']:.3f} | {cost:.2f} |") in summary_md
    # Part h: every convolution of the tiny model timed in each of its forms.
    assert checks["convolution forms compute the native result"]["status"] == "PASS"
    assert len(summary["conv_forms"]["layers"]) == 4 and "## Convolution forms" in summary_md


CLAIMS = {
    "python train.py --config=quickstart": check_quickstart,
    "python -m utils.make_dataset --box 256 --seed 1 --out data/train.h5": check_file("data/train.h5"),
    "python -m utils.make_dataset --box 128 --seed 2 --out data/val.h5": check_file("data/val.h5"),
    "python -m utils.make_dataset --out data/train.h5 --npy_only":
        check_file("data/train.h5", "data/train_data.npy", "data/train_label.npy"),
    "python train.py --config=quickstart --num_epochs 1 --Nsamples 256 --profile_dir traces": check_profile,
    "python train.py --config=quickstart --enable_benchy": check_benchy,
    "torchrun --nproc_per_node=2 train.py --config=quickstart --num_epochs 1 --Nsamples 512": check_torchrun,
    "python benchmarks/gpu_suite.py logs/suite_small --small": check_gpu_suite,
    # Section 15: loss plots, the science report of the run and of a whole-box prediction.
    "python -m utils.plot_logs logs/quickstart/1GPU/0": check_file("logs/quickstart/1GPU/0/loss.png"),
    "python -m science.report logs/quickstart/1GPU/0": check_file("logs/quickstart/1GPU/0/science_report.png"),
    "python predict.py --checkpoint logs/quickstart/1GPU/0 --input data/quickstart_val.h5 --output logs/hydro.h5 "
    "--force": check_file("logs/hydro.h5"),
    "python -m science.report logs/hydro.h5": check_file("logs/hydro_report.png"),
}


@pytest.mark.slow
@pytest.mark.longest  # by far: CI starts it first (tests/conftest.py)
@pytest.mark.timeout(1200)  # pytest-timeout, where installed: the GPU whole-suite command's 300 s is too short here
def test_readme_walkthrough_on_a_fresh_clone(tmp_path):
    if not (REPO_ROOT / ".git").exists():
        pytest.skip("tests/test_readme_commands.py clones the repository: not a git checkout")
    clone = tmp_path / "clone"
    fresh_clone(clone)
    untouched = git_status(clone)  # the working tree's own changes, copied over the clone
    env, seen, timings = user_env(), {}, []
    commands = [c for _, c in readme_commands(README.read_text())]
    for step, command in enumerate(commands + [QUICKSTART]):
        rerun = step == len(commands)
        runs_before = sorted(p.name for p in (clone / "logs" / "quickstart" / "1GPU").iterdir()) if rerun else None
        status, output, seconds = run(command, clone, env)
        timings.append(f"{seconds:6.1f} s  {command}")
        context = f"README command {step + 1} `{command}` exited with {status} after {seconds:.0f} s:\n{output[-4000:]}"
        assert status == 0, context
        if rerun:
            # Section 2: "the same command continues its run" -- also after other runs took newer numbers.
            assert run_dir_of(output, clone) == seen["quickstart"], context
            assert sorted(p.name for p in (clone / "logs" / "quickstart" / "1GPU").iterdir()) == runs_before, context
            continue
        check = CLAIMS.get(bare(command))
        if check:
            try:
                check(clone, output, seen)
            except AssertionError as error:
                raise AssertionError(f"{error}\n{context}") from None
    print("\n".join(timings))
    left = sorted(set(git_status(clone)) - set(untouched))
    assert not left, f"README commands left files outside the git-ignored logs/ and data/: {left}"
    shutil.rmtree(clone)  # its data is 1.4 GB; a failing run's clone stays for a look
