"""docker/Dockerfile, checked without Docker: its base, what it copies, and its install steps.

The install steps run for real under /bin/sh with stand-ins for `pip` and `python` that record their
arguments, so a shell mistake or a changed requirements file shows here rather than in a GPU build.
"""
import re
import shlex
import subprocess
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = REPO_ROOT / "docker" / "Dockerfile"
CONSTRAINTS = "/etc/pip/constraint.txt"  # the NGC container's pip constraints (25.03 and later)


def instructions():
    """[(INSTRUCTION, arguments)] with continuation lines joined and comments dropped."""
    lines = [line for line in DOCKERFILE.read_text().splitlines() if not line.lstrip().startswith("#")]
    joined = re.sub(r"\\\n", " ", "\n".join(lines))
    return [(line.split(None, 1)[0].upper(), line.split(None, 1)[1]) for line in joined.splitlines() if line.strip()]


def run_commands(word):
    return [args for instruction, args in instructions() if instruction == "RUN" and word in args]


def requirement_names(text):
    return [re.split(r"[<>=!~;\[ ]", line, maxsplit=1)[0].lower() for line in text.splitlines()
            if line.strip() and not line.startswith(("#", "-"))]


def test_base_is_an_ngc_pytorch_container():
    steps = instructions()
    args = {name: value for instruction, arg in steps if instruction == "ARG" and "=" in arg
            for name, value in [arg.split("=", 1)]}
    base = next(arg for instruction, arg in steps if instruction == "FROM")
    base = re.sub(r"\$\{(\w+)\}", lambda match: args[match.group(1)], base)
    assert re.fullmatch(r"nvcr\.io/nvidia/pytorch:(\d\d)\.(\d\d)-py3", base), base
    year, month = map(int, re.fullmatch(r".*:(\d\d)\.(\d\d)-py3", base).groups())
    assert (year, month) >= (25, 3), "the install steps need /etc/pip/constraint.txt (NGC 25.03 and later)"


def test_never_installs_pypi_apex_or_torch():
    for command in run_commands("pip install"):
        words = shlex.split(command)
        assert "apex" not in words, "PyPI's `apex` is not NVIDIA apex (the container ships the real one)"
        assert not any(re.match(r"torch\b", word) for word in words), "would replace the container's CUDA torch"


def test_every_copied_path_exists_and_entry_points_are_copied():
    copied = []
    for instruction, args in instructions():
        if instruction == "COPY":
            *sources, _ = shlex.split(args)
            copied += [source.rstrip("/") for source in sources]
    assert copied
    for source in copied:
        assert (REPO_ROOT / source).exists(), f"COPY {source}: no such file in the repository"
    scripts = {path.name for path in REPO_ROOT.glob("*.py")}
    packages = {path.parent.name for path in REPO_ROOT.glob("*/*.py")} - {"tests"}
    assert scripts | packages | {"config"} <= set(copied), sorted(scripts | packages - set(copied))


def fake_tools(tmp_path, pip_list):
    """`pip` and `python` stand-ins on a PATH: they append their arguments (and -r files) to calls.log."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "calls.log"
    (bin_dir / "pip").write_text(f"""#!/bin/sh
echo "pip $*" >> {log}
if [ "$1" = list ]; then printf '{pip_list}'; fi
previous=
for arg; do if [ "$previous" = -r ]; then cat "$arg" >> {log}; fi; previous=$arg; done
""")
    (bin_dir / "python").write_text(f"""#!/bin/sh
echo "python $*" >> {log}
case "$*" in *torch.version.cuda*) echo 13 ;; esac
""")
    for tool in bin_dir.iterdir():
        tool.chmod(0o755)
    return bin_dir, log


def run_step(command, tmp_path, bin_dir):
    constraints = tmp_path / "constraint.txt"
    command = command.replace("/tmp/", f"{tmp_path}/").replace(CONSTRAINTS, str(constraints))
    result = subprocess.run(["/bin/sh", "-c", command], cwd=REPO_ROOT, capture_output=True, text=True,
                            env={"PATH": f"{bin_dir}:/usr/bin:/bin"})
    assert result.returncode == 0, result.stderr


def test_requirements_step_installs_everything_but_torch(tmp_path):
    (command,) = run_commands("requirements.txt")
    bin_dir, log = fake_tools(tmp_path, pip_list="")
    run_step(command, tmp_path, bin_dir)
    wanted = [name for name in requirement_names((REPO_ROOT / "requirements.txt").read_text()) if name != "torch"]
    calls, installed = [], []
    for line in log.read_text().splitlines():
        (calls if line.startswith("pip ") else installed).append(line)
    assert len(calls) == 1 and calls[0].startswith("pip install")
    assert requirement_names("\n".join(installed)) == wanted
    assert not list(tmp_path.glob("requirements-*"))  # the filtered copy is not left in the image


def test_dali_step_replaces_a_shipped_dali_with_the_pinned_one(tmp_path):
    (command,) = run_commands("requirements-dali.txt")
    pinned = re.search(r"^nvidia-dali-cuda\d+==(\S+)", (REPO_ROOT / "requirements-dali.txt").read_text(), re.M)
    assert pinned, "requirements-dali.txt needs a line nvidia-dali-cudaXXX==VERSION"
    (tmp_path / "constraint.txt").write_text("numpy==2.1.0\nnvidia-dali-cuda130==1.52.0\nnvidia-libnvcomp-cu13==5.0.0\n"
                                             "nvidia_nvimgcodec_cu13==0.6.1\ntensorboard==2.20.0\n")
    bin_dir, log = fake_tools(tmp_path, pip_list=r"numpy==2.1.0\nnvidia-dali-cuda130==1.52.0\n")
    run_step(command, tmp_path, bin_dir)
    calls = log.read_text().splitlines()
    pip_calls = [call for call in calls if call.startswith("pip") and call != "pip list --format=freeze"]
    assert pip_calls == ["pip uninstall -y nvidia-dali-cuda130",
                         f"pip install --no-cache-dir nvidia-dali-cuda130=={pinned.group(1)}"]  # CUDA 13 -> cuda130
    assert (tmp_path / "constraint.txt").read_text() == "numpy==2.1.0\ntensorboard==2.20.0\n"
    assert "import torch, nvidia.dali" in calls[-1]  # the build log shows what the image got


@pytest.mark.parametrize("line", ["nvidia-dali-cuda120>=2.4", "nvidia-dali-cuda120"])
def test_dali_step_stops_on_an_unpinned_requirement(tmp_path, line, monkeypatch):
    (command,) = run_commands("requirements-dali.txt")
    (tmp_path / "requirements-dali.txt").write_text(line + "\n")
    (tmp_path / "constraint.txt").write_text("")
    bin_dir, _ = fake_tools(tmp_path, pip_list="")
    constraints = tmp_path / "constraint.txt"
    result = subprocess.run(["/bin/sh", "-c", command.replace(CONSTRAINTS, str(constraints))], cwd=tmp_path,
                            capture_output=True, text=True, env={"PATH": f"{bin_dir}:/usr/bin:/bin"})
    assert result.returncode != 0
    assert "no nvidia-dali-cudaXXX==VERSION line in requirements-dali.txt" in result.stderr
