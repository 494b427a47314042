"""Progress that suits where it goes (adaptive.progress): lines off a terminal, a bar on one."""

import io

from adaptive.progress import Lines, interactive, progress_bar


class Tty(io.StringIO):
    def isatty(self):
        return True


def test_off_a_terminal_a_line_per_tenth_and_no_carriage_returns():
    out = io.StringIO()
    bar = progress_bar(200, "bench", unit="run", stream=out)
    assert isinstance(bar, Lines) and not interactive(out)
    for i in range(200):
        bar.set_postfix(step=i)
        bar.update(1)
    bar.close()
    lines = out.getvalue().splitlines()
    assert "\r" not in out.getvalue() and len(lines) == 10
    assert lines[0].startswith("bench:  10% (20/200 run), ") and "left" in lines[0] and "[step=19]" in lines[0]
    assert lines[-1].startswith("bench: 100% (200/200 run), ") and "left" not in lines[-1]


def test_an_unknown_total_waits_a_resumed_run_starts_at_its_step_and_close_reports_a_short_run():
    out = io.StringIO()
    bar = Lines(None, "distill eagle", "step", stream=out)
    bar.update(5)
    assert out.getvalue() == ""  # nothing before the total is known (the pace sets it)
    bar.total = 100
    bar.update(10)  # 15%: the 10% line
    assert out.getvalue().count("\n") == 1 and "15%" in out.getvalue()
    resumed = Lines(50, "calibrate", stream=(out2 := io.StringIO()), initial=26)
    resumed.update(1)  # 54%: the tenths done before the resume are not printed again
    resumed.close()
    assert out2.getvalue().splitlines()[0].startswith("calibrate:  54% (27/50 it)")
    assert len(out2.getvalue().splitlines()) == 1  # closed where it was printed last: no second line
    short = Lines(10, "x", stream=(out3 := io.StringIO()))
    short.update(3)
    short.close()
    assert [line.split(",")[0] for line in out3.getvalue().splitlines()] == ["x:  30% (3/10 it)"]


def test_on_a_terminal_a_bar():
    from tqdm import tqdm

    bar = progress_bar(5, "calibrate", stream=Tty())
    try:
        assert isinstance(bar, tqdm)
    finally:
        bar.close()
