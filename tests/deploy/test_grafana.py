"""deploy/grafana/recserve.json holds together without a Grafana: every panel has its own id and
place on the 24-column grid, every query reads metrics the code exports (or TorchServe's own), and
the row "Guards and experiments" charts the two guards and each experiment arm's figures with
their intervals, each of its panels described in docs/guards-and-experiments.md. That every query returns series from the running processes is
tests/serving/stack/test_local.py's (a real Prometheus over a live stack)."""

from __future__ import annotations

import ast
import json
import re

from tests.deploy.helpers import GRAFANA, dashboard_panels, dashboard_queries
from tests.helpers import ROOT

PACKAGES = ("features", "model_store", "stream", "training", "serving", "handlers", "recserve")
"""The product's packages (pyproject.toml's), whose modules define every metric recserve exports."""
EXTERNAL = {"ts_inference_requests_total": "TorchServe's frontend (serving/torchserve/metrics.py)"}
SUFFIXES = ("_total", "_bucket", "_sum", "_count")
"""What Prometheus's client adds to a counter's or a histogram's name."""
KEYWORDS = {"and", "or", "unless", "bool", "offset"}
ROW = "Guards and experiments"


def metric_names(expr: str) -> set[str]:
    """The metrics a PromQL expression reads: its identifiers less the label matchers ``{...}``,
    the label lists of ``by``/``without``/``on``/``ignoring``, the ranges ``[...]``, the functions
    (a name before ``(``) and the keywords."""
    expr = re.sub(r"\{[^}]*\}|\[[^\]]*\]", " ", expr)
    expr = re.sub(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", expr)
    return {w for w in re.findall(r"\b[A-Za-z_:][\w:]*\b(?!\s*\()", expr) if w not in KEYWORDS}


def test_metric_names_are_what_a_query_reads():
    expr = 'histogram_quantile(0.99, sum by (le, stage) (rate(recserve_x_seconds_bucket{stage!="a"}[1m])))'
    assert metric_names(expr) == {"recserve_x_seconds_bucket"}
    assert metric_names("max(a_b) > 0 and on (instance) c == 1") == {"a_b", "c"}


def exported() -> set[str]:
    """Every metric name the product's modules spell: a string constant that is one
    (``"recserve_join_label_rate"``), or a prefix a module formats or adds to (``f"recserve_ps_{name}"``,
    ``P + k + part``) followed by at most two string constants of the same module (``"rows"``;
    ``"logloss"`` and ``"_low"``)."""
    names: set[str] = set()
    for path in (p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")):
        tree = ast.parse(path.read_text())
        strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and type(n.value) is str}
        names |= {s for s in strings if re.fullmatch(r"recserve_\w*[a-z0-9]", s)}
        prefixes = {s for s in strings if re.fullmatch(r"recserve_\w*_", s)}
        parts = {"", *(s for s in strings if re.fullmatch(r"\w{1,40}", s))} if prefixes else set()
        names |= {p + a + b for p in prefixes for a in parts for b in parts}
    return names


def test_every_metric_a_query_reads_is_one_the_code_exports():
    code = exported()
    for expr in dashboard_queries():
        for name in metric_names(expr):
            bare = next((name.removesuffix(s) for s in SUFFIXES if name.endswith(s)), name)
            assert name in EXTERNAL or name in code or bare in code, f"{name} (in {expr}) is exported nowhere"


def test_every_panel_has_its_own_id_and_place_on_the_grid():
    top = json.loads(GRAFANA.read_text())["panels"]
    every = [*top, *(p for row in top if row["type"] == "row" for p in row.get("panels", []))]
    ids = [p["id"] for p in every]
    assert len(ids) == len(set(ids)), ids
    taken: dict[tuple[int, int], str] = {}
    for p in (p for p in top if p["type"] != "row" or not p.get("collapsed")):
        g = p["gridPos"]
        assert g["x"] >= 0 and g["x"] + g["w"] <= 24 and g["h"] > 0, p["title"]
        for cell in ((x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])):
            assert cell not in taken, f"{p['title']!r} overlaps {taken[cell]!r}"
            taken[cell] = p["title"]
    for p in dashboard_panels():
        assert p["targets"] and all(t["datasource"]["uid"] == "${DS_PROMETHEUS}" for t in p["targets"]), p
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), p["title"]


def test_the_guards_and_experiments_row_charts_both_guards_and_every_arm_with_its_interval():
    top = json.loads(GRAFANA.read_text())["panels"]
    (row,) = [i for i, p in enumerate(top) if p["type"] == "row" and p["title"] == ROW]
    below = {n for p in top[row + 1 :] for t in p.get("targets", []) for n in metric_names(t["expr"])}
    above = {n for p in top[:row] for t in p.get("targets", []) for n in metric_names(t["expr"])}
    guards = {"recserve_join_guard_tripped", "recserve_join_label_rate", "recserve_join_label_rate_band",
              "recserve_join_quarantined_samples_total", "recserve_follow_guard_tripped",
              "recserve_follow_served_auc", "recserve_follow_served_calibration"}  # fmt: skip
    arms = {f"recserve_experiment_{k}{part}" for k in ("ctr", "calibration", "logloss", "auc")
            for part in ("", "_low", "_high")}  # fmt: skip
    assert guards | arms <= below, sorted((guards | arms) - below)
    ours = re.compile(r"recserve_(join|follow_guard|follow_served|experiment)_")
    assert not {n for n in above if ours.match(n)}, "guard or experiment panels above their row"


def test_the_guide_describes_each_panel_of_the_row():
    top = json.loads(GRAFANA.read_text())["panels"]
    (row,) = [i for i, p in enumerate(top) if p["type"] == "row" and p["title"] == ROW]
    titles = [p["title"] for p in top[row + 1 :]]
    guide = (ROOT / "docs" / "guards-and-experiments.md").read_text()
    section = guide[guide.index("## Reading the metrics") :]
    assert re.findall(r"^\| \*\*(.+?)\*\* \|", section, re.M) == titles
