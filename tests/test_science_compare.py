"""benchmarks/science_compare.py: what it refuses before any training, and where its table goes."""
import pytest

from benchmarks.science_compare import parse_args


def test_without_out_the_table_goes_under_expdir(tmp_path):
    """A trial run cannot replace the committed benchmarks/results/science_cpu.md."""
    assert parse_args(["--expdir", str(tmp_path)]).out == str(tmp_path / "science_compare.md")
    assert parse_args(["--out", str(tmp_path / "t.md")]).out == str(tmp_path / "t.md")


@pytest.mark.parametrize("argv, message", [
    (["--options", "bilinear"], "argument --options: invalid choice: 'bilinear' (choose from "),
    (["--options", "transposed", "transposed"], "--options repeats transposed; give each once"),
    (["--seeds", "0", "0"], "--seeds repeats 0; give each once"),
    (["--from_json", "missing.json"], "--from_json missing.json does not exist; give the JSON an earlier run wrote"),
    (["--options", "transposed_blur"], "--options must include transposed, the reference's upsampling that the "
                                       "others are measured against; got transposed_blur"),  # else hours, then NaNs
    (["--from_json", "old.json", "--options", "transposed"], "--from_json redraws the options its JSON holds; drop "
                                                               "--options"),
])
def test_a_bad_paste_is_one_line_before_any_training(argv, message, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        parse_args(argv + ["--expdir", str(tmp_path)])
    assert stop.value.code == 2
    assert f"error: {message}" in capsys.readouterr().err  # argparse's quoting of the choices varies by Python
    assert not any(tmp_path.iterdir())
