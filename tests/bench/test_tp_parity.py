"""bench tp_parity empties only a work folder it made."""

from torchtitan_ext.bench.tp_parity import main


def test_a_folder_it_did_not_make_is_never_emptied(tmp_path, capsys):
    (tmp_path / "precious.txt").write_text("kept")
    assert main(["--work", str(tmp_path)]) == 2
    assert capsys.readouterr().err.strip() == (f"error: work folder '{tmp_path}' is not empty and was not made by this "
                                               "tool: pass a new or empty folder")
    assert (tmp_path / "precious.txt").read_text() == "kept"
