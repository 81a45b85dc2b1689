from loadtest.e2e_workers import max_held, refine, step_up


def fake(limits: dict[str, float]):
    """A run that holds every rate up to its form's limit; the calls it was given."""
    calls: list[tuple[float, str]] = []

    def run(rate: float, form: str) -> dict:
        calls.append((rate, form))
        ok = rate <= limits[form]
        return {"p50_ms": 1.0, "p99_ms": 5.0 if ok else 20.0, "requests": 10, "failures": 0}

    return run, calls


def test_refine_bisects_each_form_to_the_step_between_its_last_rate_held_and_first_missed():
    run, calls = fake({"records": 740.0, "columns": 560.0})
    results = step_up(run, [100, 200, 300, 400, 500, 600, 700, 800], ["records", "columns"])
    assert max_held(results["records"]) == 700 and max_held(results["columns"]) == 500
    del calls[:]
    refine(run, results, 25)
    assert max_held(results["records"]) == 725 and max_held(results["columns"]) == 550
    # on the 25 rps grid: 750 missed, 725 held; 550 held, 575 missed
    assert calls == [(750, "records"), (725, "records"), (550, "columns"), (575, "columns")]


def test_refine_leaves_a_form_that_held_every_rate_or_none():
    run, calls = fake({"records": 1e9, "columns": 0.0})
    results = step_up(run, [100, 200], ["records", "columns"])
    del calls[:]
    refine(run, results, 25)
    assert calls == []
    assert max_held(results["records"]) == 200 and max_held(results["columns"]) == 0
