"""The suite's time guard (tests/budget.py): a file over its share is reported, over twice its share fails the run."""

import budget


def test_a_file_over_its_share_is_reported_and_over_twice_it_fails():
    share = budget.share("tests/test_trainer.py")
    warn, fail = budget.over_budget(
        {
            "tests/test_trainer.py": share * 1.5,
            "tests/test_new.py": 1.0,
            "tests/test_other_new.py": budget.DEFAULT_SHARE_S * 2.5,
        }
    )
    assert warn == [
        f"SUITE BUDGET: tests/test_trainer.py took {share * 1.5:.0f} s, its share is {share:.0f} s (tests/budget.py)"
    ]
    assert len(fail) == 1 and "tests/test_other_new.py" in fail[0]  # an unlisted file gets the default share


def test_time_spent_building_the_cache_is_not_charged_to_the_file_that_waited():
    class Report:
        nodeid, duration = "tests/test_x.py::test_y", 200.0

    budget.note_build(190.0)
    before = budget._spent.get("tests/test_x.py", 0.0)
    budget.pytest_runtest_logreport(Report())
    assert budget._spent["tests/test_x.py"] - before == 10.0
    budget._spent.pop("tests/test_x.py")
    budget._builds.pop()
