"""migrate's --lock-timeout and --build-lock-timeout take a positive number of seconds; a
bad one is refused by the parser (exit 2, the flag named) before anything connects."""

from __future__ import annotations

import pytest

from poimen_memory.cli.main import main


@pytest.mark.parametrize("flag", ["--lock-timeout", "--build-lock-timeout"])
@pytest.mark.parametrize("bad", ["0", "-1", "nan", "inf", "soon"])
def test_a_bad_timeout_is_refused_by_the_parser(
    flag: str, bad: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["migrate", flag, bad])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert flag in err and "not a positive number of seconds" in err
