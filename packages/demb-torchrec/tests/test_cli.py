"""The `demb` command."""

from __future__ import annotations


def test_cli_reports_the_environment(capsys):
    from demb_torchrec.cli import main

    assert main([]) == 0
    out = capsys.readouterr().out
    assert "demb CPU kernels     built" in out
    assert "torch                2.11.0" in out
    assert "device" in out
